"""docs/threat-model.md and the tests agree: every test it names exists (in any suite: a unit test can be the
evidence for a row), and every attack, crash and fuzz test is named there (a case by `func[case]`, or all of a
function's cases by `func`)."""

from __future__ import annotations

import re
import subprocess
import sys

import _attackkit as kit

DOC = kit.REPO / "docs" / "threat-model.md"
SUITES = ("tests/attacks", "tests/crash", "tests/fuzz")
_NAME = re.compile(r"`(test_[A-Za-z0-9_]+(?:\[[^\]`]+\])?)`")


def _collected() -> dict[str, set[str]]:
    """`func[case]` (or `func`) of every test, by file path, from pytest's own collection."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                       cwd=kit.REPO, capture_output=True, text=True, timeout=300)
    ids: dict[str, set[str]] = {}
    for line in r.stdout.splitlines():
        if "::" in line:
            path, test = line.split("::", 1)
            ids.setdefault(path, set()).add(test)
    assert ids, r.stdout + r.stderr
    return ids


def _covers(ref: str, test_id: str) -> bool:
    return test_id == ref or ("[" not in ref and test_id.startswith(ref + "["))


def test_threat_model_doc_matches_the_tests():
    named = set(_NAME.findall(DOC.read_text()))
    by_file = _collected()
    everywhere = set().union(*by_file.values())
    dangling = sorted(ref for ref in named if not any(_covers(ref, t) for t in everywhere))
    assert not dangling, f"docs/threat-model.md names tests that do not exist: {dangling}"
    suites = {t for path, tests in by_file.items() if path.startswith(SUITES) for t in tests}
    missing = sorted(t for t in suites if not t.startswith("test_threat_model_doc")
                     and not any(_covers(ref, t) for ref in named))
    assert not missing, f"tests not listed in docs/threat-model.md: {missing}"
