"""The coordinator's RemoteExperts and the node's NodeService in one process, without Ray: node services over a
real split, signed model, joined by a transport that calls them directly (or fails as told). Parity with the
local forward pass, the refusals of wrong replies (another root, another name, a wrong shape), the retries on a
replica, the node's checks of every argument, and a shard tampered under a node."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardtool.errors import UnavailableError, UsageError
import _clusterkit as kit
from shardtool.keys import load_private_key, load_public_key
from shardtool.layout import expert_path
from shardtool.manifest import load_trusted_manifest, pae
from shardtool.runtime import (Engine, ErrorEvent, NodeService, SamplingParams, Session, load_signed_plan,
                               prepare_node)
from shardtool.runtime.engine._cluster import NodeFailed, choose_replica, plan_placement
from shardtool.runtime.engine._cluster_node import REPLY_TYPE

PROMPT = [5, 77, 300, 12]
NONCE = "0" * 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A split, signed model and its operator-signed plan over nodes a, b, c (every expert on 2), each node's key."""
    made = kit.build_model(tmp_path_factory.mktemp("units"), "mixtral", replicas=2, nodes=("a", "b", "c"))
    verified = load_trusted_manifest(made.full / "manifest.msgpack", [load_public_key(made.work / "a.pub")], 1,
                                     made.work / "state")
    return made.work, verified, load_signed_plan(made.plan, verified, [load_public_key(made.work / "op.pub")])


def _keys(model) -> dict:
    work, _, plan = model
    return {n.name: load_private_key(work / f"node-{n.name}.key", None) for n in plan.nodes}


def _services(model, directory: Path | None = None) -> dict[str, NodeService]:
    work, verified, plan = model
    keys = _keys(model)
    return {n.name: NodeService(prepare_node(directory or work / "full", verified, plan, n.name, budget=1 << 30,
                                             key=keys[n.name])) for n in plan.nodes}


def Direct(services: dict) -> kit.Direct:
    return kit.Direct(services, {name: s._key for name, s in services.items()})


def _remote(model, transport):
    _, verified, plan = model
    remote = kit.remote_experts(plan, transport, timeout=5)
    remote.connect()
    return remote


def _generate(model, remote=None, new: int = 12, **sampling) -> list[int]:
    work, verified, _ = model
    session = Session(work / "full", verified, budget=1 << 30, max_tokens=len(PROMPT) + new, remote=remote)
    try:
        out: list[int] = []
        session.generate(PROMPT, new, temperature=sampling.get("temperature", 0.0), top_p=1.0,
                         seed=sampling.get("seed"), on_token=out.append)
        return out
    finally:
        session.close()


def test_remote_experts_give_the_local_tokens_greedy_and_sampled(model):
    transport = Direct(_services(model))
    remote = _remote(model, transport)
    assert _generate(model, remote) == _generate(model)
    assert _generate(model, remote, temperature=0.9, seed=3) == _generate(model, temperature=0.9, seed=3)
    assert {node for node, _, _ in transport.calls} == {"a", "b", "c"}  # experts spread over their replicas
    assert remote.stats.calls == len(transport.calls) and remote.stats.wire_bytes > 0 and not remote.stats.dropped


def test_a_node_answering_for_another_root_or_name_is_refused_and_its_replica_serves(model):
    for forge, why in ((lambda r: {**r, "root": "00" * 32}, "manifest root"),
                       (lambda r: {**r, "name": "b"}, "as node")):
        transport = Direct(_services(model))
        logged = []
        remote = _remote(model, transport)
        remote._log = logged.append
        transport.edit["a"] = forge  # a's info() passed at connect; its replies now lie
        assert _generate(model, remote) == _generate(model)
        assert "a" in remote.stats.dropped and why in remote.stats.dropped["a"]
        assert any("node a dropped" in line for line in logged)
    transport = Direct(_services(model))
    transport.edit["a"] = lambda r: {**r, "root": "11" * 32}
    _, verified, plan = model
    remote = kit.remote_experts(plan, transport)
    remote.connect()  # refused at connect already: R = 2 leaves every expert a node
    assert "refused" in remote.stats.dropped["a"]
    assert _generate(model, remote) == _generate(model)
    assert all(node != "a" for node, _, _ in transport.calls)


class _Sly(np.ndarray):
    """An array whose arithmetic lies: a reply must carry plain ndarrays."""

    def __mul__(self, other):
        return np.full(self.shape, 1234.0, np.float32)


@pytest.mark.parametrize("forge", [
    lambda r: {**r, "outputs": {e: y[:, :-1] for e, y in r["outputs"].items()}},
    lambda r: {**r, "outputs": {e: y.astype(np.float64) for e, y in r["outputs"].items()}},
    lambda r: {**r, "outputs": {}},
    lambda r: [r],
    lambda r: {**r, "outputs": {e: np.full_like(y, np.nan) for e, y in r["outputs"].items()}},
    lambda r: {**r, "outputs": {e: y.view(_Sly) for e, y in r["outputs"].items()}},
    lambda r: {**r, "layer": r["layer"] + 1},
], ids=["shape", "dtype", "missing", "not-a-dict", "not-finite", "ndarray-subclass", "other-layer"])
def test_a_malformed_reply_drops_the_node(model, forge):
    transport = Direct(_services(model))
    remote = _remote(model, transport)
    transport.edit["b"] = forge
    assert _generate(model, remote) == _generate(model)
    assert "b" in remote.stats.dropped


def test_with_no_replica_left_only_the_requests_that_chose_its_experts_fail_with_503(model):
    transport = Direct(_services(model))
    remote = _remote(model, transport)
    work, verified, plan = model
    transport.down |= {"a", "b"}  # every expert a and b both hold has no node left
    lost = {p for p in plan_placement(plan) if set(plan.holders(*p)) == {"a", "b"}}
    assert lost
    engine = Engine(work / "full", verified, budget=1 << 30, max_batch=4, max_context=64, remote=remote)
    events: dict[int, list] = {}
    try:
        for i, prompt in enumerate(([5, 77, 300, 12], [9], [100, 3], [42, 42, 42])):
            engine.submit(prompt, SamplingParams(4), lambda ev, i=i: events.setdefault(i, []).append(ev))
        while any(not t.done for t in list(engine._running)):
            engine.step()
    finally:
        engine.close()
    errors = [evs[-1] for evs in events.values() if isinstance(evs[-1], ErrorEvent)]
    assert len(events) == 4 and errors
    assert all(e.status == 503 and isinstance(e.error, UnavailableError) for e in errors)
    assert all("no replica left" in e.message for e in errors)
    # Every request either failed so, or finished with the tokens a local run gives it.
    for i, prompt in enumerate(([5, 77, 300, 12], [9], [100, 3], [42, 42, 42])):
        if not isinstance(events[i][-1], ErrorEvent):
            alone = Engine(work / "full", verified, budget=1 << 30, max_batch=1, max_context=64)
            try:
                tokens = []
                alone.run_one(prompt, SamplingParams(4), tokens.append)
            finally:
                alone.close()
            assert [ev.token for ev in events[i] if hasattr(ev, "token")] == tokens
    # Each error names a lost node and the experts it held (what an operator must bring back).
    held = {n: [e for (lay, e) in plan_placement(plan) if lay == 0 and n in plan.holders(0, e)] for n in "ab"}
    assert all(any(f"node {n} was lost (ActorDiedError" in e.message
                   and f"it held layer 0 experts {', '.join(map(str, held[n]))}; layer 1 experts" in e.message
                   for n in "ab") for e in errors), errors[0].message
    transport.down |= {"c"}
    with pytest.raises(UnavailableError, match="no replica left"):  # one run alone: its own error, exit 3
        _generate(model, remote)


