"""Malformed block-quantized experts, published properly: the expert shard is rewritten and the manifest signed
again by the publisher's own key (tests/runtime/_republish.py), so every digest matches and only the runtime's
checks of the tensors themselves stand between the bytes and the forward pass. Each must stop `verify-and-run`
with exit 1 before the first token, in one line naming the layer, the expert and the tensor; never a traceback.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import _attackkit as kit

sys.path.insert(0, str(kit.REPO / "tests" / "runtime"))  # the one re-signing helper, shared with the runtime tests
from _republish import republish  # noqa: E402

# Every expert is chosen for every token (experts == experts_per_tok): the bad expert is read during prefill.
# hidden 32 and expert width 64 are multiples of the quantization block.
KNOBS = dict(layers=2, experts=2, experts_per_tok=2, hidden=32, moe_intermediate=64, intermediate=48, vocab=300,
             heads=4, kv_heads=2)
EXPERT = "experts/layer-001/expert-0001.safetensors"
WHERE = "layer 1 expert 1"


def _load(path: Path) -> dict[str, np.ndarray]:
    import safetensors

    from shardtool.safetensors_format import numpy_dtype

    return {name: np.frombuffer(t["data"], numpy_dtype(t["dtype"])).reshape(t["shape"]).copy()
            for name, t in safetensors.deserialize(path.read_bytes())}


def _save(tensors: dict[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()})


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> dict:
    """{method: signed quantized model, "key": private key, "pub": public key}, built through the CLI."""
    from examples import make_tiny_moe
    from shardtool import keys as keylib

    base = tmp_path_factory.mktemp("quantized")
    keylib.write_keypair(base / "pub", keylib.generate(), None, force=False)
    ck = make_tiny_moe.make_checkpoint(base / "hf", "mixtral", seed=3, **KNOBS)
    out = {"key": base / "pub.key", "pub": base / "pub.pub"}
    for method in ("int8", "int4", "int8-trunk"):
        model = base / method
        quantize = ("--quantize", "int8", "--quantize-trunk") if method == "int8-trunk" else ("--quantize", method)
        for args in (("split", ck, model, "-q", "--model-id", "acme/quant", *quantize),
                     ("sign", model, "--key", base / "pub.key")):
            r = kit.run("shardtool", *args, cwd=base)
            assert r.code == 0, r.err
        r = kit.run(*kit.run_cmd(model, [out["pub"]], 1, base / f"state-{method}"), cwd=base)
        assert r.code == 0 and r.out.strip(), f"the clean {method} model does not run:\n{r.err}"
        out[method] = model
    return out


def _nan_scale(t):
    t["gate_proj.weight_scale"][0, 0] = np.nan


def _inf_scale(t):
    t["down_proj.weight_scale"][-1, -1] = np.inf


def _float32_scale(t):
    t["up_proj.weight_scale"] = t["up_proj.weight_scale"].astype(np.float32)


def _short_scale(t):
    t["down_proj.weight_scale"] = t["down_proj.weight_scale"][:, :-1]


def _no_scale(t):
    del t["gate_proj.weight_scale"]


def _q4_beside_weight(t):
    t["up_proj.weight"] = np.zeros((t["up_proj.weight_q4"].shape[0], t["up_proj.weight_q4"].shape[1] * 2), np.int8)


def _q8_wrong_shape(t):
    t["up_proj.weight"] = np.ascontiguousarray(t["up_proj.weight"][:, :-32])


def _q4_wrong_shape(t):
    t["gate_proj.weight_q4"] = np.ascontiguousarray(t["gate_proj.weight_q4"][:-1])


def _q8_transposed(t):
    t["down_proj.weight"] = np.ascontiguousarray(t["down_proj.weight"].T)


def _scale_beside_float_weight(t):
    t["gate_proj.weight"] = t["gate_proj.weight"].astype(np.float32)


def _q4_signed(t):
    t["up_proj.weight_q4"] = t["up_proj.weight_q4"].view(np.int8)


# case -> (method, change, words the one line must hold besides WHERE)
CASES = {
    "nan-scale": ("int8", _nan_scale, ("gate_proj.weight_scale", "NaN")),
    "inf-scale-int4": ("int4", _inf_scale, ("down_proj.weight_scale", "infinite")),
    "float32-scale": ("int8", _float32_scale, ("up_proj.weight_scale", "float32", "float16")),
    "short-scale": ("int4", _short_scale, ("down_proj.weight_scale", "(32, 1)", "(32, 2)")),
    "int8-weight-without-scale": ("int8", _no_scale, ("gate_proj.weight_scale",)),
    "weight-q4-beside-weight": ("int4", _q4_beside_weight, ("up_proj", "more than one form")),
    "int8-weight-wrong-shape": ("int8", _q8_wrong_shape, ("up_proj.weight", "(64, 0)")),
    "int4-weight-wrong-shape": ("int4", _q4_wrong_shape, ("gate_proj.weight_q4", "(63, 16)")),
    "int8-weight-transposed": ("int8", _q8_transposed, ("down_proj.weight", "(64, 32)")),
    "scale-beside-float-weight": ("int8", _scale_beside_float_weight, ("gate_proj.weight_scale", "float32")),
    "int4-weight-signed-bytes": ("int4", _q4_signed, ("up_proj.weight_q4", "int8")),
}


def _refused(signed: dict, tmp_path: Path, variant: str, shard: str, change, words) -> None:
    """`change` applied to `shard` of the signed `variant`, republished: verify-and-run must stop with exit 1 and
    one line holding every one of `words`."""
    model = tmp_path / "model"
    shutil.copytree(signed[variant], model)
    tensors = _load(model / shard)
    change(tensors)
    republish(model, shard, _save(tensors), signed["key"])
    r = kit.run(*kit.run_cmd(model, [signed["pub"]], 1, tmp_path / "state"), cwd=tmp_path)
    kit.assert_no_traceback(r)
    assert r.code == 1 and r.out == "", (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_expert_refused(signed, tmp_path, case):
    method, change, words = CASES[case]
    _refused(signed, tmp_path, method, EXPERT, change, (WHERE, *words))


def _trunk_nan_scale(t):
    t["self_attn.o_proj.weight_scale"][3, 0] = np.nan


def _trunk_scale_dropped(t):
    del t["self_attn.q_proj.weight_scale"]


def _head_short_scale(t):
    t["lm_head.weight_scale"] = np.ascontiguousarray(t["lm_head.weight_scale"][:-1])


# `--quantize-trunk`: a trunk weight's scales get the checks an expert's get. case -> (shard, change, words)
TRUNK_CASES = {
    "attention-nan-scale": ("trunk/layer-001.safetensors", _trunk_nan_scale,
                            ("layer 1", "self_attn.o_proj.weight_scale", "NaN")),
    "attention-int8-without-scale": ("trunk/layer-001.safetensors", _trunk_scale_dropped,
                                     ("layer 1", "self_attn.q_proj.weight_scale")),
    "lm-head-short-scale": ("trunk/head.safetensors", _head_short_scale, ("lm_head.weight_scale", "(299, 1)")),
}


@pytest.mark.parametrize("case", sorted(TRUNK_CASES))
def test_quantized_trunk_refused(signed, tmp_path, case):
    shard, change, words = TRUNK_CASES[case]
    quantized = _load(signed["int8-trunk"] / shard)["lm_head.weight" if "head" in shard else "self_attn.o_proj.weight"]
    assert quantized.dtype == np.int8  # the clean split quantized the trunk
    _refused(signed, tmp_path, "int8-trunk", shard, change, words)
