"""Quantized experts end to end through the installed commands, per family: make_tiny_moe.py -> `shardtool split
--quantize int8|int4` -> `shardtool sign` -> `verify-and-run`, which must run on the block-quantized experts it
verified (and read fewer bytes as int4 than as int8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _kit.cli import ok, run

PROMPT = "1,2,3,4,5,6,7,8"
NEW = 8
# hidden 64 and expert width 160 are multiples of the quantization block (32)
KNOBS = dict(moe_intermediate=160, dtype="bf16")
FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "olmoe", "qwen2_moe", "llama4",
            "gpt_oss"]


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("key")
    ok("shardtool", "keygen", "--out", d / "pub", "--no-passphrase", cwd=d)
    return d / "pub"


def _signed(work: Path, ck: Path, name: str, key: Path, *split_args) -> Path:
    out = work / name
    ok("shardtool", "split", ck, out, "-q", "--model-id", "acme/quant", *split_args, cwd=work)
    ok("shardtool", "sign", out, "--key", key.with_suffix(".key"), cwd=work)
    return out


def _run(work: Path, model: Path, key: Path) -> tuple[list[int], dict]:
    report = work / f"{model.name}.json"
    r = ok("verify-and-run", model, "--trust", key.with_suffix(".pub"), "--state-dir", work / f"state-{model.name}",
           "--prompt-ids", PROMPT, "--max-new-tokens", NEW, "--print-ids", "-q", "--json-report", report, cwd=work)
    assert "Traceback" not in r.stderr
    return [int(x) for x in r.stdout.split()], json.loads(report.read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_split_quantize_sign_verify_and_run(tmp_path, key, family, tiny):
    ck = tiny.checkpoint(family, **KNOBS)
    read = {}
    for name, args in (("int8", ["--quantize", "int8"]), ("int4", ["--quantize", "int4"]),
                       ("int8-trunk", ["--quantize", "int8", "--quantize-trunk"])):
        model = _signed(tmp_path, ck, name, key, *args)
        ids, report = _run(tmp_path, model, key)
        assert len(ids) == NEW and report["generated_ids"] == ids, (name, ids)
        read[name] = report["bytes_read"]
    # with 4 experts, all are chosen during the prefill of 8 tokens: what was read is the quantized shards
    assert read["int4"] < read["int8"], read
    assert read["int8-trunk"] < read["int8"], read
    # the trunk's linear weights went to int8 (+ scales); its router and norms did not
    dtypes = _dtypes(tmp_path / "int8-trunk" / "trunk" / "layer-000.safetensors")
    assert dtypes["self_attn.o_proj.weight"] == "I8" and dtypes["self_attn.o_proj.weight_scale"] == "F16", dtypes
    assert dtypes["input_layernorm.weight"] == "BF16", dtypes
    assert all(d != "I8" for n, d in dtypes.items() if "gate.weight" in n and "proj" not in n), dtypes


def _dtypes(shard: Path) -> dict[str, str]:
    import struct

    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return {name: t["dtype"] for name, t in header.items() if name != "__metadata__"}


def test_quantize_trunk_is_int8_only(tmp_path, tiny):
    ck = tiny.checkpoint("mixtral", **KNOBS)
    for args in (["--quantize", "int4", "--quantize-trunk"], ["--quantize-trunk"]):
        r = run("shardtool", "split", ck, tmp_path / "out", *args, cwd=tmp_path)
        assert r.returncode == 2 and "--quantize-trunk needs --quantize int8" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