def test_connect_refuses_when_a_planned_expert_has_no_node(model):
    transport = Direct(_services(model))
    transport.down |= {"b", "c"}
    _, verified, plan = model
    remote = kit.remote_experts(plan, transport)
    with pytest.raises(UnavailableError, match="no live node holds layer"):
        remote.connect()


# ---------------------------------------------------------------------------------------------------- the node


NEW_SESSION = object()  # `_call`'s default: a session made for the call


def _call(service: NodeService, layer=0, ids=None, x=None, rows=None, session=NEW_SESSION):
    held = sorted(e for (lay, e) in service.held if lay == layer)
    ids = held[:2] if ids is None else ids
    x = np.ones((3, service.config.hidden_size), np.float32) if x is None else x
    rows = {e: np.array([0, 2], np.int64) for e in ids} if rows is None else rows
    return service.run(layer, ids, x, rows, NONCE, kit.session(service)[0] if session is NEW_SESSION else session)


@pytest.mark.parametrize("forge", [
    lambda r: {**r, "failed": {"a/b": "x"}},
    lambda r: {**r, "failed": {5: "x"}},
    lambda r: {**r, "failed": ["0/1"]},
    lambda r: {**r, "experts": 7},
    lambda r: {**r, "experts": [[[0, 1]]]},
    lambda r: {**r, "experts": [[0, True]] + r["experts"]},
    lambda r: {k: v for k, v in r.items() if k != "boot"},
    lambda r: {**r, "boot": r["boot"].upper()},
    lambda r: {**r, "boot": 7},
    lambda r: {k: v for k, v in r.items() if k != "session"},
    lambda r: {**r, "session": r["session"]["node"]},
    lambda r: {**r, "session": {**r["session"], "node": r["session"]["node"][:62]}},
    lambda r: {**r, "session": {**r["session"], "node": r["session"]["node"].upper()}},
    lambda r: {**r, "session": {**r["session"], "extra": r["session"]["node"]}},
    lambda r: {**r, "session": {**r["session"], "node": "00" * 32}},
], ids=["failed-key", "failed-int-key", "failed-list", "experts-int", "experts-nested", "experts-bool", "boot-missing",
        "boot-upper", "boot-int", "session-missing", "session-not-a-map", "session-node-short", "session-node-upper",
        "session-extra-key", "session-node-low-order"])
def test_a_malformed_info_drops_the_node_at_connect_and_its_replicas_serve(model, forge):
    """A node's info() is untrusted: a malformed one is that node failing (one line), never a crash of the
    coordinator."""
    transport = Direct(_services(model))
    transport.edit["a"] = forge
    _, verified, plan = model
    remote = kit.remote_experts(plan, transport)
    remote.connect()
    assert "a" in remote.stats.dropped and "refused" in remote.stats.dropped["a"]
    assert _generate(model, remote) == _generate(model)


@pytest.mark.parametrize("session", [
    "ab" * 31,  # 31 bytes
    "ab" * 33,
    "AB" * 32,  # upper case
    "g" * 64,
    bytes(32),  # raw bytes, not hex
    7,
    "",
    "ab" * 100_000,
], ids=["short", "long", "upper-case", "not-hex", "raw-bytes", "int", "empty", "huge"])
def test_a_node_refuses_an_info_session_key_of_the_wrong_form(model, session):
    service = _services(model)["a"]
    with pytest.raises(UsageError, match="info\\(\\)'s session must be an X25519 public key of 64 lowercase hex") as info:
        service.info(NONCE, session)
    assert len(str(info.value)) < 200 and len(service.sessions) == 0


_P = 2**255 - 19
_SMALL_ORDER = (0, 1, _P - 1, 325606250916557431795983626356110631294008115727848805560023387167927233504,
                39382357235489614581723060781553021112529911719440698176882885853963445705823)
# Every encoding of a point of order 1, 2, 4 or 8: canonical, + p where that still fits 255 bits, and each with the
# top bit set (X25519 ignores it).
LOW_ORDER = sorted({u | top for v in _SMALL_ORDER for u in (v, v + _P) if u < 2**255 for top in (0, 2**255)})


@pytest.mark.parametrize("u", LOW_ORDER, ids=[f"{u:064x}"[:8] + "..." + f"{u:064x}"[-4:] for u in LOW_ORDER])
def test_a_node_refuses_an_info_session_key_of_low_order(model, u):
    """A key of low order, in any of its encodings: the shared secret would be all zero, known to anyone."""
    service = _services(model)["a"]
    with pytest.raises(UsageError, match="low order"):
        service.info(NONCE, u.to_bytes(32, "little").hex())
    assert len(service.sessions) == 0


def test_a_node_info_without_a_session_makes_none_and_one_with_signs_both_keys(model):
    """`shardtool node`'s own health checks ask info() without a session: still answered, no session kept."""
    from shardtool.runtime.engine._cluster_node import INFO_TYPE
    service = _services(model)["a"]
    plain = service.info(NONCE)
    assert "session" not in json.loads(plain["body"]) and len(service.sessions) == 0
    sid, key = kit.session(service)
    answer = service.info(NONCE, "11" * 32)
    _keys(model)["a"].public.verify(answer["signature"], pae(INFO_TYPE, answer["body"]))
    assert json.loads(answer["body"])["session"]["coordinator"] == "11" * 32
    assert len(service.sessions) == 2 and service.sessions.key(sid) == key  # both sides derived the same key


@pytest.mark.parametrize("session, error", [
    ("f" * 32, "is not one of this node process's"),  # unknown: another process's, or evicted
    ("F" * 32, "session must be 32 lowercase hex digits"),
    ("f" * 64, "session must be 32 lowercase hex digits"),
    (None, "session must be 32 lowercase hex digits"),
    (b"f" * 32, "session must be 32 lowercase hex digits"),
], ids=["unknown", "upper-case", "long", "none", "bytes"])
def test_a_node_refuses_a_run_in_a_session_it_does_not_hold(model, session, error):
    service = _services(model)["a"]
    kit.session(service)
    with pytest.raises(UsageError, match=error):
        _call(service, session=session)
    assert service.calls == 0


def test_a_nodes_session_table_is_bounded_and_evicts_the_least_recently_used():
    from shardtool.runtime.engine._cluster_session import SessionTable
    table = SessionTable(cap=3)
    for i in range(3):
        table.add(f"{i:032x}", bytes([i]) * 32)
    assert table.key(f"{0:032x}") == bytes(32)  # 0 used: 1 is now the least recently used
    table.add(f"{3:032x}", b"3" * 32)
    assert len(table) == 3
    with pytest.raises(UsageError, match="is not one of this node process's"):
        table.key(f"{1:032x}")
    assert [table.key(f"{i:032x}")[:1] for i in (0, 2, 3)] == [b"\0", b"\2", b"3"]


def test_a_node_service_keeps_at_most_max_sessions(model):
    from shardtool.runtime.engine._cluster_session import MAX_SESSIONS, Handshake
    service = _services(model)["a"]
    first, _ = kit.session(service)
    for _ in range(MAX_SESSIONS):
        service.info(NONCE, Handshake().public)
    assert len(service.sessions) == MAX_SESSIONS
    with pytest.raises(UsageError, match="is not one of this node process's"):
        _call(service, session=first)


def test_only_info_and_run_are_reachable_on_a_node_actor(model):
    from shardtool.runtime.engine._cluster_node import NodeActor
    assert {name for name in vars(NodeActor) if not name.startswith("_")} == {"info", "run", "graph_run"}


