"""Rollback floor: the highest manifest version accepted per (model ID, trusted key set).

A lower version is a rollback; the same version with a different signed head is equivocation. The
state file is JSON, updated under an exclusive lock with an atomic rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import blake3

from shardtool.atomic import atomic_write_bytes
from shardtool.safeio import read_regular
from shardtool.errors import MissingFileError, RollbackError, StorageError, VerificationError
from shardtool.keys import PublicKey
from shardtool.manifest._document import head_digest
from shardtool.manifest._records import Head

STATE_FILE = "rollback.json"
MAX_STATE_BYTES = 16 * 1024 * 1024


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "shardtool"


def trust_set_id(model_id: str, trusted: Sequence[PublicKey]) -> str:
    """Key of the state record: the model ID and the sorted raw trusted keys (not key IDs)."""
    h = blake3.blake3(model_id.encode("utf-8") + b"\x00")
    for raw in sorted({k.raw for k in trusted}):
        h.update(raw)
    return h.hexdigest()[:32]


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[Path]:
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(state_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise StorageError(f"cannot use state directory: {e.strerror}", path=str(state_dir),
                           hint="pass --state-dir to choose another") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield state_dir / STATE_FILE
    finally:
        os.close(fd)


def _load(path: Path) -> dict:
    try:
        data = read_regular(path, MAX_STATE_BYTES, what="rollback state", too_large=StorageError)
    except MissingFileError:
        return {}
    except VerificationError as e:  # a FIFO or directory in our own state directory: our trouble, not a verdict
        raise StorageError(f"cannot read rollback state: {e.message}", path=str(path)) from None
    try:
        state = json.loads(data)
        if not isinstance(state, dict):
            raise ValueError("not an object")
        for record in state.values():
            if not (isinstance(record, dict) and type(record.get("version")) is int
                    and isinstance(record.get("head"), str)):
                raise ValueError("bad record")
    except (ValueError, RecursionError) as e:  # RecursionError: json.loads on absurdly nested input
        # A corrupt state file must not silently reset the floor to zero.
        raise StorageError(f"rollback state is corrupt ({e})", path=str(path),
                           hint="inspect or remove it deliberately; removing it forgets every floor") from e
    return state


def check_and_record(state_dir: Path, head: Head, trusted: Sequence[PublicKey]) -> int | None:
    """Refuse `head` if it rolls back or equivocates; otherwise raise the floor to it.

    Returns the previously accepted version (None on first use).
    """
    record_id = trust_set_id(head.model_id, trusted)
    digest = head_digest(head).hex()
    with _locked(Path(state_dir)) as path:
        state = _load(path)
        previous = state.get(record_id)
        if previous is not None:
            if head.version < previous["version"]:
                raise RollbackError(
                    f"manifest version {head.version} of {head.model_id!r} is older than version "
                    f"{previous['version']} already accepted", path=str(path))
            if head.version == previous["version"] and digest != previous["head"]:
                raise RollbackError(
                    f"manifest version {head.version} of {head.model_id!r} differs from the version "
                    f"{head.version} already accepted (two different manifests under one version)", path=str(path))
        if previous is None or head.version > previous["version"]:
            state[record_id] = {"model_id": head.model_id, "version": head.version, "head": digest}
            atomic_write_bytes(path, json.dumps(state, indent=1, sort_keys=True).encode(), mode=0o600)
        return previous["version"] if previous else None
