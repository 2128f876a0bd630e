"""What the pull/push tests share: the installed `shardtool` run as a user runs it, checks on a pull's DEST, and
the subprocess servers (hostile_mirror.py, moto) with their process-group teardown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest

from _kit.cli import BIN, REPO, Cli, Result  # noqa: F401  (the remote tests use them through this kit)

from shardtool.keys import load_public_key
from shardtool.manifest import MANIFEST_NAME, load_trusted_manifest

HERE = Path(__file__).resolve().parent
MODEL_ID = "test/remote"
CHUNK = 8 * 1024 * 1024  # remote/_mirror.py's READ_CHUNK: the most a run may hold beyond the signed total
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class World:
    work: Path
    model: Path  # split + signed by publisher
    unsigned: Path  # split, never signed
    pub: Path
    entries: dict  # path -> Entry of the signed manifest

    @property
    def total(self) -> int:
        return sum(e.size for e in self.entries.values())


def build_cli(work: Path) -> Cli:
    return Cli(work)


def verified_entries(model: Path, pub: Path, state: Path) -> dict:
    manifest = load_trusted_manifest(model / MANIFEST_NAME, [load_public_key(pub)], 1, state)
    return {e.path: e for e in manifest.entries}


# -- checks on DEST -------------------------------------------------------------------------------------------

def disk_use(dest: Path) -> int:
    return sum(p.lstat().st_size for p in dest.rglob("*") if p.is_file() and not p.is_symlink())


def check_dest(dest: Path, entries: dict, *, complete: bool, selected=None) -> None:
    """Nothing unverified under a final name; disk use within the signed total of the selection plus one chunk;
    the manifest present exactly when the run completed."""
    selected = set(entries) if selected is None else set(selected)
    for p in dest.rglob("*"):
        if not p.is_file():
            continue
        assert not p.is_symlink(), p
        rel = p.relative_to(dest).as_posix()
        if p.name.endswith(".partial") and p.name.startswith("."):
            continue
        if rel == MANIFEST_NAME:
            continue
        assert rel in selected, f"{rel} is in DEST but was not selected"
        entry = entries[rel]
        data = p.read_bytes()
        assert len(data) == entry.size and blake3.blake3(data).digest() == entry.digest, f"{rel} is not verified"
    assert disk_use(dest) <= sum(entries[p].size for p in selected) + CHUNK + (
        (dest / MANIFEST_NAME).stat().st_size if (dest / MANIFEST_NAME).exists() else 0)
    if complete:
        for rel in selected:
            assert (dest / rel).is_file(), f"{rel} missing after a complete pull"
    assert (dest / MANIFEST_NAME).exists() == complete


# -- subprocess servers ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"{what} did not listen on port {port} within {seconds:g}s")


def stop(proc: subprocess.Popen) -> None:
    """End the server's own process group (it was started with start_new_session=True)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


class MirrorServer:
    """hostile_mirror.py serving `root`; `url(name)` is mirror `name`'s base URL."""

    def __init__(self, root: Path, config: dict, tmp: Path):
        self.root, self.tmp = root, tmp
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(config))
        self.log = tmp / "requests.log"
        self.log.touch()
        port_file = tmp / "port"
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "hostile_mirror.py"), "--root", str(root), "--config", str(tmp / "config.json"),
             "--log", str(self.log), "--port-file", str(port_file), "--also-host", "127.0.0.2"],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(tmp / "err", "w"))
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                stop(self.proc)
                pytest.fail(f"hostile_mirror.py did not start: {(tmp / 'err').read_text()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        wait_port(self.port, self.proc, "hostile_mirror.py")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}/"

    def mark(self) -> int:
        return self.log.stat().st_size

    def requests(self, since: int = 0) -> list[dict]:
        with open(self.log, "rb") as fh:
            fh.seek(since)
            return [json.loads(line) for line in fh.read().decode().splitlines() if line]

    def close(self) -> None:
        stop(self.proc)


def target_file(world: World) -> str:
    """The shard every path-specific fault hits: an expert of layer 1."""
    return sorted(p for p, e in world.entries.items() if e.kind == "expert" and e.layer == 1)[0]


FAULTS = ("wrong_bytes", "endless", "short", "http500", "stall", "redirect")
