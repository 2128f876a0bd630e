"""The floor plan holds (docs/architecture.md): each part imports only the floors below it, and nobody
imports another part's `_private` module. Read from the source text with `ast`, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder -> (package, floor). A part may import its own floor's modules and the public face of lower floors.
PARTS = {"shardtool": ("shardtool", 0), "keys": ("shardtool.keys", 1), "manifest": ("shardtool.manifest", 2),
         "remote": ("shardtool.remote", 2.5), "checkpoint": ("shardtool.checkpoint", 3), "runtime": ("shardtool.runtime", 3), "serve": ("shardtool.serve", 4),
         "cli": ("shardtool.cli", 5)}


def _part_of(module: str) -> str | None:
    """The part (folder) a dotted shardtool module belongs to; "shardtool" for the base floor."""
    best = None
    for folder, (package, _) in PARTS.items():
        if module == package or module.startswith(package + "."):
            if best is None or len(package) > len(PARTS[best][0]):
                best = folder
    return best


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name.startswith("_")]
    return [(line, m) for line, m in found if m == "shardtool" or m.startswith("shardtool.")]


def _violations() -> list[str]:
    out = []
    for folder, (package, floor) in PARTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if folder == "shardtool" and path.relative_to(REPO / folder).parts[0] in PARTS:
                continue
            for line, module in _imports(path):
                target = _part_of(module)
                if target is None or target == folder:
                    continue
                where = f"{path.relative_to(REPO)}:{line} imports {module}"
                if PARTS[target][1] >= floor:
                    out.append(f"{where}: {target} is not on a lower floor than {folder}")
                rest = module[len(PARTS[target][0]):].lstrip(".")
                if any(part.startswith("_") for part in rest.split(".") if part):
                    out.append(f"{where}: a private module of {target}")
    return out


def test_no_part_imports_upward_or_another_parts_private_module():
    assert _violations() == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The test above can fail: a planted private import across parts is reported."""
    fake = tmp_path / "repo"
    for folder in PARTS:
        (fake / folder).mkdir(parents=True)
    (fake / "runtime" / "bad.py").write_text("from shardtool.checkpoint._join import x\nimport shardtool.cli\n")
    monkeypatch.setattr(__import__(__name__), "REPO", fake)
    found = _violations()
    assert any("private module of checkpoint" in v for v in found)
    assert any("cli is not on a lower floor" in v for v in found)
