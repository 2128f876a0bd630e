"""The one way the suite runs an installed command (`shardtool`, `verify-and-run`, `ray`) as a user does: argv as
strings, no stdin, output captured as text, its own XDG state directory and no passphrase from the environment.

`Result` answers to both spellings the tests use: `code/out/err` and subprocess's `returncode/stdout/stderr`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent  # the venv's bin: the console scripts `make install` put next to this python
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    @property
    def returncode(self) -> int:
        return self.code

    @property
    def stdout(self) -> str:
        return self.out

    @property
    def stderr(self) -> str:
        return self.err

    @property
    def ids(self) -> list[int]:
        """`--print-ids` output as token ids."""
        return [int(x) for x in self.out.split()]

    @property
    def report(self) -> dict:
        """The one JSON document on stdout (a test failure, not a crash, when there is none)."""
        assert self.out.strip(), f"no JSON on stdout (exit {self.code}):\n{self.err}"
        return json.loads(self.out)

    @property
    def error_class(self) -> str | None:
        """The `[ClassName]` at the end of the CLI's one-line error on stderr."""
        for line in self.err.splitlines():
            if ": error: " in line and line.rstrip().endswith("]"):
                return line.rstrip().rsplit("[", 1)[1][:-1]
        return None

    def one_line(self) -> str:
        lines = self.err.strip().splitlines()
        assert len(lines) == 1, f"expected one stderr line, got:\n{self.err}"
        return lines[0]


def user_env(state: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without SHARDTOOL_PASSPHRASE, with XDG_STATE_HOME=`state`, then `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDTOOL_PASSPHRASE"}
    env["XDG_STATE_HOME"] = str(state)
    env.update(extra or {})
    return env


def argv(program: str, *args: Any) -> list[str]:
    return [str(BIN / program), *map(str, args)]


def _spawn(argv_: list[str], cwd: Path | None, env: dict[str, str], timeout: float) -> Result:
    proc = subprocess.run(argv_, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def run(program: str, *args: Any, cwd: Path | None = None, state: Path | None = None, env: dict | None = None,
        timeout: float = 120) -> Result:
    """Run `program args...` in `cwd`; XDG state in `state` (default: `cwd/xdg`), `env` on top."""
    state = state if state is not None else Path(cwd or Path.cwd()) / "xdg"
    return _spawn(argv(program, *args), cwd, user_env(state, env), timeout)


def ok(program: str, *args: Any, **kw: Any) -> Result:
    """`run`, which must exit 0 (the failure shows the command and the end of its stderr)."""
    r = run(program, *args, **kw)
    assert r.code == 0, f"{program} {' '.join(map(str, args))} exited {r.code}:\n{r.err[-3000:]}"
    return r


class Cli:
    """`run` bound to a working directory and its environment (`env`, a dict a test may update; XDG state in `state`,
    default `cwd/xdg`): `cli("split", ...)`, `cli.ok(...)`, `cli("--json", program="verify-and-run")`."""

    def __init__(self, cwd: Path, state: Path | None = None, env: dict | None = None):
        if not (BIN / "shardtool").exists():
            pytest.fail(f"the shardtool console script is not installed next to {sys.executable}; run `make install`")
        self.cwd = cwd
        self.env = user_env(state if state is not None else cwd / "xdg", env)

    def argv(self, *args: Any, program: str = "shardtool") -> list[str]:
        return argv(program, *args)

    def __call__(self, *args: Any, program: str = "shardtool", env: dict | None = None, timeout: float = 120) -> Result:
        return _spawn(argv(program, *args), self.cwd, {**self.env, **(env or {})}, timeout)

    def ok(self, *args: Any, program: str = "shardtool", **kw: Any) -> Result:
        r = self(*args, program=program, **kw)
        assert r.code == 0, f"{program} {' '.join(map(str, args))} exited {r.code}:\n{r.err[-3000:]}"
        return r
