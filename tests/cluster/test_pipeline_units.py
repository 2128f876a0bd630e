"""A pipeline plan's coordinator (`RemoteExperts.span`) and its span nodes (`NodeService.run_span`) in one process,
without Ray: node services over a real split, signed model with a pipeline plan, joined by a transport that hands
each call's wire bytes to them. What a hostile or mismatched party can do to a span node's state and memory: a
coordinator whose steps a node cannot hold is refused at start, in one line."""

from __future__ import annotations

import numpy as np
import pytest

import _clusterkit as kit
from shardtool.errors import UsageError
from shardtool.keys import load_private_key, load_public_key
from shardtool.manifest import load_trusted_manifest
from shardtool.runtime import NodeService, Session, load_signed_plan, prepare_node
from shardtool.runtime.engine._cluster_session import mac
from shardtool.runtime.engine._cluster_wire import SPAN_CALL_TYPE, decode_any_call, encode_span_call, pack

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


def _rows(services, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, services["a"].config.hidden_size)).astype(np.float32)


def _next_step_after(model, between) -> np.ndarray:
    """Node a's answer to sequence 0's fifth row after its first four, with `between(services, remote, transport)`
    done in between (by someone on the wire)."""
    services = _services(model)
    remote, transport = _remote(model, services)
    remote.span("a", (0, 1), _rows(services, 4, 0), [(0, 0, 4)], [], False)
    between(services, remote, transport)
    y, _ = remote.span("a", (0, 1), _rows(services, 1, 1), [(0, 4, 1)], [], False)
    return y


def _forge(services, remote, _):
    """A call naming the coordinator's session (its id crosses the wire) rewriting position 3, without its key."""
    forged = encode_span_call((0, 1), np.full_like(_rows(services, 1, 2), 7.0), [(0, 3, 1)], [], False, "1" * 32, 99,
                              (remote._sessions["a"][0], bytes(32)))
    with pytest.raises(UsageError, match="the span call is not authenticated by session [0-9a-f]{32}'s key"):
        services["a"].run_span(*decode_any_call(forged)[1])


def _replay(services, remote, transport):
    """The first call's bytes sent again: they would rewrite the keys of positions 0..3 and roll the sequence back."""
    first = next(call for node, call in transport.calls if node == "a")
    with pytest.raises(UsageError, match="call 1 of session [0-9a-f]{32} comes after call 1: a replayed"):
        services["a"].run_span(*decode_any_call(first)[1])


@pytest.mark.parametrize("attack", [_forge, _replay], ids=["forged", "replayed"])
def test_a_span_call_forged_or_replayed_on_the_wire_is_refused_and_changes_no_later_answer(model, attack):
    assert np.array_equal(_next_step_after(model, attack), _next_step_after(model, lambda *_: None))


def test_a_replayed_call_after_a_rolled_back_step_cannot_put_its_keys_back(model):
    """Row A at position 4 ran here but the step failed further on; the coordinator sent row B at 4 instead. The
    call with A, replayed, would leave A's keys at 4 under a length the coordinator's next call accepts."""
    services = _services(model)
    remote, transport = _remote(model, services)
    remote.span("a", (0, 1), _rows(services, 4, 0), [(0, 0, 4)], [], False)
    remote.span("a", (0, 1), _rows(services, 1, 5), [(0, 4, 1)], [], False)  # A
    with_a = transport.calls[-1][1]
    remote.span("a", (0, 1), _rows(services, 1, 6), [(0, 4, 1)], [], False)  # B, after the rollback
    with pytest.raises(UsageError, match="a replayed or reordered call"):
        services["a"].run_span(*decode_any_call(with_a)[1])
    assert services["a"].spans._length(remote._sessions["a"][0], 0) == 5


def test_a_span_call_of_the_wrong_form_is_refused_in_one_line(model):
    services = _services(model)
    remote, _ = _remote(model, services)
    sid, key = remote._sessions["a"]
    cases = [(pack({"session": sid, "span_call": "text", "mac": b""}), "carry its call and its MAC as bytes"),
             (pack({"session": "x", "span_call": b"", "mac": b""}), "session must be 32 lowercase hex"),
             (pack({"session": sid, "span_call": b"\x80", "mac": mac(key, SPAN_CALL_TYPE, b"\x80")}),
              "a span call must have exactly the keys")]
    for call, message in cases:
        with pytest.raises(UsageError, match=message):
            services["a"].run_span(*decode_any_call(call)[1])
    number_zero = encode_span_call((0, 1), _rows(services, 1, 0), [(0, 0, 1)], [], False, "1" * 32, 0, (sid, key))
    with pytest.raises(UsageError, match="a call's number must be an integer in"):
        services["a"].run_span(*decode_any_call(number_zero)[1])


