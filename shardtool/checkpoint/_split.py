"""`split`: stream a checkpoint into per-expert and trunk shards, hashing the exact bytes written.

One pass: each source byte is read once into a bounded buffer, hashed and written (or, on a rerun,
compared with the shard already there). The manifest is written last, so a failed split leaves none.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from shardtool.checkpoint._copy import _UNSUPPORTED as _COPY_UNSUPPORTED
from shardtool.checkpoint._copy import HashingFileWriter, replace_when_done, sync_filesystem
from shardtool.checkpoint._contract import DEFAULT_CONTEXT_TOKENS, SplitSizes, check_config, contract_from_split
from shardtool.checkpoint._families import plan_split, text_config
from shardtool.checkpoint._plan import Piece, ShardPlan, cut
from shardtool.checkpoint._safetensors import HashingWriter, TensorSpec, encode_header
from shardtool.checkpoint._source import Checkpoint, open_checkpoint
from shardtool.errors import CheckpointFormatError, StorageError, UsageError

CHUNK = 8 * 1024 * 1024  # bounded copy buffer: peak memory is this plus one fused expert slice
SOURCE_KEY = "shardtool.source"
SOURCE_FORMAT = 1
MANIFEST_NAME = "manifest.msgpack"
_SCALE_SUFFIXES = ("_scale_inv", "_scales", "weight_scale", "input_scale")


@dataclass(frozen=True)
class OutputFile:
    """A file split will write: a shard (pieces) or a side file copied whole (source)."""

    path: str
    kind: str
    layer: int | None
    expert: int | None
    header: bytes            # b"" for side files
    pieces: tuple[Piece, ...]
    copy_from: str | None    # side files: name in the checkpoint directory
    size: int


@dataclass(frozen=True)
class SplitJob:
    checkpoint: Checkpoint
    family: str
    outputs: tuple[OutputFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.outputs)


@dataclass(frozen=True)
class SplitResult:
    out: Path
    family: str
    files_written: int
    files_reused: int
    bytes_written: int
    bytes_total: int
    seconds: float
    contract: Mapping[str, int]
    skipped: tuple[str, ...]
    stale: tuple[str, ...]
    model_id: str
    version: int

    def summary(self) -> dict[str, Any]:
        return {
            "out": str(self.out), "family": self.family, "model_id": self.model_id, "version": self.version,
            "files": self.files_written + self.files_reused, "files_written": self.files_written,
            "files_reused": self.files_reused, "bytes_total": self.bytes_total,
            "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3),
            "gb_per_second": round(self.bytes_total / self.seconds / 1e9, 3) if self.seconds else None,
            "manifest": str(self.out / MANIFEST_NAME), "contract": dict(self.contract),
            "skipped": list(self.skipped), "stale": list(self.stale),
        }


def _source_record(plan: ShardPlan, ckpt: Checkpoint) -> str:
    """The `shardtool.source` metadata: enough for `join` to put every byte back where it came from."""
    tensors: dict[str, Any] = {}
    files: dict[str, Any] = {}
    for p in plan.pieces:
        header = ckpt.headers[p.file]
        rec: dict[str, Any] = {"name": p.source.name, "file": p.file, "offset": p.source.start - header.data_start}
        if p.cut is not None:
            rec.update(expert=p.expert, shape=list(p.source.shape), cut=p.cut.to_json())
        tensors[p.name] = rec
        files[p.file] = dict(header.metadata) if header.metadata is not None else None
    doc = {"format": SOURCE_FORMAT, "files": files, "tensors": tensors}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prepare_split(src: Path, *, expert_pattern: str | None = None) -> SplitJob:
    """Read and validate the checkpoint's headers and decide every output file; reads no tensor bytes."""
    from shardtool.manifest import classify

    ckpt = open_checkpoint(Path(src))
    family, plans = plan_split(ckpt.config, ckpt.tensors, expert_pattern=expert_pattern)
    check_config(ckpt.config)
    outputs = []
    for plan in plans:
        specs = [TensorSpec(p.name, p.dtype, p.shape) for p in plan.pieces]
        header = encode_header(specs, {SOURCE_KEY: _source_record(plan, ckpt)})
        outputs.append(OutputFile(plan.path, plan.kind, plan.layer, plan.expert, header, plan.pieces, None,
                                  len(header) + sum(s.nbytes for s in specs)))
    for name in ckpt.side_files:
        if name == MANIFEST_NAME:
            continue
        kind, _, _ = classify(name)
        size = (ckpt.root / name).stat().st_size
        outputs.append(OutputFile(name, kind, None, None, b"", (), name, size))
    return SplitJob(ckpt, family, tuple(outputs))


