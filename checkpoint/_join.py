"""`join`: rebuild the Hugging Face checkpoint from verified shards, every tensor byte-identical.

Each shard's `shardtool.source` record says where its tensors came from. Pass 1 streams every shard
through the entry check and keeps only its header, to lay out the rebuilt files; pass 2 streams each shard
again through the entry check (`VerifyingStream`, bounded buffers: a 2 GiB trunk file is never held whole),
checks its header is the one verified in pass 1, and writes the tensor bytes at their place with pwrite into
the rebuilt files' temp files. Side files (config, tokenizer, ...) are streamed through the same check into
temp files of their own. All of them are renamed into place only after every shard's and side file's size
and BLAKE3 matched: a file that fails its check leaves no rebuilt file. Memory: one CHUNK buffer, plus, for
a fused tensor, one expert's slice (its pieces are pasted back together before they are written).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from shardtool.atomic import atomic_writer
from shardtool.checkpoint._plan_records import Cut, paste, uint_view
from shardtool.checkpoint._writer import TensorSpec, encode_header
from shardtool.safetensors_format import DTYPE_SIZES, MAX_HEADER_BYTES, parse_header
from shardtool.checkpoint._split import QUANTIZED_KEY, SOURCE_FORMAT, SOURCE_KEY
from shardtool import formats
from shardtool.errors import (CheckpointFormatError, DigestMismatchError, ShardFormatError, StorageError,
                              UsageError)

if TYPE_CHECKING:
    import numpy as np

CHUNK = 4 * 1024 * 1024  # pass 2's read buffer: join's memory does not grow with the size of a shard


@dataclass
class _Target:
    """One tensor of a rebuilt file."""

    dtype: str
    shape: tuple[int, ...]
    offset: int                      # in the rebuilt file's data section
    fused: bool = False
    done: set[int] = field(default_factory=set)   # experts written (fused) or {0} (plain)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class _File:
    metadata: dict[str, str] | None
    tensors: dict[str, _Target] = field(default_factory=dict)
    header: bytes = b""


@dataclass(frozen=True)
class JoinResult:
    out: Path
    files: int
    tensors: int
    bytes_written: int
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {"rebuilt": str(self.out), "files": self.files, "tensors": self.tensors,
                "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3)}


def _header_length(prefix: bytes) -> int:
    """How much of a shard's start join keeps: the 8-byte length and the header it announces (capped:
    a longer one is refused by the parser)."""
    (n,) = struct.unpack("<Q", prefix)
    return 8 + min(n, MAX_HEADER_BYTES + 1)


def _verified_header(root: Path, entry: Any, buffer: bytearray) -> bytes:
    """The shard's header bytes, returned only after the whole shard matched its entry."""
    from shardtool.manifest import read_verified_prefix

    header = read_verified_prefix(root, entry, _header_length, buffer)
    if len(header) < 8:
        raise CheckpointFormatError("too short for a safetensors header", path=entry.path)
    return header


