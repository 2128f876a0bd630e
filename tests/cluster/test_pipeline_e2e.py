"""A pipeline plan on the real parts: a Ray head on 127.0.0.1, two `shardtool node`s each running a span of whole
layers (`shardtool plan --pipeline`), `verify-and-run --cluster` and `serve --cluster` as the coordinator. Greedy and
sampled tokens and the run receipt equal one process's bit for bit; concurrent requests through the official
`openai` client get verify-and-run's text; a node lost mid-run fails the run cleanly (exit 3, HTTP 503) naming the
node and the layers it ran, and nothing wrong is printed."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time

import openai
import pytest

import _clusterkit as kit

PROMPT_IDS = "5,77,300,12"
NODES = ("pp-a", "pp-b")
SERVE_FLAGS = ("--memory-budget", "256MiB", "--max-context", "128", "--max-batch", "4", "--readers", "1",
               "--remote-timeout", "10")


@pytest.fixture(scope="module")
def pipeline(head, tmp_path_factory):
    """DeepSeek-V3 layout (MLA, a dense first layer, a shared expert), its layers cut into 2 spans."""
    model = kit.build_model(tmp_path_factory.mktemp("pipeline"), "deepseek_v3", replicas=1, nodes=NODES, layers=3,
                            pipeline=True)
    procs = {name: kit.start(kit.node_argv(model, name, head.address, budget="256MiB"),
                             model.work / f"node-{name}-{time.monotonic_ns()}.log", model.work) for name in NODES}
    try:
        for name, proc in procs.items():
            proc.wait_for(rf"node {name} ready", 180)
        yield model, procs
    finally:
        for proc in procs.values():
            proc.stop()
            assert kit.group_members(proc.pgid) == []


def _ids(r: subprocess.CompletedProcess) -> list[int]:
    return [int(t) for t in r.stdout.split()]


def test_the_plan_gives_each_node_whole_layers_and_the_node_holds_only_those(pipeline):
    model, _ = pipeline
    held = {name: sorted(p.relative_to(model.node_dir(name)).as_posix() for p in model.node_dir(name).rglob("*.safetensors"))
            for name in NODES}
    layers = [sorted({path.split("/")[1] for path in paths if path.startswith("trunk/")}) for paths in held.values()]
    # the decoder's 3 layers; the stored multi-token-prediction layer 3 stays with the coordinator
    assert sorted(sum(layers, [])) == ["layer-000.safetensors", "layer-001.safetensors", "layer-002.safetensors"]
    assert (model.coordinator / "trunk" / "layer-003.safetensors").exists()
    assert all(layers) and not set(layers[0]) & set(layers[1])


def test_pipeline_tokens_and_receipts_equal_one_process(pipeline, head):
    model, _ = pipeline
    for sampling in (("--seed", "11"), ("--temperature", "0.9", "--seed", "7")):
        runs = kit.receipt_runs(model, head.address, sampling, PROMPT_IDS)
        assert runs["cluster"] == runs["local"] and len(runs["local"][0]) >= 1
    kit.ok("shardtool", "verify-receipt", "cluster.receipt", model.full, "--operator", "op.pub", "--trust", "a.pub",
           "--model-id", model.model_id, "--state-dir", model.work / "state-receipt", cwd=model.work)


def test_serve_pipeline_answers_concurrent_clients_as_verify_and_run(pipeline, head):
    model, _ = pipeline
    argv = [str(kit.BIN / "shardtool"), "serve", str(model.coordinator), "--trust", str(model.work / "a.pub"),
            "--state-dir", str(model.work / "state-serve"), "--model-id", model.model_id, "--port", "0",
            "--cluster", head.address, "--plan", str(model.plan), "--plan-trust", str(model.work / "op.pub"),
            *SERVE_FLAGS]
    server = kit.start(argv, model.work / f"serve-{time.monotonic_ns()}.log", model.work)
    try:
        url = server.wait_for(r"serving \S+ on (http://127\.0\.0\.1:\d+)", 180).group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [("Hi", 12), ("The miller said the river", 16), ("Once", 20), ("A cat", 8), ("Hi", 12)]
        expected = [kit.verify_and_run(model, model.full, "--prompt", p, "--max-new-tokens", str(n)).stdout[:-1]
                    for p, n in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # batched steps: several sequences a call
            got = list(pool.map(lambda pn: client.completions.create(
                model=model.model_id, prompt=pn[0], max_tokens=pn[1], temperature=0).choices[0].text, prompts))
        # (verify-and-run's stdout is read as text: universal newlines turn a generated "\r" into "\n")
        assert [text.replace("\r\n", "\n").replace("\r", "\n") for text in got] == expected
    finally:
        code = server.stop()
        assert code == 0, server.text()[-2000:]


def test_a_pipeline_node_killed_mid_run_fails_the_run_naming_it_and_its_layers(head, tmp_path):
    model = kit.build_model(tmp_path, "mixtral", replicas=1, nodes=("pk-a", "pk-b"), layers=2, pipeline=True)
    procs = {name: kit.start(kit.node_argv(model, name, head.address, budget="256MiB"),
                             model.work / f"node-{name}.log", model.work) for name in model.nodes}
    try:
        for name, proc in procs.items():
            proc.wait_for(rf"node {name} ready", 180)
        local = _ids(kit.verify_and_run(model, model.full, "--prompt-ids", PROMPT_IDS, "--print-ids",
                                        "--max-new-tokens", "64"))
        run = subprocess.Popen(
            [str(kit.BIN / "verify-and-run"), str(model.coordinator), "--trust", str(model.work / "a.pub"),
             "--state-dir", str(model.work / "state-var"), "--model-id", model.model_id, "-q", "--cluster",
             head.address, "--plan", str(model.plan), "--plan-trust", str(model.work / "op.pub"), "--prompt-ids",
             PROMPT_IDS, "--print-ids", "--max-new-tokens", "64", "--remote-timeout", "10"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=kit.env(model.work), cwd=model.work,
            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            first = run.stdout.read(1)  # the run is under way
            procs["pk-b"].stop(signal.SIGKILL)
            out, err = run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                kit._killpg(run.pid, signal.SIGKILL)
                run.wait()
        printed = [int(t) for t in (first + out).decode().split()]
        last = err.decode().strip().splitlines()[-1]
        assert run.returncode == 3, err.decode()
        assert last.startswith("verify-and-run: error:") and "no node left: node pk-b" in last, last
        assert "layer 1" in last or "layers 1" in last, last
        assert 1 <= len(printed) < len(local) and local[:len(printed)] == printed
    finally:
        for proc in procs.values():
            if proc.proc.poll() is None:
                proc.stop()
