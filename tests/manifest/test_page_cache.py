"""The verified read's page-cache modes (`read_verified_timed(..., page_cache=)`): "keep", "drop" and "direct" hand out
the same verified bytes and refuse the same bad files; what they leave in the kernel's page cache is measured with
mincore(2) on a mapping of the file."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import blake3
import pytest

from shardtool.errors import DigestMismatchError
from shardtool.manifest import PAGE_CACHE_MODES, Entry, read_verified_timed

PAGE = mmap.PAGESIZE
# Sizes around the O_DIRECT block (4 KiB) and the read chunk (1 MiB), and an empty file.
SIZES = [0, 1, 4095, 4096, 4097, 2**20, 2**20 + 3, 3 * 2**20]


def _write(root: Path, size: int, name: str = "experts/e.safetensors") -> tuple[Entry, bytes]:
    data = (bytes(range(251)) * (size // 251 + 1))[:size]
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return Entry(path=name, kind="other", size=size, digest=blake3.blake3(data).digest()), data


@pytest.mark.parametrize("mode", PAGE_CACHE_MODES)
@pytest.mark.parametrize("size", SIZES)
def test_every_mode_hands_out_exactly_the_verified_bytes(tmp_path, mode, size):
    entry, data = _write(tmp_path, size)
    got = read_verified_timed(tmp_path, entry, mode).data
    assert len(got) == size and got.tobytes() == data
    assert not got.flags.writeable


@pytest.mark.parametrize("mode", PAGE_CACHE_MODES)
@pytest.mark.parametrize("bad", ["flipped-byte", "one-byte-short", "one-byte-long"])
def test_every_mode_refuses_a_wrong_file(tmp_path, mode, bad):
    entry, data = _write(tmp_path, 2**20 + 3)
    path = tmp_path / entry.path
    if bad == "flipped-byte":
        path.write_bytes(data[:5000] + bytes([data[5000] ^ 1]) + data[5001:])
    elif bad == "one-byte-short":
        path.write_bytes(data[:-1])
    else:
        path.write_bytes(data + b"\0")
    with pytest.raises(DigestMismatchError) as e:
        read_verified_timed(tmp_path, entry, mode)
    assert e.value.finding == ("digest-mismatch" if bad == "flipped-byte" else "size-mismatch")


@pytest.mark.parametrize("mode", PAGE_CACHE_MODES)
@pytest.mark.parametrize("change", ["grows", "shrinks"])
def test_every_mode_refuses_a_file_that_changes_while_it_is_read(tmp_path, monkeypatch, mode, change):
    """The size is right when the file is opened; after the first read (1 MiB of 1 MiB + 3 bytes) the file grows by
    two blocks or loses its second half."""
    size = 2**20 + 3
    entry, data = _write(tmp_path, size)
    path, real_readv, calls = tmp_path / entry.path, os.readv, []

    def readv_then_change(fd, buffers):
        n = real_readv(fd, buffers)
        if not calls:
            calls.append(n)
            if change == "grows":
                with open(path, "ab") as f:
                    f.write(b"\1" * 8192)
            else:
                os.truncate(path, size // 2)
        return n

    monkeypatch.setattr(os, "readv", readv_then_change)
    with pytest.raises(DigestMismatchError, match="changed while it was being hashed"):
        read_verified_timed(tmp_path, entry, mode)
    assert calls


def test_an_unknown_mode_is_a_callers_bug(tmp_path):
    entry, _ = _write(tmp_path, 10)
    with pytest.raises(ValueError, match="page_cache"):
        read_verified_timed(tmp_path, entry, "mmap")


def _resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache: mincore(2) over a read-only shared mapping, which itself faults nothing in."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(b & 1 for b in vec.raw[:(size + PAGE - 1) // PAGE])
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode, resident", [("keep", "all"), ("drop", "none"), ("direct", "none")])
def test_what_each_mode_leaves_in_the_page_cache(tmp_path, mode, resident):
    entry, _ = _write(tmp_path, 4 * 2**20)
    path = tmp_path / entry.path
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written pages are clean now: dropped
    finally:
        os.close(fd)
    if _resident_pages(path) != 0:
        pytest.skip(f"{tmp_path}'s filesystem keeps file pages whatever is advised (tmpfs?)")
    read_verified_timed(tmp_path, entry, mode)
    pages = _resident_pages(path)
    assert pages == (entry.size // PAGE if resident == "all" else 0)


def test_direct_reads_bypass_the_page_cache_on_every_call(tmp_path, monkeypatch):
    """"direct" reads through a descriptor with O_DIRECT set (where the filesystem accepts it), in aligned blocks."""
    import fcntl

    entry, data = _write(tmp_path, 2**20 + 3)
    probe = os.open(tmp_path / entry.path, os.O_RDONLY | os.O_DIRECT)
    os.close(probe)  # the filesystem accepts O_DIRECT (tmpfs would refuse: then "direct" reads as "drop")
    real_readv, seen = os.readv, []

    def readv(fd, buffers):
        seen.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), len(buffers[0]) % 4096))
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    assert read_verified_timed(tmp_path, entry, "direct").data.tobytes() == data
    assert seen and seen == [(True, 0)] * len(seen)


@pytest.mark.parametrize("mode", PAGE_CACHE_MODES)
@pytest.mark.parametrize("cap", [1000, 4096, 524288])
def test_short_reads_mid_file_are_not_the_end_of_it(tmp_path, monkeypatch, mode, cap):
    """FUSE, NFS and CIFS may answer a read with fewer bytes than asked mid-file: every mode goes on reading (under
    O_DIRECT, from an unaligned offset with plain reads) and hands out the verified bytes (an attacker's review found
    "direct" refusing a good file there)."""
    entry, data = _write(tmp_path, 3 * 2**20 + 5)
    real_readv = os.readv
    monkeypatch.setattr(os, "readv", lambda fd, buffers: real_readv(fd, [buffers[0][:cap]]))
    got = read_verified_timed(tmp_path, entry, mode).data
    assert got.tobytes() == data and not got.flags.writeable


def test_direct_falls_back_to_plain_reads_where_the_filesystem_refuses_them(tmp_path, monkeypatch):
    """A filesystem that takes O_DIRECT but answers its reads with EINVAL is read plainly."""
    import errno
    import fcntl

    entry, data = _write(tmp_path, 2**20 + 3)
    real_readv = os.readv

    def readv(fd, buffers):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    assert read_verified_timed(tmp_path, entry, "direct").data.tobytes() == data


def test_nothing_reachable_from_direct_bytes_is_writeable(tmp_path):
    entry, _ = _write(tmp_path, 5000)
    got = read_verified_timed(tmp_path, entry, "direct").data
    owner = got
    while owner.base is not None and hasattr(owner.base, "flags"):
        owner = owner.base
        assert not owner.flags.writeable
    with pytest.raises(ValueError):
        got[:10].flags.writeable = True
