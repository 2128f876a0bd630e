"""Official BLAKE3 vectors through both shard digest paths: in memory (`digest_bytes`) and streamed from an
open file (`digest_fd`). Input i is bytes(j % 251 for j in range(input_len)); the digest is the first 32
bytes of the extended "hash" output."""

from __future__ import annotations

import os

import blake3
import pytest

from shardtool.manifest._files import PARALLEL_HASH_MIN, digest_bytes, digest_fd

FILE = "blake3_test_vectors.json"


def _input(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]  # byte j is j % 251


def _cases(data):
    return [(f"len{c['input_len']}", c) for c in data["cases"]]


def test_vector_file_shape(load_testdata):
    data = load_testdata(FILE)
    assert len(data["cases"]) == 35
    assert all(len(c["hash"]) == 131 * 2 for c in data["cases"])
    assert [c["input_len"] for c in data["cases"]][:3] == [0, 1, 2] and data["cases"][-1]["input_len"] == 102400


@pytest.fixture
def write(tmp_path):
    def _write(data: bytes) -> int:
        path = tmp_path / f"shard-{len(data)}"
        path.write_bytes(data)
        return os.open(path, os.O_RDONLY)
    return _write


@pytest.mark.vectors(FILE, "case", _cases)
def test_digest_bytes_and_digest_fd_match_the_vector(case, write):
    data = _input(case["input_len"])
    want = bytes.fromhex(case["hash"][:64])
    assert digest_bytes(data) == want
    assert digest_bytes(memoryview(data)) == want
    fd = write(data)
    try:
        result = digest_fd(fd)
        assert (result.digest, result.size, result.changed) == (want, len(data), False)
        # A tiny reused buffer forces many reads that split BLAKE3 chunks (1024 B) at odd places.
        os.lseek(fd, 0, os.SEEK_SET)
        assert digest_fd(fd, bytearray(1000)).digest == want
    finally:
        os.close(fd)


def test_threaded_paths_agree_with_single_threaded_blake3(write):
    # The vectors stop at 100 KiB; shards use BLAKE3's multithreaded mode from PARALLEL_HASH_MIN upwards.
    data = _input(4 * PARALLEL_HASH_MIN + 12345)
    want = blake3.blake3(data, max_threads=1).digest()
    assert digest_bytes(data) == want
    fd = write(data)
    try:
        assert digest_fd(fd).digest == want
    finally:
        os.close(fd)
