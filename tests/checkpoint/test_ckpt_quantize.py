"""`shardtool split --quantize int8|int4` through the installed CLI: every float routed-expert projection is written
in shardtool.blockquant's format (checked against the reference quantizer applied to the plain split's canonical
tensors), everything else is the plain split's bytes, widths that do not fit are refused before anything is
written, FP8/MXFP4 experts are kept as stored, join refuses, reruns reuse, the contract counts the real bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardtool import blockquant
from shardtool.checkpoint._quantize import METHODS
from shardtool.manifest import load_manifest
from shardtool.safetensors_format import numpy_dtype

from _kit.cli import Result, run

KNOBS = dict(moe_intermediate=160)  # hidden 64, expert width 160: both multiples of 32, all widths distinct


def cli(*args, cwd: Path) -> Result:
    """The installed `shardtool args...` through the suite's runner."""
    return run("shardtool", *args, cwd=cwd, timeout=300)


def split(ck: Path, out: Path, *extra) -> Result:
    r = cli("split", ck, out, "-q", "--model-id", "acme/q", *extra, cwd=out.parent)
    assert r.returncode == 0, r.stderr
    return r


def shard(path: Path) -> dict[str, np.ndarray]:
    import safetensors

    return {name: np.frombuffer(t["data"], numpy_dtype(t["dtype"])).reshape(t["shape"])
            for name, t in safetensors.deserialize(path.read_bytes())}


def digests(out: Path) -> dict[str, bytes]:
    return {e.path: e.digest for e in load_manifest(out / "manifest.msgpack").entries}


@pytest.mark.parametrize("family", ["mixtral", "llama4", "gpt_oss", "qwen2_moe"])
def test_quantized_split_is_blockquant_of_the_plain_splits_experts(make_tiny, tmp_path, family):
    """Per-expert (mixtral), fused [E, H, 2I] (llama4), fused interleaved with expert biases (gpt_oss), a shared
    expert in the trunk (qwen2_moe): both methods, against the reference quantizer."""
    ck = make_tiny(family, **KNOBS)
    split(ck, tmp_path / "float")
    plain = digests(tmp_path / "float")
    for method in METHODS:
        out = tmp_path / method
        r = split(ck, out, "--quantize", method)
        assert "quantized" in r.stderr and f"block {method}" in r.stderr
        got = digests(out)
        assert set(got) == set(plain)
        experts = sorted(p for p in got if p.startswith("experts/"))
        assert experts
        for path in got:
            if not path.startswith("experts/"):
                assert got[path] == plain[path], f"{path} changed under --quantize {method}"
        for path in experts:
            want, have = shard(tmp_path / "float" / path), shard(out / path)
            expected = {}
            for name, w in want.items():
                proj, _, suffix = name.partition(".")
                if suffix != "weight":
                    expected[name] = w  # expert biases stay as stored
                    continue
                q, d = (blockquant.quantize_q8 if method == "int8" else blockquant.quantize_q4)(w.astype(np.float32))
                expected[f"{proj}.weight" if method == "int8" else f"{proj}.weight_q4"] = q
                expected[f"{proj}.weight_scale"] = d
            assert set(have) == set(expected), path
            for name, value in expected.items():
                assert have[name].dtype == value.dtype and have[name].shape == value.shape, (path, name)
                assert have[name].tobytes() == value.tobytes(), (path, name)


