"""`verify-and-run --remote` on a real S3 endpoint (moto's server, read through s3fs): with a memory budget that
holds fewer than the model's experts (so shards are evicted and read again from the cache directory), greedy
output equals the local run; a shard every store serves wrong fails the run as unavailable (exit 3, one line), and
a good mirror behind the bad store gives the local tokens again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import boto3
import pytest

from _remotekit import MODEL_ID, Result, build_cli, target_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # one home of the budget arithmetic
from _budgets import budget_for_top_k_plus  # noqa: E402

PROMPT = "4,5,6,7"


def _bucket(s3):
    return boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


@pytest.fixture(scope="module")
def stores(world, s3, tmp_path_factory):
    """The model pushed to s3://models/run (whole) and s3://models/run-bad (one expert's object wrong)."""
    cli = build_cli(tmp_path_factory.mktemp("run-push"))
    cli.env.update(s3)
    for prefix in ("run", "run-bad"):
        cli.ok("push", world.model, f"s3://models/{prefix}", "-q")
    bad = target_file(world)
    assert bad.startswith("experts/")
    _bucket(s3).put_object(Bucket="models", Key=f"run-bad/{bad}", Body=b"\0" * world.entries[bad].size)
    return "s3://models/run", "s3://models/run-bad"


def _verify_and_run(cli, *args) -> Result:
    return cli(*args, program="verify-and-run", timeout=300)


def _run(cli, *args) -> Result:
    return _verify_and_run(cli, *args, "--trust", cli.pub, "--model-id", MODEL_ID, "--prompt-ids", PROMPT,
                           "--print-ids", "--max-new-tokens", "12", "-q")


@pytest.fixture
def runner(world, s3, tmp_path):
    cli = build_cli(tmp_path)
    cli.env.update(s3)
    cli.pub = world.pub
    return cli


def _smallest_budget(world) -> str:
    """A --memory-budget whose shard cache holds only top-k + 1 of the model's largest shards (the refusal's own hint
    is in whole MiB, which leaves this tiny model's shard cache room for every expert)."""
    return str(budget_for_top_k_plus(world.model, world.pub, len(PROMPT.split(",")) + 12, 1))


def test_verify_and_run_from_s3_with_a_budget_smaller_than_the_experts_equals_the_local_run(world, stores, runner,
                                                                                          tmp_path):
    good, _ = stores
    budget = _smallest_budget(world)
    local = _run(runner, world.model, "--memory-budget", budget)
    assert local.code == 0, local.err
    cache = tmp_path / "cache"
    report = tmp_path / "report.json"
    remote = _run(runner, "--remote", good, "--cache-dir", cache, "--memory-budget", budget, "--json-report", report)
    assert remote.code == 0, remote.err
    assert remote.out.split() == local.out.split() and len(local.out.split()) == 12
    summary = json.loads(report.read_text())
    expert_bytes = sum(e.size for e in world.entries.values() if e.kind == "expert")
    assert summary["budget"]["shard_cache"] < expert_bytes  # the budget holds fewer than the experts...
    assert summary["cache"]["evictions"] > 0  # ...so shards were evicted and read (verified) again
    assert summary["cache"]["fetched_from_remote"] >= 1
    fetched = {p.relative_to(cache).as_posix() for p in cache.rglob("*.safetensors")}
    assert fetched and all(world.entries[p].kind in ("expert", "trunk") for p in fetched)
    # The cache directory is a faithful subset: what it holds is verified (audit --present-only).
    runner.ok("audit", cache, "--present-only", "--trust", world.pub, "--model-id", MODEL_ID)
    # A second run from the same cache fetches nothing again.
    again = _run(runner, "--remote", good, "--cache-dir", cache, "--memory-budget", budget, "--json-report", report)
    assert again.code == 0 and again.out == remote.out, again.err
    assert json.loads(report.read_text())["cache"]["fetched_from_remote"] == 0


def test_a_shard_no_store_serves_right_fails_the_run_as_unavailable_and_a_good_mirror_rescues_it(world, stores,
                                                                                                  runner, tmp_path):
    good, bad = stores
    local = _run(runner, world.model, "--memory-budget", "256MiB")
    # Every expert is fetched before the first token (--verify-all-first), so the bad one surely is.
    failed = _run(runner, "--remote", bad, "--cache-dir", tmp_path / "c1", "--memory-budget", "256MiB",
                  "--verify-all-first")
    assert failed.code == 3, failed.err
    line = failed.one_line()
    assert target_file(world) in line and "run-bad" in line and "Traceback" not in failed.err, line
    rescued = _run(runner, "--remote", bad, "--remote", good, "--cache-dir", tmp_path / "c2", "--memory-budget",
                   "256MiB", "--verify-all-first")
    assert rescued.code == 0 and rescued.out == local.out, rescued.err


@pytest.mark.parametrize("args, needle", [
    (("--remote", "s3://models/run"), "--cache-dir"),
    (("DIR", "--remote", "s3://models/run", "--cache-dir", "c"), "not both"),
    (("--cache-dir", "c"), "model directory"),
    (("--remote", "http://[::1", "--cache-dir", "c"), "not a store URL"),
    (("--remote", "s3://models/run", "--cache-dir", "c", "--manifest", "m"), "--manifest"),
])
def test_remote_option_mistakes_are_one_usage_line(runner, args, needle):
    """Checked before anything is read or fetched, by verify-and-run, serve and node alike."""
    for r in (_verify_and_run(runner, *args, "--trust", "k.pub", "--prompt-ids", "1"),
              runner("serve", *args, "--trust", "k.pub", "--memory-budget", "1GiB"),
              runner("node", *args, "--trust", "k.pub", "--memory-budget", "1GiB", "--plan", "p", "--name", "n",
                     "--address", "127.0.0.1:1")):
        assert r.code == 2 and needle in r.one_line(), r.err