def _records(header: bytes, file_size: int, where: str) -> tuple[Any, dict[str, Any]]:
    """(parsed header, source records) of a shard; the header bytes include the length prefix."""
    try:
        parsed = parse_header(header[8:], file_size=file_size)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(e.message, path=where) from None
    raw = (parsed.metadata or {}).get(SOURCE_KEY)
    if raw is None:
        raise CheckpointFormatError(f"no {SOURCE_KEY} metadata: not written by shardtool split", path=where)
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{SOURCE_KEY} is not JSON: {e.msg}", path=where) from None
    if not isinstance(doc, dict) or doc.get("format") != SOURCE_FORMAT or not isinstance(doc.get("tensors"), dict) \
            or not isinstance(doc.get("files"), dict):
        raise CheckpointFormatError(f"{SOURCE_KEY} has an unknown form", path=where)
    if set(doc["tensors"]) != {t.name for t in parsed.tensors}:
        raise CheckpointFormatError(f"{SOURCE_KEY} does not describe exactly the shard's tensors", path=where)
    records = doc["tensors"]
    marked = [r for r in [doc, *records.values()] if isinstance(r, dict) and QUANTIZED_KEY in r]
    if marked:  # present at all, whatever its value: a shard written by `split --quantize`
        raise UsageError(f"this split's routed experts were quantized ({str(marked[0][QUANTIZED_KEY])[:16]}) by "
                         "`split --quantize`: the float checkpoint cannot be rebuilt from it", path=where,
                         hint="join a split made without --quantize; a quantized split is run, not joined")
    for t in parsed.tensors:
        rec = records[t.name]
        # only --quantize writes a weight_q4 (a `weight_scale` beside an int8 weight is caught by its dtype below; a
        # source FP8 checkpoint may name its scales weight_scale, and such a plain split must still join)
        if t.name.endswith(f".{formats.INT4.data}"):
            raise UsageError(f"tensor {t.name!r} is block-quantized (`split --quantize`): the float checkpoint "
                             "cannot be rebuilt from it", path=where,
                             hint="join a split made without --quantize; a quantized split is run, not joined")
        if isinstance(rec, dict) and "dtype" in rec and rec["dtype"] != t.dtype:
            raise CheckpointFormatError(f"tensor {t.name!r} is {t.dtype} but its source record says "
                                        f"{str(rec['dtype'])[:16]!r}: its bytes are not the source's", path=where)
    return parsed, doc


