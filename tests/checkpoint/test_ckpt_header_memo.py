"""HeaderMemo: a verified shard read again is not parsed again, and what it returns is exactly what parsing returns.

The memo is keyed by the header's exact bytes and the file's size; an error is never remembered; it stays under its
byte bound, dropping the least recently used header first."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import shardtool.safetensors_format as sf
from shardtool.errors import CheckpointFormatError
from shardtool.safetensors_format import HeaderMemo, parse_safetensors


def _shard(values: list[float], name: str = "w", pad: str = "") -> bytes:
    data = np.asarray(values, np.float32).tobytes()
    header = {name: {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, len(data)]}}
    if pad:
        header["__metadata__"] = {"pad": pad}
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def test_a_shard_read_again_is_parsed_once_and_its_views_are_on_the_new_bytes(header_parses):
    memo = HeaderMemo(1 << 20)
    first = bytearray(_shard([1.0, 2.0]))
    again = bytearray(first)
    again[-4:] = np.float32(7.0).tobytes()  # same header, other tensor bytes: a view must read these
    a, _ = parse_safetensors(first, headers=memo)
    b, _ = parse_safetensors(again, headers=memo)
    assert len(header_parses) == 1
    assert a["w"].tolist() == [1.0, 2.0] and b["w"].tolist() == [1.0, 7.0]
    assert not b["w"].flags.writeable


def test_other_header_bytes_or_another_file_size_are_parsed_for_themselves(header_parses):
    memo = HeaderMemo(1 << 20)
    one, two = _shard([1.0], name="a"), _shard([1.0], name="b")  # headers of the same length, other bytes
    assert len(one) == len(two)
    assert list(parse_safetensors(one, headers=memo)[0]) == ["a"]
    assert list(parse_safetensors(two, headers=memo)[0]) == ["b"]
    assert len(header_parses) == 2
    # the same header bytes in a file one byte longer: not the remembered parse, which would accept it
    with pytest.raises(CheckpointFormatError, match="1 bytes after the last tensor"):
        parse_safetensors(one + b"\0", headers=memo)
    assert len(header_parses) == 3


def test_an_error_is_not_remembered(header_parses):
    memo = HeaderMemo(1 << 20)
    bad = _shard([1.0])[:-1]  # the header promises 4 bytes of data, 3 follow
    for _ in range(2):
        with pytest.raises(CheckpointFormatError, match="truncated"):
            parse_safetensors(bad, headers=memo)
    assert len(header_parses) == 2 and memo.used == 0


def test_the_memo_stays_under_its_bound_dropping_the_least_recently_used(header_parses):
    shards = [_shard([float(i)], name=f"t{i:03d}") for i in range(70)]  # headers of one length, so one cost
    header = shards[0][8:8 + struct.unpack("<Q", shards[0][:8])[0]]
    cost = HeaderMemo.cost(header, sf.parse_header(header, file_size=len(shards[0])))
    memo = HeaderMemo(64 * cost)  # 64 headers fit (and a header is kept only when 64 of it fit)
    for s in shards[:65]:
        parse_safetensors(s, headers=memo)
    assert memo.used == 64 * cost
    parse_safetensors(shards[1], headers=memo)  # kept; now the most recently used
    parse_safetensors(shards[65], headers=memo)  # a new one drops the least recently used: shards[2]
    header_parses.clear()
    parse_safetensors(shards[1], headers=memo)
    parse_safetensors(shards[64], headers=memo)
    assert header_parses == []
    parse_safetensors(shards[2], headers=memo)
    parse_safetensors(shards[0], headers=memo)  # dropped by the 65th
    assert len(header_parses) == 2 and memo.used <= memo.max_bytes


def test_a_header_too_large_for_the_bound_is_parsed_every_time(header_parses):
    shard = _shard([1.0], pad="x" * 4000)
    memo = HeaderMemo(64 * 1000)  # a header is kept only when 64 of it fit: this one costs over 8000
    for _ in range(3):
        parse_safetensors(shard, headers=memo)
    assert len(header_parses) == 3 and memo.used == 0


def _big_shard(i: int, case: str) -> bytes:
    """Headers whose parse holds far more memory than their bytes: names and metadata with a character outside
    Latin-1 (4 bytes a character in Python), many small metadata strings."""
    w = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}
    if case == "wide names":
        header = {f"{i}" + "a" * 1000 + "\U0001F600": w}
    elif case == "long metadata":
        header = {"__metadata__": {"m": f"{i}" + "x" * 20000 + "\U0001F600"}, "w": w}
    else:  # many one-character keys and values outside Latin-1
        header = {"__metadata__": {chr(0x4E00 + j) + str(i): chr(0x4E00 + j) for j in range(400)}, "w": w}
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return struct.pack("<Q", len(body)) + body + b"\0"


@pytest.mark.parametrize("case", ["wide names", "long metadata", "many metadata strings"])
def test_what_the_memo_holds_stays_within_its_bound(case):
    """`cost` is an upper bound on the memory a remembered header holds (measured by tracemalloc), so a memo filled to
    its bound holds at most that."""
    import gc
    import tracemalloc

    parse_safetensors(_big_shard(-1, case))  # numpy and the dtype table imported before measuring
    memo = HeaderMemo(8 << 20)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(5000):
            parse_safetensors(_big_shard(i, case), headers=memo)
            if memo.used >= 0.9 * memo.max_bytes:  # full (each header is kept: it costs under 1/64 of the bound)
                break
        else:
            pytest.fail(f"the memo did not fill: {memo.used} bytes")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held <= memo.used <= memo.max_bytes, (held, memo.used)


def test_a_store_has_room_for_every_shard_header_within_its_limits():
    from shardtool.runtime.store._store import HEADER_MEMO_MAX, HEADER_MEMO_MIN, HEADER_MEMO_PER_SHARD, header_memo_bytes

    assert header_memo_bytes(0) == header_memo_bytes(10) == HEADER_MEMO_MIN
    assert header_memo_bytes(1000) == 1000 * HEADER_MEMO_PER_SHARD
    assert header_memo_bytes(15_000) == 15_000 * HEADER_MEMO_PER_SHARD  # DeepSeek-V3's ~14,900 experts: every one
    assert header_memo_bytes(10**6) == HEADER_MEMO_MAX
