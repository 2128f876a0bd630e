"""The floor plan holds (docs/architecture.md): each part imports only the floors below it, and nobody
imports another part's `_private` module; inside the runtime, the store sits below the model and the model below
the engine, in the same way; and no shardtool module imports itself back through others, deferred (function-level)
imports included. Read from the source text with `ast`, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# folder -> (package, floor). A part may import its own floor's modules and the public face of lower floors.
PARTS = {"shardtool": ("shardtool", 0), "keys": ("shardtool.keys", 1), "manifest": ("shardtool.manifest", 2),
         "remote": ("shardtool.remote", 2.5), "checkpoint": ("shardtool.checkpoint", 3), "runtime": ("shardtool.runtime", 3), "serve": ("shardtool.serve", 4),
         "api": ("shardtool.api", 4.5), "cli": ("shardtool.cli", 5)}
# The one upward import allowed: the package's face (shardtool/__init__.py) hands out the library calls
# (`shardtool.open_model`, ...) by importing this module inside its module `__getattr__`, on first use only.
FACE, FACE_IMPORT = "shardtool/__init__.py", "shardtool.api"
# The runtime's own floors, bottom up: sub-package -> floor. A module imports its own sub-package's modules and the
# public face (`__init__`) of the sub-packages below it; `runtime/__init__.py` (the part's face) may import every
# face. No module sits beside them at the top of runtime/ (a test holds that too).
RUNTIME = "shardtool.runtime"
SUBFLOORS = {"store": 0, "model": 1, "engine": 2}


def _part_of(module: str) -> str | None:
    """The part (folder) a dotted shardtool module belongs to; "shardtool" for the base floor."""
    best = None
    for folder, (package, _) in PARTS.items():
        if module == package or module.startswith(package + "."):
            if best is None or len(package) > len(PARTS[best][0]):
                best = folder
    return best


def _modules() -> dict[str, Path | None]:
    """Every shardtool module by dotted name -> its source file (None: a C extension, which imports nothing of
    ours). A package is named by its folder and read from its `__init__.py`."""
    found: dict[str, Path | None] = {}
    for folder, (package, _) in PARTS.items():
        root = REPO / folder
        for path in sorted(root.rglob("*.py")) + sorted(root.rglob("*.c")):
            rel = path.relative_to(root).with_suffix("")
            if folder == "shardtool" and len(rel.parts) > 1:
                continue
            parts = [package, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path if path.suffix == ".py" else None
    return found


def _import_statements(path: Path) -> list[tuple[int, str, list[str] | None]]:
    """(line, module, names) for every import anywhere in the file (module level, functions, `if TYPE_CHECKING:`),
    relative ones resolved; names None for `import M`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str, list[str] | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.append((node.lineno, base, [a.name for a in node.names]))
    return [(line, m, names) for line, m, names in found if m == "shardtool" or m.startswith("shardtool.")]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file; `from M import _name` also gives `M._name` (it may be a private
    module), and so does `from . import name` (a sibling module)."""
    found = []
    for line, module, names in _import_statements(path):
        found.append((line, module))
        found += [(line, f"{module}.{n}") for n in names or () if n.startswith("_")]
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    folder = rel.parts[0]
    parts = [PARTS[folder][0], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _violations() -> list[str]:
    out = []
    for folder, (package, floor) in PARTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if folder == "shardtool" and path.relative_to(REPO / folder).parts[0] in PARTS:
                continue
            lazy = _lazy_face_lines(path) if path.relative_to(REPO).as_posix() == FACE else set()
            for line, module in _imports(path):
                target = _part_of(module)
                if target is None or target == folder or (module == FACE_IMPORT and line in lazy):
                    continue
                where = f"{path.relative_to(REPO)}:{line} imports {module}"
                if PARTS[target][1] >= floor:
                    out.append(f"{where}: {target} is not on a lower floor than {folder}")
                rest = module[len(PARTS[target][0]):].lstrip(".")
                if any(part.startswith("_") for part in rest.split(".") if part):
                    out.append(f"{where}: a private module of {target}")
    return out


def _lazy_face_lines(path: Path) -> set[int]:
    """The lines of the package face's module `__getattr__` (PEP 562): imports there run on first use only."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {line for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            for line in range(node.lineno, node.end_lineno + 1)}


def _subfloor(module: str) -> str | None:
    """The runtime floor of a module under shardtool.runtime: its sub-package; None for the runtime's face
    (`shardtool.runtime` itself) and for a module outside every floor (`test_every_runtime_module_is_on_a_floor`)."""
    rest = module[len(RUNTIME) + 1:].split(".") if module.startswith(RUNTIME + ".") else []
    return rest[0] if rest and rest[0] in SUBFLOORS else None