def test_the_node_checks_every_argument_from_the_wire(model):
    service = _services(model)["a"]
    h = service.config.hidden_size
    not_held = next(e for e in range(service.config.num_experts) if (0, e) not in service.held)
    e0 = sorted(e for (lay, e) in service.held if lay == 0)[0]
    bad = [dict(layer=99), dict(layer=True), dict(layer="0"), dict(ids=[not_held]), dict(ids=[e0, e0]), dict(ids=[]),
           dict(ids=[e0], x=np.ones((3, h), np.float64)), dict(ids=[e0], x=np.ones((3, h + 1), np.float32)),
           dict(ids=[e0], x=np.ones((0, h), np.float32)), dict(ids=[e0], x=[[1.0] * h]),
           dict(ids=[e0], rows={e0: np.array([0, 3], np.int64)}), dict(ids=[e0], rows={e0: np.array([2, 0], np.int64)}),
           dict(ids=[e0], rows={e0: np.array([0, 1], np.int32)}), dict(ids=[e0], rows={e0: np.array([-1], np.int64)}),
           dict(ids=[e0], rows={e0 + 100: np.array([0], np.int64)}), dict(ids=[e0], rows={e0: np.array([], np.int64)}),
           dict(layer="9" * 100_000)]
    for case in bad:
        with pytest.raises(UsageError) as info:
            _call(service, **case)
        assert len(str(info.value)) < 300  # a hostile value is quoted short
    held = sorted(e for (lay, e) in service.held if lay == 0)
    assert len(held) > service.config.top_k
    ids = held[:service.config.top_k + 1]  # one token row in more than top-k experts: no step asks that
    with pytest.raises(UsageError, match="top-"):
        _call(service, ids=ids, x=np.ones((1, h), np.float32), rows={e: np.array([0], np.int64) for e in ids})
    assert service.calls == 0


def test_a_shard_tampered_under_the_node_is_failed_from_then_on_and_the_others_keep_serving(model, tmp_path):
    work, verified, plan = model
    copy = Path(shutil.copytree(work / "full", tmp_path / "node"))
    service = NodeService(prepare_node(copy, verified, plan, "a", budget=1 << 30, key=_keys(model)["a"]))
    ids = sorted(e for (lay, e) in service.held if lay == 0)[:2]
    victim = copy / expert_path(0, ids[0])
    original = victim.read_bytes()
    victim.write_bytes(original[:-3] + bytes([original[-3] ^ 0x40]) + original[-2:])
    reply = kit.plain(_call(service, ids=ids))
    assert set(reply["outputs"]) == {ids[1]} and "BLAKE3" in reply["failed"][str(ids[0])]
    assert reply["outputs"][ids[1]].shape == (2, service.config.hidden_size)
    victim.write_bytes(original)  # restored: the node still does not serve it (it failed once here)
    again = kit.plain(_call(service, ids=ids))
    assert set(again["failed"]) == {str(ids[0])} and set(again["outputs"]) == {ids[1]}
    assert kit.plain(service.info(NONCE))["failed"] == {f"0/{ids[0]}": reply["failed"][str(ids[0])]}


def test_a_node_refuses_to_join_with_a_missing_planned_file_or_a_budget_that_cannot_hold_a_step(model, tmp_path):
    from shardtool.errors import VerificationError

    work, verified, plan = model
    copy = Path(shutil.copytree(work / "full", tmp_path / "node"))
    path = plan.node("b").files()[0]
    (copy / path).unlink()
    keys = _keys(model)
    other = "c" if path not in plan.node("c").files() else "a"
    prepare_node(copy, verified, plan, other, budget=1 << 30, key=keys[other])
    with pytest.raises(VerificationError, match="missing") as info:
        prepare_node(copy, verified, plan, "b", budget=1 << 30, key=keys["b"])
    assert info.value.path == path
    with pytest.raises(UsageError, match="cannot hold a step"):
        prepare_node(work / "full", verified, plan, "b", budget=1 << 20, key=keys["b"])


def test_the_calls_start_when_the_layer_asks_before_any_output_is_waited_for(model):
    """So the nodes compute while the coordinator runs the shared expert; the first output waited for gathers."""
    transport = Direct(_services(model))
    remote = _remote(model, transport)
    service = transport.services["a"]
    x = np.ones((2, service.config.hidden_size), np.float32)
    rows = {e: np.array([0, 1], np.int64) for e in range(4)}
    outputs = remote.fetch(0)(x, rows)
    assert transport.calls and sum(len(ids) for _, _, ids in transport.calls) == 4
    got = {e: outputs[e]() for e in rows}
    assert all(y.shape == (2, service.config.hidden_size) for y in got.values())


# ------------------------------------------------------------------------------ the cluster proxy's wire form

def _array(dtype="<f4", shape=(2, 3), data=None):
    return {"dtype": dtype, "shape": list(shape), "data": bytes(24) if data is None else data}


@pytest.mark.parametrize("data", [
    b"\xc1",  # a msgpack byte that is never valid
    b"\x93\x01\x02\x03",  # an array, not a map
    b"\x81\x01\x02",  # a map with an int key (strict_map_key)
    b"\x81\xa1a\xd4\x05\x00",  # an ext type
    b"\x81\xa1a",  # truncated
    b"\x81\xa1a\x01\x01",  # trailing bytes
], ids=["invalid", "not-a-map", "int-key", "ext-type", "truncated", "trailing"])
def test_proxy_frame_that_is_not_a_strict_msgpack_map_is_refused(data):
    from shardtool.runtime.engine._cluster_proxy import ProtocolError, unpack
    with pytest.raises(ProtocolError):
        unpack(data)


@pytest.mark.parametrize("answer", [
    {"body": "text", "signature": b"s"},
    {"body": b"{}"},
    {"body": b"{}", "signature": b"s", "extra": b""},
    {"body": b"{}", "signature": b"s", "outputs": [[0, _array()]]},  # a reply's outputs beside a signature
    {"body": b"{}", "mac": b"m"},  # a MAC without outputs
    {"body": b"{}", "mac": "m", "outputs": []},
    {"body": b"{}", "signature": b"s", "mac": b"m", "outputs": []},
    {"body": b"{}", "mac": b"m", "outputs": {"0": _array()}},
    {"body": b"{}", "mac": b"m", "outputs": [[0, _array(dtype="<f8", data=bytes(48))]]},
    {"body": b"{}", "mac": b"m", "outputs": [[0, _array(dtype="|O")]]},
    {"body": b"{}", "mac": b"m", "outputs": [[0, _array(shape=(2, 4))]]},
    {"body": b"{}", "mac": b"m", "outputs": [[0, _array(shape=(6,))]]},
    {"body": b"{}", "mac": b"m", "outputs": [[0, _array(shape=(1 << 20, 1 << 20))]]},
    {"body": b"{}", "mac": b"m", "outputs": [[0, _array(shape=(-2, -3))]]},
    {"body": b"{}", "mac": b"m", "outputs": [[0, {**_array(), "strides": [1]}]]},
    {"body": b"{}", "mac": b"m", "outputs": [[0, _array()], [0, _array()]]},
    {"body": b"{}", "mac": b"m", "outputs": [[-1, _array()]]},
    {"body": b"{}", "mac": b"m", "outputs": [[True, _array()]]},
], ids=["body-text", "no-signature", "extra-key", "signature-with-outputs", "mac-without-outputs", "mac-text",
        "signature-and-mac", "outputs-map", "float64", "object-dtype", "bytes-short-of-shape", "one-dimension",
        "huge-shape", "negative-shape", "extra-array-key", "expert-twice", "negative-expert", "bool-expert"])
