"""Units of the remote reader: an HTTP answer's checks before a byte is read (`_check_response`, `_range_start`) and
the bounded, verified download of one entry across mirrors (`fetch_entry`) with in-memory mirrors."""

from __future__ import annotations

import errno
from pathlib import Path

import blake3
import pytest

from shardtool.manifest import Entry
from shardtool.outdir import OutDir
from shardtool.remote import FetchFailed, Mirror, MirrorFault, fetch_entry
from shardtool.remote._fetch import partial_name
from shardtool.remote._mirror import Stream, _check_response, _FsspecMirror, _range_start


class _Response:
    def __init__(self, status: int, **headers: str):
        self.status = status
        self.headers = {k.replace("_", "-"): v for k, v in headers.items()}


@pytest.mark.parametrize("status,headers,start,size,cap,offset", [
    (200, {}, 0, 10, None, 0),
    (200, {"Content_Length": "10"}, 0, 10, None, 0),
    (200, {"Content_Length": "10", "Content_Encoding": "identity"}, 0, 10, None, 0),
    (206, {"Content_Range": "bytes 4-9/10", "Content_Length": "6"}, 4, 10, None, 4),
    (200, {"Content_Length": "10"}, 4, 10, None, 0),  # Range ignored: the whole file from 0
    (200, {"Content_Length": "100"}, 0, None, 100, 0),  # the manifest: size unknown, within the cap
    (200, {}, 0, None, 100, 0),
], ids=["no-length", "length", "identity", "partial", "range-ignored", "manifest-at-cap", "manifest-no-length"])
def test_check_response_accepts(status, headers, start, size, cap, offset):
    assert _check_response(_Response(status, **headers), start, size, cap) == offset


@pytest.mark.parametrize("status,headers,start,size,cap,reason", [
    (404, {}, 0, 10, None, "not found"),
    (500, {}, 0, 10, None, "HTTP 500"),
    (416, {}, 10, 10, None, "refuses a read from byte 10"),
    (416, {}, 4, 10, None, "HTTP 416"),
    (200, {"Content_Length": "11"}, 0, 10, None, "declares 11 bytes, the signed size is 10"),
    (200, {"Content_Length": "9"}, 0, 10, None, "declares 9 bytes"),
    (206, {"Content_Range": "bytes 4-9/10", "Content_Length": "5"}, 4, 10, None, "declares 9 bytes"),
    (206, {"Content_Range": "bytes 0-9/10"}, 4, 10, None, "answers a read from byte 4 with bytes from 0"),
    (206, {"Content_Range": "bytes */10"}, 4, 10, None, "Content-Range"),
    (206, {}, 4, 10, None, "Content-Range"),
    (200, {"Content_Encoding": "gzip"}, 0, 10, None, "'gzip'-encoded"),
    (200, {"Content_Encoding": "br"}, 0, 10, None, "'br'-encoded"),
    (200, {"Content_Length": "-1"}, 0, 10, None, "Content-Length of '-1'"),
    (200, {"Content_Length": "1e1"}, 0, 10, None, "Content-Length"),
    (200, {"Content_Length": "\u0661\u0660"}, 0, 10, None, "Content-Length"),  # Arabic-Indic "10"
    (200, {"Content_Length": "1" * 21}, 0, 10, None, "Content-Length"),
    (200, {"Content_Length": "101"}, 0, None, 100, "more than the cap of 100"),
    (200, {"Content_Length": str(1 << 30)}, 0, None, 100, "more than the cap"),
], ids=["404", "500", "416-at-end", "416-inside", "long", "short", "partial-short", "wrong-start", "range-star",
        "206-no-range", "gzip", "br", "negative", "exponent", "non-ascii-digits", "21-digits", "manifest-over-cap",
        "manifest-1gib"])
def test_check_response_refuses(status, headers, start, size, cap, reason):
    with pytest.raises(MirrorFault) as info:
        _check_response(_Response(status, **headers), start, size, cap)
    assert reason in info.value.reason


@pytest.mark.parametrize("text,start", [("bytes 100-199/200", 100), ("bytes 0-0/1", 0), ("BYTES 7-8/9", 7),
                                        ("  bytes 5-9/10 ", 5), ("bytes 3-9/*", 3)])
def test_range_start(text, start):
    assert _range_start(text) == start


@pytest.mark.parametrize("text", ["", "bytes", "bytes */200", "items 0-1/2", "bytes -5-10/20", "bytes x-1/2",
                                  "bytes \u0661-2/3", "bytes " + "9" * 21 + "-1/2", "bytes=0-1"])
def test_range_start_refuses(text):
    with pytest.raises(MirrorFault, match="Content-Range"):
        _range_start(text)


# -- fetch_entry across in-memory mirrors ---------------------------------------------------------------------

class _BytesStream(Stream):
    def __init__(self, body: bytes, offset: int):
        self._body, self.offset, self._pos = body, offset, 0

    def read(self, n: int) -> bytes:
        data = self._body[self._pos:self._pos + n]
        self._pos += len(data)
        return data


