"""The memory budget: `verify-and-run --memory-budget B` must keep the process's peak RSS within B + 150 MiB
(the interpreter and its libraries) for any run the budget admits, and refuse up front what it cannot admit.

Attacks: a signed config.json asking for sizes beyond what any model needs (an 8192x8192 FP8 block grid
once made dequantisation allocate 256 MiB for a 32x48 weight; any field past its cap), a long prompt
(prefill attention is quadratic in the prompt), a sequence whose KV cache the budget cannot hold, and
hostile values for every numeric option. Peak RSS is measured from outside: a small wrapper process spawns
the real CLI and reads the child's ru_maxrss from wait4().
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _attackkit as kit
from _attackkit import Attack, refused

MIB = 2**20
RSS_SLACK = 150 * MIB  # the README's promise: peak RSS <= budget + 150 MiB
LONG_PROMPT = [3 + i % 290 for i in range(3000)]  # ids below the attack model's vocabulary of 300
IDS = "5,6,7"

# Spawns argv[2:] and writes the child's peak RSS (KiB) to argv[1]. posix_spawn + exec: the child's
# ru_maxrss starts from this small process's size (Linux keeps the pre-exec high-water mark), never from
# pytest's, so the figure is the CLI's own peak or this wrapper's ~10 MiB, whichever is larger.
_WRAPPER = """
import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(program: str, *args, cwd: Path, timeout: int = 120) -> tuple[kit.Result, int]:
    """(result, peak RSS in bytes) of one installed CLI run."""
    rss_file = cwd / f"rss-{program}.txt"
    env = kit.env_for(cwd / "xdg")
    proc = subprocess.run([sys.executable, "-S", "-c", _WRAPPER, str(rss_file), str(kit.BIN / program),
                           *map(str, args)], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    return kit.Result(proc.returncode, proc.stdout, proc.stderr), int(rss_file.read_text()) * 1024


def run_args(model: Path, world, state: Path, *extra) -> list:
    return [model, "--trust", world.keys.pub("A"), "--state-dir", state, "--print-ids", "-q", *extra]


def var(model: Path, world, *extra) -> kit.Result:
    return kit.run("verify-and-run", *run_args(model, world, world.tmp / "state", *extra), cwd=world.tmp)


def one_line(r: kit.Result) -> str:
    kit.assert_no_traceback(r)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr:\n{r.err}"
    return lines[0]


def publish(model: Path, rel: str, rewrite, world) -> None:
    """Rewrite `rel` and publish it properly: entry updated, root resealed, re-signed by trusted key A."""
    kit.publish_rewritten(model, rel, rewrite, world.keys.signer("A"))


def set_config(change: dict):
    def rewrite(path: Path) -> None:
        config = json.loads(path.read_text())
        for key, value in change.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        path.write_text(json.dumps(config))
    return rewrite


# ---------------------------------------------------------------------------------------------------------
# A signed config.json asking for sizes beyond any model: refused, naming config.json, field, cap and value


def _config_case(field: str, value, cap: str) -> Attack:
    return Attack(lambda model, world: publish(model, "config.json", set_config({field: value}), world), kit.CLEAN,
                  refused("VerificationError", f"config.json: {field} is {value}, above the cap of {cap}"))


CAPS = {
    "hidden-size": _config_case("hidden_size", 65537, "65536"),
    "vocab-size": _config_case("vocab_size", 2**21 + 1, str(2**21)),
    "attention-heads": _config_case("num_attention_heads", 1025, "1024"),
    "experts": _config_case("num_local_experts", 16385, "16384"),
    "experts-per-token": _config_case("num_experts_per_tok", 257, "256"),
    "layers": _config_case("num_hidden_layers", 4097, "4096"),
    "intermediate-size": _config_case("intermediate_size", 2**18 + 1, str(2**18)),
    "max-positions": _config_case("max_position_embeddings", 2**24 + 1, str(2**24)),
    "sliding-window": _config_case("sliding_window", 2**24 + 1, str(2**24)),
    "head-dim": _config_case("head_dim", 4097, "4096"),
    "rope-theta": Attack(lambda model, world: publish(model, "config.json", set_config(
        {"rope_parameters": {"rope_theta": 1e300}}), world), kit.CLEAN, refused(
        "VerificationError", "config.json: rope_parameters.rope_theta is 1e+300, beyond the cap of 1e+12")),
}


@pytest.mark.parametrize("case", sorted(CAPS))
def test_budget_signed_config_above_cap(case, model, world):
    _, run = kit.check_attack(CAPS[case], model, world)
    assert "config.json" in one_line(run)


# ---------------------------------------------------------------------------------------------------------
# FP8 block-scaled weights: dequantisation memory is O(weight) whatever block size the signed config names


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory, keys):
    """DeepSeek-V3 FP8 (every quantised dimension <= 128, so each weight has one scale) signed with key A as
    published ([128, 128] blocks), and the same with the block grid the signed config.json claims set to
    [8192, 8192]: the same scales and the same weights, so the same tokens."""
    from shardtool.checkpoint import split_checkpoint

    base = tmp_path_factory.mktemp("fp8")
    ck = make_checkpoint(base / "ck", "deepseek_v3", fp8=True, layers=2, experts=4, hidden=32, heads=4,
                             kv_heads=4, moe_intermediate=16, intermediate=48, vocab=300, dtype="bf16")
    models = {}
    for name, block in (("published", [128, 128]), ("block-8192", [8192, 8192])):
        src = shutil.copytree(ck, base / f"{name}-hf")
        set_config({"quantization_config": {"weight_block_size": block}})(src / "config.json")
        split_checkpoint(src, base / name, model_id=f"acme/fp8-{name}", version=1)
        kit.Doc.read(base / name).sign(keys.signer("A")).write(base / name)
        models[name] = base / name
    return models


