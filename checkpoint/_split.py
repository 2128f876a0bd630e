"""`split`: stream a checkpoint into per-expert and trunk shards, hashing the exact bytes written.

One pass: each source byte is copied once (in the kernel where it goes unchanged) and the bytes that land
in the shard are hashed; on a rerun, a shard already there is compared instead. The manifest is written
last, so a failed split leaves none.

Everything split can refuse is refused before OUT is touched: the checkpoint's metadata while planning
(`prepare_split`: names, shapes, layer and expert numbers, counts, each output as a manifest entry) and the
manifest as a whole with placeholder digests (`run_split`: model ID, version, entry count, contract). A
refused split leaves OUT exactly as it was; once writing starts, an earlier manifest is removed first, so
a split that fails midway leaves none. Reading the checkpoint: `_ckptdir`; writing OUT: `_outdir`.
Output files are never more permissive than their sources: mode = 0644 & the modes of the files they
are made from.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from shardtool.atomic import atomic_writer_at
from shardtool.atomic import sync_filesystem
from shardtool.checkpoint._copy import COPY_UNSUPPORTED, HashingFileWriter, HashQueue, preallocate
from shardtool.checkpoint._contract import DEFAULT_CONTEXT_TOKENS, SplitSizes, check_config, contract_from_split
from shardtool.checkpoint._split_plan import decoder_layers, plan_split
from shardtool.outdir import OutDir
from shardtool.checkpoint._plan_records import OutputFile, Piece, ShardPlan
from shardtool.checkpoint._expert_check import check_expert_plans, expected_shapes, fp8_block
from shardtool.checkpoint._quantize import QuantizeReport, check_method, quantize_plans
from shardtool.checkpoint._reuse import existing_digest
from shardtool.checkpoint._writer import TensorSpec, encode_header
from shardtool.checkpoint._source import Checkpoint, SignedDigests, open_checkpoint
from shardtool.checkpoint._stream import Run, Sources, segments
from shardtool.errors import (CheckpointFormatError, ManifestFormatError, MissingFileError, StorageError, UsageError,
                              VerificationError)

SOURCE_KEY = "shardtool.source"
SOURCE_FORMAT = 1
QUANTIZED_KEY = "quantized"  # in a shard's source record: the --quantize method its expert projections went through
MANIFEST_NAME = "manifest.msgpack"
# An OpenSSF Model Signing signature of the checkpoint is signature material, not a model file: never copied. With
# `split --oms-signature`, the statement it signs is recorded instead, in this signed file of the split.
OMS_SIGNATURE_NAME = "model.sig"
OMS_RECORD_NAME = "source.oms.json"
OMS_RECORD_FORMAT = "shardtool-oms-source-v1"
MAX_SOURCE_METADATA_BYTES = 64 * 1024  # a source file's __metadata__ is copied into every shard made from it
MAX_OUTPUT_MODE = 0o644  # an output file's mode: this, narrowed by the modes of the files it is made from
_PLACEHOLDER_DIGEST = bytes(32)
_SCALE_SUFFIXES = ("_scale_inv", "_scales", "weight_scale", "input_scale")


@dataclass(frozen=True)
class SplitJob:
    checkpoint: Checkpoint
    family: str
    outputs: tuple[OutputFile, ...]
    modes: Mapping[str, int]          # output path -> permission bits it is written with
    quantized: QuantizeReport | None = None  # --quantize: what was done to the routed experts

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
    why_skipped: Mapping[str, str]    # skipped name -> reason (a directory, a FIFO, another weight format, ...)
    quantized: QuantizeReport | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "out": str(self.out), "family": self.family, "model_id": self.model_id, "version": self.version,
            "files": self.files_written + self.files_reused, "files_written": self.files_written,
            "files_reused": self.files_reused, "bytes_total": self.bytes_total,
            "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3),
            "gb_per_second": round(self.bytes_total / self.seconds / 1e9, 3) if self.seconds else None,
            "manifest": str(self.out / MANIFEST_NAME), "contract": dict(self.contract),
            "skipped": list(self.skipped), "stale": list(self.stale),
            "quantize": self.quantized.method if self.quantized else None,
            "quantized_projections": self.quantized.projections if self.quantized else 0,
            "kept_as_stored": dict(self.quantized.kept) if self.quantized else {},
        }


def _source_record(plan: ShardPlan, ckpt: Checkpoint) -> str:
    """The `shardtool.source` metadata: enough for `join` to put every byte back where it came from."""
    tensors: dict[str, Any] = {}
    files: dict[str, Any] = {}
    quantized = None
    for p in plan.pieces:
        header = ckpt.headers[p.file]
        rec: dict[str, Any] = {"name": p.source.name, "file": p.file, "offset": p.source.start - header.data_start}
        if p.cut is not None:
            rec.update(expert=p.expert, shape=list(p.source.shape), cut=p.cut.to_json())
        if p.quant is not None:  # computed from the source tensor, not its bytes: join cannot put it back
            quantized = p.quant[0]
            rec.update(quantized=p.quant[0], dtype=p.source.dtype)
        tensors[p.name] = rec
        files[p.file] = dict(header.metadata) if header.metadata is not None else None
    doc = {"format": SOURCE_FORMAT, "files": files, "tensors": tensors}
    if quantized is not None:
        doc[QUANTIZED_KEY] = quantized
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def default_model_id(root: Path, config: Mapping[str, Any] | None = None) -> str:
    """The model ID when the publisher gives none: the source's, never an output directory's (two releases
    split into `out-v1/` and `out-v2/` must share one ID, or the rollback floor never applies).

    In order: config.json's `_name_or_path` (the hub repository it was saved from), a Hugging Face cache
    snapshot's repository (`models--ORG--NAME/snapshots/REV` -> `ORG/NAME`), the directory's name. `config`:
    the checkpoint's config.json already read (split); None: `root`'s own config.json is read, when there is
    one (`manifest DIR`).
    """
    from shardtool.manifest import check_model_id_form

    if config is None:
        config = _directory_config(Path(root))
    candidates = []
    name_or_path = config.get("_name_or_path")
    if isinstance(name_or_path, str):
        candidates.append(name_or_path)
    root = Path(os.path.abspath(root))
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        candidates.append(root.parent.parent.name[len("models--"):].replace("--", "/"))
    candidates.append(root.name)
    for candidate in candidates:
        try:
            check_model_id_form(candidate)
            return candidate
        except ManifestFormatError:
            continue
    raise UsageError("no model ID can be taken from the directory (config.json's _name_or_path, the directory "
                     "name)", path=str(root), hint="pass --model-id ORG/NAME")


def _directory_config(root: Path) -> Mapping[str, Any]:
    """`root`'s config.json as a JSON object (the one safe read, the one strict parser), or {} when there is none."""
    from shardtool.checkpoint._source import MAX_JSON_BYTES, parse_json
    from shardtool.safeio import read_regular

    path = root / "config.json"
    try:
        data = read_regular(path, MAX_JSON_BYTES, what="config.json", too_large=CheckpointFormatError)
    except MissingFileError:
        return {}
    except VerificationError as e:  # a FIFO or a directory where config.json should be
        raise CheckpointFormatError(e.message, path=str(path)) from None
    config = parse_json(data, str(path))
    if not isinstance(config, dict):
        raise CheckpointFormatError("must be a JSON object", path=str(path))
    return config


