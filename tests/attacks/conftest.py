"""Fixtures for the attack suite: a small signed MoE model in two releases, a foreign model, publisher keys.

Built once per session in-process (split + hand signing); every test then attacks its own copy through the
installed `shardtool audit` and `verify-and-run`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import _attackkit as kit

MODEL_ID = "acme/tiny-moe"


@dataclass(frozen=True)
class Keys:
    dir: Path

    def pub(self, name: str) -> Path:
        return self.dir / f"{name}.pub"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def signer(self, name: str):
        return kit.load_signing_key(self.key(name))


@dataclass(frozen=True)
class World:
    """Everything an attack case may use besides its own model copy."""

    keys: Keys
    v1: Path  # release 1 of MODEL_ID, signed by A
    v2: Path  # release 2 of MODEL_ID (different weights), signed by A: the model under attack
    other: Path  # another model with the same shapes, signed by A
    clean_out: str  # verify-and-run's stdout on an untouched copy of v2
    tmp: Path  # per-test scratch directory outside the model


def _make_checkpoint(out: Path, seed: int) -> Path:
    from examples import make_tiny_moe  # the repository root is on pytest's pythonpath
    return make_tiny_moe.make_checkpoint(out, "mixtral", seed=seed, **kit.MODEL_KNOBS)


def _release(base: Path, name: str, seed: int, model_id: str, version: int, signer) -> Path:
    from shardtool.checkpoint import split_checkpoint

    out = base / name
    split_checkpoint(_make_checkpoint(base / f"{name}-hf", seed), out, model_id=model_id, version=version)
    kit.Doc.read(out).sign(signer).write(out)
    return out


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> Keys:
    from shardtool import keys as keylib

    d = tmp_path_factory.mktemp("keys")
    for name in ("A", "B", "C"):
        keylib.write_keypair(d / name, keylib.generate(), None, force=False)
    keylib.write_keypair(d / "E", keylib.generate(), b"correct horse", force=False)  # encrypted
    for name, text in (("E.pass", "correct horse\n"), ("wrong.pass", "battery staple\n")):
        (d / name).write_text(text)
        (d / name).chmod(0o600)  # a passphrase file is a secret: owner-only, like the key
    return Keys(d)


@pytest.fixture(scope="session")
def releases(tmp_path_factory, keys):
    base = tmp_path_factory.mktemp("releases")
    a = keys.signer("A")
    v1 = _release(base, "v1", 0, MODEL_ID, 1, a)
    v2 = _release(base, "v2", 1, MODEL_ID, 2, a)
    other = _release(base, "other", 2, "other/tiny-moe", 1, a)
    r = kit.run(*kit.run_cmd(v2, [keys.pub("A")], 1, base / "state"), cwd=base)
    assert r.code == 0 and r.out.strip(), f"the clean model does not run:\n{r.err}"
    return v1, v2, other, r.out


@pytest.fixture
def world(releases, keys, tmp_path) -> World:
    v1, v2, other, clean_out = releases
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return World(keys, v1, v2, other, clean_out, scratch)


@pytest.fixture
def model(world, tmp_path) -> Path:
    """A private copy of release 2, ready to be attacked."""
    return kit.copy_model(world.v2, tmp_path / "model")