def make_checkpoint(out: Path, family: str, **knobs) -> Path:
    from examples import make_tiny_moe  # the repository root is on pytest's pythonpath
    return make_tiny_moe.make_checkpoint(out, family, **knobs)


def test_budget_fp8_block_8192_stays_within_budget(fp8_models, world):
    budget = 64 * MIB
    outs = {}
    for name, model in fp8_models.items():
        r, peak = run_measured("verify-and-run", *run_args(model, world, world.tmp / f"state-{name}", "--prompt-ids",
                                                           IDS, "--max-new-tokens", 4, "--memory-budget", "64MiB"),
                               cwd=world.tmp)
        kit.assert_no_traceback(r)
        assert r.code == 0, r.err
        assert peak <= budget + RSS_SLACK, f"{name}: peak RSS {peak / MIB:.1f} MiB under a 64 MiB budget"
        outs[name] = r.out
    assert outs["block-8192"] == outs["published"] and len(outs["published"].split()) == 4


def test_budget_fp8_block_above_cap_refused(fp8_models, world, tmp_path):
    model = kit.copy_model(fp8_models["block-8192"], tmp_path / "model")
    publish(model, "config.json", set_config({"quantization_config": {"weight_block_size": [2**18 + 1, 128]}}), world)
    r = kit.run(*kit.run_cmd(model, [world.keys.pub("A")], 1, world.tmp / "state"),
                cwd=world.tmp)
    kit.assert_run_refused(r, "VerificationError", "config.json: quantization_config.weight_block_size[0] is "
                                                   "262145, above the cap of 262144")
    one_line(r)


# ---------------------------------------------------------------------------------------------------------
# Long prompts: prefill runs in chunks sized from the budget, and gives the unchunked tokens


def _unchunked_greedy(model: Path, world, ids: list[int], new: int) -> list[int]:
    """The same verified model in-process, the whole prompt in one forward step (no chunking)."""
    import numpy as np

    from shardtool.keys import load_public_key
    from shardtool.manifest import load_verified_manifest
    from shardtool.runtime.engine._session import Session

    verified = load_verified_manifest(model / kit.MANIFEST, [load_public_key(world.keys.pub("A"))], 1)
    session = Session(model, verified, budget=8 << 30, max_tokens=len(ids) + new)
    try:
        logits = session.model.prefill(ids, last_only=True, chunk=len(ids))[0]
        out = []
        for _ in range(new):
            out.append(int(np.argmax(logits)))
            logits = session.model.decode(out[-1])
        return out
    finally:
        session.close()