def test_quantized_split_rerun_reuses_every_shard(make_tiny, tmp_path):
    ck = make_tiny("mixtral", **KNOBS)
    split(ck, tmp_path / "out", "--quantize", "int4")
    r = cli("split", ck, tmp_path / "out", "-q", "--json", "--model-id", "acme/q", "--quantize", "int4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["files_written"] == 0 and doc["files_reused"] == doc["files"]
    assert doc["quantize"] == "int4" and doc["quantized_projections"] == 2 * 4 * 3
    # the same directory without --quantize: every expert shard differs and is rewritten
    r = cli("split", ck, tmp_path / "out", "-q", "--json", "--model-id", "acme/q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_written"] == 2 * 4


def test_split_refuses_a_width_not_a_multiple_of_the_block_before_writing(make_tiny, tmp_path):
    ck = make_tiny("mixtral", moe_intermediate=40)  # down_proj [64, 40]
    r = cli("split", ck, tmp_path / "out", "-q", "--quantize", "int8", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "experts.0.w2.weight" in lines[0] and "40" in lines[0] and "32" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["int9", "INT8", ""])
def test_split_refuses_an_unknown_method(make_tiny, tmp_path, method):
    r = cli("split", make_tiny("mixtral", **KNOBS), tmp_path / "out", "-q", "--quantize", method, cwd=tmp_path)
    assert r.returncode == 2 and "--quantize" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, knobs, kept", [("deepseek_v3", {"fp8": True}, "FP8 block-scaled"),
                                                 ("gpt_oss", {"mxfp4": True}, "MXFP4")])
def test_fp8_and_mxfp4_experts_are_kept_as_stored(make_tiny, tmp_path, family, knobs, kept):
    ck = make_tiny(family, **KNOBS, **knobs)
    split(ck, tmp_path / "plain")
    r = split(ck, tmp_path / "q", "--quantize", "int8")
    assert f"already stored {kept} kept as stored" in r.stderr and "quantized 0" not in r.stderr
    assert digests(tmp_path / "q") == digests(tmp_path / "plain")