class _MemMirror(Mirror):
    """Serves `data` (the bytes it holds, right or not) up to `stop` bytes of the file; `honours_range`: starts
    where asked. `starts` records every read's start."""

    def __init__(self, name: str, data: bytes, *, stop: int | None = None, honours_range: bool = True):
        super().__init__(f"mem://{name}/", 5.0)
        self.data, self.stop, self.honours_range = data, stop, honours_range
        self.starts: list[int] = []

    def open(self, relpath, start, size, cap=None):
        self.starts.append(start)
        offset = start if self.honours_range else 0
        return _BytesStream(self.data[offset:self.stop], offset)


PATH = "experts/layer-001/expert-0002.safetensors"
DATA = bytes(range(256)) * 40 + b"tail"


def _entry(data: bytes = DATA) -> Entry:
    return Entry(PATH, "expert", len(data), blake3.blake3(data).digest(), layer=1, expert=2)


def _corrupt(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


def _partial(dest: Path) -> Path:
    return dest / "experts" / "layer-001" / partial_name("expert-0002.safetensors")


def test_resume_across_mirrors_short_by_one_byte(tmp_path):
    a = _MemMirror("a", DATA, stop=len(DATA) - 1)
    b = _MemMirror("b", DATA)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [a, b])
    assert a.starts == [0] and b.starts == [len(DATA) - 1]  # B continues with a range request
    assert outcome.status == "downloaded" and outcome.mirror == b.label and outcome.downloaded == len(DATA)
    assert [(f.mirror, f.path) for f in outcome.faults] == [(a.label, PATH)]
    assert f"ended after {len(DATA) - 1} of the signed {len(DATA)} bytes" in outcome.faults[0].reason
    assert (tmp_path / PATH).read_bytes() == DATA and not _partial(tmp_path).exists()


def test_wrong_bytes_after_a_resumed_prefix_are_fetched_whole_before_blame(tmp_path):
    half = len(DATA) // 2
    a = _MemMirror("a", _corrupt(DATA, 10), stop=half)  # a bad prefix, then it stops
    b = _MemMirror("b", DATA)  # right: its own bytes complete the file when asked whole
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [a, b])
    assert b.starts == [half, 0]
    assert outcome.mirror == b.label and (tmp_path / PATH).read_bytes() == DATA
    assert [f.mirror for f in outcome.faults] == [a.label]  # B is not blamed for A's prefix
    assert "wrong bytes" not in outcome.faults[0].reason


def test_a_mirror_wrong_when_asked_whole_is_blamed(tmp_path):
    a = _MemMirror("a", DATA, stop=len(DATA) - 1)
    b = _MemMirror("b", _corrupt(DATA, len(DATA) - 1))  # its last byte, the one it is first asked for, is wrong
    with OutDir(tmp_path) as od, pytest.raises(FetchFailed) as info:
        fetch_entry(od, _entry(), [a, b])
    assert b.starts == [len(DATA) - 1, 0]
    faults = info.value.faults
    assert [f.mirror for f in faults] == [a.label, b.label] and "served wrong bytes" in faults[1].reason
    assert info.value.path == PATH and b.label in str(info.value)
    assert not (tmp_path / PATH).exists()
    assert _partial(tmp_path).stat().st_size <= len(DATA)


def test_wrong_bytes_from_one_mirror_are_blamed_at_once_and_the_next_serves(tmp_path):
    a = _MemMirror("a", _corrupt(DATA, 0))
    b = _MemMirror("b", DATA)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [a, b])
    assert a.starts == [0] and b.starts == [0]
    assert [f.mirror for f in outcome.faults] == [a.label] and "served wrong bytes" in outcome.faults[0].reason
    assert outcome.mirror == b.label


def test_a_longer_answer_is_cut_at_the_signed_size(tmp_path):
    """Nothing past the signed size is written; when the bytes before it are the signed ones they are verified and
    kept (the fault stays on the record), otherwise the file fails."""
    a = _MemMirror("a", DATA + b"x" * 100_000)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [a])
    assert [f.mirror for f in outcome.faults] == [a.label] and "serves more than the signed" in outcome.faults[0].reason
    assert (tmp_path / PATH).read_bytes() == DATA and not _partial(tmp_path).exists()
    bad = _MemMirror("bad", _corrupt(DATA, 0) + b"x" * 100_000)
    with OutDir(tmp_path / "2") as od, pytest.raises(FetchFailed) as info:
        fetch_entry(od, _entry(), [bad])
    assert "serves more than the signed" in info.value.faults[0].reason
    assert _partial(tmp_path / "2").stat().st_size == 0 and not (tmp_path / "2" / PATH).exists()


