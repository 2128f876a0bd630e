"""split -> join round trips for every family, the canonical expert layout, reruns, and failures."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import safetensors

from shardtool.checkpoint import parse_safetensors, split_checkpoint
from shardtool.checkpoint._copy import HashingFileWriter
from shardtool.errors import (CheckpointFormatError, DigestMismatchError, MissingFileError, StorageError,
                              UsageError)
from shardtool.manifest import hash_directory, load_manifest

from ckpt_helpers import NOW, join_unsigned, tensors_of

# (family, knobs): every family, per-expert and fused layouts, dense layers and DeepSeek's FP8 + MTP layer.
# A small shard size gives several source files and an index, as real checkpoints have.
CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {"layers": 3, "dense_layers": 1}),
    "qwen3_moe": ("qwen3_moe", {"layers": 3, "dense_layers": 1}),
    "olmoe": ("olmoe", {}),
    "deepseek_v3": ("deepseek_v3", {"layers": 3, "dense_layers": 1, "mtp_layers": 1}),
    "deepseek_v3_fp8": ("deepseek_v3", {"layers": 3, "dense_layers": 1, "mtp_layers": 1, "fp8": True,
                                        "hidden": 256, "moe_intermediate": 128, "intermediate": 256}),
    "fused": ("fused", {"layers": 3, "dense_layers": 1}),
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss_mxfp4": ("gpt_oss", {"mxfp4": True, "moe_intermediate": 32}),  # experts as released: U8 blocks + scales
    "llama4": ("llama4", {"layers": 3, "dense_layers": 1}),
    "mixtral_single_file_f32": ("mixtral", {"dtype": "f32", "shard_size_mb": 5000.0}),
}
EXPERT_NAMES = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}


def _source(make_tiny, case: str) -> Path:
    family, knobs = CASES[case]
    return make_tiny(family, **{"shard_size_mb": 0.05, **knobs})


def _split(src: Path, out: Path, **kw):
    return split_checkpoint(src, out, model_id="tiny", now=NOW, **kw)


def _arrays(directory: Path, pattern: str = "*.safetensors") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for path in sorted(directory.glob(pattern)):
        out.update(parse_safetensors(path.read_bytes())[0])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_byte_identical(case: str, make_tiny, tmp_path: Path) -> None:
    src = _source(make_tiny, case)
    out, rebuilt = tmp_path / "out", tmp_path / "rebuilt"
    result = _split(src, out)
    assert result.files_reused == 0 and (out / "manifest.msgpack").is_file()
    join_unsigned(out, rebuilt)
    # Per tensor (what the issue asks): names, dtypes, shapes, bytes, as the reference reader sees them.
    assert tensors_of(rebuilt) == tensors_of(src)
    # And per file: the sources were written by the reference writer, whose layout join reproduces.
    assert sorted(p.name for p in rebuilt.iterdir()) == sorted(p.name for p in src.iterdir())
    for path in src.iterdir():
        assert (rebuilt / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_shard_is_valid_safetensors_and_manifest_matches_disk(case: str, make_tiny, tmp_path: Path) -> None:
    src = _source(make_tiny, case)
    out = tmp_path / "out"
    _split(src, out)
    manifest = load_manifest(out / "manifest.msgpack")
    # The manifest split wrote is exactly what `shardtool manifest` would compute from the files on disk.
    assert list(manifest.entries) == sorted(hash_directory(out, exclude=["manifest.msgpack"]))
    for entry in manifest.entries:
        if entry.path.endswith(".safetensors"):
            safetensors.deserialize((out / entry.path).read_bytes())  # the reference reader accepts it
    config = json.loads((src / "config.json").read_text())
    n_layers, n_experts = config["num_hidden_layers"], (config.get("num_local_experts") or config.get("num_experts")
                                                        or config.get("n_routed_experts"))
    experts = [e for e in manifest.entries if e.kind == "expert"]
    moe_layers = {e.layer for e in experts}
    assert len(experts) == len(moe_layers) * n_experts
    assert all(layer < n_layers for layer in moe_layers)
    trunk_layers = {e.layer for e in manifest.entries if e.kind == "trunk" and e.layer is not None}
    assert set(range(n_layers)) <= trunk_layers


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "fused", "gpt_oss", "llama4"])
def test_experts_use_canonical_names_and_orientation(case: str, make_tiny, tmp_path: Path) -> None:
    """Each expert shard holds gate/up/down in nn.Linear [out, in] orientation, whatever the source layout."""
    family, knobs = CASES[case]
    src = _source(make_tiny, case)
    out = tmp_path / "out"
    _split(src, out)
    source = _arrays(src)
    cfg = json.loads((src / "config.json").read_text())
    hidden = cfg["hidden_size"]
    layer = next(int(p.name[6:]) for p in sorted((out / "experts").iterdir()))
    e = 3
    shard, _ = parse_safetensors((out / f"experts/layer-{layer:03d}/expert-{e:04d}.safetensors").read_bytes())
    p = f"model.layers.{layer}"
    if family == "mixtral":
        want = {n: source[f"{p}.block_sparse_moe.experts.{e}.{w}.weight"]
                for n, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))}
    elif family == "fused":  # [E, 2I, H] = cat(gate, up) on axis 1; down [E, H, I]
        gu, i = source[f"{p}.mlp.experts.gate_up_proj"][e], cfg["moe_intermediate_size"]
        want = {"gate_proj": gu[:i], "up_proj": gu[i:], "down_proj": source[f"{p}.mlp.experts.down_proj"][e]}
    elif family == "gpt_oss":  # [E, H, 2I] interleaved gate/up on the last axis; down [E, I, H]
        gu = source[f"{p}.mlp.experts.gate_up_proj"][e]
        bias = source[f"{p}.mlp.experts.gate_up_proj_bias"][e]
        want = {"gate_proj": gu[:, 0::2].T, "up_proj": gu[:, 1::2].T,
                "down_proj": source[f"{p}.mlp.experts.down_proj"][e].T}
        assert shard["gate_proj.bias"].tobytes() == np.ascontiguousarray(bias[0::2]).tobytes()
        assert shard["up_proj.bias"].tobytes() == np.ascontiguousarray(bias[1::2]).tobytes()
        assert shard["down_proj.bias"].tobytes() == source[f"{p}.mlp.experts.down_proj_bias"][e].tobytes()
    elif family == "llama4":  # [E, H, 2I] = cat(gate, up) on the last axis; down [E, I, H]
        gu = source[f"{p}.feed_forward.experts.gate_up_proj"][e]
        i = gu.shape[1] // 2
        want = {"gate_proj": gu[:, :i].T, "up_proj": gu[:, i:].T,
                "down_proj": source[f"{p}.feed_forward.experts.down_proj"][e].T}
    else:
        want = {n: source[f"{p}.mlp.experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")}
    for name, arr in want.items():
        got = shard[f"{name}.weight"]
        assert got.dtype == arr.dtype and got.shape == arr.shape, name
        assert got.tobytes() == np.ascontiguousarray(arr).tobytes(), name
    assert shard["gate_proj.weight"].shape[1] == hidden and shard["down_proj.weight"].shape[0] == hidden


def test_deepseek_fp8_scales_travel_with_weights_and_mtp_layer_is_trunk(make_tiny, tmp_path: Path) -> None:
    src = _source(make_tiny, "deepseek_v3_fp8")
    out = tmp_path / "out"
    _split(src, out)
    expert, _ = parse_safetensors((out / "experts/layer-001/expert-0002.safetensors").read_bytes())
    source = _arrays(src)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert expert[f"{proj}.weight"].dtype.name == "float8_e4m3fn"
        assert expert[f"{proj}.weight_scale_inv"].dtype == np.float32
        assert expert[f"{proj}.weight_scale_inv"].tobytes() == \
            source[f"model.layers.1.mlp.experts.2.{proj}.weight_scale_inv"].tobytes()
    dense, _ = parse_safetensors((out / "trunk/layer-000.safetensors").read_bytes())
    assert {"mlp.gate_proj.weight", "mlp.gate_proj.weight_scale_inv", "self_attn.kv_a_proj_with_mqa.weight"} <= set(dense)
    moe, _ = parse_safetensors((out / "trunk/layer-001.safetensors").read_bytes())
    assert {"mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight_scale_inv"} \
        <= set(moe)
    assert not any(".experts." in n and "shared" not in n for n in moe)
    # The MTP layer (index 3 = num_hidden_layers) stays whole in the trunk, routed experts included.
    mtp, _ = parse_safetensors((out / "trunk/layer-003.safetensors").read_bytes())
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.head.weight", "embed_tokens.weight",
            "mlp.experts.0.gate_proj.weight"} <= set(mtp)
    assert not (out / "experts/layer-003").exists()
    contract = load_manifest(out / "manifest.msgpack").head.contract
    assert contract["mtp_layers"] == 1
    assert contract["resident_trunk_bytes"] == contract["trunk_bytes"] - (out / "trunk/layer-003.safetensors").stat().st_size


def test_trunk_files_hold_the_documented_names(make_tiny, tmp_path: Path) -> None:
    src = _source(make_tiny, "qwen2_moe")
    out = tmp_path / "out"
    _split(src, out)
    embed, _ = parse_safetensors((out / "trunk/embed.safetensors").read_bytes())
    head, _ = parse_safetensors((out / "trunk/head.safetensors").read_bytes())
    layer, meta = parse_safetensors((out / "trunk/layer-001.safetensors").read_bytes())
    assert set(embed) == {"model.embed_tokens.weight"}
    assert set(head) == {"model.norm.weight", "lm_head.weight"}
    assert {"self_attn.q_proj.weight", "self_attn.q_proj.bias", "input_layernorm.weight", "mlp.gate.weight",
            "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert_gate.weight"} <= set(layer)
    record = json.loads(meta["shardtool.source"])
    assert record["tensors"]["mlp.gate.weight"]["name"] == "model.layers.1.mlp.gate.weight"
    assert {p.name for p in out.iterdir()} >= {"config.json", "generation_config.json", "tokenizer.json",
                                                 "tokenizer_config.json", "special_tokens_map.json",
                                                 "model.safetensors.index.json"}
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_rerun_reuses_shards_that_verify_and_rewrites_the_rest(make_tiny, tmp_path: Path) -> None:
    src = _source(make_tiny, "fused")
    out = tmp_path / "out"
    first = _split(src, out)
    before = (out / "manifest.msgpack").read_bytes()
    second = _split(src, out)
    assert (second.files_written, second.files_reused) == (0, first.files_written)
    assert (out / "manifest.msgpack").read_bytes() == before

    flipped = out / "experts/layer-002/expert-0001.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0x01  # same size, one bit off: only a byte comparison catches it
    flipped.write_bytes(bytes(data))
    truncated = out / "trunk/layer-000.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-10])
    (out / "trunk/.layer-001.safetensors.abc.tmp").write_bytes(b"left by a crash")
    third = _split(src, out)
    assert third.files_written == 2 and third.files_reused == first.files_written - 2
    assert (out / "manifest.msgpack").read_bytes() == before
    assert not (out / "trunk/.layer-001.safetensors.abc.tmp").exists()


def test_failed_split_leaves_no_manifest(make_tiny, tmp_path: Path, monkeypatch, raises_exactly) -> None:
    src = _source(make_tiny, "mixtral")
    out = tmp_path / "out"
    _split(src, out)
    (out / "experts/layer-001/expert-0002.safetensors").unlink()
    calls = []

    def full_disk(real):
        def method(self, *args):  # the first write succeeds, then the disk is full
            if calls:
                raise OSError(errno.ENOSPC, "No space left on device")
            calls.append(args)
            return real(self, *args)
        return method

    for name in ("write", "copy"):
        monkeypatch.setattr(HashingFileWriter, name, full_disk(getattr(HashingFileWriter, name)))
    with raises_exactly(StorageError, match="disk full"):
        _split(src, out)
    assert not (out / "manifest.msgpack").exists()
    assert not list(out.rglob(".*.tmp"))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 512 KiB tmpfs: a real ENOSPC. Needs root and mount permission; skipped elsewhere."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_real_disk_full_is_a_storage_error(make_tiny, tiny_tmpfs: Path, raises_exactly) -> None:
    src = make_tiny("mixtral", hidden=128, moe_intermediate=256, layers=4, shard_size_mb=0.5)
    with raises_exactly(StorageError, match="disk full"):
        _split(src, tiny_tmpfs / "out")
    assert not (tiny_tmpfs / "out/manifest.msgpack").exists()


def test_join_refuses_a_tampered_shard(make_tiny, tmp_path: Path, raises_exactly) -> None:
    src = _source(make_tiny, "olmoe")
    out = tmp_path / "out"
    _split(src, out)
    shard = out / "experts/layer-000/expert-0000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x80
    shard.write_bytes(bytes(data))
    with raises_exactly(DigestMismatchError):
        join_unsigned(out, tmp_path / "rebuilt")
    assert not list((tmp_path / "rebuilt").glob("*.safetensors"))


def test_join_refuses_missing_shard_and_nonempty_target(make_tiny, tmp_path: Path, raises_exactly) -> None:
    src = _source(make_tiny, "mixtral")
    out = tmp_path / "out"
    _split(src, out)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with raises_exactly(UsageError):
        join_unsigned(out, busy)
    (out / "experts/layer-000/expert-0001.safetensors").unlink()
    with raises_exactly(MissingFileError):  # the tree is not as signed: a verdict (exit 1), not I/O trouble
        join_unsigned(out, tmp_path / "rebuilt")


def test_split_refuses_out_equal_to_checkpoint(make_tiny, raises_exactly) -> None:
    src = _source(make_tiny, "mixtral")
    with raises_exactly(UsageError):
        _split(src, src)


def test_bad_manifest_options_fail_before_any_write(make_tiny, tmp_path: Path, raises_exactly) -> None:
    src = _source(make_tiny, "mixtral")
    with raises_exactly(UsageError):
        split_checkpoint(src, tmp_path / "out", model_id="-bad id-")
    assert not (tmp_path / "out").exists()


def test_expert_pattern_splits_an_unknown_family(make_tiny, tmp_path: Path) -> None:
    """A renamed family with its own expert naming: --expert-pattern is the way in, join still round-trips."""
    src = _source(make_tiny, "olmoe")
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["model_type"], config["architectures"] = "acme_moe", ["AcmeMoeForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config))
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, arr in parse_safetensors(path.read_bytes())[0].items():
            tensors[name.replace(".mlp.experts.", ".moe.ffn.")] = arr
    import safetensors.numpy
    safetensors.numpy.save_file(tensors, odd / "model.safetensors")
    with pytest.raises(CheckpointFormatError, match="supported: mixtral"):
        _split(odd, tmp_path / "out0")
    pattern = r"model\.layers\.(?P<layer>\d+)\.moe\.ffn\.(?P<expert>\d+)\."
    result = _split(odd, tmp_path / "out", expert_pattern=pattern)
    assert result.family == "custom"
    shard, _ = parse_safetensors((tmp_path / "out/experts/layer-001/expert-0003.safetensors").read_bytes())
    assert set(shard) == EXPERT_NAMES
    assert result.contract["experts_per_token"] == config["num_experts_per_tok"]
    join_unsigned(tmp_path / "out", tmp_path / "rebuilt")
    assert tensors_of(tmp_path / "rebuilt") == tensors_of(odd)


def test_fsync_flushes_once_before_the_manifest(make_tiny, tmp_path: Path, monkeypatch) -> None:
    from shardtool.checkpoint import _split as split_module

    src = _source(make_tiny, "mixtral")
    out = tmp_path / "out"
    calls = []

    def record(directory: int, where: str) -> None:  # split passes its descriptor of OUT
        calls.append((os.path.samestat(os.fstat(directory), os.stat(out)), where, (out / "manifest.msgpack").exists(),
                      len(list(out.rglob("*.safetensors")))))

    monkeypatch.setattr(split_module, "sync_filesystem", record)
    _split(src, out)
    assert calls == []
    _split(src, out, fsync=True)
    # every shard in place, no manifest yet
    assert calls == [(True, str(out), False, len(list(out.rglob("*.safetensors"))))]


@pytest.mark.slow
def test_peak_rss_stays_below_largest_tensor_plus_256_mib(make_tiny, tmp_path: Path) -> None:
    """Streaming: a ~600 MB checkpoint splits in far less memory than its size (issue: < largest tensor + 256 MiB)."""
    import shutil
    import sys

    time_bin = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists() else None)
    script = Path(sys.executable).parent / "shardtool"
    if time_bin is None or not script.exists():
        pytest.skip("needs GNU time and the installed shardtool script")
    src = make_tiny("mixtral", layers=6, experts=8, hidden=1024, moe_intermediate=2048, vocab=32000,
                    shard_size_mb=300.0)
    from shardtool.checkpoint import read_header

    size = sum(p.stat().st_size for p in src.iterdir())
    largest = max(t.nbytes for f in src.glob("*.safetensors") for t in read_header(f).tensors)
    bound = largest + 256 * 1024 * 1024
    assert size > bound  # otherwise the test could not tell streaming from loading everything
    proc = subprocess.run([time_bin, "-f", "%M", str(script), "split", str(src), str(tmp_path / "out"), "-q"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    peak = int(proc.stderr.strip().splitlines()[-1]) * 1024
    assert peak < bound, f"peak RSS {peak / 2**20:.0f} MiB >= bound {bound / 2**20:.0f} MiB"


def test_buffered_fallback_writes_the_same_bytes(make_tiny, tmp_path: Path, monkeypatch) -> None:
    """Where copy_file_range is refused (another filesystem, old kernel), the buffered path gives identical shards."""
    src = _source(make_tiny, "gpt_oss")
    _split(src, tmp_path / "fast")
    refused = []

    def exdev(*args):
        refused.append(args)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", exdev)
    _split(src, tmp_path / "slow")
    assert len(refused) == 1  # tried once, then the buffered path for the rest of the run
    fast = load_manifest(tmp_path / "fast/manifest.msgpack")
    slow = load_manifest(tmp_path / "slow/manifest.msgpack")
    assert fast.entries == slow.entries and fast.head.contract == slow.head.contract


def test_hashing_falls_back_to_reads_without_mmap(make_tiny, tmp_path: Path, monkeypatch) -> None:
    from shardtool.checkpoint import _copy

    src = _source(make_tiny, "mixtral")
    _split(src, tmp_path / "mapped")

    def no_mmap(*args, **kwargs):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(_copy.mmap, "mmap", no_mmap)
    _split(src, tmp_path / "read")
    assert load_manifest(tmp_path / "mapped/manifest.msgpack").entries == \
        load_manifest(tmp_path / "read/manifest.msgpack").entries


def test_join_streams_a_large_trunk_file_through_bounded_buffers(make_tiny, tmp_path: Path) -> None:
    """join never holds a shard whole: with 64 KiB pieces, rebuilding a checkpoint whose embedding shard is
    32 MiB allocates far less than that shard (tracemalloc counts bytes, bytearrays and numpy's buffers)."""
    import tracemalloc

    from shardtool.checkpoint import join_checkpoint

    src = make_tiny("mixtral", hidden=512, vocab=16384, dtype="f32", tie_word_embeddings=True, layers=2,
                    shard_size_mb=1000.0)
    out = tmp_path / "out"
    _split(src, out)
    trunk = (out / "trunk/embed.safetensors").stat().st_size
    assert trunk > 32 * 1024 * 1024
    manifest = load_manifest(out / "manifest.msgpack")
    np.zeros(1)  # numpy's own first-use allocations are not join's
    tracemalloc.start()
    try:
        join_checkpoint(out, tmp_path / "rebuilt", manifest, chunk=64 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < trunk // 8, f"join allocated {peak} bytes at peak for a {trunk}-byte shard"
    assert tensors_of(tmp_path / "rebuilt") == tensors_of(src)


def test_join_refuses_a_large_shard_tampered_in_its_middle(make_tiny, tmp_path: Path, monkeypatch,
                                                          raises_exactly) -> None:
    """Pass 2 writes a shard's bytes before its digest is known: a mismatch found at its end must still leave
    no rebuilt file (the temp files are removed, nothing renamed into place)."""
    import shardtool.checkpoint._join as join_module
    from shardtool.checkpoint import join_checkpoint

    src = _source(make_tiny, "mixtral")
    out = tmp_path / "out"
    _split(src, out)
    manifest = load_manifest(out / "manifest.msgpack")
    shard = out / "trunk/embed.safetensors"
    calls = []
    real = join_module._place

    def tamper_between_passes(path, *args):  # pass 1 saw the right bytes; pass 2 reads changed ones
        if path == "trunk/embed.safetensors" and not calls:
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 1
            shard.write_bytes(bytes(data))
            calls.append(path)
        return real(path, *args)

    monkeypatch.setattr(join_module, "_place", tamper_between_passes)
    with raises_exactly(DigestMismatchError):
        join_checkpoint(out, tmp_path / "rebuilt", manifest, chunk=4096)
    assert calls
    assert not list((tmp_path / "rebuilt").iterdir())


def test_join_refuses_a_shard_that_grew_between_passes(make_tiny, tmp_path: Path, monkeypatch,
                                                       raises_exactly) -> None:
    """Pass 2 compares the size before reading a byte: a shard appended to after pass 1 is refused, and
    nothing is renamed into place."""
    import shardtool.checkpoint._join as join_module
    from shardtool.checkpoint import join_checkpoint

    src = _source(make_tiny, "mixtral")
    out = tmp_path / "out"
    _split(src, out)
    manifest = load_manifest(out / "manifest.msgpack")
    real = join_module._plan

    def plan_then_grow(*args):
        planned = real(*args)
        with open(out / "trunk/head.safetensors", "ab") as fh:
            fh.write(b"x")
        return planned

    monkeypatch.setattr(join_module, "_plan", plan_then_grow)
    with raises_exactly(DigestMismatchError, match="size is"):
        join_checkpoint(out, tmp_path / "rebuilt", manifest)
    assert not list((tmp_path / "rebuilt").iterdir())


@pytest.mark.parametrize("case", ["mixtral", "gpt_oss"])
def test_preallocated_shards_hold_exactly_the_bytes_written(case: str, make_tiny, tmp_path: Path,
                                                            monkeypatch) -> None:
    """Every output preallocated (threshold 0): same files, sizes and digests as without preallocation, and the
    manifest still names the bytes on disk (no reserved block left unwritten or past the planned size)."""
    from shardtool.checkpoint import _copy

    src = _source(make_tiny, case)
    monkeypatch.setattr(_copy, "PREALLOCATE_MIN", 1 << 62)
    _split(src, tmp_path / "plain")
    calls = []
    real = _copy.preallocate

    def counted(fd: int, size: int) -> None:
        calls.append(size)
        real(fd, size)

    monkeypatch.setattr(_copy, "PREALLOCATE_MIN", 0)
    from shardtool.checkpoint import _split as split_module
    monkeypatch.setattr(split_module, "preallocate", counted)
    _split(src, tmp_path / "prealloc")
    plain = load_manifest(tmp_path / "plain/manifest.msgpack")
    prealloc = load_manifest(tmp_path / "prealloc/manifest.msgpack")
    assert len(calls) == len(prealloc.entries)
    assert plain.entries == prealloc.entries
    assert list(prealloc.entries) == sorted(hash_directory(tmp_path / "prealloc", exclude=["manifest.msgpack"]))


def test_a_plain_split_whose_fp8_scales_are_named_weight_scale_still_joins(make_tiny, tmp_path: Path) -> None:
    """Some FP8 checkpoints name their block scales `weight_scale` (the suffix `split --quantize` also writes): join
    refuses a quantized split by its records and dtypes, never by that name alone."""
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    shutil.copytree(_source(make_tiny, "deepseek_v3_fp8"), src)
    renamed = 0
    for path in sorted(src.glob("*.safetensors")):
        arrays = parse_safetensors(path.read_bytes())[0]
        renamed += sum(n.endswith(".weight_scale_inv") for n in arrays)
        save_file({n.removesuffix("_inv"): a for n, a in arrays.items()}, str(path))
    index = src / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"] = {n.removesuffix("_inv"): f for n, f in doc["weight_map"].items()}
        index.write_text(json.dumps(doc))
    assert renamed
    out, rebuilt = tmp_path / "out", tmp_path / "rebuilt"
    _split(src, out)
    join_unsigned(out, rebuilt)
    assert tensors_of(rebuilt) == tensors_of(src)