def _plan(root: Path, shard_entries: list, chunk: int) -> tuple[dict[str, _File], dict[str, bytes]]:
    files: dict[str, _File] = {}
    headers: dict[str, bytes] = {}
    buffer = bytearray(chunk)
    for entry in shard_entries:
        header = _verified_header(root, entry, buffer)
        headers[entry.path] = header
        parsed, doc = _records(header, entry.size, entry.path)
        infos = parsed.by_name()
        for fname, meta in doc["files"].items():
            if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
                raise CheckpointFormatError(f"source file name {fname!r} is not a plain name", path=entry.path)
            if meta is not None and not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                        for k, v in meta.items())):
                raise CheckpointFormatError(f"metadata recorded for {fname} is not a string map", path=entry.path)
            f = files.setdefault(fname, _File(meta))
            if f.metadata != meta:
                raise CheckpointFormatError(f"shards disagree on the metadata of {fname}", path=entry.path)
        for name, rec in doc["tensors"].items():
            info = infos[name]
            try:
                src_name, fname, offset = rec["name"], rec["file"], rec["offset"]
            except (KeyError, TypeError):
                raise CheckpointFormatError(f"malformed source record for {name!r}", path=entry.path) from None
            if fname not in files or not isinstance(offset, int) or offset < 0:
                raise CheckpointFormatError(f"bad source record for {name!r}", path=entry.path)
            fused = "cut" in rec
            shape = rec.get("shape") if fused else info.shape
            if fused and (not isinstance(shape, list) or len(shape) < 2
                          or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise CheckpointFormatError(f"bad fused shape recorded for {name!r}", path=entry.path)
            shape = tuple(shape)
            if fused:
                c = Cut.from_json(rec["cut"])
                if c.out_shape(shape[1:]) != info.shape or not isinstance(rec.get("expert"), int) \
                        or not 0 <= rec["expert"] < shape[0]:
                    raise CheckpointFormatError(f"fused record for {name!r} does not match its shape", path=entry.path)
            target = files[fname].tensors.setdefault(src_name, _Target(info.dtype, shape, offset, fused))
            if (target.dtype, target.shape, target.offset, target.fused) != (info.dtype, shape, offset, fused):
                raise CheckpointFormatError(f"shards disagree about source tensor {src_name!r}", path=entry.path)
    for fname, f in files.items():
        ordered = sorted(f.tensors.items(), key=lambda kv: (kv[1].offset, kv[1].nbytes))
        cursor = 0
        for name, t in ordered:
            if t.offset != cursor:
                raise CheckpointFormatError(f"source records of {fname} leave a gap or overlap at {name!r} "
                                            "(shards from different splits mixed?)")
            cursor += t.nbytes
        f.header = encode_header([TensorSpec(n, t.dtype, t.shape) for n, t in ordered], f.metadata)
    return files, headers


def join_checkpoint(out: Path, rebuilt: Path, manifest: Any, *,
                    on_bytes: Callable[[int], None] | None = None, chunk: int = CHUNK) -> JoinResult:
    """Rebuild the checkpoint of split directory `out` in `rebuilt` from `manifest`'s files only.

    `manifest`: a signature-verified manifest (`VerifiedManifest`, from `load_trusted_manifest`), or, for
    a publisher's own unsigned split, a decoded one. Either way every byte join uses is checked against
    its entry first: each shard is streamed through the size and BLAKE3 check before its header is
    parsed (pass 1), and streamed through the same check again while its tensors are placed (pass 2), in
    pieces of at most `chunk` bytes; no rebuilt file is renamed into place unless every check passed.
    """
    out, rebuilt = Path(out), Path(rebuilt)
    on_bytes = on_bytes or (lambda n: None)
    if chunk < 1:
        raise ValueError("chunk must be positive")
    started = time.perf_counter()
    if rebuilt.exists() and (not rebuilt.is_dir() or any(rebuilt.iterdir())):
        raise UsageError("output must be absent or an empty directory", path=str(rebuilt))
    shards = [e for e in manifest.entries if e.kind in ("trunk", "expert")]
    side = [e for e in manifest.entries if e.kind not in ("trunk", "expert")]
    try:
        files, headers = _plan(out, shards, chunk)
    except CheckpointFormatError as e:
        # The bytes matched the manifest: the shards as listed cannot be joined (exit 1, not "malformed input").
        raise ShardFormatError(e.message, path=e.path) from None

    try:
        rebuilt.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create directory: {e.strerror}", path=str(rebuilt)) from e
    buffer = memoryview(bytearray(chunk))
    written = 0
    with contextlib.ExitStack() as stack:
        fds: dict[str, tuple[int, str]] = {}   # rebuilt file name -> (temp file descriptor, path for errors)
        for fname, f in files.items():
            fh = stack.enter_context(atomic_writer(rebuilt / fname))
            fh.write(f.header)
            fh.flush()
            fds[fname] = (fh.fileno(), str(rebuilt / fname))
            written += len(f.header)
        written += _place_shards(out, shards, headers, files, fds, buffer, on_bytes)
        try:
            _check_complete(files)
        except CheckpointFormatError as e:
            raise ShardFormatError(e.message, path=e.path or str(out)) from None
        written += _copy_side_files(out, rebuilt, side, stack, buffer, on_bytes)
    tensors = sum(len(f.tensors) for f in files.values())
    return JoinResult(rebuilt, len(files) + len(side), tensors, written, time.perf_counter() - started)


def _place_shards(out: Path, shards: list, headers: dict[str, bytes], files: dict[str, _File],
                  fds: dict[str, tuple[int, str]], buffer: memoryview, on_bytes: Callable[[int], None]) -> int:
    """Pass 2: each shard streamed through its entry check again, its header compared with the one pass 1
    parsed, its tensors placed in the rebuilt files; the bytes written."""
    from shardtool.manifest import VerifyingStream

    written = 0
    for entry in shards:
        with VerifyingStream(out, entry) as stream:
            header = headers[entry.path]
            head = bytearray(len(header))
            stream.readinto(memoryview(head))
            if head != header:
                raise DigestMismatchError("shard changed between planning and reading", path=entry.path)
            try:
                written += _place(entry.path, stream, header, files, fds, buffer)
            except CheckpointFormatError as e:
                raise ShardFormatError(e.message, path=e.path) from None
            stream.finish()
        on_bytes(entry.size)
    return written


def _copy_side_files(out: Path, rebuilt: Path, side: list, stack: contextlib.ExitStack, buffer: memoryview,
                     on_bytes: Callable[[int], None]) -> int:
    """The side files, checked before anything is renamed too: each is streamed through its entry check into a
    temp file whose writer stays open on `stack`, so a failed check discards every rebuilt file at once; the bytes
    written."""
    from shardtool.manifest import VerifyingStream

    written = 0
    for entry in side:
        target = rebuilt / entry.path
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create directory: {e.strerror}", path=str(target.parent)) from e
        fh = stack.enter_context(atomic_writer(target))  # one descriptor per side file until the end
        with VerifyingStream(out, entry) as stream:
            while stream.done < entry.size:
                piece = buffer[:min(len(buffer), entry.size - stream.done)]
                stream.readinto(piece)
                fh.write(piece)
            stream.finish()
        written += entry.size
        on_bytes(entry.size)
    return written


def _pwrite(fd: int, where: str, data: memoryview | bytes, position: int) -> None:
    view = memoryview(data).cast("B")
    try:
        while len(view):
            n = os.pwrite(fd, view, position)
            view, position = view[n:], position + n
    except OSError as e:
        raise StorageError(f"write failed: {e.strerror}", path=where) from e


def _place(path: str, stream: Any, header: bytes, files: dict[str, _File], fds: dict[str, tuple[int, str]],
           buffer: memoryview) -> int:
    """Read the shard's tensors from `stream` (positioned after its header), in data order, and write each at
    its place in the rebuilt file: plain tensors piece by piece through `buffer`, a fused expert's pieces
    pasted into its slice first."""
    import numpy as np

    parsed, doc = _records(header, stream.entry.size, path)
    written = 0
    fused: dict[tuple[str, str, int], tuple[np.ndarray, np.ndarray]] = {}
    for t in parsed.tensors:  # data order: they tile the file from the header's end
        rec = doc["tensors"][t.name]
        f = files[rec["file"]]
        target = f.tensors[rec["name"]]
        base = len(f.header) + target.offset
        if "cut" not in rec:
            if target.done:
                raise CheckpointFormatError(f"tensor {rec['name']!r} appears in two shards", path=path)
            done = 0
            while done < t.nbytes:
                piece = buffer[:min(len(buffer), t.nbytes - done)]
                stream.readinto(piece)
                _pwrite(*fds[rec["file"]], piece, base + done)
                done += len(piece)
            target.done.add(0)
            written += t.nbytes
            continue
        key = (rec["file"], rec["name"], rec["expert"])
        if key not in fused:
            slice_shape = target.shape[1:]
            fused[key] = (np.zeros(slice_shape, dtype=uint_view(target.dtype)), np.zeros(slice_shape, dtype=np.uint8))
        s, cover = fused[key]
        data = bytearray(t.nbytes)  # one piece of one expert's slice, no larger than the slice itself
        stream.readinto(memoryview(data))
        paste(s, cover, data, Cut.from_json(rec["cut"]))
    for (fname, name, e), (s, cover) in fused.items():
        target = files[fname].tensors[name]
        if e in target.done:
            raise CheckpointFormatError(f"expert {e} of {name!r} appears in two shards", path=path)
        if not (cover == 1).all():
            raise CheckpointFormatError(f"shard covers expert {e} of {name!r} only partly", path=path)
        slice_bytes = target.nbytes // target.shape[0]
        fd, where = fds[fname]
        _pwrite(fd, where, memoryview(s).cast("B"), len(files[fname].header) + target.offset + e * slice_bytes)
        target.done.add(e)
        written += slice_bytes
    return written


def _check_complete(files: dict[str, _File]) -> None:
    for fname, f in files.items():
        for name, t in f.tensors.items():
            want = set(range(t.shape[0])) if t.fused else {0}
            if t.done != want:
                missing = sorted(want - t.done)
                raise CheckpointFormatError(f"{fname}: tensor {name!r} incomplete, no shard holds expert(s) "
                                            f"{missing[:8]}" if t.fused else f"{fname}: tensor {name!r} missing")
