"""Fuzz every CLI option that parses a number, a size, a list or an identifier, through the real command
line (in-process, the installed entry points' `main(args)`), the way the other fuzz targets fuzz decoders.

The contract: any value gives exit 0, 1, 2 or 3 with at most one line of error on stderr, never a traceback
(an exception escaping `run_app` fails the test with the input attached), never a hang, and any JSON printed
is valid JSON.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _fuzzkit import Hang, watchdog

WATCHDOG = 30  # seconds for one whole command (a verify-and-run loads and runs a model)

# What a user (or a script with a bug) may type where a number, size or list belongs.
ODD = st.sampled_from(["", " ", "0", "-0", "1", "-1", "nan", "NaN", "inf", "-inf", "1e400", "-1e400", "1e-400",
                       "9" * 400, "0x10", "1_000", " 1", "1 ", "１", "٣", "2**64", "18446744073709551616",
                       "9223372036854775808", "-9223372036854775809", "1.5", "1,2", ",", "1,,2", "-1,2",
                       "8GiB", "8 GiB", "8gib", "0GiB", "1e3MiB", "9" * 400 + "GiB", "1TiB", "1PiB", "1EiB",
                       "99999999999EiB", "inf GiB", "nanMiB", "\x00", "a\nb"])
VALUES = (ODD | st.integers(-(2**80), 2**80).map(str)
          | st.floats(allow_nan=True, allow_infinity=True).map(repr)
          | st.text(max_size=24)
          | st.lists(st.integers(-(2**70), 2**70), max_size=6).map(lambda xs: ",".join(map(str, xs))))


def invoke(main, args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        with watchdog(WATCHDOG), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Hang as e:
        raise AssertionError(f"{args!r:.400} hung: {e}") from None
    return code, out.getvalue(), err.getvalue()


def check(main, args: list[str]) -> int:
    code, out, err = invoke(main, args)
    assert code in (0, 1, 2, 3), (code, args, err)
    assert "Traceback" not in err, (args, err)
    if code != 0:
        assert len(err.strip().splitlines()) == 1, (args, err)
    if out.strip().startswith("{"):
        json.loads(out)  # strict: no NaN / Infinity
    return code


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A tiny signed split model, its key, and a proof of one expert."""
    from shardtool import keys
    from shardtool.checkpoint import split_checkpoint
    from shardtool.manifest import build_proof, load_manifest, save_manifest

    from examples import make_tiny_moe

    base = tmp_path_factory.mktemp("cli-fuzz")
    ckpt = make_tiny_moe.make_checkpoint(base / "hf", "mixtral", seed=0, layers=2, experts=2, experts_per_tok=2,
                                         hidden=32, moe_intermediate=16, intermediate=48, vocab=300, heads=4,
                                         kv_heads=2)
    out = base / "model"
    split_checkpoint(ckpt, out, model_id="fuzz/tiny", version=1)
    key = keys.generate()
    keys.write_keypair(base / "k", key, None, force=False)
    manifest = load_manifest(out / "manifest.msgpack")
    signed_manifest = manifest.with_envelope(manifest.envelope.signed_by(key))
    save_manifest(out / "manifest.msgpack", signed_manifest)
    expert = "experts/layer-000/expert-0001.safetensors"
    (base / "expert.proof").write_bytes(build_proof(signed_manifest, expert))
    (base / "log").mkdir()
    (base / "log" / "run.receipt").write_bytes(_receipt(out, base / "k.pub", base / "op"))
    (base / "plan.json").write_bytes(_cluster_plan(out, base / "k.pub"))
    return {"base": base, "model": out, "ckpt": ckpt, "pub": base / "k.pub", "proof": base / "expert.proof",
            "expert": out / expert, "entry": expert, "n": 0, "receipt": base / "log" / "run.receipt",
            "op": base / "op.pub", "plan": base / "plan.json"}


def _cluster_plan(model: Path, publisher: Path) -> bytes:
    """A plan putting every expert on one node "a"."""
    from shardtool import keys
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import encode_plan, make_plan

    verified = load_trusted_manifest(model / "manifest.msgpack", [keys.load_public_key(publisher)], 1,
                                     model.parent / "st")
    return encode_plan(make_plan(verified, [("a", 1 << 30, None)], 1))


def _node(s, name: str, budget: str) -> list:
    """`shardtool node` at a closed port: every option is checked (and the planned files) before it connects."""
    return ["node", s["model"], "--trust", s["pub"], "--state-dir", s["base"] / "st", "--plan", s["plan"],
            "--name", name, "--memory-budget", budget, "--address", "127.0.0.1:1", "--join-timeout", "5"]


