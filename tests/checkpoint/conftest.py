"""Fixtures for checkpoint tests: tiny HF checkpoints from examples/make_tiny_moe.py, and split/join helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
from ckpt_helpers import NOW, tensors_of  # noqa: F401  (re-exported for fixtures)


def _generator():
    from examples import make_tiny_moe  # the repository root is on pytest's pythonpath
    return make_tiny_moe


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make_tiny(family, **knobs)` -> a checkpoint directory, built once per session per argument set."""
    cache: dict[tuple, Path] = {}
    base = tmp_path_factory.mktemp("tiny")

    def make(family: str, **knobs: Any) -> Path:
        key = (family, tuple(sorted(knobs.items())))
        if key not in cache:
            out = base / f"{family}-{len(cache)}"
            cache[key] = _generator().make_checkpoint(out, family, **knobs)
        return cache[key]

    return make