def test_proxy_answer_of_the_wrong_form_is_refused(answer):
    from shardtool.runtime.engine._cluster_proxy import ProtocolError, decode_answer
    with pytest.raises(ProtocolError):
        decode_answer(answer)


def test_proxy_answer_round_trips_as_read_only_float32_arrays():
    from shardtool.runtime.engine._cluster_proxy import decode_answer, encode_answer, pack, unpack
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    answer = decode_answer(unpack(pack(encode_answer({"body": b"{}", "mac": b"m", "outputs": {3: y}}))))
    assert set(answer) == {"body", "mac", "outputs"} and set(answer["outputs"]) == {3}
    got = answer["outputs"][3]
    assert type(got) is np.ndarray and got.dtype == np.float32 and (got == y).all() and not got.flags.writeable
    with pytest.raises(NodeFailed, match="not a signed answer"):
        encode_answer(None)  # what a reply whose pickle ran `exec` unpickles to


# ------------------------------------------------------------------------------ replicas: balance and readmission

GEN = 64  # tokens of the runs below (the "64-token generation")


@pytest.mark.parametrize("candidates, in_flight, asked, chosen", [
    (["a", "b"], {}, {}, "a"),  # all even: plan order
    (["a", "b"], {"a": 1}, {}, "b"),  # fewer in flight first
    (["a", "b"], {"a": 1, "b": 1}, {"a": 5, "b": 4}, "b"),  # then fewer asked so far
    (["b", "a"], {"a": 0, "b": 0}, {"a": 3, "b": 3}, "b"),  # then the first holder of the plan
    (["a", "c"], {"a": 2, "b": 0, "c": 1}, {"c": 99}, "c"),  # only the candidates count (b is lost or refused)
], ids=["plan-order", "in-flight", "asked", "first-holder", "candidates-only"])
def test_choose_replica_takes_the_less_loaded_holder_deterministically(candidates, in_flight, asked, chosen):
    assert choose_replica(candidates, in_flight, asked) == chosen


def test_expert_calls_balance_over_the_replicas_with_r2_on_3_nodes(model):
    """A 64-token greedy run's real routing, every expert on 2 of 3 nodes: each expert's rows go to the less loaded
    holder, and the busiest node is asked for at most 1.2 x the mean node's expert calls (what the run report and
    /metrics export)."""
    transport = Direct(_services(model))
    remote = _remote(model, transport)
    assert _generate(model, remote, GEN) == _generate(model, None, GEN)
    per_node = {n: sum(len(ids) for node, _, ids in transport.calls if node == n) for n in "abc"}
    assert remote.stats.expert_calls == per_node
    balance = max(per_node.values()) / (sum(per_node.values()) / 3)
    assert remote.stats.busiest_over_mean() == pytest.approx(balance)
    assert remote.stats.as_dict()["busiest_over_mean"] == round(balance, 4)
    assert balance <= 1.2, per_node
    assert remote._in_flight == {"a": 0, "b": 0, "c": 0}  # every call collected


def test_a_node_lost_mid_run_changes_no_token_and_is_readmitted_only_as_a_new_checked_process(model):
    """R = 2: node b dies in the middle of a 64-token run; the step that hit it asks its experts of the other holder,
    and the tokens are a local run's. b answering again as the same process (same boot id) is not taken back; a new
    service for b (which `shardtool node` starts only after its subset check) is, and is asked again."""
    work, verified, plan = model
    services = _services(model)
    transport = Direct(services)
    remote = kit.remote_experts(plan, transport, timeout=5, probe_seconds=0)
    remote.connect()
    logged: list[str] = []
    remote._log = logged.append
    local = _generate(model, None, GEN)

    submit = transport.submit

    def dies_on_its_tenth_call(node, *args):
        pending = submit(node, *args)
        if node == "b" and sum(1 for n, _, _ in transport.calls if n == "b") == 10:
            transport.down.add("b")  # between the call's start and its result: a SIGKILL mid-layer
        return pending

    transport.submit = dies_on_its_tenth_call
    assert _generate(model, remote, GEN) == local
    assert "b" in remote.stats.dropped and remote.stats.retries >= 1
    assert any("node b dropped: ActorDiedError" in line for line in logged)
    asked_while_lost = remote.stats.expert_calls["b"]

    transport.down.discard("b")  # the same process answers again: its boot id is the lost one's
    assert _generate(model, remote, 4) == local[:4]
    assert "b" in remote.stats.dropped and remote.stats.readmitted == 0
    assert remote.stats.expert_calls["b"] == asked_while_lost

    old_session = remote._sessions["b"]
    services["b"] = NodeService(prepare_node(work / "full", verified, plan, "b", budget=1 << 30, key=_keys(model)["b"]))
    assert _generate(model, remote, GEN) == local
    assert "b" not in remote.stats.dropped and remote.stats.readmitted == 1
    assert remote.stats.expert_calls["b"] > asked_while_lost
    assert any(line.startswith("cluster: node b readmitted: it answered as a new process") for line in logged)
    assert remote._sessions["b"][0] != old_session[0] and remote._sessions["b"][1] != old_session[1]


def test_a_restarted_node_is_refused_in_its_old_session_and_readmitted_in_a_new_one(model):
    """b restarts (a new process: new boot id, no sessions): the next call in b's old session is refused by b, b
    is dropped and its replicas serve; the probe's handshake makes a new session, in which b answers again. A reply
    MACed with the old session's key is refused from then on."""
    work, verified, plan = model
    services = _services(model)
    transport = Direct(services)
    remote = kit.remote_experts(plan, transport, timeout=5, probe_seconds=3600)
    remote.connect()
    local = _generate(model, None, 8)
    old = remote._sessions["b"]
    services["b"] = NodeService(prepare_node(work / "full", verified, plan, "b", budget=1 << 30, key=_keys(model)["b"]))
    assert _generate(model, remote, 8) == local
    assert "refused the call: session " in remote.stats.dropped["b"]
    assert "is not one of this node process's" in remote.stats.dropped["b"]
    remote._probe_at["b"] = (0.0, 1.0)  # due now
    asked = remote.stats.expert_calls["b"]
    assert _generate(model, remote, 8) == local
    assert "b" not in remote.stats.dropped and remote.stats.readmitted == 1
    assert remote._sessions["b"][0] != old[0] and remote.stats.expert_calls["b"] > asked
    transport.mac_keys["b"], transport.edit["b"] = old[1], lambda doc: doc  # b's answers MACed with the old key
    assert _generate(model, remote, 8) == local
    assert "the reply is not authenticated by node b's session key" in remote.stats.dropped["b"]