class _Sources:
    """Open source files and bounded, offset-addressed reads from them."""

    def __init__(self, ckpt: Checkpoint, side_sizes: Mapping[str, int]):
        self.root = self._root = ckpt.root
        self.copy_file_range_ok = True
        self._sizes = {f: h.file_size for f, h in ckpt.headers.items()}
        self._sizes.update(side_sizes)
        self._fds: dict[str, int] = {}
        # Two buffers, used in turn: a chunk stays intact while the next one is read (see HashingWriter).
        self._bufs = (bytearray(CHUNK), bytearray(CHUNK))
        self._turn = 0
        self._slice_key: tuple[str, int, int] | None = None
        self._slice: bytes = b""

    def fd(self, file: str) -> int:
        if file not in self._fds:
            path = self._root / file
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise StorageError(f"cannot open: {e.strerror}", path=str(path)) from e
            size = os.fstat(fd).st_size
            expected = self._sizes.get(file)
            if expected is not None and size != expected:
                os.close(fd)
                raise CheckpointFormatError(f"file changed size during split ({expected} -> {size} bytes)",
                                            path=str(path))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._fds[file] = fd
        return self._fds[file]

    def chunks(self, file: str, offset: int, length: int) -> Iterator[memoryview]:
        """Yield views into one reusable buffer; each is valid until the next is requested."""
        fd = self.fd(file)
        while length > 0:
            self._turn ^= 1
            view = memoryview(self._bufs[self._turn])
            try:
                n = os.preadv(fd, [view[:min(length, CHUNK)]], offset)
            except OSError as e:
                raise StorageError(f"read failed: {e.strerror}", path=str(self._root / file)) from e
            if n == 0:
                raise CheckpointFormatError("file ended early (truncated during split?)", path=str(self._root / file))
            yield view[:n]
            offset += n
            length -= n

    def read(self, file: str, offset: int, length: int) -> bytes:
        """A whole fused expert slice, cached so the gate and up halves cut from it read it once."""
        key = (file, offset, length)
        if key != self._slice_key:
            self._slice = b"".join(bytes(c) for c in self.chunks(file, offset, length))
            self._slice_key = key
        return self._slice

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True)
class _Run:
    """A contiguous byte range of a source file that goes into the output unchanged."""

    file: str
    offset: int
    length: int


def _segments(out: OutputFile, sources: _Sources) -> Iterator[_Run | memoryview | bytes]:
    """The bytes of `out` in order: source runs, or bytes computed in memory (header, cut fused slices)."""
    if out.copy_from is not None:
        yield _Run(out.copy_from, 0, out.size)
        return
    yield out.header
    for p in out.pieces:
        run = p.byte_range()
        if run is not None:
            yield _Run(p.file, *run)
        else:
            start, length = p.slice_range()
            arr = cut(sources.read(p.file, start, length), p.dtype, p.source.shape[1:], p.cut)
            yield memoryview(arr).cast("B")


def _stream(out: OutputFile, sources: _Sources) -> Iterator[memoryview | bytes]:
    """The exact bytes of `out`, in bounded chunks read through our own buffers."""
    for seg in _segments(out, sources):
        if isinstance(seg, _Run):
            yield from sources.chunks(seg.file, seg.offset, seg.length)
        else:
            yield seg


class _Mismatch(Exception):
    pass