def prepare_split(src: Path, *, expert_pattern: str | None = None, quantize: str | None = None,
                  quantize_trunk: bool = False, oms: Any = None) -> SplitJob:
    """Read and validate the checkpoint's headers and decide every output file; reads no tensor bytes.
    `quantize` ("int8", "int4"): routed-expert projections are written block-quantized (`_quantize.py`);
    `quantize_trunk` (int8 only): the trunk's linear weights too. `oms`: a verified `OmsStatement` (from
    `shardtool.api.trusted_oms`); every file split parses or copies must then match its signed digest, checked on
    the bytes split reads (through the fd it reads them from), and the job records the statement
    (`with_oms_record`)."""
    from shardtool.layout import classify

    check_method(quantize, quantize_trunk)
    signed = None
    if oms is not None:
        signed = SignedDigests(oms.hash_type, {r.name: r.digest for r in oms.resources}, "the OMS signature")
    ckpt = open_checkpoint(Path(src), signed=signed)
    if oms is not None:  # a signed file gone from the checkpoint: the split would not be of the signed model
        gone = sorted(r.name for r in oms.resources if r.name.split("/", 1)[0] not in ckpt.items)
        if gone:
            raise VerificationError(f"{len(gone)} file(s) the OMS statement lists are not in the checkpoint, e.g. "
                                    f"{gone[0]!r}", path=str(ckpt.root / gone[0]))
    family, plans = plan_split(ckpt.config, ckpt.tensors, expert_pattern=expert_pattern)
    check_expert_plans(plans, expected_shapes(ckpt.config, family), fp8_block(ckpt.config))
    report = None
    if quantize is not None:
        plans, report = quantize_plans(plans, quantize, trunk=quantize_trunk)
    check_config(ckpt.config)
    for name, header in ckpt.headers.items():
        size = len(json.dumps(dict(header.metadata or {}), ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > MAX_SOURCE_METADATA_BYTES:
            raise CheckpointFormatError(f"safetensors __metadata__ of {size} bytes; split copies it into every shard "
                                        f"made from this file, so at most {MAX_SOURCE_METADATA_BYTES} are accepted",
                                        path=name)
    outputs = []
    for plan in plans:
        specs = [TensorSpec(p.name, p.dtype, p.shape) for p in plan.pieces]
        header = encode_header(specs, {SOURCE_KEY: _source_record(plan, ckpt)})
        outputs.append(OutputFile(plan.path, plan.kind, plan.layer, plan.expert, header, plan.pieces, None,
                                  len(header) + sum(s.nbytes for s in specs)))
    for name in ckpt.side_files:
        if name in (MANIFEST_NAME, OMS_SIGNATURE_NAME):
            continue
        kind, _, _ = classify(name)
        outputs.append(OutputFile(name, kind, None, None, b"", (), name, ckpt.items[name].size))
    _check_entries(outputs)
    job = SplitJob(ckpt, family, tuple(outputs), {o.path: _output_mode(o, ckpt) for o in outputs}, report)
    return with_oms_record(job, oms) if oms is not None else job


def with_oms_record(job: SplitJob, statement: Any) -> SplitJob:
    """`job` with one more output, `source.oms.json`: which OMS statement (`OmsStatement`, whose digests
    `prepare_split(oms=...)` checks on the bytes split reads) the input matched, by the SHA-256 of the signed
    statement. It is an `other` entry of the new manifest, so the record is covered by the manifest's signature
    without a new field in its head (which every existing verifier would refuse)."""
    # Every file split reads must be one the statement lists: one it ignores (`--ignore-paths`) matched nothing.
    listed = {r.name for r in statement.resources}
    reads = {"config.json", *(o.copy_from for o in job.outputs if o.copy_from is not None),
             *(p.file for o in job.outputs for p in o.pieces)}
    unlisted = sorted(n for n in reads if n not in listed)
    if unlisted:
        raise VerificationError(f"{len(unlisted)} file(s) split reads are not listed in the OMS statement (it "
                                f"ignores them: their bytes are not signed), e.g. {unlisted[0]!r}",
                                path=str(job.checkpoint.root / unlisted[0]),
                                hint="sign the checkpoint again without --ignore-paths over the files split uses")
    if any(o.path == OMS_RECORD_NAME for o in job.outputs):
        raise UsageError(f"the checkpoint holds a file named {OMS_RECORD_NAME}, the name split gives the OMS record",
                         path=str(job.checkpoint.root / OMS_RECORD_NAME))
    record = json.dumps({"format": OMS_RECORD_FORMAT, "statement_sha256": statement.statement_sha256.hex(),
                         "subject_sha256": statement.root_digest.hex(), "model_name": statement.model_name,
                         "hash_type": statement.hash_type, "files": len(statement.resources),
                         "signer_key_hint": statement.signer.hint}, sort_keys=True, indent=1).encode() + b"\n"
    out = OutputFile(OMS_RECORD_NAME, "other", None, None, record, (), None, len(record))
    return dataclasses.replace(job, outputs=(*job.outputs, out), modes={**job.modes, OMS_RECORD_NAME: 0o644})


def _output_mode(out: OutputFile, ckpt: Checkpoint) -> int:
    """Never wider than any file the output is made from: a 0600 source gives a 0600 shard."""
    mode = MAX_OUTPUT_MODE
    for name in [out.copy_from] if out.copy_from is not None else {p.file for p in out.pieces}:
        mode &= ckpt.items[name].mode
    return mode


def _check_entries(outputs: list[OutputFile]) -> None:
    """Every output must be a valid manifest entry, found under its path by the layout's own classifier,
    before a byte is written (a layer number beyond the format's cap is refused here, not after the shards)."""
    from shardtool.layout import classify
    from shardtool.manifest import Entry

    directories = {o.path.rsplit("/", i)[0] for o in outputs for i in range(1, o.path.count("/") + 1)}
    for o in outputs:
        if o.path in directories:  # e.g. a side file called `trunk`: it cannot be both a file and a directory
            raise CheckpointFormatError(f"{o.path!r} is both a file to copy and a directory of the split layout")
        try:
            Entry(o.path, o.kind, o.size, _PLACEHOLDER_DIGEST, o.layer, o.expert)
        except ManifestFormatError as e:
            raise CheckpointFormatError(f"cannot be split into the manifest format: {e.message}") from None
        if o.copy_from is None and classify(o.path) != (o.kind, o.layer, o.expert):
            raise CheckpointFormatError(f"output {o.path!r} would not be recognised as {o.kind} layer {o.layer} "
                                        f"expert {o.expert} by the layout (docs/shard-layout.md)")


def _write(dir_fd: int, name: str, where: str, out: OutputFile, mode: int, sources: Sources,
           on_bytes: Callable[[int], None], queue: HashQueue) -> Future:
    """Write `out` and rename it into place; returns the future BLAKE3 of the bytes in it (its last hash
    steps may still run while the next file is copied)."""
    # No fsync per shard: a shard lost to a crash fails the rerun's byte comparison, and run_split
    # flushes the filesystem once before writing the manifest.
    with atomic_writer_at(dir_fd, name, mode, fsync=False, where=where) as fh:
        w = HashingFileWriter(fh.fileno(), queue, use_copy_file_range=sources.copy_file_range_ok)
        try:
            preallocate(fh.fileno(), out.size)
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
            if w.pos != out.size:
                raise CheckpointFormatError(f"wrote {w.pos} bytes, planned {out.size}", path=out.path)
            return w.finish()
        except BaseException:
            w.abandon()
            raise


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


def _params(p: Piece) -> int:
    """Parameters a tensor holds: quantisation scales are not weights; MXFP4 and int4 pack two per byte."""
    if p.name.endswith(_SCALE_SUFFIXES):
        return 0
    numel = math.prod(p.shape)
    packed = p.name.endswith("_blocks") or p.quant is not None  # MXFP4 blocks; int4 `weight_q4`
    return numel * 2 if packed and p.dtype == "U8" else numel


def _sizes(job: SplitJob, sizes: Mapping[str, int]) -> SplitSizes:
    n_layers = decoder_layers(job.checkpoint.config)
    trunk = mtp = expert_total = params_total = params_resident = 0
    layer_max: dict[int, int] = defaultdict(int)
    layer_params: dict[int, int] = defaultdict(int)
    layer_count: dict[int, int] = defaultdict(int)
    for o in job.outputs:
        params = sum(_params(p) for p in o.pieces)
        params_total += params
        if o.kind == "trunk":
            trunk += sizes[o.path]
            is_mtp = o.layer is not None and n_layers is not None and o.layer >= n_layers
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
    out = Path(out)
    on_bytes = on_bytes or (lambda n: None)
    started = time.perf_counter()
    contract = _check_manifest(job, model_id, version, expires_in_days, now, context_tokens)
    with OutDir(out, checkpoint=job.checkpoint.identity) as od:
        _prepare(od, job, fsync)
        digests, written, reused, bytes_written = _write_all(od, job, on_bytes)
        if fsync:
            sync_filesystem(od.fd, str(out))
        entries = [_entry(o, digests[o.path]) for o in job.outputs]
        manifest = _manifest(entries, model_id, version, expires_in_days, contract, now)
        with atomic_writer_at(od.fd, MANIFEST_NAME, 0o644, where=str(out / MANIFEST_NAME)) as fh:
            fh.write(manifest.to_bytes())
        stale = od.stale_files({o.path for o in job.outputs})
    ckpt = job.checkpoint
    return SplitResult(out, job.family, written, reused, bytes_written, job.total_bytes,
                       time.perf_counter() - started, contract, ckpt.skipped, stale, model_id, version,
                       {name: ckpt.why_skipped[name] for name in ckpt.skipped}, job.quantized)


def _prepare(od: OutDir, job: SplitJob, fsync: bool) -> None:
    """Open every output directory (refusing links) before the first byte is written; then remove an earlier
    manifest, which must not outlive a failed rerun (it would vouch for changed shards), and old temp files."""
    for reldir in sorted({o.path.rpartition("/")[0] for o in job.outputs}):
        od.dir(reldir)
    if od.is_directory(MANIFEST_NAME):
        raise UsageError("is a directory where split writes its manifest", path=str(od.path / MANIFEST_NAME))
    od.unlink(MANIFEST_NAME)
    if fsync:
        os.fsync(od.fd)  # the old manifest is gone for good before any shard changes
    od.remove_temp_files()


def _write_all(od: OutDir, job: SplitJob, on_bytes: Callable[[int], None]) -> tuple[dict[str, bytes], int, int, int]:
    """(digest per output path, files written, files reused, bytes written).

    A file is renamed into place before its last hash steps ran (they overlap the next file's copy). If a
    hash step fails, the queue stops the copy at its next step, and every file whose digest was lost is
    removed again: no file is left at its final name without a digest behind it."""
    sources = Sources(job.checkpoint)
    digests: dict[str, bytes] = {}
    hashing: dict[str, Future] = {}
    written = reused = bytes_written = 0
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtool-hash")
    queue = HashQueue(executor)
    current = ""  # the output being written
    try:
        for o in job.outputs:
            current = o.path
            dir_fd, name = od.locate(o.path)
            mode = job.modes[o.path]
            digest = existing_digest(dir_fd, name, o, mode, sources, on_bytes, executor)
            if digest is None:
                hashing[o.path] = _write(dir_fd, name, str(od.path / o.path), o, mode, sources, on_bytes, queue)
                written += 1
                bytes_written += o.size
            else:
                reused += 1
                digests[o.path] = digest
        for path, future in hashing.items():
            digests[path] = future.result()
        sources.check_pins()  # before the manifest: no file changed under the reads
    except BaseException:
        executor.shutdown(wait=True)  # every step has run: each future below is settled
        lost = _remove_unhashed(od, hashing)
        failure = lost[1] if lost is not None else queue.failure
        if isinstance(failure, OSError):  # name the file whose hash failed, not the one being copied then
            where = lost[0] if lost is not None else current  # else: the file being written, already removed
            raise StorageError(f"cannot hash the file just written: {failure.strerror or failure}",
                               path=str(od.path / where)) from failure
        raise
    finally:
        executor.shutdown(wait=True)
        sources.close()
    return digests, written, reused, bytes_written


def _remove_unhashed(od: OutDir, hashing: Mapping[str, Future]) -> tuple[str, BaseException] | None:
    """Remove every file renamed into place whose digest failed; returns the first (path, error)."""
    first = None
    for path, future in hashing.items():
        error = None if future.cancelled() else future.exception()
        if error is None:
            continue
        first = first or (path, error)
        try:
            od.unlink(path)
        except StorageError:
            pass  # the error being reported is the hash failure; a rerun compares this file anyway
    return first


def _entry(o: OutputFile, digest: bytes) -> Any:
    from shardtool.manifest import Entry

    return Entry(o.path, o.kind, o.size, digest, o.layer, o.expert)


def _manifest(entries: list, model_id: str, version: int, expires_in_days: int, contract: Mapping[str, int] | None,
              now: int | None) -> Any:
    """build_manifest, whose format errors are usage errors here: split is a producer (exit 2)."""
    from shardtool.manifest import build_manifest

    try:
        return build_manifest(entries, model_id=model_id, version=version, expires_in_days=expires_in_days,
                              contract=contract, now=now)
    except ManifestFormatError as e:
        raise UsageError(f"the manifest cannot be built: {e.message}") from None


def _check_manifest(job: SplitJob, model_id: str, version: int, expires_in_days: int, now: int | None,
                    context_tokens: int) -> dict[str, int]:
    """Build the whole manifest with placeholder digests before any work: bad --model-id/--version/--expires-in,
    too many entries or a contract value out of range fail here, as usage errors, with OUT untouched.
    Returns the contract (it depends only on planned sizes, which the writer enforces)."""
    contract = contract_from_split(job.checkpoint.config, _sizes(job, {o.path: o.size for o in job.outputs}),
                                   context_tokens=context_tokens)
    _manifest([_entry(o, _PLACEHOLDER_DIGEST) for o in job.outputs], model_id, version, expires_in_days,
              contract, now)
    return contract


def split_checkpoint(src: Path, out: Path, *, model_id: str, version: int = 1, expires_in_days: int = 365,
                     expert_pattern: str | None = None, on_bytes: Callable[[int], None] | None = None,
                     now: int | None = None, fsync: bool = False, quantize: str | None = None,
                     quantize_trunk: bool = False) -> SplitResult:
    job = prepare_split(Path(src), expert_pattern=expert_pattern, quantize=quantize, quantize_trunk=quantize_trunk)
    return run_split(job, Path(out), model_id=model_id, version=version, expires_in_days=expires_in_days,
                     on_bytes=on_bytes, now=now, fsync=fsync)
