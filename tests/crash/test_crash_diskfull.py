"""A full disk during `split`, `sign` and `keygen`: a clear error (exit 3, "disk full"), no manifest from a failed
split, the old manifest kept by a failed sign, no half-written key file, no temp files left behind.

Uses a 2 MiB tmpfs, which needs root (CAP_SYS_ADMIN); elsewhere these tests skip and say so.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

import _crashkit as ck


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(directory: Path) -> None:
    """Write a filler file until the file system is full."""
    with open(directory / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def assert_disk_full(r) -> None:
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "disk full" in r.stderr and "[StorageError]" in r.stderr, r.stderr


def temp_files(root: Path) -> list[str]:
    return [d.path for d in ck.files_under(root) if ck.is_temp(d.name)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """About 6 MB of shards: three times what the small disk holds."""
    return ck.make_checkpoint(tmp_path_factory.mktemp("diskfull") / "hf", layers=3, experts=8, hidden=128,
                              moe_intermediate=256, intermediate=96, vocab=300)


def test_crash_diskfull_split(checkpoint, small_disk, tmp_path):
    out = small_disk / "out"
    r = ck.run("shardtool", "split", checkpoint, out, "-q", cwd=tmp_path)
    assert_disk_full(r)
    assert not (out / "manifest.msgpack").exists()
    assert temp_files(out) == []
    # Whatever did land under a final name is complete (same bytes as a split on a roomy disk).
    ck.run("shardtool", "split", checkpoint, tmp_path / "ref", "-q", cwd=tmp_path)
    for d in ck.files_under(out):
        rel = Path(d.path).relative_to(out)
        assert Path(d.path).read_bytes() == (tmp_path / "ref" / rel).read_bytes(), f"{rel} is incomplete"


def test_crash_diskfull_sign(small_disk, tmp_path):
    from shardtool.checkpoint import split_checkpoint

    ckpt = ck.make_checkpoint(tmp_path / "hf", layers=1, experts=2, hidden=32, moe_intermediate=16, intermediate=48,
                              vocab=300)
    split_checkpoint(ckpt, small_disk / "model", model_id="crash/full")
    assert ck.run("shardtool", "keygen", "--out", tmp_path / "A", "--no-passphrase", cwd=tmp_path).returncode == 0
    before = (small_disk / "model" / "manifest.msgpack").read_bytes()
    fill(small_disk)
    assert_disk_full(ck.run("shardtool", "sign", small_disk / "model", "--key", tmp_path / "A.key", cwd=tmp_path))
    assert (small_disk / "model" / "manifest.msgpack").read_bytes() == before
    assert temp_files(small_disk) == []
    (small_disk / "filler").unlink()
    assert ck.run("shardtool", "sign", small_disk / "model", "--key", tmp_path / "A.key", cwd=tmp_path).returncode == 0


def test_crash_diskfull_keygen(small_disk, tmp_path):
    fill(small_disk)
    assert_disk_full(ck.run("shardtool", "keygen", "--out", small_disk / "k", "--no-passphrase", cwd=tmp_path))
    assert sorted(os.listdir(small_disk)) == ["filler"]
    (small_disk / "filler").unlink()
    assert ck.run("shardtool", "keygen", "--out", small_disk / "k", "--no-passphrase", cwd=tmp_path).returncode == 0