class _Comparer:
    """A writer that writes nothing: it checks each chunk against the file already on disk."""

    def __init__(self, fd: int, hasher: HashingWriter):
        self._fd, self._hash = fd, hasher
        self._pos = 0
        self._buf = memoryview(bytearray(CHUNK))

    def write(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        for start in range(0, len(data), CHUNK):
            part = data[start:start + CHUNK]
            n = os.preadv(self._fd, [self._buf[:len(part)]], self._pos)
            if n != len(part) or not np.array_equal(np.frombuffer(self._buf[:n], np.uint8),
                                                    np.frombuffer(part, np.uint8)):
                raise _Mismatch
            self._pos += n
        self._hash.write(data)


class _NullFile:
    def write(self, data: Any) -> None:
        pass


def _try_reuse(path: Path, out: OutputFile, sources: _Sources, on_bytes: Callable[[int], None],
               executor: Any = None) -> bytes | None:
    """The digest of an existing shard whose bytes equal what we would write, else None.

    Safe without trusting mtimes or a journal: every byte is compared with the source-derived stream.
    Costs a read of the old shard instead of a write, and a crash-truncated or stale file simply fails.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != out.size:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    hasher = HashingWriter(_NullFile(), executor)
    done = 0
    try:
        comparer = _Comparer(fd, hasher)
        for chunk in _stream(out, sources):
            comparer.write(chunk)
            done += len(chunk)
            on_bytes(len(chunk))
    except (_Mismatch, OSError):
        hasher.digest()  # let a pending hash finish before its buffer is read into again
        on_bytes(-done)
        return None
    finally:
        os.close(fd)
    return hasher.digest()


def _write(path: Path, out: OutputFile, sources: _Sources, on_bytes: Callable[[int], None],
           executor: Any = None) -> bytes:
    with replace_when_done(path) as fd:
        w = HashingFileWriter(fd, executor, use_copy_file_range=sources.copy_file_range_ok)
        try:
            for seg in _segments(out, sources):
                if not isinstance(seg, _Run):
                    w.write(seg)
                    on_bytes(len(seg))
                elif w.copy_file_range_ok:
                    _copy_run(w, seg, sources, on_bytes)
                else:
                    for chunk in sources.chunks(seg.file, seg.offset, seg.length):
                        w.write(chunk)
                        on_bytes(len(chunk))
            digest = w.digest()
        except BaseException:
            w.abandon()
            raise
        if w.pos != out.size:
            raise CheckpointFormatError(f"wrote {w.pos} bytes, planned {out.size}", path=out.path)
    return digest


def _copy_run(w: HashingFileWriter, run: _Run, sources: _Sources, on_bytes: Callable[[int], None]) -> None:
    """Kernel copy of a source run; falls back to buffered copying where copy_file_range is unsupported."""
    start = w.pos
    try:
        done = w.copy(sources.fd(run.file), run.offset, run.length)
    except OSError as e:
        if e.errno not in _COPY_UNSUPPORTED or w.pos != start:
            raise
        sources.copy_file_range_ok = w.copy_file_range_ok = False
        for chunk in sources.chunks(run.file, run.offset, run.length):
            w.write(chunk)
            on_bytes(len(chunk))
        return
    on_bytes(done)
    if done != run.length:
        raise CheckpointFormatError("file ended early (truncated during split?)", path=str(sources.root / run.file))


def _prepare_out(out: Path, src: Path) -> None:
    try:
        if out.resolve() == src.resolve():
            raise UsageError("output directory is the checkpoint itself", path=str(out))
        if out.exists() and not out.is_dir():
            raise UsageError("output exists and is not a directory", path=str(out))
        out.mkdir(parents=True, exist_ok=True)
        # A manifest from an earlier run must not outlive a failed rerun: it would vouch for changed shards.
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        for directory in [out, out / "trunk", *sorted((out / "experts").glob("layer-*"))]:
            if directory.is_dir():
                for leftover in directory.glob(".*.tmp"):  # temp files of an interrupted atomic write
                    leftover.unlink()
    except OSError as e:
        raise StorageError(f"cannot prepare output directory: {e.strerror}", path=str(out)) from e


def _params(p: Piece) -> int:
    """Parameters a tensor holds: quantisation scales are not weights; MXFP4 packs two per byte."""
    if p.name.endswith(_SCALE_SUFFIXES):
        return 0
    numel = int(np.prod(p.shape, dtype=np.int64)) if p.shape else 1
    return numel * 2 if p.name.endswith("_blocks") and p.dtype == "U8" else numel


def _sizes(job: SplitJob, sizes: Mapping[str, int]) -> SplitSizes:
    n_layers = text_config(job.checkpoint.config).get("num_hidden_layers")
    trunk = mtp = expert_total = params_total = params_resident = 0
    layer_max: dict[int, int] = defaultdict(int)
    layer_params: dict[int, int] = defaultdict(int)
    layer_count: dict[int, int] = defaultdict(int)
    for o in job.outputs:
        params = sum(_params(p) for p in o.pieces)
        params_total += params
        if o.kind == "trunk":
            trunk += sizes[o.path]
            is_mtp = o.layer is not None and isinstance(n_layers, int) and o.layer >= n_layers
            mtp += sizes[o.path] if is_mtp else 0
            params_resident += 0 if is_mtp else params
        elif o.kind == "expert":
            expert_total += sizes[o.path]
            layer_max[o.layer] = max(layer_max[o.layer], sizes[o.path])
            layer_params[o.layer] = max(layer_params[o.layer], params)
            layer_count[o.layer] += 1
    return SplitSizes(sum(sizes.values()), trunk, mtp, expert_total, dict(layer_max),
                      max(layer_count.values(), default=0), params_total, params_resident, dict(layer_params))


def run_split(job: SplitJob, out: Path, *, model_id: str, version: int = 1, expires_in_days: int = 365,
              on_bytes: Callable[[int], None] | None = None, now: int | None = None,
              context_tokens: int = DEFAULT_CONTEXT_TOKENS, fsync: bool = False) -> SplitResult:
    """Write every output of `job` under `out` (reusing files that already hold the right bytes), then the manifest.

    Shards are renamed into place atomically but not flushed one by one: a shard lost to a crash is caught
    when a rerun compares it byte for byte. With fsync=True the output filesystem is flushed once (syncfs)
    before the manifest, so a manifest on disk implies its shards are. The manifest itself is always
    written atomically and flushed, and only after every shard is in place.
    """
    from shardtool.manifest import Entry, build_manifest, save_manifest

    out = Path(out)
    on_bytes = on_bytes or (lambda n: None)
    started = time.perf_counter()
    _check_manifest_options(model_id, version, expires_in_days, now)
    _prepare_out(out, job.checkpoint.root)
    sources = _Sources(job.checkpoint, {o.copy_from: o.size for o in job.outputs if o.copy_from is not None})
    entries, sizes = [], {}
    written = reused = bytes_written = 0
    made_dirs: set[Path] = set()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtool-hash")
    try:
        for o in job.outputs:
            path = out / o.path
            if path.parent not in made_dirs:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise StorageError(f"cannot create directory: {e.strerror}", path=str(path.parent)) from e
                made_dirs.add(path.parent)
            digest = _try_reuse(path, o, sources, on_bytes, executor)
            if digest is None:
                digest = _write(path, o, sources, on_bytes, executor)
                written += 1
                bytes_written += o.size
            else:
                reused += 1
            entries.append(Entry(o.path, o.kind, o.size, digest, o.layer, o.expert))
            sizes[o.path] = o.size
    finally:
        executor.shutdown(wait=True)
        sources.close()
    if fsync:
        sync_filesystem(out)
    contract = contract_from_split(job.checkpoint.config, _sizes(job, sizes), context_tokens=context_tokens)
    manifest = build_manifest(entries, model_id=model_id, version=version, expires_in_days=expires_in_days,
                              contract=contract, now=now)
    save_manifest(out / MANIFEST_NAME, manifest)
    stale = _stale_files(out, {o.path for o in job.outputs} | {MANIFEST_NAME})
    return SplitResult(out, job.family, written, reused, bytes_written, job.total_bytes,
                       time.perf_counter() - started, contract, job.checkpoint.skipped, stale, model_id, version)


def _check_manifest_options(model_id: str, version: int, expires_in_days: int, now: int | None) -> None:
    """Bad --model-id/--version/--expires-in fail before any work, as usage errors."""
    from shardtool.errors import ManifestFormatError
    from shardtool.manifest import build_manifest

    try:
        build_manifest([], model_id=model_id, version=version, expires_in_days=expires_in_days, now=now)
    except ManifestFormatError as e:
        raise UsageError(e.message) from None


def _stale_files(out: Path, expected: set[str]) -> tuple[str, ...]:
    """Files under OUT that this split did not write (left by an earlier split of another checkpoint)."""
    found = []
    for top in ("trunk", "experts"):
        base = out / top
        if base.is_dir():
            found += [p.relative_to(out).as_posix() for p in base.rglob("*") if p.is_file()]
    return tuple(sorted(set(found) - expected))


def split_checkpoint(src: Path, out: Path, *, model_id: str, version: int = 1, expires_in_days: int = 365,
                     expert_pattern: str | None = None, on_bytes: Callable[[int], None] | None = None,
                     now: int | None = None, fsync: bool = False) -> SplitResult:
    job = prepare_split(Path(src), expert_pattern=expert_pattern)
    return run_split(job, Path(out), model_id=model_id, version=version, expires_in_days=expires_in_days,
                     on_bytes=on_bytes, now=now, fsync=fsync)