def test_budget_long_prompt_stays_within_budget_and_matches_unchunked(model, world):
    budget = 40 * MIB
    r, peak = run_measured("verify-and-run", *run_args(model, world, world.tmp / "state", "--prompt-ids",
                                                       ",".join(map(str, LONG_PROMPT)), "--max-new-tokens", 4,
                                                       "--memory-budget", "40MiB"), cwd=world.tmp)
    kit.assert_no_traceback(r)
    assert r.code == 0, r.err
    assert peak <= budget + RSS_SLACK, f"peak RSS {peak / MIB:.1f} MiB for a 3000-token prompt under 40 MiB"
    assert [int(t) for t in r.out.split()] == _unchunked_greedy(model, world, LONG_PROMPT, 4)


def test_budget_sequence_too_long_for_the_budget_refused_up_front(model, world):
    # 3,000 prompt tokens + 1,000,000 new ones: the KV cache alone is 244 MiB. Refused before any token.
    r = var(model, world, "--prompt-ids", ",".join(map(str, LONG_PROMPT)), "--max-new-tokens", 1_000_000,
            "--memory-budget", "40MiB")
    line = one_line(r)
    assert r.code == 2 and r.out == "" and "[UsageError]" in line, r.err
    assert "cannot run 1003000 tokens (prompt + --max-new-tokens)" in line and "KV cache 244.9 MiB" in line, line
    # A shorter run just over what the budget holds is refused too, and the budget it names is enough.
    args = ("--prompt-ids", ",".join(map(str, LONG_PROMPT)), "--max-new-tokens", 4)
    r = var(model, world, *args, "--memory-budget", "32MiB")
    line = one_line(r)
    assert r.code == 2 and r.out == "", r.err
    need = int(line.split("raise --memory-budget to at least ")[1].split("MiB")[0])
    r, peak = run_measured("verify-and-run", *run_args(model, world, world.tmp / "state", *args, "--memory-budget",
                                                       f"{need}MiB"), cwd=world.tmp)
    assert r.code == 0 and len(r.out.split()) == 4, r.err
    assert peak <= need * MIB + RSS_SLACK, f"peak RSS {peak / MIB:.1f} MiB under the {need} MiB it asked for"


# ---------------------------------------------------------------------------------------------------------
# Streaming: experts four times the budget, evicted and read again, within budget + 150 MiB


def test_budget_streaming_experts_beyond_the_budget(tmp_path, keys, world):
    from shardtool.checkpoint import split_checkpoint

    # 12 layers x 16 experts x 1.5 MiB (f32) = 288 MiB of experts under a 64 MiB budget.
    ck = make_checkpoint(tmp_path / "ck", "mixtral", layers=12, experts=16, hidden=256, moe_intermediate=512,
                         intermediate=512, heads=4, kv_heads=2, vocab=512, dtype="f32")
    split_checkpoint(ck, tmp_path / "model", model_id="acme/stream", version=1)
    shutil.rmtree(ck)
    kit.Doc.read(tmp_path / "model").sign(keys.signer("A")).write(tmp_path / "model")
    report = tmp_path / "report.json"
    r, peak = run_measured("verify-and-run", *run_args(tmp_path / "model", world, tmp_path / "state", "--prompt-ids",
                                                       IDS, "--max-new-tokens", 16, "--memory-budget", "64MiB",
                                                       "--json-report", report), cwd=tmp_path)
    assert r.code == 0, r.err
    s = json.loads(report.read_text())
    assert s["cache"]["evictions"] > 0 and s["cache"]["peak_cached_bytes"] <= s["budget"]["shard_cache"]
    assert peak <= 64 * MIB + RSS_SLACK, f"peak RSS {peak / MIB:.1f} MiB under a 64 MiB budget"