def _routes(change):
    def edit(doc):
        doc["routes"] = change(doc["routes"])
        return doc
    return edit


BAD_ROUTES = [
    ("a float id", _routes(lambda r: [[[row[0] + 0.5, *row[1:]] for row in r[0]]])),
    ("a bool id", _routes(lambda r: [[[True, *row[1:]] for row in r[0]]])),
    ("a string id", _routes(lambda r: [[[str(row[0]), *row[1:]] for row in r[0]]])),
    ("an id outside the layer", _routes(lambda r: [[[10 ** 6, *row[1:]] for row in r[0]]])),
    ("ragged rows", _routes(lambda r: [[r[0][0], r[0][1][:1], *r[0][2:]]])),
    ("a row too few", _routes(lambda r: [r[0][:-1]])),
    ("a layer too many", _routes(lambda r: r + r)),
    ("no routes", _routes(lambda r: None)),
]


@pytest.mark.parametrize("name,edit", BAD_ROUTES, ids=[b[0] for b in BAD_ROUTES])
def test_a_span_reply_whose_authenticated_routes_are_malformed_drops_the_node(model, name, edit):
    from shardtool.errors import UnavailableError
    services = _services(model)
    remote, transport = _remote(model, services)
    transport.edit["a"] = edit  # node a's own session key MACs the edited body
    with pytest.raises(UnavailableError, match="node a, which runs them .* was lost .*routes"):
        remote.span("a", (0, 1), _rows(services, 3, 0), [(0, 0, 3)], [], True)


def test_a_span_node_readmitted_again_and_again_leaves_no_call_counter_behind(model):
    """Each readmission is a new session with its own call numbers; the lost session's counter goes with it."""
    from shardtool.errors import UnavailableError
    services = _services(model)
    remote, transport = _remote(model, services)
    remote.probe_seconds = 0.0
    for restart in range(4):
        remote.span("a", (0, 1), _rows(services, 1, 0), [(restart, 0, 1)], [], False)
        services["a"] = _services(model)["a"]  # a new process under the same name: the session is not its
        transport.keys["a"] = services["a"]._key
        with pytest.raises(UnavailableError, match="node a, which runs them .* was lost"):
            remote.span("a", (0, 1), _rows(services, 1, 0), [(restart, 1, 1)], [], False)
    remote.span("a", (0, 1), _rows(services, 1, 0), [(9, 0, 1)], [], False)  # readmitted by the call's probe
    assert remote.stats.readmitted == 4
    assert set(remote._call_numbers) <= {sid for sid, _ in remote._sessions.values()}


def _scored(engine, prompt, new: int) -> list:
    """A completion with echo and logprobs, as serve submits it: the prompt's scores, then each token's."""
    from shardtool.runtime.engine._engine import ErrorEvent
    from shardtool.runtime.engine._sampling import SamplingParams
    events: list = []
    engine.submit(prompt, SamplingParams(max_new_tokens=new, temperature=0.0, top_p=1.0, seed=1), events.append,
                  logprobs=3, score_prompt=True)
    while engine._running:
        engine.step()
    assert not any(isinstance(e, ErrorEvent) for e in events), events
    return [repr(e) for e in events]


def test_prompt_scores_and_logprobs_through_span_nodes_equal_one_process(model):
    """Every prompt row's logits ("all"), computed by the coordinator's head on the last node's hidden states."""
    from shardtool.runtime import Engine
    work, verified, _ = model
    remote, _ = _remote(model, _services(model))
    engines = [Engine(work / "full", verified, budget=1 << 30, max_batch=2, max_context=64, remote=r)
               for r in (None, remote)]
    try:
        for prompt, new in ((PROMPT + [9, 8], 4), ([1, 2, 3], 0)):
            assert _scored(engines[1], prompt, new) == _scored(engines[0], prompt, new)
    finally:
        for engine in engines:
            engine.close()
