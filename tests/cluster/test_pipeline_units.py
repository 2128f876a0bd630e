"""A pipeline plan's coordinator (`RemoteExperts.span`) and its span nodes (`NodeService.run_span`) in one process,
without Ray: node services over a real split, signed model with a pipeline plan, joined by a transport that hands
each call's wire bytes to them. What a hostile or mismatched party can do to a span node's state and memory: a
coordinator whose steps a node cannot hold is refused at start, in one line."""

from __future__ import annotations

import pytest

import _clusterkit as kit
from shardtool.errors import UsageError
from shardtool.keys import load_private_key, load_public_key
from shardtool.manifest import load_trusted_manifest
from shardtool.runtime import NodeService, Session, load_signed_plan, prepare_node

PROMPT = [5, 77, 300, 12]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A split, signed model and its operator-signed pipeline plan over nodes a, b (one layer each), each node's key."""
    made = kit.build_model(tmp_path_factory.mktemp("spans"), "mixtral", replicas=1, nodes=("a", "b"), pipeline=True)
    verified = load_trusted_manifest(made.full / "manifest.msgpack", [load_public_key(made.work / "a.pub")], 1,
                                     made.work / "state")
    return made.work, verified, load_signed_plan(made.plan, verified, [load_public_key(made.work / "op.pub")])


def _services(model, **limits) -> dict[str, NodeService]:
    work, verified, plan = model
    return {n.name: NodeService(prepare_node(work / "full", verified, plan, n.name, budget=1 << 30,
                                             key=load_private_key(work / f"node-{n.name}.key", None), **limits))
            for n in plan.nodes}


def _remote(model, services):
    _, _, plan = model
    transport = kit.Direct(services, {name: s._key for name, s in services.items()})
    remote = kit.remote_experts(plan, transport, timeout=5, spans=plan.spans())
    remote.connect()
    return remote, transport


def _generate(model, remote, new: int = 8) -> list[int]:
    work, verified, _ = model
    session = Session(work / "full", verified, budget=1 << 30, max_tokens=len(PROMPT) + new, remote=remote)
    try:
        out: list[int] = []
        session.generate(PROMPT, new, temperature=0.0, top_p=1.0, seed=None, on_token=out.append)
        return out
    finally:
        session.close()


def test_span_nodes_in_sessions_give_the_local_tokens(model):
    remote, transport = _remote(model, _services(model))
    assert _generate(model, remote) == _generate(model, None)
    assert {node for node, *_ in transport.calls} == {"a", "b"}


def test_a_coordinator_whose_sequences_a_span_node_cannot_hold_is_refused_at_start_in_one_line(model):
    remote, transport = _remote(model, _services(model, max_context=8))
    with pytest.raises(UsageError, match="node a runs sequences of at most 8 tokens .its --max-context., this "
                                         "coordinator's may reach 12") as e:
        _generate(model, remote, new=8)  # 4 + 8 tokens
    assert "\n" not in e.value.one_line()
    assert transport.calls == []  # refused before a step: the node is not lost for a call it would refuse
    assert _generate(model, remote, new=4) == _generate(model, None, new=4)


def test_a_coordinator_batching_more_sequences_than_a_span_node_keeps_is_refused_at_start(model):
    work, verified, _ = model
    from shardtool.runtime import Engine
    remote, _ = _remote(model, _services(model, max_sequences=2))
    with pytest.raises(UsageError, match="node a keeps 2 sequences .its --max-sequences., this coordinator steps "
                                         "up to 3 at once"):
        Engine(work / "full", verified, budget=1 << 30, max_batch=3, max_context=64, remote=remote)
    Engine(work / "full", verified, budget=1 << 30, max_batch=2, max_context=64, remote=remote).close()
