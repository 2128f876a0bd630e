"""Fixtures for end-to-end tests that run the installed `shardtool` command as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@dataclass
class Result:
    code: int
    out: str
    err: str


class Cli:
    def __init__(self, cwd: Path, state_dir: Path):
        self.cwd = cwd
        self.env = {**os.environ, "XDG_STATE_HOME": str(state_dir), "SHARDTOOL_PASSPHRASE": ""}
        self.env.pop("SHARDTOOL_PASSPHRASE")

    def __call__(self, *args: str, program: str = "shardtool", env: dict | None = None, timeout: int = 120) -> Result:
        proc = subprocess.run([str(BIN / program), *map(str, args)], cwd=self.cwd, capture_output=True, text=True,
                              env={**self.env, **(env or {})}, timeout=timeout, stdin=subprocess.DEVNULL)
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def ok(self, *args: str, **kw) -> Result:
        r = self(*args, **kw)
        assert r.code == 0, f"shardtool {' '.join(map(str, args))} exited {r.code}:\n{r.err}"
        return r


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    if not (BIN / "shardtool").exists():
        pytest.fail(f"the shardtool console script is not installed next to {sys.executable}; run `make install`")
    return Cli(tmp_path, tmp_path / "state")


@pytest.fixture
def make_model():
    return write_model


def write_model(root: Path) -> Path:
    """A small directory in the split layout; contents are arbitrary bytes (audit does not parse them)."""
    files = {
        "config.json": b'{"model_type": "mixtral"}',
        "tokenizer.json": b'{"version": "1.0"}',
        "trunk/embed.safetensors": os.urandom(3000),
        "trunk/layer-000.safetensors": os.urandom(2000),
        "trunk/layer-001.safetensors": os.urandom(2000),
        "experts/layer-000/expert-0000.safetensors": os.urandom(5000),
        "experts/layer-000/expert-0001.safetensors": os.urandom(5000),
        "experts/layer-001/expert-0000.safetensors": os.urandom(5000),
        "experts/layer-001/expert-0001.safetensors": os.urandom(5000),
    }
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root
