"""The suite's shared kit: one runner for the installed commands (`cli`), and tiny models generated, split and
signed once per session (`models`, served to tests by the fixtures in tests/conftest.py).

Imported as `_kit` (tests/ is on sys.path through tests/conftest.py). Under pytest-xdist a session is one worker, so
a session-built model is built once per worker.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# Under `pytest -n N --dist loadgroup` (make test) the tests of each of these folders of tests/ run on one worker:
# each folder holds session-wide servers (one Ray head; moto and the hostile mirror) that a second worker would
# start again. tests/conftest.py marks them.
XDIST_GROUPS = {"cluster": "ray", "remote": "remote"}
_SHARED_SCOPES = ("class", "module", "package")


def xdist_group_of(path: Path) -> str | None:
    """The xdist group of the test file at `path` (None: any worker)."""
    parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
    return XDIST_GROUPS.get(parts[0]) if len(parts) > 1 else None


def xdist_group_of_item(item) -> str | None:
    """A test's xdist group: its folder's (above), else its file's when it uses a class-, module- or package-scoped
    fixture (a model built and signed, a server started: on a second worker it would be built again), else None."""
    group = xdist_group_of(item.path)
    if group is None:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(fds and fds[-1].scope in _SHARED_SCOPES for fds in defs):
            group = item.path.relative_to(TESTS.parent).as_posix() if item.path.is_relative_to(TESTS) else str(item.path)
    return group
