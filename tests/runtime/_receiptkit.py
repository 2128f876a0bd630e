"""What the receipt tests share: the installed commands, run as a user runs them (the suite's one runner)."""

from __future__ import annotations

from pathlib import Path

from _kit.cli import REPO, Result, ok, run  # noqa: F401  (REPO: the receipt tests import it from here)


def cli(program: str, *args, cwd: Path, check: bool = True) -> Result:
    """Run an installed command (`shardtool`, `verify-and-run`) in `cwd` with its own XDG state (`cwd/xdg`); by
    default it must succeed."""
    return (ok if check else run)(program, *args, cwd=cwd)