# ---------------------------------------------------------------------------------------------------------
# Numeric options: every out-of-range or malformed value is one usage line, exit 2, before any file is read


OPTION_CASES = {
    "memory-budget-400-nines": ("--memory-budget", "9" * 400),
    "memory-budget-zero": ("--memory-budget", "0"),
    "memory-budget-above-1pib": ("--memory-budget", "1025TiB"),
    "memory-budget-exponent": ("--memory-budget", "1e9"),
    "memory-budget-unicode-digits": ("--memory-budget", "\u0661\u0660MiB"),
    "prompt-ids-unicode-digits": ("--prompt-ids", "\u0661,\u0662"),
    "prompt-ids-negative": ("--prompt-ids", "5,-1"),
    "prompt-ids-huge": ("--prompt-ids", "5," + "9" * 5000),
    "prompt-ids-above-vocabulary": ("--prompt-ids", "5,300"),
    "prompt-ids-empty": ("--prompt-ids", ","),
    "seed-negative": ("--seed", "-1"),
    "seed-above-2-64": ("--seed", str(2**64)),
    "temperature-infinite": ("--temperature", "inf"),
    "temperature-nan": ("--temperature", "nan"),
    "temperature-negative": ("--temperature", "-0.5"),
    "top-p-zero": ("--top-p", "0"),
    "top-p-nan": ("--top-p", "nan"),
    "top-p-above-one": ("--top-p", "1.5"),
    "max-new-tokens-above-cap": ("--max-new-tokens", "1000001"),
    "max-new-tokens-negative": ("--max-new-tokens", "-1"),
    "max-new-tokens-huge": ("--max-new-tokens", "9" * 400),
}


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_budget_option_value_refused(case, model, world):
    option, value = OPTION_CASES[case]
    prompt = [] if option == "--prompt-ids" else ["--prompt-ids", IDS]
    r = var(model, world, *prompt, option, value)
    line = one_line(r)
    assert r.code == 2 and r.out == "", r.err
    assert option in line and "UsageError" in line, line


def test_budget_tiny_temperature_samples_without_a_crash(model, world):
    r = var(model, world, "--prompt-ids", IDS, "--temperature", "1e-320", "--seed", 2**64 - 1, "--max-new-tokens", 3)
    kit.assert_no_traceback(r)
    greedy = var(model, world, "--prompt-ids", IDS, "--max-new-tokens", 3)
    assert r.code == 0 and r.out == greedy.out, r.err  # a temperature that small is greedy


_OPTION_TEXT = st.text(max_size=40) | st.sampled_from(["9" * 400, "nan", "inf", "-inf", "1e308", "-0", "0x10",
                                                         "1_000", "\u0661", "1e-320", "18446744073709551616"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(["--memory-budget", "--prompt-ids", "--temperature", "--top-p", "--seed",
                               "--max-new-tokens"]), value=_OPTION_TEXT)
def test_budget_option_values_fuzz(option, value, tmp_path):
    """In-process through the CLI's own error handling: any value is accepted (the run then stops at the
    missing model directory) or refused with one usage line; never another exception, never exit 1."""
    from shardtool.cli import _common, run_cmd

    prompt = [] if option == "--prompt-ids" else ["--prompt-ids", IDS]
    argv = ["verify-and-run", str(tmp_path / "absent"), *prompt, f"{option}={value}"]
    err = io.StringIO()
    # (malloc tuning is for the CLI's own process, not pytest's)
    with contextlib.redirect_stderr(err), mock.patch.object(run_cmd, "keep_freed_memory", lambda: None), \
            mock.patch.object(sys, "argv", argv), pytest.raises(SystemExit) as info:
        run_cmd.main()
    lines = err.getvalue().strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1, (option, value, info.value.code, err.getvalue())
    assert option in lines[0] or "absent" in lines[0], lines[0]
    if "absent" in lines[0] and option == "--memory-budget":
        assert 1 <= _common.parse_size(value) <= 2**50 and math.isfinite(_common.parse_size(value))
