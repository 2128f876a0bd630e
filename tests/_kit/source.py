"""The package's source read as a test reads it: every constant literal in the parts' Python files, with where it
stands (the family and format tables' tests look for names spelled outside their table)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator


def constants(root: Path, folders: tuple[str, ...], skip: Path) -> Iterator[tuple[Path, int, object]]:
    """(path relative to `root`, line, value) for every constant in `folders`' Python files but `skip`, in order."""
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if rel == skip:
                continue
            nodes = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.Constant)]
            for node in sorted(nodes, key=lambda n: n.lineno):
                yield rel, node.lineno, node.value
