"""The real parts end to end: a Ray head on 127.0.0.1, `shardtool node` processes each holding only the experts a
plan gives it, and `verify-and-run --cluster` as the coordinator. Its output (greedy and sampled tokens, the run
receipt's routing trace) equals single-process verify-and-run on the whole model, bit for bit; a node that dies
or stops passing verification is routed around when a replica is left, and fails the run cleanly (exit 3) when
none is."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import _clusterkit as kit
from shardtool.keys import load_public_key
from shardtool.manifest import open_receipt

PROMPT_IDS = "5,77,300,12"


def _budget(model: kit.Model) -> str:
    """The least --memory-budget a node of this model runs with (`--readers 1`, as every node here): its shard cache
    holds only top-k + 1 experts, so experts are evicted and read (and verified) again all the time."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import load_plan, node_memory_floor

    verified = load_trusted_manifest(model.full / "manifest.msgpack", [load_public_key(model.work / "a.pub")], 1,
                                     model.work / "budget-state")
    plan = load_plan(model.plan, verified)
    sizes = {e.path: e.size for e in verified.entries}
    k = verified.head.contract["experts_per_token"]
    return str(max(node_memory_floor([sizes[p] for p in n.files()], max(map(len, n.experts.values())), k, readers=1)
                   for n in plan.nodes))


