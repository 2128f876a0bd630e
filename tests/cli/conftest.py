"""Fixtures for end-to-end tests that run the installed `shardtool` command as a user would."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _kit.cli import Cli


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path, state=tmp_path / "state")


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
