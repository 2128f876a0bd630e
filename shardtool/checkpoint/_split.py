"""`split`: stream a checkpoint into per-expert and trunk shards, hashing the exact bytes written.

One pass: each source byte is copied once (in the kernel where it goes unchanged) and the bytes that land
in the shard are hashed; on a rerun, a shard already there is compared instead. The manifest is written
last, so a failed split leaves none.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from shardtool._atomic import atomic_writer
from shardtool.checkpoint._copy import COPY_UNSUPPORTED, HashingFileWriter, sync_filesystem
from shardtool.checkpoint._contract import DEFAULT_CONTEXT_TOKENS, SplitSizes, check_config, contract_from_split
from shardtool.checkpoint._families import plan_split, text_config
from shardtool.checkpoint._plan import OutputFile, Piece, ShardPlan
from shardtool.checkpoint._reuse import existing_digest
from shardtool.checkpoint._safetensors import TensorSpec, encode_header
from shardtool.checkpoint._source import Checkpoint, open_checkpoint
from shardtool.checkpoint._stream import Run, Sources, segments
from shardtool.errors import CheckpointFormatError, StorageError, UsageError

SOURCE_KEY = "shardtool.source"
SOURCE_FORMAT = 1
MANIFEST_NAME = "manifest.msgpack"
_SCALE_SUFFIXES = ("_scale_inv", "_scales", "weight_scale", "input_scale")


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


def _write(path: Path, out: OutputFile, sources: Sources, on_bytes: Callable[[int], None],
           executor: Any = None) -> bytes:
    # No fsync per shard: a shard lost to a crash fails the rerun's byte comparison, and run_split
    # flushes the filesystem once before writing the manifest.
    with atomic_writer(path, fsync=False) as fh:
        w = HashingFileWriter(fh.fileno(), executor, use_copy_file_range=sources.copy_file_range_ok)
        try:
            for seg in segments(out, sources):
                if not isinstance(seg, Run):
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


def _copy_run(w: HashingFileWriter, run: Run, sources: Sources, on_bytes: Callable[[int], None]) -> None:
    """Kernel copy of a source run; falls back to buffered copying where copy_file_range is unsupported."""
    start = w.pos
    try:
        done = w.copy(sources.fd(run.file), run.offset, run.length)
    except OSError as e:
        if e.errno not in COPY_UNSUPPORTED or w.pos != start:
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
    numel = math.prod(p.shape)
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
    sources = Sources(job.checkpoint, {o.copy_from: o.size for o in job.outputs if o.copy_from is not None})
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
            digest = existing_digest(path, o, sources, on_bytes, executor)
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