def test_a_node_that_evicted_the_coordinators_session_is_readmitted_in_a_new_one(model):
    """b, the same process, evicts this coordinator's session (1,024 newer handshakes: other coordinators, a
    member's flood): its next call is refused, b is dropped and its replicas serve; the probe then makes a new
    session with the same process (boot id unchanged: it never stopped nor answered wrongly), and b serves again.
    A reply MACed with the old session's key is refused from then on."""
    from shardtool.runtime.engine._cluster_session import MAX_SESSIONS, Handshake
    _, _, plan = model
    services = _services(model)
    transport = Direct(services)
    remote = kit.remote_experts(plan, transport, timeout=5, probe_seconds=3600)
    logged: list[str] = []
    remote._log = logged.append
    remote.connect()
    local = _generate(model, None, 8)
    old, boot = remote._sessions["b"], services["b"].boot
    for _ in range(MAX_SESSIONS):
        services["b"].info(NONCE, Handshake().public)
    assert _generate(model, remote, 8) == local
    assert remote.stats.dropped["b"].startswith(f"refused the call: session {old[0]} is not one of this node process's")
    remote._probe_at["b"] = (0.0, 1.0)  # due now
    asked = remote.stats.expert_calls["b"]
    assert _generate(model, remote, 8) == local
    assert "b" not in remote.stats.dropped and remote.stats.readmitted == 1 and services["b"].boot == boot
    assert remote._sessions["b"][0] != old[0] and remote.stats.expert_calls["b"] > asked
    assert any(line.startswith("cluster: node b readmitted in a new session: ") for line in logged)
    transport.mac_keys["b"], transport.edit["b"] = old[1], lambda doc: doc  # b's answers MACed with the old key
    assert _generate(model, remote, 8) == local
    assert "the reply is not authenticated by node b's session key" in remote.stats.dropped["b"]


LOST_SAME_PROCESS = {  # why b (its process unchanged) was dropped -> whether a probe takes it back
    "refused its session": (lambda sid: f"refused the call: session {sid} is not one of this node process's (it "
                                        f"was restarted, or the session was evicted): ask for its info() again", True),
    "refused another session": (lambda sid: f"refused the call: session {'f' * 32} is not one of this node "
                                            f"process's", False),
    "timed out": (lambda sid: "no reply within 5.0s", False),
    "refused something else": (lambda sid: "refused the call: layer 99 is not a MoE layer of this model", False),
    "quoted the refusal as its name": (lambda sid: f"the reply as node session {sid} is not one of this node "
                                                   f"process's: refused", False),
}


@pytest.mark.parametrize("why", LOST_SAME_PROCESS)
def test_a_node_lost_as_the_same_process_is_taken_back_only_when_it_refused_its_session(model, why):
    _, _, plan = model
    remote = kit.remote_experts(plan, Direct(_services(model)), timeout=5)
    remote.connect()
    reason, taken_back = LOST_SAME_PROCESS[why]
    remote._drop("b", reason(remote._sessions["b"][0]))
    remote._probe_at["b"] = (0.0, 1.0)  # due now
    remote.probe()
    assert ("b" not in remote.stats.dropped) == taken_back
    assert remote.stats.readmitted == int(taken_back)


def test_a_lost_node_is_probed_with_a_growing_gap(model):
    """While a lost node stays away it is asked less and less often (a probe holds up the step that makes it)."""
    _, _, plan = model
    transport = Direct(_services(model))
    remote = kit.remote_experts(plan, transport, timeout=5, probe_seconds=0.5)
    remote.connect()
    asked: list[str] = []
    info = transport.info
    transport.info = lambda node, nonce, session, timeout: (asked.append(node), info(node, nonce, session, timeout))[1]
    transport.down.add("c")
    remote._drop("c", "ActorDiedError: test")
    remote.probe()
    assert asked == []  # not yet due
    import time
    gaps = []
    for _ in range(3):
        remote._probe_at["c"] = (0.0, remote._probe_at["c"][1])  # due now
        remote.probe()
        gaps.append(remote._probe_at["c"][1])
    assert asked == ["c"] * 3 and gaps == [1.0, 2.0, 4.0]
    assert remote._probe_at["c"][0] > time.monotonic() + 3


# ------------------------------------------------------------------------------ a run call's bytes, and its rounds

def _packed_call(**doc) -> bytes:
    import msgpack
    call = {"layer": 0, "experts": [0], "x": _array(), "rows": [[0, _array("<i8", (1,), bytes(8))]],
            "nonce": NONCE, "session": "0" * 32, **doc}
    return msgpack.packb({k: v for k, v in call.items() if v is not None}, use_bin_type=True)


@pytest.mark.parametrize("call", [
    {"layer": 0},  # not bytes (what Ray would hand a node from a caller that pickled a dict)
    b"\xc1",
    _packed_call(nonce=None),
    _packed_call(session=None),
    _packed_call(extra=1),
    _packed_call(x=_array(dtype="<f8", data=bytes(48))),
    _packed_call(x=_array(shape=(6,))),
    _packed_call(x=_array(shape=(2, 4))),
    _packed_call(rows={"0": _array("<i8", (1,), bytes(8))}),
    _packed_call(rows=[[0, _array("<i4", (1,), bytes(4))]]),
    _packed_call(rows=[[0, _array("<i8", (1,), bytes(8))], [0, _array("<i8", (1,), bytes(8))]]),
    _packed_call(rows=[["0", _array("<i8", (1,), bytes(8))]]),
], ids=["not-bytes", "not-msgpack", "no-nonce", "no-session", "extra-key", "x-float64", "x-one-dimension", "x-bytes-short",
        "rows-map", "rows-int32", "rows-expert-twice", "rows-expert-text"])
def test_a_node_actor_refuses_a_call_of_the_wrong_form(model, call):
    from shardtool.runtime.engine._cluster_node import NodeActor
    work, verified, plan = model
    actor = NodeActor(prepare_node(work / "full", verified, plan, "a", budget=1 << 30, key=_keys(model)["a"]))
    with pytest.raises(UsageError) as info:
        actor.run(call)
    assert len(str(info.value)) < 300 and actor._service.calls == 0


def test_a_node_actor_answers_a_calls_bytes_with_its_services_answer_as_bytes(model):
    """One bytes object each way (Ray carries it without pickling arrays): the same answer as the service's, MACed
    with the session's key."""
    from shardtool.runtime.engine._cluster_session import mac
    from shardtool.runtime.engine._cluster_node import NodeActor
    from shardtool.runtime.engine._cluster_wire import decode_answer, encode_call, unpack
    work, verified, plan = model
    actor = NodeActor(prepare_node(work / "full", verified, plan, "a", budget=1 << 30, key=_keys(model)["a"]))
    service = actor._service
    ids = sorted(e for (lay, e) in service.held if lay == 0)[:2]
    x = np.arange(3 * service.config.hidden_size, dtype=np.float32).reshape(3, -1) / 100
    rows = {ids[0]: np.array([0, 2], np.int64), ids[1]: np.array([1], np.int64)}
    sid, key = kit.session(service)
    packed = actor.run(encode_call(0, ids, x, rows, NONCE, sid))
    assert type(packed) is bytes
    got, want = decode_answer(unpack(packed)), _call(service, ids=ids, x=x, rows=rows, session=sid)
    body, expected = json.loads(got["body"]), json.loads(want["body"])
    assert {**body, "seconds": 0} == {**expected, "seconds": 0}
    assert set(got["outputs"]) == set(ids) and all((got["outputs"][e] == want["outputs"][e]).all() for e in ids)
    assert set(got) == {"body", "mac", "outputs"} and got["mac"] == mac(key, REPLY_TYPE, got["body"])


class _FakeRay:
    """What the proxy's child calls Ray through (`RayTransport`'s submit/result), logging the order of the calls."""

    def __init__(self, answers: dict):
        self.answers, self.log = answers, []

    def submit(self, node, call):
        self.log.append(("submit", node))
        if isinstance(self.answers[node], Exception):
            raise self.answers[node]
        return node

    def result(self, pending, timeout):
        self.log.append(("result", pending))
        return self.answers[pending]

    def graph_round(self, calls, timeout):
        self.log.append(("graph", sorted(calls)))
        return None  # no Compiled Graph: plain calls


