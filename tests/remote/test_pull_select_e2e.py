"""`shardtool pull --layers A-B` and `--plan PLAN --node NAME` fetch only those files (plus the files of no layer,
or the node's config), the `--json` summary says what was done, and usage errors exit 2 in one line before anything
is fetched or created."""

from __future__ import annotations

import json

import pytest

from shardtool.keys import load_public_key
from shardtool.manifest import MANIFEST_NAME, load_trusted_manifest
from shardtool.runtime import load_plan, node_files

from _remotekit import MODEL_ID, check_dest


def _files(dest):
    return {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}


@pytest.mark.parametrize("span,first,last", [("1-2", 1, 2), ("0", 0, 0)])
def test_layers_selects_only_those_layers(cli, world, http_mirrors, tmp_path, span, first, last):
    dest = tmp_path / "dest"
    mark = http_mirrors.mark()
    r = cli("pull", http_mirrors.url("good"), dest, "--trust", world.pub, "--model-id", MODEL_ID, "--layers", span,
            "--json")
    assert r.code == 0, r.err
    wanted = {p for p, e in world.entries.items() if e.layer is None or first <= e.layer <= last}
    assert wanted != set(world.entries) and any(world.entries[p].layer is None for p in wanted)
    assert _files(dest) == wanted | {MANIFEST_NAME}
    assert {q["path"] for q in http_mirrors.requests(mark)} == wanted | {MANIFEST_NAME}
    summary = json.loads(r.out)
    assert summary["complete"] and summary["model_id"] == MODEL_ID
    assert summary["files"] == {"selected": len(wanted), "kept": 0, "downloaded": len(wanted), "resumed": 0,
                                "failed": 0}
    assert summary["bytes"]["selected"] == summary["bytes"]["downloaded"] == sum(world.entries[p].size for p in wanted)
    assert summary["merkle_root"] and summary["manifest_mirror"] == http_mirrors.url("good")
    check_dest(dest, world.entries, complete=True, selected=wanted)
    cli.ok("audit", dest, "--trust", world.pub, "--model-id", MODEL_ID, "--present-only")
    if span != "0":
        return
    again = cli("pull", http_mirrors.url("good"), dest, "--trust", world.pub, "--model-id", MODEL_ID, "--layers",
                span, "--json")
    assert again.code == 0 and json.loads(again.out)["files"]["kept"] == len(wanted)


def test_plan_and_node_select_that_nodes_share(cli, world, http_mirrors, tmp_path):
    plan = tmp_path / "cluster.plan"
    cli.ok("plan", world.model, "--trust", world.pub, "--model-id", MODEL_ID, "--node", "a=64MiB", "--node",
           "b=64MiB", "--out", plan)
    manifest = load_trusted_manifest(world.model / MANIFEST_NAME, [load_public_key(world.pub)], 1, tmp_path / "st")
    shares = {node: set(node_files(load_plan(plan, manifest), node)) for node in ("a", "b")}
    experts = {p for p, e in world.entries.items() if e.kind == "expert"}
    assert (shares["a"] | shares["b"]) & experts == experts and shares["a"] != shares["b"]
    dest = tmp_path / "a"
    mark = http_mirrors.mark()
    r = cli("pull", http_mirrors.url("good"), dest, "--trust", world.pub, "--model-id", MODEL_ID, "--plan", plan,
            "--node", "a", "--json")
    assert r.code == 0, r.err
    wanted = shares["a"]
    assert 1 < len(wanted) < len(world.entries)
    assert _files(dest) == wanted | {MANIFEST_NAME}
    assert {q["path"] for q in http_mirrors.requests(mark)} == wanted | {MANIFEST_NAME}
    assert json.loads(r.out)["files"]["selected"] == len(wanted)
    check_dest(dest, world.entries, complete=True, selected=wanted)

    r = cli("pull", http_mirrors.url("good"), tmp_path / "zz", "--trust", world.pub, "--model-id", MODEL_ID,
            "--plan", plan, "--node", "zz")
    assert r.code == 2, r.err
    assert "zz" in r.one_line()
    assert not (tmp_path / "zz").exists() or not any((tmp_path / "zz").rglob("*"))


@pytest.mark.parametrize("args,says", [
    (["--layers", "2-1"], "--layers"),
    (["--layers", "abc"], "--layers"),
    (["--layers", "-1"], "--layers"),
    (["--layers", "1-2-3"], "--layers"),
    (["--layers", "9" * 30], "--layers"),
    (["--plan", "p.plan"], "--plan and --node"),
    (["--node", "a"], "--plan and --node"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
], ids=["reversed", "word", "negative", "three", "long", "plan-alone", "node-alone", "timeout-0", "timeout-nan"])
def test_usage_errors_exit_2_in_one_line(cli, world, http_mirrors, tmp_path, args, says):
    mark = http_mirrors.mark()
    dest = tmp_path / "dest"
    r = cli("pull", http_mirrors.url("good"), dest, "--trust", world.pub, *args)
    assert r.code == 2, r.err
    assert says in r.one_line() and "Traceback" not in r.err
    assert not dest.exists()
    assert http_mirrors.requests(mark) == []
