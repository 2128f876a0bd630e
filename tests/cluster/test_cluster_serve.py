"""`shardtool serve --cluster`: the coordinator behind the OpenAI-style API, driven by the official `openai` client.
Same text as single-process verify-and-run; with a node gone and no replica, HTTP 503 with a JSON error body that
names the lost node and the experts it held."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

import _clusterkit as kit

SERVE_FLAGS = ("--memory-budget", "256MiB", "--max-context", "128", "--max-batch", "4", "--readers", "1",
               "--remote-timeout", "10")


@pytest.fixture(scope="module")
def served(head, tmp_path_factory):
    model = kit.build_model(tmp_path_factory.mktemp("serve"), "mixtral", replicas=1, nodes=("sv-a", "sv-b"))
    nodes = {name: kit.start(kit.node_argv(model, name, head.address), model.work / f"node-{name}.log", model.work)
             for name in model.nodes}
    server = None
    try:
        for name, proc in nodes.items():
            proc.wait_for(rf"node {name} ready", 180)
        argv = [str(kit.BIN / "shardtool"), "serve", str(model.coordinator), "--trust", str(model.work / "a.pub"),
                "--state-dir", str(model.work / "state-serve"), "--model-id", model.model_id, "--port", "0",
                "--cluster", head.address, "--plan", str(model.plan), "--plan-trust", str(model.work / "op.pub"),
                *SERVE_FLAGS]
        server = kit.start(argv, model.work / f"serve-{time.monotonic_ns()}.log", model.work)
        url = server.wait_for(r"serving \S+ on (http://127\.0\.0\.1:\d+)", 180).group(1)
        yield model, nodes, url
    finally:
        if server is not None:
            code = server.stop()
            assert code == 0, server.text()[-2000:]
            assert kit.group_members(server.pgid) == []
        for proc in nodes.values():
            proc.stop()
            assert kit.group_members(proc.pgid) == []


def test_completions_equal_verify_and_run_and_a_lost_node_is_a_503(served):
    model, nodes, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt, new in (("Hi", 16), ("The miller said the river", 24)):
        expected = kit.verify_and_run(model, model.full, "--prompt", prompt, "--max-new-tokens", str(new)).stdout[:-1]
        got = client.completions.create(model=model.model_id, prompt=prompt, max_tokens=new, temperature=0)
        assert got.choices[0].text == expected
    streamed = client.completions.create(model=model.model_id, prompt="Hi", max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == client.completions.create(
        model=model.model_id, prompt="Hi", max_tokens=16, temperature=0).choices[0].text

    metrics = dict(line.split(" ", 1) for line in httpx.get(url + "/metrics").text.splitlines()
                   if line.startswith("shardtool_cluster"))
    assert float(metrics["shardtool_cluster_wire_bytes_total"]) > 0
    assert float(metrics["shardtool_cluster_node_calls_total"]) > 0 and float(metrics["shardtool_cluster_nodes_dropped"]) == 0

    nodes["sv-b"].stop(signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model.model_id, prompt="The miller said the river", max_tokens=24,
                                  temperature=0)
    assert info.value.status_code == 503
    body = httpx.post(url + "/v1/completions", json={"model": model.model_id, "prompt": "Hi", "max_tokens": 8,
                                                     "temperature": 0}, timeout=120)
    message = body.json()["error"]["message"]
    assert body.status_code == 503 and "no replica left" in message
    assert "node sv-b was lost (" in message and "; it held layer " in message, message  # the node and its experts
    assert httpx.get(url + "/health").json() == {"status": "ok"}  # the server itself stays up
    assert "shardtool_cluster_nodes_dropped 1.0" in httpx.get(url + "/metrics").text