def test_the_proxy_child_starts_every_call_of_a_round_before_waiting_and_answers_them_in_one_frame():
    from shardtool.runtime.engine import _cluster_proxy as cp
    sent: list[dict] = []
    child = cp._Child(lambda n: b"", lambda data: sent.append(cp.unpack(data[cp.HEADER.size:])))
    child.transport = _FakeRay({"a": b"packed by a", "b": {"body": b"{}", "signature": b"s"},
                                "c": NodeFailed("no node named c has joined the cluster")})
    child.round({"timeout": 5.0, "calls": [{"id": 7, "node": "a", "call": b"1"}, {"id": 8, "node": "b", "call": b"2"},
                                           {"id": 9, "node": "c", "call": b"3"}]})
    assert child.transport.log == [("graph", ["a", "b", "c"]), ("submit", "a"), ("submit", "b"), ("submit", "c"),
                                   ("result", "a"), ("result", "b")]
    assert len(sent) == 1 and [pair[0] for pair in sent[0]["answers"]] == [7, 8, 9]
    (_, a), (_, b), (_, c) = sent[0]["answers"]
    assert a == {"packed": b"packed by a"}  # forwarded as the node encoded it, never read here
    assert "not a signed answer" in b["failed"] and c == {"failed": "no node named c has joined the cluster"}


def test_a_round_through_the_compiled_graph_answers_each_call_as_plain_calls_would():
    from shardtool.runtime.engine import _cluster_proxy as cp
    sent: list[dict] = []
    child = cp._Child(lambda n: b"", lambda data: sent.append(cp.unpack(data[cp.HEADER.size:])))
    child.transport = _FakeRay({})
    child.transport.graph_round = lambda calls, timeout: {"a": b"packed by a", "b": NodeFailed("refused the call: x")}
    child.round({"timeout": 5.0, "calls": [{"id": 8, "node": "b", "call": b"2"}, {"id": 7, "node": "a", "call": b"1"}]})
    assert child.transport.log == []  # no plain call was made
    assert sent == [{"answers": [[8, {"failed": "refused the call: x"}], [7, {"packed": b"packed by a"}]]}]


class _Compiled:
    """A compiled graph whose executions raise `error` (None: each node answers b"")."""

    def __init__(self, error=None):
        self.error, self.torn_down = error, []

    def get_id(self):
        return "fake"

    def execute(self, calls):
        if self.error is not None:
            raise self.error
        return ["a", "b"]

    def teardown(self, kill_actors=False):
        self.torn_down.append(kill_actors)


class _GraphRay:
    class exceptions:
        RayTaskError = type("RayTaskError", (Exception,), {})

    def get(self, ref, timeout=None):
        return b""


def _ray_transport(compile_graph):
    from shardtool.runtime.engine._cluster_proxy import RayTransport
    transport = object.__new__(RayTransport)
    transport.ray, transport._actors, transport.nodes = _GraphRay(), {}, ("a", "b")
    transport._graph, transport.graph_off = None, None
    transport._compile = compile_graph
    return transport


FALLBACKS = {  # why a coordinator's proxy cannot have a Compiled Graph: then its rounds are plain actor calls
    "compile refused (another coordinator's graph, a node not joined)": RuntimeError("actor already in a graph"),
    "first execution does not answer (loops of dead coordinators hold the node's graph threads)":
        TimeoutError("RayChannelTimeoutError"),
}


@pytest.mark.parametrize("why", FALLBACKS)
def test_a_proxy_without_a_compiled_graph_falls_back_to_plain_calls_and_kills_no_actor(why):
    from shardtool.runtime.engine import _cluster_proxy as cp
    compiled = _Compiled(FALLBACKS[why])
    made = []

    def compile_graph():
        if "compile" in why:
            raise FALLBACKS[why]
        made.append(cp._Graph.__new__(cp._Graph))
        made[-1].ray, made[-1].compiled, made[-1].nodes = _GraphRay(), compiled, ("a", "b")
        return made[-1]

    transport = _ray_transport(compile_graph)
    assert transport.graph_round({"a": b"1"}, 5.0) is None
    assert transport.graph_off.startswith("no Compiled Graph") and transport._graph is None
    assert compiled.torn_down == ([] if "compile" in why else [False])  # torn down, never with kill_actors
    assert transport.graph_round({"a": b"1"}, 5.0) is None  # and not tried again
    sent: list[dict] = []
    child = cp._Child(lambda n: b"", lambda data: sent.append(cp.unpack(data[cp.HEADER.size:])))
    child.transport = transport
    transport.submit, transport.result = lambda node, call: node, lambda pending, timeout: b"plain " + pending.encode()
    child.round({"timeout": 5.0, "calls": [{"id": 1, "node": "a", "call": b"1"}]})
    assert sent == [{"answers": [[1, {"packed": b"plain a"}]]}]


def test_a_compiled_graph_answers_the_nodes_asked_and_is_ended_without_killing_on_close():
    from shardtool.runtime.engine import _cluster_proxy as cp
    compiled = _Compiled()
    graph = cp._Graph.__new__(cp._Graph)
    graph.ray, graph.compiled, graph.nodes = _GraphRay(), compiled, ("a", "b")
    transport = _ray_transport(lambda: graph)
    transport.ray.shutdown = lambda: None
    assert transport.graph_round({"b": b"1"}, 5.0) == {"b": b""}
    assert transport.graph_round({"c": b"1"}, 5.0) is None  # a node outside the graph: plain calls, graph kept
    assert transport._graph is graph
    transport.close()
    assert compiled.torn_down == [False] and transport.graph_off == "closed"


def test_a_nodes_refusal_in_a_compiled_graph_round_is_its_own_not_every_nodes():
    """Ray's graph reader fails fast: once one node's output is an error, it hands that one error for every output
    of the round (Ray 2.60's SynchronousReader), so whose refusal it is cannot be told from the graph. The round
    then goes out as plain calls, where b's refusal (a session it evicted) is b's alone and a answers; the graph is
    ended without killing an actor. Taken as every node's, it dropped a too, under b's line (never readmitted)."""
    from shardtool.runtime.engine import _cluster_proxy as cp
    refusal = _GraphRay.exceptions.RayTaskError("RayTaskError(UsageError)")
    refusal.cause = UsageError(f"session {'b' * 32} is not one of this node process's")

    class FailingFast(_Compiled):
        def execute(self, calls):
            return [(node, bool(calls)) for node in ("a", "b")]

    class Ray(_GraphRay):
        def get(self, ref, timeout=None):
            if ref[1]:  # a round with calls (not the warm-up): b refused, so every output is its error
                raise refusal
            return b""

    compiled = FailingFast()
    graph = cp._Graph.__new__(cp._Graph)
    graph.ray, graph.compiled, graph.nodes = Ray(), compiled, ("a", "b")
    transport = _ray_transport(lambda: graph)
    plain = {"a": b"plain a", "b": NodeFailed(f"refused the call: session {'b' * 32} is not one of this node process's")}

    def result(pending, timeout):
        if isinstance(plain[pending], Exception):
            raise plain[pending]
        return plain[pending]

    transport.submit, transport.result = lambda node, call: node, result
    sent: list[dict] = []
    child = cp._Child(lambda n: b"", lambda data: sent.append(cp.unpack(data[cp.HEADER.size:])))
    child.transport = transport
    child.round({"timeout": 5.0, "calls": [{"id": 1, "node": "a", "call": b"1"}, {"id": 2, "node": "b", "call": b"2"}]})
    assert sent == [{"answers": [[1, {"packed": b"plain a"}], [2, {"failed": str(plain["b"])}]]}]
    assert transport._graph is None and compiled.torn_down == [False]
    assert "refused the call: session" in transport.graph_off