def test_a_partial_file_from_an_earlier_run_is_continued(tmp_path):
    part = _partial(tmp_path)
    part.parent.mkdir(parents=True)
    part.write_bytes(DATA[:1000])
    b = _MemMirror("b", DATA)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [b])
    assert b.starts == [1000] and outcome.status == "resumed" and outcome.downloaded == len(DATA) - 1000
    assert (tmp_path / PATH).read_bytes() == DATA


def test_a_mirror_that_ignores_the_range_restarts_the_partial_file(tmp_path):
    part = _partial(tmp_path)
    part.parent.mkdir(parents=True)
    part.write_bytes(_corrupt(DATA, 3)[:1000])  # a bad prefix: dropped, since the store starts from 0
    b = _MemMirror("b", DATA, honours_range=False)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [b])
    assert b.starts == [1000] and outcome.downloaded == len(DATA) and not outcome.faults
    assert (tmp_path / PATH).read_bytes() == DATA


def test_a_partial_file_longer_than_signed_is_dropped(tmp_path):
    part = _partial(tmp_path)
    part.parent.mkdir(parents=True)
    part.write_bytes(DATA + b"more")
    b = _MemMirror("b", DATA)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [b])
    assert b.starts == [0] and outcome.status == "downloaded"


def test_a_verified_file_is_kept_without_asking(tmp_path):
    (tmp_path / PATH).parent.mkdir(parents=True)
    (tmp_path / PATH).write_bytes(DATA)
    b = _MemMirror("b", DATA)
    with OutDir(tmp_path) as od:
        assert fetch_entry(od, _entry(), [b]).status == "kept"
    assert b.starts == []


def test_an_unverified_file_under_the_final_name_is_replaced(tmp_path):
    (tmp_path / PATH).parent.mkdir(parents=True)
    (tmp_path / PATH).write_bytes(_corrupt(DATA, 7))
    b = _MemMirror("b", DATA)
    with OutDir(tmp_path) as od:
        assert fetch_entry(od, _entry(), [b]).status == "downloaded"
    assert (tmp_path / PATH).read_bytes() == DATA


def test_a_file_in_place_that_cannot_be_read_is_replaced(tmp_path, monkeypatch):
    """A read error on the file under the final name makes it a file to replace (a VerificationError the keep
    check catches), not a StorageError that ends the pull."""
    import shardtool.manifest._files as files

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    (tmp_path / PATH).parent.mkdir(parents=True)
    (tmp_path / PATH).write_bytes(DATA)
    monkeypatch.setattr(files, "digest_fd", eio)
    b = _MemMirror("b", DATA)
    with OutDir(tmp_path) as od:
        assert fetch_entry(od, _entry(), [b]).status == "downloaded"
    assert b.starts == [0] and (tmp_path / PATH).read_bytes() == DATA


def test_a_mirror_fault_raised_on_open_moves_on(tmp_path):
    class Refusing(_MemMirror):
        def open(self, relpath, start, size, cap=None):
            self.starts.append(start)
            raise MirrorFault("HTTP 503")

    r, b = Refusing("r", b""), _MemMirror("b", DATA)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [r, b])
    assert r.starts == [0] and outcome.mirror == b.label
    assert [(f.mirror, f.reason) for f in outcome.faults] == [(r.label, "HTTP 503")]


# -- an fsspec store that refuses a range starting at the object's end (S3: HTTP 416) --------------------------

class _S3LikeFS:
    def __init__(self, data: bytes):
        self.data, self.reads = data, []

    def cat_file(self, path, start, end):
        self.reads.append((start, end))
        if start >= len(self.data):
            raise OSError(errno.EINVAL, "The requested range is not satisfiable")
        return self.data[start:end]


def _store(data: bytes) -> _FsspecMirror:
    mirror = _FsspecMirror("memory://models/m", 5.0)
    mirror.fs = _S3LikeFS(data)
    return mirror


def test_a_small_file_from_an_object_store_is_read_without_a_range_past_its_end(tmp_path):
    store = _store(DATA)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [store])
    assert not outcome.faults and (tmp_path / PATH).read_bytes() == DATA
    assert store.fs.reads == [(0, len(DATA) + 1)]  # one byte more than signed is asked, and nothing after


@pytest.mark.parametrize("data,reason", [(DATA + b"!", "serves more than the signed"),
                                         (DATA[:-1], f"ended after {len(DATA) - 1} of the signed")],
                         ids=["longer", "shorter"])
def test_an_object_of_another_size_is_a_fault_and_the_next_store_continues(tmp_path, data, reason):
    bad, good = _store(data), _store(DATA)
    with OutDir(tmp_path) as od:
        outcome = fetch_entry(od, _entry(), [bad, good])
    assert [f.mirror for f in outcome.faults] == [bad.label] and reason in outcome.faults[0].reason
    assert (tmp_path / PATH).read_bytes() == DATA
    if data == DATA[:-1]:
        assert good.fs.reads == [(len(DATA) - 1, len(DATA) + 1)]  # continued with a range read