class Nodes:
    """The node processes of one model; started together, each stopped by its own process group."""

    def __init__(self, model: kit.Model, address: str, budget: str):
        self.model, self.address, self.budget = model, address, budget
        self.procs: dict[str, kit.Proc] = {}

    def start(self, *names: str) -> "Nodes":
        for name in names:
            argv = kit.node_argv(self.model, name, self.address, budget=self.budget)
            self.procs[name] = kit.start(argv, self.model.work / f"node-{name}-{time.monotonic_ns()}.log",
                                         self.model.work)
        for name in names:
            self.procs[name].wait_for(rf"node {name} ready", 180)
        return self

    def kill(self, name: str) -> None:
        self.procs.pop(name).stop(signal.SIGKILL)

    def stop_all(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            code = proc.stop()
            assert code == 0, f"node {name} exited {code} on SIGTERM:\n{proc.text()[-2000:]}"
            assert kit.group_members(proc.pgid) == []


@pytest.fixture(scope="module")
def mixtral(head, tmp_path_factory):
    """Mixtral layout, 3 nodes, every expert on 2 of them."""
    model = kit.build_model(tmp_path_factory.mktemp("mixtral"), "mixtral", replicas=2, nodes=("mx-a", "mx-b", "mx-c"))
    nodes = Nodes(model, head.address, _budget(model)).start("mx-a", "mx-b", "mx-c")
    yield model, nodes
    nodes.stop_all()


def _shared(model: kit.Model, a: str, b: str) -> list[Path]:
    """Node a's files of the experts that only a and b hold."""
    from shardtool.keys import load_public_key
    from shardtool.layout import expert_path
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import load_plan

    verified = load_trusted_manifest(model.full / "manifest.msgpack", [load_public_key(model.work / "a.pub")], 1,
                                     model.work / "shared-state")
    plan = load_plan(model.plan, verified)
    pairs = [p for p in plan.node(a).pairs() if set(plan.holders(*p)) == {a, b}]
    assert pairs
    return [model.node_dir(a) / expert_path(*p) for p in pairs]


def _ids(r: subprocess.CompletedProcess) -> list[int]:
    return [int(t) for t in r.stdout.split()]


# ---------------------------------------------------------------------------------------------------- joining


def test_a_node_with_a_tampered_or_missing_planned_shard_refuses_to_join(mixtral, tmp_path):
    model, _ = mixtral
    name = "mx-a"
    node_dir = Path(shutil.copytree(model.node_dir(name), tmp_path / "node"))
    planned = sorted(p.relative_to(node_dir).as_posix() for p in (node_dir / "experts").rglob("*.safetensors"))
    victim = node_dir / planned[len(planned) // 2]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x40
    victim.write_bytes(bytes(data))

    def join() -> subprocess.CompletedProcess:
        argv = kit.node_argv(model, name, "127.0.0.1:1")  # refused before it connects anywhere
        argv[2] = str(node_dir)
        return subprocess.run(argv, capture_output=True, text=True, env=kit.env(model.work), timeout=120,
                              stdin=subprocess.DEVNULL)

    r = join()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert len(lines) == 1 and planned[len(planned) // 2] in lines[0] and "digest-mismatch" in lines[0], r.stderr
    victim.unlink()
    r = join()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and planned[len(planned) // 2] in lines[0], r.stderr
    assert "missing" in lines[0]


def test_a_file_planned_for_another_node_may_be_absent_but_a_foreign_plan_is_refused(mixtral, tmp_path):
    """Present-only: mx-a's directory lacks the experts only other nodes hold, and joins (checked in-process up
    to the join); a plan for other weights is refused (exit 1) before any file is hashed."""
    model, _ = mixtral
    from shardtool.keys import load_private_key, load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import load_plan, prepare_node, sign_plan

    verified = load_trusted_manifest(model.node_dir("mx-a") / "manifest.msgpack",
                                     [load_public_key(model.work / "a.pub")], 1, tmp_path / "state")
    setup = prepare_node(model.node_dir("mx-a"), verified, load_plan(model.plan, verified), "mx-a", budget=1 << 30,
                         key=load_private_key(model.work / "node-mx-a.key", None))
    assert {e.path for e in setup.entries} == set(load_plan(model.plan, verified).node("mx-a").files())
    other = tmp_path / "other.json"  # signed by the operator, for other weights
    other.write_bytes(model.plan.read_bytes().replace(verified.head.merkle_root.hex().encode(), b"0" * 64))
    (tmp_path / "other.json.sig").write_bytes(sign_plan(other.read_bytes(),
                                                        load_private_key(model.work / "op.key", None)))
    argv = kit.node_argv(model, "mx-a", "127.0.0.1:1")
    argv[argv.index("--plan") + 1] = str(other)
    r = subprocess.run(argv, capture_output=True, text=True, env=kit.env(model.work), timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "plan is for" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------------- parity


def test_greedy_sampled_and_receipts_equal_one_process(mixtral, head):
    model, _ = mixtral
    for sampling in (("--seed", "11"), ("--temperature", "0.9", "--seed", "7")):
        runs = kit.receipt_runs(model, head.address, sampling, PROMPT_IDS)
        assert runs["cluster"] == runs["local"] and len(runs["local"][0]) >= 1
    # The receipt a coordinator signed checks out against the whole model, replayed in one process.
    kit.ok("shardtool", "verify-receipt", "cluster.receipt", model.full, "--operator", "op.pub", "--trust", "a.pub",
           "--model-id", model.model_id, "--state-dir", model.work / "state-receipt", cwd=model.work)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_greedy_parity_on_other_layouts_and_a_clean_failure_without_replicas(head, tmp_path, family):
    """Two nodes, one copy of each expert. A node SIGKILLed mid-run: the run fails (exit 3) naming an expert with
    no node left, and what it printed before is a prefix of the true answer (nothing wrong is returned)."""
    model = kit.build_model(tmp_path, family, replicas=1, nodes=(f"{family[:2]}-a", f"{family[:2]}-b"))
    nodes = Nodes(model, head.address, _budget(model)).start(*model.nodes)
    try:
        local = _ids(kit.verify_and_run(model, model.full, "--prompt-ids", PROMPT_IDS, "--print-ids",
                                        "--max-new-tokens", str(LONG)))
        remote = kit.verify_and_run(model, model.coordinator, "--prompt-ids", PROMPT_IDS, "--print-ids",
                                    "--max-new-tokens", "12", cluster=head.address)
        assert _ids(remote) == local[:12]
        code, printed, err = _kill_mid_run(model, head.address, nodes, model.nodes[0])
        assert code == 3, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("verify-and-run: error:") and "no replica left" in last, err
        victim = model.nodes[0]  # the error names the lost node and what it held (all of it, with R = 1)
        assert f"node {victim} was lost (" in last and "; it held layer " in last, err
        assert 1 <= len(printed) < len(local) and local[:len(printed)] == printed
    finally:
        nodes.stop_all()


# ---------------------------------------------------------------------------------------------------- faults


LONG = 64  # new tokens of a run that a node is killed in the middle of


def _kill_mid_run(model: kit.Model, address: str, nodes: Nodes, victim: str) -> tuple[int, list[int], str]:
    """Start a long coordinator run; once its first token is out, SIGKILL node `victim`'s process group. Returns
    the run's exit code, the token ids it printed and its stderr."""
    run = subprocess.Popen(
        [str(kit.BIN / "verify-and-run"), str(model.coordinator), "--trust", str(model.work / "a.pub"), "--state-dir",
         str(model.work / "state-var"), "--model-id", model.model_id, "-q", "--cluster", address, "--plan",
         str(model.plan), "--plan-trust", str(model.work / "op.pub"), "--prompt-ids", PROMPT_IDS, "--print-ids",
         "--max-new-tokens", str(LONG),
         "--remote-timeout", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=kit.env(model.work), cwd=model.work,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        first = run.stdout.read(1)  # unbuffered: one byte, the first token's first digit; the run is under way
        nodes.kill(victim)
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            kit._killpg(run.pid, signal.SIGKILL)
            run.wait()
    return run.returncode, [int(t) for t in (first + out).decode().split()], err.decode()


def test_expert_calls_balance_over_the_replicas_of_a_real_cluster(mixtral, head):
    """R = 2 on 3 nodes, a 64-token greedy run: the run report counts each node's expert calls, and the busiest node
    is asked for at most 1.2 x the mean node's (each expert's rows go to the less loaded of its two holders)."""
    model, _ = mixtral
    local = _ids(kit.verify_and_run(model, model.full, "--prompt-ids", PROMPT_IDS, "--print-ids",
                                    "--max-new-tokens", str(LONG)))
    r = kit.verify_and_run(model, model.coordinator, "--prompt-ids", PROMPT_IDS, "--print-ids", "--max-new-tokens",
                           str(LONG), "--json-report", "balance.json", cluster=head.address)
    assert _ids(r) == local
    cluster = json.loads((model.work / "balance.json").read_text())["cluster"]
    calls = cluster["expert_calls"]
    assert set(calls) == {"mx-a", "mx-b", "mx-c"} and cluster["dropped_nodes"] == {} and cluster["retries"] == 0
    assert cluster["busiest_over_mean"] == round(max(calls.values()) * 3 / sum(calls.values()), 4)
    assert cluster["busiest_over_mean"] <= 1.2, calls


def test_a_shard_tampered_under_a_running_node_is_no_longer_served_and_is_routed_around(mixtral, head):
    """mx-a's shards of the experts it shares with mx-c are changed on disk while it runs; its cache holds only
    top-k + 1 experts, so it reads them again: each fails verification there, is reported, and the coordinator
    asks the replica."""
    model, nodes = mixtral
    assert "mx-a" in nodes.procs
    local = _ids(kit.verify_and_run(model, model.full, "--prompt-ids", PROMPT_IDS, "--print-ids",
                                    "--max-new-tokens", "24"))
    for path in _shared(model, "mx-a", "mx-c"):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
    r = kit.verify_and_run(model, model.coordinator, "--prompt-ids", PROMPT_IDS, "--print-ids", "--max-new-tokens",
                           "24", cluster=head.address)
    assert _ids(r) == local
    assert "cluster: node mx-a stopped serving layer" in r.stderr and "BLAKE3" in r.stderr, r.stderr
    # The next coordinator learns it from the node's info() and does not ask mx-a for those experts again.
    again = kit.verify_and_run(model, model.coordinator, "--prompt-ids", PROMPT_IDS, "--print-ids",
                               "--max-new-tokens", "24", cluster=head.address)
    assert _ids(again) == local


def test_sigkill_of_a_node_mid_run_with_replicas_gives_the_same_tokens(mixtral, head):
    """After the tamper test: mx-a no longer serves the experts it shares with mx-c, and mx-b dies mid-run; every
    expert still has a node that serves it."""
    model, nodes = mixtral
    local = _ids(kit.verify_and_run(model, model.full, "--prompt-ids", PROMPT_IDS, "--print-ids",
                                    "--max-new-tokens", str(LONG)))
    code, printed, err = _kill_mid_run(model, head.address, nodes, "mx-b")
    assert code == 0, err
    assert printed == local and len(local) == LONG
    assert "node mx-b dropped" in err  # -q still says that a node was dropped


def _metrics(url: str) -> dict[str, float]:
    import httpx
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in
            httpx.get(url + "/metrics").text.splitlines() if line.startswith("shardtool_cluster"))}


def test_serve_loses_a_node_mid_request_changing_no_token_and_readmits_it_once_it_is_back(mixtral, head):
    """`serve --cluster`, R = 2: mx-b (back after the test above killed it; it checked its subset before joining)
    is SIGKILLed while a 64-token greedy completion streams: the completion is the local run's text, no error. mx-b
    is started again (it checks its subset again), and the server, which probes the lost node, takes it back and
    asks it for experts again."""
    import httpx

    model, nodes = mixtral
    if "mx-b" not in nodes.procs:  # killed by the test above (run alone, with -k, this test finds mx-b still up)
        nodes.start("mx-b")
    prompt = "The miller said the river"
    expected = kit.verify_and_run(model, model.full, "--prompt", prompt, "--max-new-tokens", str(LONG)).stdout[:-1]
    argv = [str(kit.BIN / "shardtool"), "serve", str(model.coordinator), "--trust", str(model.work / "a.pub"),
            "--state-dir", str(model.work / "state-serve"), "--model-id", model.model_id, "--port", "0",
            "--cluster", head.address, "--plan", str(model.plan), "--plan-trust", str(model.work / "op.pub"),
            "--memory-budget", "256MiB", "--max-context", "128", "--max-batch", "4", "--readers", "1",
            "--remote-timeout", "10"]
    server = kit.start(argv, model.work / f"serve-{time.monotonic_ns()}.log", model.work)
    try:
        url = server.wait_for(r"serving \S+ on (http://127\.0\.0\.1:\d+)", 180).group(1)
        request = {"model": model.model_id, "prompt": prompt, "max_tokens": LONG, "temperature": 0}
        assert _metrics(url)["shardtool_cluster_nodes_dropped"] == 0
        text, after_kill = [], 0
        with httpx.stream("POST", url + "/v1/completions", json={**request, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
                if len(text) == 1:
                    nodes.kill("mx-b")
                else:
                    after_kill += 1
        assert "".join(text) == expected
        assert after_kill >= 8, "the completion ended before mx-b died: nothing was tested"
        lost = _metrics(url)
        assert lost["shardtool_cluster_nodes_dropped"] == 1 and lost["shardtool_cluster_expert_retries_total"] >= 1
        assert "cluster: node mx-b dropped" in server.text()

        nodes.start("mx-b")
        deadline = time.monotonic() + 120  # the server probes a lost node at growing gaps while it serves
        while "cluster: node mx-b readmitted" not in server.text() and time.monotonic() < deadline:
            httpx.post(url + "/v1/completions", json={**request, "max_tokens": 4}, timeout=120).raise_for_status()
            time.sleep(0.5)
        assert "cluster: node mx-b readmitted: it answered as a new process" in server.text(), server.text()[-2000:]
        back = _metrics(url)
        assert back["shardtool_cluster_nodes_dropped"] == 0 and back["shardtool_cluster_nodes_readmitted_total"] == 1
        got = httpx.post(url + "/v1/completions", json=request, timeout=120).json()
        assert got["choices"][0]["text"] == expected
        after = _metrics(url)
        assert after['shardtool_cluster_expert_calls_total{node="mx-b"}'] > back['shardtool_cluster_expert_calls_total{node="mx-b"}']
        assert after["shardtool_cluster_nodes_dropped"] == 0
    finally:
        code = server.stop()
        assert code == 0, server.text()[-2000:]


def test_cluster_options_and_an_unreachable_head_are_one_line_each(mixtral):
    model, _ = mixtral
    r = kit.run("verify-and-run", model.coordinator, "--trust", model.work / "a.pub", "--prompt-ids", "1,2",
                "--cluster", "127.0.0.1:1", cwd=model.work)
    assert r.returncode == 2 and "--cluster and --plan go together" in r.stderr
    closed = kit.free_port()  # nothing listens there: refused before Ray (whose client would retry without end)
    r = kit.verify_and_run(model, model.coordinator, "--prompt-ids", "1,2", cluster=f"127.0.0.1:{closed}", expect=3)
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and "no Ray head answers" in r.stderr, r.stderr
    argv = kit.node_argv(model, "mx-c", f"127.0.0.1:{closed}")
    r = subprocess.run(argv, capture_output=True, text=True, env=kit.env(model.work), timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 3 and "no Ray head answers" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------- --remote


def test_nodes_and_coordinator_fetch_from_a_store_only_what_they_are_asked_for(head, tmp_path):
    """Two nodes started with `--remote STORE --cache-dir D` (nothing on disk but what they fetch) and a coordinator
    started the same way give the local run's tokens; each node's D then holds config.json, the manifest and exactly
    the experts of its share that the run's routing trace selected; the coordinator's D holds no expert."""
    from shardtool.layout import classify, expert_path
    from shardtool.manifest import decode_trace

    model = kit.build_model(tmp_path, "mixtral", replicas=1, nodes=("rm-a", "rm-b"))
    nodes = Nodes(model, head.address, _budget(model))
    for name in model.nodes:
        argv = [str(kit.BIN / "shardtool"), "node", "--remote", str(model.full), "--cache-dir",
                str(tmp_path / f"cache-{name}"), "--trust", str(model.work / "a.pub"), "--state-dir",
                str(model.work / f"state-{name}"), "--plan", str(model.plan), "--name", name, "--memory-budget",
                _budget(model), "--address", head.address, "--readers", "1", "--plan-trust",
                str(model.work / "op.pub"), "--node-key", str(model.work / f"node-{name}.key")]
        nodes.procs[name] = kit.start(argv, model.work / f"node-{name}-remote.log", model.work)
    coordinator_cache = tmp_path / "cache-coordinator"
    try:
        for name in model.nodes:
            nodes.procs[name].wait_for(rf"node {name} ready", 180)
        local = _ids(kit.verify_and_run(model, model.full, "--prompt-ids", PROMPT_IDS, "--print-ids",
                                        "--max-new-tokens", "2"))
        clustered = kit.run("verify-and-run", "--remote", model.full, "--cache-dir", coordinator_cache, "--trust",
                            model.work / "a.pub", "--state-dir", model.work / "state-var", "--model-id", model.model_id,
                            "-q", "--cluster", head.address, "--plan", model.plan, "--plan-trust",
                            model.work / "op.pub", "--prompt-ids", PROMPT_IDS,
                            "--print-ids", "--max-new-tokens", "2", "--receipt-key", "op.key", "--receipt-out", "r",
                            "--trace-out", "t", cwd=model.work)
        assert clustered.returncode == 0, clustered.stderr
        assert _ids(clustered) == local and len(local) == 2
    finally:
        nodes.stop_all()
    receipt, _ = open_receipt((model.work / "r").read_bytes(), [load_public_key(model.work / "op.pub")])
    routes = decode_trace((model.work / "t").read_bytes(), receipt)  # [positions, moe layers, k]
    routed = {expert_path(receipt.moe_layers[j], int(e)) for position in routes for j, picks in enumerate(position)
              for e in picks}
    fetched_experts = set()
    for name in model.nodes:
        cache = tmp_path / f"cache-{name}"
        share = {str(p.relative_to(model.node_dir(name))) for p in model.node_dir(name).rglob("*.safetensors")}
        fetched = {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}
        assert {"config.json", "manifest.msgpack"} <= fetched, fetched
        experts = {p for p in fetched if classify(p)[0] == "expert"}
        assert experts == routed & share, (name, sorted(experts), sorted(routed & share))
        fetched_experts |= experts
    assert fetched_experts == routed
    assert not [p for p in coordinator_cache.rglob("*") if p.is_file() and
                classify(str(p.relative_to(coordinator_cache)))[0] == "expert"]
