"""No function body longer than MAX_BODY lines anywhere in the package: a command is argument handling around one
library call, and a long function elsewhere is several jobs. The body is counted from its first statement after
the docstring to its last line; a signature (a command's typer options) does not count. Read with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_architecture import PARTS, REPO

MAX_BODY = 60
# Functions allowed over the cap while a change splits them (only while they are still too long): none now.
BEING_SPLIT: set[tuple[str, str]] = set()


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return fn.end_lineno - body[0].lineno + 1


def long_functions(root: Path) -> dict[tuple[str, str], int]:
    found = {}
    for folder in PARTS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if folder == "shardtool" and len(rel.parts) > 2:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > MAX_BODY:
                    found[(rel.as_posix(), node.name)] = body_lines(node)
    return found


def test_no_function_body_is_longer_than_the_cap():
    over = {k: n for k, n in long_functions(REPO).items() if k not in BEING_SPLIT}
    assert over == {}, f"function bodies over {MAX_BODY} lines: {over}"


def test_the_being_split_list_names_only_functions_still_too_long():
    """An entry whose function got short (or moved) leaves the list: it must not hide a new long function later."""
    assert sorted(BEING_SPLIT - set(long_functions(REPO))) == []


CASES = [
    ("short_with_docstring", "def f(\n    a=1,\n    b=2,\n):\n    '''doc'''\n" + "    x = 1\n" * MAX_BODY, {}),
    ("one_line_too_long", "def f():\n    '''doc\n    more'''\n" + "    x = 1\n" * (MAX_BODY + 1),
     {("cli/mod.py", "f"): MAX_BODY + 1}),
    ("a_nested_function", "def f():\n    def g():\n" + "        x = 1\n" * (MAX_BODY + 1),
     {("cli/mod.py", "f"): MAX_BODY + 2, ("cli/mod.py", "g"): MAX_BODY + 1}),
]


@pytest.mark.parametrize("text, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_count_sees_a_planted_long_function(tmp_path, text, expected):
    for folder in PARTS:
        (tmp_path / folder).mkdir()
    (tmp_path / "cli" / "mod.py").write_text(text)
    assert long_functions(tmp_path) == expected
