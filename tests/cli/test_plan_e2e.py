"""`shardtool plan` end to end, as an operator runs it on a split, signed tiny model: exit 0 with a plan file that
decodes against the verified manifest, 1 for a manifest it cannot trust, 2 for nodes that cannot hold the model or
options it cannot read. Every failure is one line; no plan file is left behind by a failed run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtool.keys import load_public_key
from shardtool.manifest import load_trusted_manifest
from shardtool.runtime import decode_plan, node_memory_floor

from _kit.cli import ok
from examples.make_tiny_moe import make_checkpoint

MODEL_ID = "test/plan"


@pytest.fixture(scope="module")
def split_model(tmp_path_factory) -> Path:
    """A split, signed DeepSeek-V3-layout tiny model (a dense first layer: MoE layers do not start at 0)."""
    base = tmp_path_factory.mktemp("plan-e2e")
    make_checkpoint(base / "ck", "deepseek_v3", experts=8, layers=3, vocab=300, dtype="f32")
    for args in (["keygen", "--out", "pub", "--no-passphrase"], ["keygen", "--out", "other", "--no-passphrase"],
                 ["split", "-q", "ck", "model", "--model-id", MODEL_ID], ["sign", "model", "--key", "pub.key"]):
        ok("shardtool", *args, cwd=base, timeout=300)
    return base


def _plan(cli, base: Path, *args: str, trust: str = "pub.pub"):
    return cli("plan", base / "model", "--trust", base / trust, "--model-id", MODEL_ID, *args)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_plan_writes_a_plan_that_decodes_and_prints_json(cli, split_model, tmp_path):
    out = tmp_path / "cluster.plan"
    r = _plan(cli, split_model, "--node", "a=64MiB", "--node", "b=128MiB,disk=1GB", "--node", "c=64MiB",
              "--replicas", "2", "--out", out, "--json")
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    verified = load_trusted_manifest(split_model / "model" / "manifest.msgpack",
                                     [load_public_key(split_model / "pub.pub")], 1, tmp_path / "st")
    plan = decode_plan(out.read_bytes(), verified, what=str(out))
    experts = [e for e in verified.entries if e.kind == "expert"]
    assert {e.layer for e in experts} == {1, 2}  # layer 0 is dense in this layout
    assert [n["name"] for n in summary["nodes"]] == ["a", "b", "c"] and summary["plan"] == str(out)
    assert sum(n["files"] for n in summary["nodes"]) == 2 * len(experts)
    for e in experts:
        assert len(set(plan.holders(e.layer, e.expert))) == 2
    assert summary["single_machine"]["expert_bytes_per_token"] == verified.head.contract["expert_bytes_per_token_cold"]
    assert summary["cluster"]["expert_bytes_per_token"] < summary["single_machine"]["expert_bytes_per_token"]
    assert summary["coordinator"]["files"] == len(verified.entries) - len(experts)
    assert "wrote the plan for 3 node(s)" in r.err

    table = _plan(cli, split_model, "--node", "a=64MiB", "--node", "b=64MiB")
    assert table.code == 0 and table.out == ""
    assert "(coordinator)" in table.err and "one machine:" in table.err and "s/token at 1.86 GiB/s" in table.err


def test_untrusted_manifest_exits_1(cli, split_model, tmp_path):
    out = tmp_path / "p"
    r = _plan(cli, split_model, "--node", "a=64MiB", "--out", out, trust="other.pub")
    assert r.code == 1 and not out.exists()
    _one_line(r.err)
    r = cli("plan", split_model / "model", "--trust", split_model / "pub.pub", "--model-id", "another/model",
            "--node", "a=64MiB")
    assert r.code == 1 and "another/model" in _one_line(r.err)


def test_nodes_that_cannot_hold_the_model_exit_2_naming_the_node(cli, split_model, tmp_path):
    out = tmp_path / "p"
    assert node_memory_floor([1], 1, 1) > 2**20  # the activation reserve alone: 1 MiB is short
    r = _plan(cli, split_model, "--node", "a=64MiB", "--node", "small=1MiB", "--out", out)
    assert r.code == 2 and not out.exists()
    line = _one_line(r.err)
    assert "node small is short of memory by" in line and "bytes" in line
    r = _plan(cli, split_model, "--node", "a=64MiB,disk=1KB", "--node", "b=64MiB,disk=2KB", "--out", out)
    assert r.code == 2 and "short of disk by" in _one_line(r.err) and not out.exists()


@pytest.mark.parametrize("args, expected", [
    (["--node", "a"], "is not NAME=BUDGET"),
    (["--node", "A=1GiB"], "is not NAME=BUDGET"),
    (["--node", "a=lots"], "--node a 'lots' is not a size"),
    (["--node", "a=1GiB,disk=0"], "--node a disk must be between"),
    (["--node", "a=1GiB,ram=2GiB"], "is not disk=SIZE"),
    (["--node", "a=1GiB", "--node", "a=2GiB"], "'a' is named more than once"),
    (["--node", "a=1GiB", "--replicas", "2"], "--replicas 2 needs at least 2 nodes"),
    ([], "give at least one --node"),
])
def test_options_it_cannot_read_exit_2(cli, split_model, args, expected):
    r = _plan(cli, split_model, *args)
    assert r.code == 2 and expected in _one_line(r.err), r.err


def test_pipeline_plan_holds_whole_layers_and_reads_back(cli, split_model, tmp_path):
    out = tmp_path / "pipe.plan"
    r = _plan(cli, split_model, "--node", "a=64MiB", "--node", "b=128MiB", "--pipeline", "--out", out, "--json")
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    verified = load_trusted_manifest(split_model / "model" / "manifest.msgpack",
                                     [load_public_key(split_model / "pub.pub")], 1, tmp_path / "st")
    plan = decode_plan(out.read_bytes(), verified, what=str(out))
    n = verified.head.contract["num_layers"]  # the decoder's layers; DeepSeek's MTP layer comes after them
    trunks = sorted(e.layer for e in verified.entries if e.kind == "trunk" and e.layer is not None)
    assert trunks == list(range(n + verified.head.contract["mtp_layers"]))
    assert plan.pipeline and [layer for _, span in plan.spans() for layer in span] == list(range(n))
    assert summary["placement"] == "pipeline" and summary["replicas"] == 1
    assert [(n["name"], tuple(n["layers"])) for n in summary["nodes"]] == list(plan.spans())
    for i, node in enumerate(plan.nodes):  # each node: the trunk and every expert of its layers, nothing else
        past = (lambda layer: layer >= n) if i == len(plan.nodes) - 1 else (lambda layer: False)  # the last: MTP's
        assert node.files() == sorted(e.path for e in verified.entries if (e.kind == "trunk" and e.layer in node.layers)
                                      or (e.kind == "expert" and (e.layer in node.layers or past(e.layer))))

    table = _plan(cli, split_model, "--node", "a=64MiB", "--node", "b=128MiB", "--pipeline")
    assert table.code == 0 and table.out == "" and "whole layers per node (pipeline)" in table.err
    rows = {line.split()[0]: line.split()[1] for line in table.err.splitlines() if line.split()[:1] in (["a"], ["b"])}
    assert rows == {name: (f"{span[0]}-{span[-1]}" if len(span) > 1 else str(span[0])) for name, span in plan.spans()}


@pytest.mark.parametrize("args, expected", [
    (["--node", "a=64MiB", "--node", "b=64MiB", "--replicas", "2"], "pipeline plans have one copy of each layer"),
    ([f"--node=n{i}=64MiB" for i in range(5)], "a pipeline plan gives each node at least one decoder layer: 5 nodes"),
    (["--node", "a=64MiB", "--node", "small=2MiB"], "node small is short of memory by"),
])
def test_pipeline_plans_it_cannot_make_exit_2(cli, split_model, tmp_path, args, expected):
    out = tmp_path / "p"
    r = _plan(cli, split_model, *args, "--pipeline", "--out", out)
    assert r.code == 2 and expected in _one_line(r.err) and not out.exists(), r.err