def test_join_refuses_a_quantized_split(make_tiny, tmp_path):
    ck = make_tiny("mixtral", **KNOBS)
    split(ck, tmp_path / "out", "--quantize", "int8")
    r = cli("join", tmp_path / "out", tmp_path / "rebuilt", "--insecure-no-verify", "-q", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "quantized (int8)" in lines[0] and "cannot be rebuilt" in lines[0], r.stderr
    rebuilt = tmp_path / "rebuilt"
    assert not rebuilt.exists() or not any(p.suffix == ".safetensors" for p in rebuilt.iterdir())


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("method", METHODS)
def test_contract_counts_the_real_bytes_per_weight(make_tiny, tmp_path, family, method):
    ck = make_tiny(family, **KNOBS)
    split(ck, tmp_path / "plain")
    split(ck, tmp_path / "q", "--quantize", method)
    measured = json.loads(cli("inspect", tmp_path / "q", "--json", cwd=tmp_path).stdout)["contract"]
    plain = json.loads(cli("inspect", tmp_path / "plain", "--json", cwd=tmp_path).stdout)["contract"]
    r = cli("inspect", "--config", ck / "config.json", "--bits-per-weight", "16", "--quantize", method, "--json",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    predicted = json.loads(r.stdout)["contract"]
    h, i = 64, 160
    bits = {"int8": 8.5, "int4": 4.5}[method]
    data = round(3 * h * i * bits / 8) + (2 * (2 * i + h) if family == "gpt_oss" else 0)  # + BF16 expert biases
    assert predicted["bytes_per_expert"] == data
    assert data < measured["bytes_per_expert"] < data + 4096  # the file: its safetensors header on top
    assert measured["params_total"] == plain["params_total"] == predicted["params_total"]
    assert measured["trunk_bytes"] == plain["trunk_bytes"]
    assert measured["expert_bytes_total"] < plain["expert_bytes_total"]


def test_inspect_quantize_needs_config(make_tiny, tmp_path):
    split(make_tiny("mixtral", **KNOBS), tmp_path / "out", "--quantize", "int8")
    r = cli("inspect", tmp_path / "out", "--quantize", "int8", cwd=tmp_path)
    assert r.returncode == 2 and "--config" in r.stderr


@pytest.mark.parametrize("bad", [np.inf, np.nan, 1e6])  # 1e6 / 127 still fits float16; 1e6 / -8 does not for int4
def test_split_refuses_a_weight_whose_scale_is_not_finite(make_tiny, tmp_path, bad):
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    ck = altered(make_tiny("mixtral", dtype="f32", **KNOBS), tmp_path, lambda t: t[name].__setitem__((5, 7), bad))
    method = "int4" if bad == 1e6 else "int8"
    r = cli("split", ck, tmp_path / "out", "-q", "--quantize", method, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and "not finite" in lines[0], r.stderr
    assert not (tmp_path / "out" / "manifest.msgpack").exists()
    if bad == 1e6:  # int8 takes it
        split(ck, tmp_path / "out8", "--quantize", "int8")


def altered(src: Path, tmp_path: Path, change) -> Path:
    """A copy of checkpoint `src` whose one safetensors file's tensors went through `change(tensors)`."""
    from safetensors.numpy import load_file, save_file

    ck = tmp_path / "ck"
    ck.mkdir()
    for f in src.iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    (weights,) = ck.glob("*.safetensors")
    t = load_file(weights)
    change(t)
    save_file(t, weights, metadata={"format": "pt"})
    return ck


def refused(ck: Path, tmp_path: Path, method: str | None, *words: str) -> str:
    """split (with --quantize `method`, None: without) exits 2 before writing, one line with each of `words`."""
    r = cli("split", ck, tmp_path / "out", "-q", *(("--quantize", method) if method else ()), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
    assert not (tmp_path / "out").exists()
    return lines[0]


W1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"  # gate_proj [160, 64], the first one planned


def every_w1(shape):
    """Every expert's gate_proj replaced by zeros of `shape` (experts of a layer must agree, or planning says so)."""
    def change(t):
        for name in [n for n in t if n.endswith(".w1.weight")]:
            t[name] = np.zeros(shape, t[name].dtype)
    return change


@pytest.mark.parametrize("shape", [(0, 64), (160, 0)])
@pytest.mark.parametrize("method", METHODS)
def test_split_refuses_an_empty_projection_while_planning(make_tiny, tmp_path, shape, method):
    ck = altered(make_tiny("mixtral", **KNOBS), tmp_path, every_w1(shape))
    refused(ck, tmp_path, method, W1, str(list(shape)))


@pytest.mark.parametrize("method", [None, *METHODS])
@pytest.mark.parametrize("shape", [(160, 128), (192, 64), (64, 160)])
def test_split_refuses_a_projection_config_does_not_describe(make_tiny, tmp_path, shape, method):
    """A hostile source cannot hand split a projection of any size, quantized or not: config.json's sizes bound
    each one (the runtime would refuse the shard at its first use, after the publisher signed it)."""
    ck = altered(make_tiny("mixtral", **KNOBS), tmp_path, every_w1(shape))
    refused(ck, tmp_path, method, W1, str(list(shape)), "[160, 64]", "config.json")


def _mxfp4_down(blocks: int, codes: int):
    """gpt-oss's fused MXFP4 down_proj with `blocks` blocks of `codes` bytes per row (the config gives 5 of 16)."""
    def change(t):
        for name in [n for n in t if n.endswith("experts.down_proj_blocks")]:
            e, rows = t[name].shape[:2]
            t[name] = np.zeros((e, rows, blocks, codes), np.uint8)
            t[name.replace("_blocks", "_scales")] = np.full((e, rows, blocks), 127, np.uint8)
    return change


def test_the_shape_check_reads_every_stored_form_the_table_names():
    from shardtool import formats
    from shardtool.checkpoint._expert_check import _WEIGHT_OF_FORM

    group = formats.MXFP4.block[1]
    assert set(_WEIGHT_OF_FORM) == set(formats.FORM_DATA)
    assert _WEIGHT_OF_FORM[formats.INT4.data]((3, 16)) == (3, blockquant.QBLOCK)  # int4: two weights a byte
    assert _WEIGHT_OF_FORM["weight_blocks"]((3, 2, group // 2)) == (3, 2 * group)


# (form, data dtype, the data tensor's stored shape for a [64, 96] weight, numpy dtype, the scale's numpy dtype)
STORED_FORMS = [("weight", "I8", (64, 96), np.int8, np.float16),
                ("weight_q4", "U8", (64, 48), np.uint8, np.float16),
                ("weight_blocks", "U8", (64, 3, 16), np.uint8, np.uint8),
                ("weight", "F8_E4M3", (64, 96), None, np.float32)]


@pytest.mark.parametrize("form, dtype, stored, data_type, scale_type", STORED_FORMS)
def test_the_shapes_split_demands_beside_a_weight_are_the_ones_the_runtime_loads(form, dtype, stored, data_type,
                                                                                 scale_type):
    """`_expert_check.beside` states, for split, the scale shapes the runtime's `pack` demands: tensors of exactly
    those shapes load, and a scale one column off is refused by both."""
    from shardtool.runtime.model._dtypes import FLOAT8
    from shardtool.runtime.model._packed import pack
    from shardtool.checkpoint._expert_check import beside
    from shardtool.errors import CheckpointFormatError

    if form != "weight_blocks" and dtype != "F8_E4M3":  # int8/int4: an input width no block divides has no scales
        assert beside(form, dtype, (64, 40), None)["weight_scale"] is None
    block = (32, 64)  # an FP8 block that divides neither side evenly into one
    want = beside(form, dtype, (64, 96), block)
    assert want.pop("bias") == (64,)
    ((suffix, scale_shape),) = want.items()
    data = np.zeros(stored, FLOAT8 if data_type is None else data_type)
    scale = np.full(scale_shape, 127 if scale_type == np.uint8 else 1, scale_type)
    pack({f"gate_proj.{form}": data, f"gate_proj.{suffix}": scale}, "gate_proj", (64, 96), "t", fp8_block=block,
         mxfp4=True)
    wider = np.full((scale_shape[0], scale_shape[1] + 1), scale.flat[0], scale_type)
    with pytest.raises(CheckpointFormatError, match=suffix):
        pack({f"gate_proj.{form}": data, f"gate_proj.{suffix}": wider}, "gate_proj", (64, 96), "t", fp8_block=block,
             mxfp4=True)


def _stored_int8_up_in_layer_1(scale_columns: int):
    """Layer 1's up_proj (w3) of every expert stored int8 + float16 scales [160, scale_columns] (64 inputs: 2)."""
    def change(t):
        for name in [n for n in t if n.startswith("model.layers.1.") and n.endswith(".w3.weight")]:
            rows, cols = t[name].shape
            t[name] = np.zeros((rows, cols), np.int8)
            t[name.replace(".weight", ".weight_scale")] = np.ones((rows, scale_columns), np.float16)
    return change


def test_split_refuses_a_stored_int8_weight_whose_scales_its_shape_does_not_give(make_tiny, tmp_path):
    """A plain split of a source whose experts are already int8: the scales beside a weight are [out, in/32], in
    any layer and projection; the same source with its scales right splits."""
    (tmp_path / "ok").mkdir()
    ok = altered(make_tiny("mixtral", **KNOBS), tmp_path / "ok", _stored_int8_up_in_layer_1(2))
    assert split(ok, tmp_path / "ok" / "out").returncode == 0
    ck = altered(make_tiny("mixtral", **KNOBS), tmp_path, _stored_int8_up_in_layer_1(3))
    refused(ck, tmp_path, None, "layer 1 expert 0", "up_proj.weight_scale", "w3.weight_scale", "[160, 3]",
            "[160, 2]")


@pytest.mark.parametrize("name, width", [("gate_up_proj_bias", lambda w: w + 2), ("down_proj_bias", lambda w: 2 * w)])
def test_split_refuses_a_gpt_oss_expert_bias_its_weight_does_not_give(make_tiny, tmp_path, name, width):
    def change(t):
        for n in [n for n in t if n.endswith(f"experts.{name}")]:
            t[n] = np.zeros((t[n].shape[0], width(t[n].shape[1])), t[n].dtype)
    ck = altered(make_tiny("gpt_oss", **KNOBS), tmp_path, change)
    refused(ck, tmp_path, None, name, ".bias", "beside its")


@pytest.mark.parametrize("blocks, codes", [(4, 16), (5, 8)])
def test_split_refuses_an_mxfp4_projection_config_does_not_describe(make_tiny, tmp_path, blocks, codes):
    """The shape check reads each stored form as the weight it stands for: MXFP4's [out, in/32, 16] blocks."""
    ck = altered(make_tiny("gpt_oss", **KNOBS, mxfp4=True), tmp_path, _mxfp4_down(blocks, codes))
    line = refused(ck, tmp_path, None, "down_proj_blocks", str([64, blocks, codes]), "[64, 160]", "config.json")
    assert "layer 0 expert 0" in line


@pytest.mark.parametrize("method", METHODS)
def test_quantized_projection_is_read_and_quantized_a_batch_of_rows_at_a_time(make_tiny, monkeypatch, method):
    """Memory under --quantize is bounded by the batch, not the projection: no read of a projection asks for more
    than one batch of rows, and the bytes are exactly the whole projection's quantization."""
    from shardtool.checkpoint import _stream
    from shardtool.checkpoint._split import prepare_split

    monkeypatch.setattr(_stream, "QUANT_BATCH", 64 * 4 * 8, raising=False)  # 8 rows of 64 float32 inputs
    ck = make_tiny("mixtral", **KNOBS)
    job = prepare_split(ck, quantize=method)
    sources = _stream.Sources(job.checkpoint)
    asked: list[int] = []
    chunks = sources.chunks
    monkeypatch.setattr(sources, "chunks", lambda f, o, n: (asked.append(n), chunks(f, o, n))[1])
    out = next(o for o in job.outputs if o.kind == "expert")
    try:
        got = b"".join(bytes(s) for s in _stream.stream(out, sources))
    finally:
        sources.close()
    tensors = shard_bytes(got)
    for p in out.pieces:
        if p.quant is None or p.quant[1] != "data":
            continue
        proj = p.name.partition(".")[0]
        w = np.frombuffer(memoryview((ck / p.file).read_bytes())[p.source.start:p.source.start + p.source.nbytes],
                          numpy_dtype(p.source.dtype)).reshape(p.source.shape).astype(np.float32)
        q, d = (blockquant.quantize_q8 if method == "int8" else blockquant.quantize_q4)(w)
        assert np.array_equal(tensors[p.name], q) and np.array_equal(tensors[f"{proj}.weight_scale"], d)
    quantized_reads = [n for n in asked if n != out.size]
    assert quantized_reads and max(quantized_reads) <= 8 * 160 * 2, asked  # 8 rows of 160 BF16 (down_proj)


def shard_bytes(data: bytes) -> dict[str, np.ndarray]:
    import safetensors

    return {name: np.frombuffer(t["data"], numpy_dtype(t["dtype"])).reshape(t["shape"])
            for name, t in safetensors.deserialize(data)}


def _add_beside_w1(suffix: str, dtype, width):
    def change(t):
        for name in [n for n in t if n.endswith(".w1.weight")]:
            w = t[name]
            t[name.replace(".weight", f".{suffix}")] = np.zeros((w.shape[0], width(w.shape[1])), dtype)
    return change


@pytest.mark.parametrize("suffix, dtype, width", [("weight_q4", np.uint8, lambda c: c // 2),
                                                  ("weight_scale", np.float16, lambda c: c // 32),
                                                  ("weight_scale_inv", np.float32, lambda c: 1)])
def test_split_refuses_a_second_stored_form_beside_a_float_weight(make_tiny, tmp_path, suffix, dtype, width):
    """The runtime's one-form rule (formats.stored) applied while planning, not after signing."""
    ck = altered(make_tiny("mixtral", **KNOBS), tmp_path, _add_beside_w1(suffix, dtype, width))
    refused(ck, tmp_path, "int8", f"experts.0.w1.{suffix}" if suffix != "weight_q4" else "more than one form")


def test_the_one_form_rule_has_one_home():
    from shardtool.runtime.model import _packed
    from shardtool.checkpoint import _expert_check, _quantize

    assert "formats.stored(" not in Path(_quantize.__file__).read_text()  # it asks _expert_check
    for module in (_packed, _expert_check):
        source = Path(module.__file__).read_text()
        assert "formats.stored(" in source and '"weight_scale_inv", ' not in source


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.float64])
def test_split_refuses_an_expert_projection_it_can_neither_quantize_nor_keep(make_tiny, tmp_path, dtype):
    def change(t):
        for name in [n for n in t if n.endswith(".w1.weight")]:
            t[name] = np.zeros(t[name].shape, dtype)
            if dtype == np.int8:  # a whole int8 form: still not a source --quantize takes
                t[name + "_scale"] = np.ones((t[name].shape[0], t[name].shape[1] // 32), np.float16)

    ck = altered(make_tiny("mixtral", **KNOBS), tmp_path, change)
    line = refused(ck, tmp_path, "int8", W1, "F8_E4M3", "MXFP4")
    assert "kept as stored (the runtime" not in line


def _retouch(out: Path, change) -> None:
    """Rewrite each expert shard's source record through `change(doc)` and re-make the manifest over the new bytes
    (what a publisher who edits a quantized split before joining it could do)."""
    import blake3
    import struct

    from shardtool.checkpoint._writer import TensorSpec, encode_header
    from shardtool.manifest import Entry, build_manifest

    for f in out.glob("experts/*/*.safetensors"):
        b = f.read_bytes()
        n = struct.unpack("<Q", b[:8])[0]
        h = json.loads(b[8:8 + n])
        meta = h.pop("__metadata__")
        doc = json.loads(meta["shardtool.source"])
        change(doc)
        meta["shardtool.source"] = json.dumps(doc)
        specs = [TensorSpec(k, v["dtype"], tuple(v["shape"]))
                 for k, v in sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0])]
        f.write_bytes(encode_header(specs, meta) + b[8 + n:])
    m = load_manifest(out / "manifest.msgpack")
    entries = [Entry(e.path, e.kind, (out / e.path).stat().st_size, blake3.blake3((out / e.path).read_bytes()).digest(),
                     e.layer, e.expert) for e in m.entries]
    (out / "manifest.msgpack").write_bytes(build_manifest(entries, model_id="acme/q", version=1).to_bytes())


def _falsy(doc):
    doc["quantized"] = 0
    for r in doc["tensors"].values():
        if "quantized" in r:
            r["quantized"] = 0


def _unmarked(doc):
    doc.pop("quantized", None)
    for r in doc["tensors"].values():
        r.pop("quantized", None)


@pytest.mark.parametrize("change, method, words", [(_falsy, "int8", ("quantized (0)",)),
                                                   (_unmarked, "int4", ("weight_q4",)),
                                                   (_unmarked, "int8", ("I8", "BF16"))])
def test_join_refuses_a_quantized_split_however_its_records_are_edited(make_tiny, tmp_path, change, method, words):
    ck = make_tiny("mixtral", **KNOBS)
    split(ck, tmp_path / "out", "--quantize", method)
    _retouch(tmp_path / "out", change)
    r = cli("join", tmp_path / "out", tmp_path / "rebuilt", "--insecure-no-verify", "-q", cwd=tmp_path)
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
    rebuilt = tmp_path / "rebuilt"
    assert not rebuilt.exists() or not any(p.suffix == ".safetensors" for p in rebuilt.iterdir())


@pytest.mark.parametrize("stray", ["weight_q4", "weight_scale_inv"])
def test_quantize_trunk_refuses_a_weight_in_two_forms(stray):
    """A trunk weight with another form's tensor beside it is refused while planning (the runtime would refuse the
    signed shard), as an expert's is."""
    from shardtool.checkpoint._plan_records import Piece, ShardPlan
    from shardtool.checkpoint._quantize import quantize_plans
    from shardtool.errors import CheckpointFormatError
    from shardtool.safetensors_format import TensorInfo

    def piece(name, dtype, shape):
        return Piece(name, dtype, shape, TensorInfo(name, dtype, shape, 0, 0), "a.safetensors")

    plan = ShardPlan("trunk/layer-000.safetensors", "trunk", 0, None,
                     (piece("self_attn.q_proj.weight", "BF16", (64, 64)), piece(f"self_attn.q_proj.{stray}", "U8", (64, 32))))
    with pytest.raises(CheckpointFormatError, match=f"self_attn.q_proj.{stray}"):
        quantize_plans([plan], "int8", trunk=True)
    kept, report = quantize_plans([plan], "int8")  # without --quantize-trunk the trunk is not looked at
    assert kept[0] is plan and report.trunk == 0