@pytest.mark.parametrize("when", ["compile", "execution"])
def test_why_a_proxy_ends_its_graph_is_one_printable_line_on_stderr(when, capsys):
    """The reason quotes Ray's error, whose text a member can choose (a node's exception): escaped, never a terminal
    control sequence on the coordinator's stderr."""
    from shardtool.runtime.engine import _cluster_proxy as cp
    hostile = RuntimeError("boom \x1b]0;owned\x07\x1b[2J\u202e")

    class Failing(_Compiled):
        def execute(self, calls):
            if calls:
                raise hostile
            return ["a", "b"]

    def compile_graph():
        if when == "compile":
            raise hostile
        graph = cp._Graph.__new__(cp._Graph)
        graph.ray, graph.compiled, graph.nodes = _GraphRay(), Failing(), ("a", "b")
        return graph

    transport = _ray_transport(compile_graph)
    assert transport.graph_round({"a": b"1"}, 5.0) is None
    err = capsys.readouterr().err
    assert "boom" in err and "\x1b" not in err and "\x07" not in err and "\u202e" not in err
    assert err.count("\n") == 1


class _Proc:
    pid = 0

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


def _proxy(frames: list[dict], sent: list[dict]):
    """A ProxyTransport whose pipe is `frames` (answered in turn) and `sent` (what it wrote), without a child."""
    import itertools
    import threading
    from shardtool.runtime.engine._cluster_proxy import ProxyTransport
    proxy = object.__new__(ProxyTransport)
    proxy._lock, proxy._ids, proxy._broken, proxy._queued, proxy._answers = threading.Lock(), itertools.count(), None, [], {}
    proxy._proc = _Proc()
    replies = iter(frames)
    proxy._exchange = lambda doc, seconds: sent.append(doc) or next(replies)
    return proxy


def _reply(service, ids, nonce=NONCE):
    from shardtool.runtime.engine._cluster_wire import encode_answer, pack
    return pack(encode_answer(service.run(0, ids, np.ones((1, service.config.hidden_size), np.float32),
                                          {e: np.array([0], np.int64) for e in ids}, nonce, kit.session(service)[0])))


def test_the_coordinator_sends_a_layers_calls_to_its_proxy_as_one_frame(model):
    services = _services(model)
    held = {n: sorted(e for (lay, e) in s.held if lay == 0)[:1] for n, s in services.items()}
    sent: list[dict] = []
    x, rows = np.ones((1, services["a"].config.hidden_size), np.float32), {}
    frames = [{"answers": [[i, {"packed": _reply(services[n], held[n])}] for i, n in enumerate("abc")]}]
    proxy = _proxy(frames, sent)
    calls = [proxy.submit(n, 0, held[n], x, {e: np.array([0], np.int64) for e in held[n]}, NONCE, "0" * 32)
             for n in "abc"]
    assert sent == []  # queued: nothing crosses the pipe before the layer waits for an answer
    got = [proxy.result(c, 5.0) for c in (calls[1], calls[0], calls[2])]
    assert len(sent) == 1 and sent[0]["op"] == "round" and [c["node"] for c in sent[0]["calls"]] == list("abc")
    assert [json.loads(g["body"])["name"] for g in got] == ["b", "a", "c"] and len(sent) == 1
    with pytest.raises(NodeFailed, match="never submitted"):
        proxy.result(calls[0], 5.0)


@pytest.mark.parametrize("frame, error, proxy_broken", [
    ({"answers": [[1, {"failed": "x"}], [0, {"failed": "y"}]]}, "the cluster proxy failed", True),
    ({"answers": [[0, {"failed": "x"}]]}, "the cluster proxy failed", True),
    ({"answers": "no"}, "the cluster proxy failed", True),
    ({"answers": [[0, {"packed": b"\xc1"}], [1, {"failed": "y"}]]}, "not a signed answer", False),
    ({"answers": [[0, {"packed": b"\x80"}], [1, {"failed": "y"}]]}, "not a signed answer", False),
    ({"answers": [[0, {"failed": "node a: ActorDiedError"}], [1, {"failed": "y"}]]}, "ActorDiedError", False),
], ids=["out-of-order", "one-answer-short", "not-a-list", "packed-not-msgpack", "packed-empty-map", "failed"])
def test_a_rounds_answer_frame_of_the_wrong_form_breaks_the_proxy_and_a_bad_node_answer_fails_that_node(
        frame, error, proxy_broken):
    sent: list[dict] = []
    proxy = _proxy([frame], sent)
    x, rows = np.ones((1, 4), np.float32), {0: np.array([0], np.int64)}
    calls = [proxy.submit(n, 0, [0], x, rows, NONCE, "0" * 32) for n in "ab"]
    with pytest.raises(NodeFailed, match=error):
        proxy.result(calls[0], 5.0)
    assert (proxy._broken is not None) == proxy_broken


def test_a_node_actor_keeps_torch_out_of_its_compiled_graph_channels(model):
    """With torch installed, Ray's channels import it at a graph's first read (seconds, cold): past the first
    execution's deadline, a fresh cluster's graph looked hung."""
    from ray.experimental.channel.common import ChannelContext
    from shardtool.runtime.engine._cluster_node import NodeActor
    work, verified, plan = model
    ChannelContext.get_current()._torch_available = None
    NodeActor(prepare_node(work / "full", verified, plan, "a", budget=1 << 30, key=_keys(model)["a"]))
    assert ChannelContext.get_current().torch_available is False


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_restarted_node_waits_for_its_killed_predecessor_to_release_the_name():
    """Ray keeps a SIGKILLed node's actor, and its name, until it notices the owner is gone (0.1-0.6 s measured):
    the node started again at once retries until the name is free instead of refusing."""
    from ray.exceptions import ActorAlreadyExistsError
    from shardtool.runtime.engine._cluster_node import claim_name
    clock, tries = _FakeClock(), []

    def create():
        tries.append(clock.now)
        if len(tries) < 4:
            raise ActorAlreadyExistsError("The name shardtool-node-b (namespace=shardtool) is already taken.")
        return "actor"

    assert claim_name("b", create, grace=20.0, clock=clock, sleep=clock.sleep) == "actor"
    assert len(tries) == 4 and 0 < clock.now < 20.0


def test_a_name_held_past_the_grace_is_another_live_node_and_refused_as_usage():
    from ray.exceptions import ActorAlreadyExistsError
    from shardtool.runtime.engine._cluster_node import claim_name
    clock = _FakeClock()

    def create():
        raise ActorAlreadyExistsError("The name shardtool-node-b (namespace=shardtool) is already taken.")

    with pytest.raises(UsageError, match=r"node name 'b' is already in use in this cluster \(still held after 5 s\)"):
        claim_name("b", create, grace=5.0, clock=clock, sleep=clock.sleep)
    assert 5.0 <= clock.now < 6.0


def test_a_node_actor_exits_as_soon_as_its_node_process_has_ended():
    """The actor watches the `shardtool node` process through a pidfd: once that process is gone (SIGKILL), the actor
    ends itself instead of serving on until Ray notices its owner died."""
    import signal
    import subprocess
    import threading
    from shardtool.runtime.engine._cluster_node import exit_with_owner
    owner = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ended = threading.Event()
    try:
        watch = exit_with_owner(owner.pid, exit=lambda code: ended.set())
        assert not ended.wait(0.3), "the actor ended while its node process still ran"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert ended.wait(5), "the actor did not end with its node process"
        watch.join(5)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_node_actor_whose_node_process_is_already_gone_exits_at_once():
    import subprocess
    from shardtool.runtime.engine._cluster_node import exit_with_owner
    gone = subprocess.Popen(["true"])
    gone.wait()
    codes = []
    with pytest.raises(ProcessLookupError):
        exit_with_owner(gone.pid, exit=codes.append)
    assert codes == [0]


