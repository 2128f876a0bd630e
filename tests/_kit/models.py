"""Tiny models built once per session: examples/make_tiny_moe.py checkpoints, and their split, signed releases.

Everything returned is shared by every test of the session (one xdist worker): read it, or take `fresh_copy` of it
before changing a byte. Each build is keyed by its full argument set, so two tests asking for the same model get
the same directory and the second pays nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .cli import ok


def fresh_copy(src: Path, dst: Path) -> Path:
    """A private copy of a shared model or checkpoint (symlinks kept as links), for a test that mutates it."""
    shutil.copytree(src, dst, symlinks=True)
    return dst


class TinyModels:
    """The session's cache of generated checkpoints, publisher keys and signed releases, under `base`."""

    def __init__(self, base: Path):
        self.base = base
        self._built: dict[tuple, Path] = {}

    def _once(self, key: tuple, make) -> Path:
        if key not in self._built:
            self._built[key] = make(self.base / f"{key[0]}-{len(self._built)}")
        return self._built[key]

    def checkpoint(self, family: str, **knobs: Any) -> Path:
        """make_tiny_moe's `family` checkpoint with `knobs` (its `Knobs` fields), generated in-process."""
        def make(out: Path) -> Path:
            from examples import make_tiny_moe  # the repository root is on pytest's pythonpath
            return make_tiny_moe.make_checkpoint(out, family, **knobs)
        return self._once(("hf", family, tuple(sorted(knobs.items()))), make)

    def keypair(self, name: str = "publisher") -> Path:
        """An unencrypted Ed25519 key pair `<dir>/<name>.key` + `.pub`; returns the `.key` path."""
        def make(out: Path) -> Path:
            from shardtool import keys as keylib
            out.mkdir()
            keylib.write_keypair(out / name, keylib.generate(), None, force=False)
            return out / f"{name}.key"
        return self._once(("key", name), make)

    def release(self, family: str, *, model_id: str, version: int = 1, key: str | None = "publisher",
                split_args: tuple[str, ...] = (), **knobs: Any) -> Path:
        """`shardtool split` of `checkpoint(family, **knobs)` (+ `split_args`), then `shardtool sign` with
        `keypair(key)` (key=None: left unsigned), through the installed command as a publisher runs it."""
        ck = self.checkpoint(family, **knobs)
        signer = self.keypair(key) if key is not None else None

        def make(out: Path) -> Path:
            ok("shardtool", "split", "-q", ck, out, "--model-id", model_id, "--version", version, *split_args,
               cwd=self.base)
            if signer is not None:
                ok("shardtool", "sign", out, "--key", signer, cwd=self.base)
            return out
        return self._once(("release", family, model_id, version, key, split_args, tuple(sorted(knobs.items()))), make)