def _runtime_violations() -> list[str]:
    out = []
    for path in sorted((REPO / "runtime").rglob("*.py")):
        source = _subfloor(_module_name(path))
        if source is None:
            continue  # runtime/__init__.py: the face, above every floor (what it may import: the part's rule above)
        for line, module in _imports(path):
            if not (module == RUNTIME or module.startswith(RUNTIME + ".")):
                continue
            where = f"{path.relative_to(REPO)}:{line} imports {module}"
            target = _subfloor(module)
            if target is None:
                out.append(f"{where}: the runtime's face, above the {source} floor")
                continue
            if SUBFLOORS[target] > SUBFLOORS[source]:
                out.append(f"{where}: {target} is above {source}")
            if target != source:
                face = f"{RUNTIME}.{target}"
                if module != face and (not module.startswith(face + ".")
                                       or any(p.startswith("_") for p in module[len(face) + 1:].split("."))):
                    out.append(f"{where}: a private module of {target}, not its face")
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the shardtool modules importing it runs or reads. `from P import name` reads module `P.name` when
    there is one, else P itself. Importing `a.b.c` from outside package `a.b` runs `a.b/__init__` first, so that counts
    too; from inside it, the package is already being imported."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        wanted: set[str] = set()
        for _, module, names in ([] if path is None else _import_statements(path)):
            wanted |= {module} if names is None else {f"{module}.{n}" if f"{module}.{n}" in modules else module
                                                     for n in names}
        targets = {t for t in wanted if t in modules}
        for target in list(targets):
            parts = target.split(".")
            targets |= {p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                        if p in modules and name != p and not name.startswith(p + ".")}
        targets.discard(name)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (first module repeated at the end) per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(group)) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, through the group (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {sorted(group)}")


def test_no_part_imports_upward_or_another_parts_private_module():
    assert _violations() == []


def test_the_runtime_floors_import_only_downward_and_only_faces():
    """store < model < engine: nothing imports upward, nor another floor's `_private` module."""
    assert _runtime_violations() == []


def test_no_import_cycles_among_shardtool_modules():
    """Deferred (function-level) and type-checking imports count: each names a dependency all the same."""
    assert [" -> ".join(cycle) for cycle in _cycles(_graph())] == []


def _fake_repo(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    fake = tmp_path / "repo"
    for folder in PARTS:
        (fake / folder).mkdir(parents=True)
    for rel, text in files.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "REPO", fake)


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The test above can fail: a planted private import across parts is reported."""
    _fake_repo(tmp_path, monkeypatch, {
        "runtime/bad.py": "from shardtool.checkpoint._join import x\nimport shardtool.cli\n"})
    found = _violations()
    assert any("private module of checkpoint" in v for v in found)
    assert any("cli is not on a lower floor" in v for v in found)


# The package face's one upward import: only shardtool.api, only inside its module __getattr__.
FACE_PLANTED = [
    ("lazy_api_import", "def __getattr__(name):\n    import shardtool.api\n", []),
    ("api_at_import_time", "import shardtool.api\n",
     ["shardtool/__init__.py:1 imports shardtool.api: api is not on a lower floor than shardtool"]),
    ("lazy_runtime_import", "def __getattr__(name):\n    import shardtool.runtime\n",
     ["shardtool/__init__.py:2 imports shardtool.runtime: runtime is not on a lower floor than shardtool"]),
    ("api_in_another_function", "def other():\n    import shardtool.api\n",
     ["shardtool/__init__.py:2 imports shardtool.api: api is not on a lower floor than shardtool"]),
]


@pytest.mark.parametrize("text, expected", [case[1:] for case in FACE_PLANTED], ids=[case[0] for case in FACE_PLANTED])
def test_the_package_face_may_import_only_the_api_and_only_lazily(tmp_path, monkeypatch, text, expected):
    _fake_repo(tmp_path, monkeypatch, {FACE: text})
    assert _violations() == expected


def test_the_package_face_hands_out_the_library_calls_lazily():
    """`import shardtool` alone imports nothing above the base floor; `shardtool.open_model` then does."""
    import subprocess
    import sys

    code = ("import sys, shardtool; before = {m for m in sys.modules if m.startswith('shardtool.')}; "
            "shardtool.open_model, shardtool.sign, shardtool.verify; print(sorted(before)); "
            "print('shardtool.api' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "True"]


# Each planted import and the one line the runtime's floor check gives for it.
RUNTIME_PLANTED = [
    ("store_imports_the_model", "runtime/store/_bad.py", "from shardtool.runtime.model import Tensors\n",
     ["runtime/store/_bad.py:1 imports shardtool.runtime.model: model is above store"]),
    ("model_imports_the_store_later", "runtime/model/_bad.py",
     "def f():\n    from shardtool.runtime.store import ShardStore\n",
     []),  # downward, through the face: allowed
    ("model_imports_the_engine_deferred", "runtime/model/_bad.py",
     "def f():\n    from shardtool.runtime.engine import Engine\n",
     ["runtime/model/_bad.py:2 imports shardtool.runtime.engine: engine is above model"]),
    ("store_imports_the_cluster", "runtime/store/_bad.py", "import shardtool.runtime.engine._cluster\n",
     ["runtime/store/_bad.py:1 imports shardtool.runtime.engine._cluster: engine is above store",
      "runtime/store/_bad.py:1 imports shardtool.runtime.engine._cluster: a private module of engine, not its face"]),
    ("model_imports_the_runtime_face", "runtime/model/_bad.py", "import shardtool.runtime\n",
     ["runtime/model/_bad.py:1 imports shardtool.runtime: the runtime's face, above the model floor"]),
    ("engine_imports_a_private_model_module", "runtime/engine/_bad.py", "from shardtool.runtime.model._packed import x\n",
     ["runtime/engine/_bad.py:1 imports shardtool.runtime.model._packed: a private module of model, not its face"]),
    ("engine_imports_a_private_module_by_name", "runtime/engine/_bad.py", "from ..store import _store\n",
     ["runtime/engine/_bad.py:1 imports shardtool.runtime.store._store: a private module of store, not its face"]),
    ("relative_upward_import", "runtime/store/_bad.py", "from ..engine import Engine\n",
     ["runtime/store/_bad.py:1 imports shardtool.runtime.engine: engine is above store"]),
]


@pytest.mark.parametrize("rel, text, expected", [case[1:] for case in RUNTIME_PLANTED],
                         ids=[case[0] for case in RUNTIME_PLANTED])
def test_the_runtime_check_sees_a_planted_import(tmp_path, monkeypatch, rel, text, expected):
    _fake_repo(tmp_path, monkeypatch, {rel: text})
    assert _runtime_violations() == expected


# Each planted set of modules and the cycle the check names for it.
CYCLES_PLANTED = [
    ("deferred_import_back", {"runtime/model/_a.py": "from ._b import x\n",
                              "runtime/model/_b.py": "def f():\n    from ._a import y\n"},
     ["shardtool.runtime.model._a -> shardtool.runtime.model._b -> shardtool.runtime.model._a"]),
    ("type_checking_import_back", {"runtime/engine/_a.py": "from shardtool.runtime.engine._b import x\n",
                                   "runtime/engine/_b.py": "if TYPE_CHECKING:\n    from . import _a\n"},
     ["shardtool.runtime.engine._a -> shardtool.runtime.engine._b -> shardtool.runtime.engine._a"]),
    ("through_a_package_face", {"runtime/engine/__init__.py": "from ._a import x\n",
                                "runtime/engine/_a.py": "from shardtool.runtime._c import y\n",
                                "runtime/_c.py": "from shardtool.runtime.engine._b import z\n",
                                "runtime/engine/_b.py": ""},
     ["shardtool.runtime._c -> shardtool.runtime.engine -> shardtool.runtime.engine._a -> shardtool.runtime._c"]),
    ("a_face_and_its_own_modules", {"runtime/model/__init__.py": "from ._a import x\n",
                                    "runtime/model/_a.py": "from . import _b\n", "runtime/model/_b.py": "",
                                    "runtime/model/_kernels.c": ""},
     []),
]


@pytest.mark.parametrize("files, expected", [case[1:] for case in CYCLES_PLANTED],
                         ids=[case[0] for case in CYCLES_PLANTED])
def test_the_cycle_check_names_a_planted_cycle(tmp_path, monkeypatch, files, expected):
    _fake_repo(tmp_path, monkeypatch, files)
    assert [" -> ".join(cycle) for cycle in _cycles(_graph())] == expected


def test_every_runtime_module_is_on_a_floor():
    """Only the runtime's face sits at the top of runtime/: every other module belongs to store, model or engine."""
    top = sorted(p.name for p in (REPO / "runtime").glob("*.py") if p.name != "__init__.py")
    top += sorted(p.name + "/" for p in (REPO / "runtime").iterdir()
                  if p.is_dir() and p.name not in SUBFLOORS and p.name != "__pycache__")
    assert top == []
