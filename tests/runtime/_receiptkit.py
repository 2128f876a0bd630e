"""What the receipt tests share: the installed commands, run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def cli(program: str, *args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run an installed command (`shardtool`, `verify-and-run`) in `cwd` with its own XDG state; by default it
    must succeed."""
    env = {**os.environ, "XDG_STATE_HOME": str(cwd / "xdg")}
    proc = subprocess.run([str(BIN / program), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300, stdin=subprocess.DEVNULL)
    if check:
        assert proc.returncode == 0, f"{program} {args} exited {proc.returncode}:\n{proc.stderr}"
    return proc