@pytest.mark.parametrize("actor_ns", [0, 4026531836], ids=["no_proc_either_side", "proc_here_only"])
def test_a_node_actor_watches_its_owner_only_where_the_pid_namespace_is_known_to_be_the_same(monkeypatch, actor_ns):
    """pid_namespace() is 0 where /proc/self/ns/pid cannot be read (no /proc, not Linux): two unknowns are not the
    same namespace, and a pid read in one namespace names another process (or none) in another, whose end would
    then end a live node's actor (or its absence end it at once)."""
    from types import SimpleNamespace
    from shardtool.runtime.engine import _cluster_node as cn
    watched = []
    monkeypatch.setattr(cn, "NodeService", lambda setup: None)
    monkeypatch.setattr(cn, "graphs_without_torch", lambda: None)
    monkeypatch.setattr(cn, "exit_with_owner", watched.append)
    monkeypatch.setattr(cn, "pid_namespace", lambda: actor_ns)
    cn.NodeActor(SimpleNamespace(owner_pid=4242, owner_pid_namespace=0))
    assert watched == []


@pytest.mark.parametrize("missing", [
    pytest.param(OSError(38, "Function not implemented"), id="kernel_without_pidfd_ENOSYS"),
    pytest.param(PermissionError(1, "Operation not permitted"), id="seccomp_refuses_pidfd_EPERM"),
    pytest.param(OSError(24, "Too many open files"), id="out_of_fds_EMFILE"),
    pytest.param(None, id="no_os_pidfd_open_not_linux"),
])
def test_a_node_actor_without_a_usable_pidfd_still_starts_and_is_not_ended(monkeypatch, missing):
    """The owner watch only shortens how long a dead node's actor lingers (Ray ends it too, later): where no pidfd
    can be opened (an older kernel, a container's seccomp profile, no pidfd_open at all) the actor must start and
    serve, not fail in its constructor and so refuse every node on that machine."""
    import os
    from shardtool.runtime.engine._cluster_node import exit_with_owner
    if missing is None:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    else:
        def refuse(pid):
            raise missing
        monkeypatch.setattr(os, "pidfd_open", refuse)
    codes = []
    assert exit_with_owner(os.getpid(), exit=codes.append) is None
    assert codes == []


@pytest.mark.parametrize("error", [
    pytest.param(ValueError("Actor name cannot be an empty string."), id="empty_name"),
    pytest.param(ValueError("If you're using multi-threaded actors, Ray can't execute actor tasks in order."),
                 id="bad_actor_options"),
])
def test_an_actor_creation_error_that_is_not_the_name_taken_is_not_waited_on_nor_called_name_in_use(error):
    """Only Ray's 'name already taken' means another node holds the name; any other ValueError from creating the
    actor is a bug here: it must surface at once as itself (exit 70 with its traceback), not after 30 s of retries
    as 'node name is already in use' (exit 2, blaming the operator's choice of name)."""
    from shardtool.runtime.engine._cluster_node import claim_name
    clock, tries = _FakeClock(), []

    def create():
        tries.append(clock.now)
        raise error

    with pytest.raises(ValueError) as raised:
        claim_name("b", create, grace=30.0, clock=clock, sleep=clock.sleep)
    assert raised.value is error and not isinstance(raised.value, UsageError)
    assert tries == [0.0] and clock.now == 0.0


class _Recording:
    """A transport that keeps what each call would send (no node answers)."""

    def __init__(self):
        self.sent: list[tuple[str, np.ndarray, dict]] = []

    def submit(self, node, layer, expert_ids, x, rows, nonce, session):
        self.sent.append((node, x, rows))
        return len(self.sent) - 1


@pytest.mark.parametrize("x_rows, rows", [
    pytest.param(1, {0: [0], 1: [0]}, id="decode-step-of-one"),
    pytest.param(3, {0: [0, 2], 1: [1]}, id="batch-of-three"),
    pytest.param(2, {0: [1], 1: [1]}, id="one-row-of-two"),
])
def test_a_call_sends_the_rows_its_experts_need_renumbered_into_its_block(model, monkeypatch, x_rows, rows):
    _, _, plan = model
    transport = _Recording()
    remote = kit.remote_experts(plan, transport)
    x = np.arange(x_rows * 16, dtype=np.float32).reshape(x_rows, 16)
    rows = {e: np.asarray(r, dtype=np.int64) for e, r in rows.items()}
    used = sorted({int(i) for r in rows.values() for i in r})
    if x_rows == 1:  # a decode step of one sequence takes no numpy set operation (its cost per round)
        monkeypatch.setattr(np, "unique", lambda *a, **k: pytest.fail("np.unique at batch one"))
    remote._sessions["a"] = ("0" * 32, bytes(32))  # (no node: nothing answers this call)
    remote._send("a", 0, sorted(rows), x, rows)
    (_, block, local), = transport.sent
    assert block.dtype == np.float32 and block.flags.c_contiguous and np.array_equal(block, x[used])
    assert {e: r.tolist() for e, r in local.items()} == {e: [used.index(int(i)) for i in r] for e, r in rows.items()}
    assert all(r.dtype == np.int64 for r in local.values())


@pytest.mark.parametrize("options, error", [
    pytest.param(dict(graph=True), "--cluster-graph need --cluster", id="graph-without-cluster"),
    pytest.param(dict(insecure=True), "--cluster-graph need --cluster", id="insecure-without-cluster"),
])
def test_cluster_only_options_without_cluster_are_a_usage_error(options, error):
    from shardtool.cli._common import check_cluster_options
    with pytest.raises(UsageError, match=error):
        check_cluster_options(None, None, 30.0, [], **options)


@pytest.mark.parametrize("graph", [False, True], ids=["plain-calls", "compiled-graph"])
def test_cluster_graph_reaches_connect_cluster_from_the_cli_options(model, monkeypatch, graph):
    """--cluster-graph: `cluster_args` -> `open_model(cluster_graph=...)` -> `connect_cluster(graph=...)`."""
    from shardtool.cli._common import cluster_args
    from shardtool.runtime import open_model
    from shardtool.runtime.engine import _open

    work, _, _ = model
    asked = []

    class Stop(Exception):
        pass

    def connect(address, plan, *, timeout, insecure, graph):
        asked.append(graph)
        raise Stop
    monkeypatch.setattr(_open, "connect_cluster", connect)
    args = cluster_args("127.0.0.1:1", work / "plan.json", [work / "op.pub"], False, 5.0, graph)
    with pytest.raises(Stop):
        open_model(work / "full", trust=[work / "a.pub"], state_dir=work / "graph-state", memory_budget="1GiB", **args)
    assert asked == [graph]


def test_the_proxys_run_calls_carry_no_ray_task_events():
    """Each task event is buffered in the proxy and the node's worker and sent to the GCS: on shared cores the round
    paid for it (proxy CPU 1.16 -> 0.85 ms a round without them, docs/scaling.md)."""
    from shardtool.runtime.engine._cluster_proxy import RayTransport
    submitted = []

    class Method:
        def __init__(self, options=None):
            self.given = options or {}

        def options(self, **options):
            return Method(options)

        def remote(self, call):
            submitted.append((self.given, call))
            return "ref"

    transport = object.__new__(RayTransport)
    transport._actors = {"a": type("Actor", (), {"run": Method()})()}
    assert transport.submit("a", b"call") == "ref"
    assert submitted == [({"enable_task_events": False}, b"call")]