def _receipt(model: Path, publisher: Path, operator: Path) -> bytes:
    """A genuine run receipt of three new tokens, signed by a fresh operator key written to `operator`.pub."""
    from shardtool import keys
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import Engine, SamplingParams, make_receipt

    op = keys.generate()
    keys.write_keypair(operator, op, None, force=False)
    verified = load_trusted_manifest(model / "manifest.msgpack", [keys.load_public_key(publisher)], 1,
                                     model.parent / "st")
    engine = Engine(model, verified, budget=1 << 28, max_batch=1)
    try:
        ticket = engine.run_one([1, 2, 3], SamplingParams(3), lambda t: None, record=True)  # stops at EOS
        return make_receipt(ticket.record, verified, engine.config, op).data
    finally:
        engine.close()


def _verify_receipt(s, *extra) -> list:
    return ["verify-receipt", s["receipt"], s["model"], "--operator", s["op"], "--trust", s["pub"], "--state-dir",
            s["base"] / "st", "--json", *extra]


def _plan(s, *extra) -> list:
    return ["plan", s["model"], "--trust", s["pub"], "--state-dir", s["base"] / "st", "--model-id", "fuzz/tiny",
            "--json", *extra]


def _pull(s, *extra) -> list:
    """`shardtool pull` from the model's own directory (a local store) into a fresh DEST."""
    return ["pull", s["model"], _fresh(s, "d"), "--trust", s["pub"], "--state-dir", s["base"] / "st", "-q", "--json",
            "--timeout", "5", *extra]


def _fresh(signed, name: str) -> Path:
    signed["n"] += 1
    return signed["base"] / f"{name}-{signed['n']}"


SHARDTOOL_OPTIONS = {
    "audit --threshold": lambda s, v: ["audit", s["model"], "--trust", s["pub"], "--state-dir", s["base"] / "st",
                                       "-q", "--json", "--threshold", v],
    "audit --workers": lambda s, v: ["audit", s["model"], "--trust", s["pub"], "--state-dir", s["base"] / "st",
                                     "-q", "--json", "--workers", v],
    "audit --model-id": lambda s, v: ["audit", s["model"], "--trust", s["pub"], "--state-dir", s["base"] / "st",
                                      "-q", "--json", "--model-id", v],
    "inspect --disk-gbps": lambda s, v: ["inspect", s["model"], "--json", "--disk-gbps", v],
    "inspect --context": lambda s, v: ["inspect", s["model"], "--json", "--context", v],
    "inspect --config --bits-per-weight": lambda s, v: ["inspect", "--config", s["ckpt"] / "config.json", "--json",
                                                        "--bits-per-weight", v],
    "plan --node": lambda s, v: _plan(s, "--node", v),
    "plan --node disk": lambda s, v: _plan(s, "--node", f"a=1GiB,disk={v}"),
    "plan --replicas": lambda s, v: _plan(s, "--node", "a=1GiB", "--node", "b=1GiB", "--replicas", v),
    "plan --disk-gbps": lambda s, v: _plan(s, "--node", "a=1GiB", "--disk-gbps", v),
    "plan --model-id": lambda s, v: ["plan", s["model"], "--trust", s["pub"], "--state-dir", s["base"] / "st",
                                     "--json", "--node", "a=1GiB", "--model-id", v],
    "manifest --version": lambda s, v: ["manifest", s["ckpt"], "--manifest", _fresh(s, "m"), "--version", v],
    "manifest --expires-in": lambda s, v: ["manifest", s["ckpt"], "--manifest", _fresh(s, "m"), "--expires-in", v],
    "prove --entry": lambda s, v: ["prove", s["model"], "--entry", v, "--out", _fresh(s, "p")],
    "verify-shard --threshold": lambda s, v: ["verify-shard", s["expert"], "--proof", s["proof"], "--trust", s["pub"],
                                              "--state-dir", s["base"] / "st", "--threshold", v],
    "verify-shard --entry": lambda s, v: ["verify-shard", s["expert"], "--proof", s["proof"], "--trust", s["pub"],
                                          "--state-dir", s["base"] / "st", "--entry", v],
    "verify-shard --model-id": lambda s, v: ["verify-shard", s["expert"], "--proof", s["proof"], "--trust", s["pub"],
                                             "--state-dir", s["base"] / "st", "--model-id", v],
    "join --threshold": lambda s, v: ["join", s["model"], _fresh(s, "j"), "--trust", s["pub"], "--state-dir",
                                      s["base"] / "st", "-q", "--threshold", v],
    "split --version": lambda s, v: ["split", s["ckpt"], _fresh(s, "o"), "-q", "--no-fsync", "--version", v],
    "split --expires-in": lambda s, v: ["split", s["ckpt"], _fresh(s, "o"), "-q", "--no-fsync", "--expires-in", v],
    "node --name": lambda s, v: _node(s, v, "1GiB"),
    "node --memory-budget": lambda s, v: _node(s, "a", v),
    "verify-receipt --memory-budget": lambda s, v: _verify_receipt(s, "--memory-budget", v),
    "verify-receipt --threshold": lambda s, v: _verify_receipt(s, "--threshold", v),
    "verify-receipt --model-id": lambda s, v: _verify_receipt(s, "--model-id", v),
    "verify-receipt --readers": lambda s, v: _verify_receipt(s, "--readers", v),
    "verify-receipt --stop-ids": lambda s, v: _verify_receipt(s, "--stop-ids", v),
    "verify-receipt --sample": lambda s, v: ["verify-receipt", s["receipt"].parent, s["model"], "--operator", s["op"],
                                             "--trust", s["pub"], "--state-dir", s["base"] / "st", "--json",
                                             "--sample", v],
    "pull --layers": lambda s, v: _pull(s, "--layers", v),
    "pull --jobs": lambda s, v: _pull(s, "--jobs", v),
    "pull --timeout": lambda s, v: ["pull", s["model"], _fresh(s, "d"), "--trust", s["pub"], "--state-dir",
                                    s["base"] / "st", "-q", "--json", "--timeout", v],
    "pull --mirror": lambda s, v: _pull(s, "--mirror", v),
    "pull --node": lambda s, v: _pull(s, "--plan", s["plan"], "--node", v),
    "pull --model-id": lambda s, v: _pull(s, "--model-id", v),
    "push --jobs": lambda s, v: ["push", s["model"], _fresh(s, "u"), "-q", "--json", "--jobs", v],
    "push --timeout": lambda s, v: ["push", s["model"], _fresh(s, "u"), "-q", "--json", "--timeout", v],
    "verify-receipt --sample-seed": lambda s, v: ["verify-receipt", s["receipt"].parent, s["model"], "--operator",
                                                  s["op"], "--trust", s["pub"], "--state-dir", s["base"] / "st",
                                                  "--json", "--sample", "1", "--sample-seed", v],
}

