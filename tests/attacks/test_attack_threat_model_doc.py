"""docs/threat-model.md and the tests agree: every test it names exists, and every attack, crash and fuzz test
is named there (a case by `func[case]`, or all of a function's cases by `func`)."""

from __future__ import annotations

import re
import subprocess
import sys

import _attackkit as kit

DOC = kit.REPO / "docs" / "threat-model.md"
SUITES = ("tests/attacks", "tests/crash", "tests/fuzz")
_NAME = re.compile(r"`(test_[A-Za-z0-9_]+(?:\[[^\]`]+\])?)`")


def _collected() -> set[str]:
    """`func[case]` (or `func`) of every test in the three suites, from pytest's own collection."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *SUITES],
                       cwd=kit.REPO, capture_output=True, text=True, timeout=120)
    ids = {line.split("::", 1)[1] for line in r.stdout.splitlines() if "::" in line}
    assert ids, r.stdout + r.stderr
    return ids


def _covers(ref: str, test_id: str) -> bool:
    return test_id == ref or ("[" not in ref and test_id.startswith(ref + "["))


def test_threat_model_doc_matches_the_tests():
    named = set(_NAME.findall(DOC.read_text()))
    collected = _collected()
    dangling = sorted(ref for ref in named if not any(_covers(ref, t) for t in collected))
    assert not dangling, f"docs/threat-model.md names tests that do not exist: {dangling}"
    missing = sorted(t for t in collected if not t.startswith("test_threat_model_doc")
                     and not any(_covers(ref, t) for ref in named))
    assert not missing, f"tests not listed in docs/threat-model.md: {missing}"