RUN_OPTIONS = {
    "--memory-budget": lambda v: ["--memory-budget", v],
    "--prompt-ids": lambda v: ["--prompt-ids", v],
    "--max-new-tokens": lambda v: ["--max-new-tokens", v],
    "--temperature": lambda v: ["--temperature", v, "--seed", "1"],
    "--top-p": lambda v: ["--top-p", v, "--temperature", "1", "--seed", "1"],
    "--seed": lambda v: ["--seed", v, "--temperature", "1"],
    "--threshold": lambda v: ["--threshold", v],
    "--remote-timeout": lambda v: ["--remote-timeout", v],
    "--fetch-timeout": lambda v: ["--fetch-timeout", v],
}


@pytest.mark.parametrize("option", list(SHARDTOOL_OPTIONS))
@given(value=VALUES)
def test_fuzz_cli_shardtool_options(option, value, signed):
    from shardtool.cli import main

    check(main, [str(a) for a in SHARDTOOL_OPTIONS[option](signed, value)])


@pytest.mark.parametrize("option", list(RUN_OPTIONS))
@given(value=VALUES)
def test_fuzz_cli_verify_and_run_options(option, value, signed):
    from shardtool.cli.run_cmd import main

    extra = RUN_OPTIONS[option](value)
    if option == "--remote-timeout":  # a cluster at a closed port: refused before Ray is asked
        extra += ["--cluster", "127.0.0.1:1", "--plan", str(signed["plan"])]
    base = [signed["model"], "--trust", signed["pub"], "--state-dir", signed["base"] / "st", "-q", "--print-ids"]
    if option == "--fetch-timeout":  # the model's own directory as a store, fetched into a fresh cache
        base[:1] = ["--remote", signed["model"], "--cache-dir", _fresh(signed, "c")]
    if option != "--prompt-ids":
        base += ["--prompt-ids", "1,2,3"]
    if option != "--max-new-tokens":
        base += ["--max-new-tokens", "2"]
    check(main, [str(a) for a in base + extra])
