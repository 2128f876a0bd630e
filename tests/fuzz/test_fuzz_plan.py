"""Fuzzing the cluster-plan decoder like the receipt's: arbitrary bytes, arbitrary JSON, plan-shaped documents with
one hostile field, and byte-level mutations of a genuine plan.

Contract: only ShardtoolError subclasses escape; a plan that decodes keeps every promise a plan makes (unique
names, budgets in range, each expert of the manifest on at least R distinct nodes, nothing the manifest does
not list) and its one encoding decodes to the same plan.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _fuzzkit import INTERESTING_INTS, mutated, only_our_errors
from shardtool import layout
from shardtool.errors import ShardtoolError
from shardtool.manifest import Entry, VerifiedManifest, build_manifest
from shardtool.runtime import ClusterPlan, decode_plan, encode_plan, make_plan


def _manifest() -> VerifiedManifest:
    entries = [Entry("config.json", "config", 20, b"\x01" * 32), Entry(layout.EMBED, "trunk", 500, b"\x02" * 32)]
    for layer in (1, 2):
        for e in range(4):
            entries.append(Entry(layout.expert_path(layer, e), "expert", 1000 + e, bytes([layer, e]) * 16,
                                 layer=layer, expert=e))
    built = build_manifest(entries, model_id="fuzz/plan", version=2,
                           contract={"experts_per_token": 2, "expert_bytes_per_token_cold": 4 * 1003})
    return VerifiedManifest(built.head, built.entries, ())


MANIFEST = _manifest()
GENUINE = make_plan(MANIFEST, [("a", 2**30, None), ("b", 2**30, 10**6), ("c", 2**31, None)], replicas=2)
DATA = encode_plan(GENUINE)
DOC = json.loads(DATA)

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | INTERESTING_INTS
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda children: st.lists(children, max_size=6)
                           | st.dictionaries(st.text(max_size=12), children, max_size=6), max_leaves=25)


def _decode(data: bytes):
    return only_our_errors(decode_plan, data, MANIFEST, what="fuzz.plan")


def _holds_its_promises(plan: ClusterPlan) -> None:
    names = [n.name for n in plan.nodes]
    assert len(set(names)) == len(names)
    assert (plan.model_id, plan.manifest_version, plan.root) == (MANIFEST.head.model_id, MANIFEST.head.version,
                                                                  MANIFEST.head.merkle_root)
    listed = {(e.layer, e.expert) for e in MANIFEST.entries if e.kind == "expert"}
    for node in plan.nodes:
        assert 1 <= node.memory_budget <= 2**62 and (node.disk is None or 1 <= node.disk <= 2**62)
        pairs = node.pairs()
        assert len(set(pairs)) == len(pairs) and set(pairs) <= listed
    for layer, expert in listed:
        assert len(set(plan.holders(layer, expert))) >= plan.replicas
    again = decode_plan(encode_plan(plan), MANIFEST, what="again")
    assert again == plan


def _check(data: bytes) -> None:
    result = _decode(data)
    if not isinstance(result, ShardtoolError):
        _holds_its_promises(result)


def test_genuine_plan_round_trips():
    assert decode_plan(DATA, MANIFEST, what="p") == GENUINE
    _holds_its_promises(GENUINE)


@given(st.binary(max_size=4096))
def test_fuzz_plan_random_bytes(data):
    _check(data)


@given(JSON_VALUES)
def test_fuzz_plan_any_json(value):
    _check(json.dumps(value).encode())


def _paths(doc, prefix=()):
    """Every place in a JSON document a value sits."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


PATHS = [p for p in _paths(DOC) if p]


def _hostile(data: bytes, path, value, delete: bool) -> bytes:
    """`data` with the value at `path` replaced by `value`, or deleted."""
    doc = json.loads(data)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(doc).encode()


# A pipeline plan: three decoder layers (0 dense), each node a span of them with every expert of its layers.
def _layered_manifest() -> VerifiedManifest:
    entries = [Entry("config.json", "config", 20, b"\x01" * 32), Entry(layout.EMBED, "trunk", 500, b"\x02" * 32)]
    for layer in range(3):
        entries.append(Entry(layout.trunk_path(layer), "trunk", 300 + layer, bytes([9, layer]) * 16, layer=layer))
        for e in range(4 if layer else 0):
            entries.append(Entry(layout.expert_path(layer, e), "expert", 1000 + e, bytes([layer, e]) * 16,
                                 layer=layer, expert=e))
    built = build_manifest(entries, model_id="fuzz/pipeline", version=2,
                           contract={"experts_per_token": 2, "expert_bytes_per_token_cold": 2 * 2 * 1003, "num_layers": 3})
    return VerifiedManifest(built.head, built.entries, ())


LAYERED = _layered_manifest()
PIPE = make_plan(LAYERED, [("a", 2**30, None), ("b", 2**30, 10**6)], replicas=1, pipeline=True)
PIPE_DATA = encode_plan(PIPE)
PIPE_PATHS = [p for p in _paths(json.loads(PIPE_DATA)) if p]


def _check_pipeline(data: bytes) -> None:
    """A pipeline plan that decodes: its spans cover the layers once, in order, each node holding exactly the
    experts of its own layers; one that decodes without spans is an expert plan keeping an expert plan's promises."""
    plan = only_our_errors(decode_plan, data, LAYERED, what="fuzz.plan")
    if isinstance(plan, ShardtoolError):
        return
    if not plan.pipeline:
        assert all(node.layers == () for node in plan.nodes)
        return
    assert plan.replicas == 1 and all(node.layers for node in plan.nodes)
    assert [layer for _, span in plan.spans() for layer in span] == [0, 1, 2]
    listed = {(e.layer, e.expert) for e in LAYERED.entries if e.kind == "expert"}
    for node in plan.nodes:
        assert set(node.pairs()) == {(layer, e) for layer, e in listed if layer in node.layers}
    assert decode_plan(encode_plan(plan), LAYERED, what="again") == plan


def test_genuine_pipeline_plan_round_trips():
    assert decode_plan(PIPE_DATA, LAYERED, what="p") == PIPE and PIPE.spans() == (("a", (0, 1)), ("b", (2,)))


# A genuine plan of each placement, the places a value sits in it, and what a plan decoded from it must keep.
GENUINE_PLANS = {"experts": (DATA, PATHS, _check), "pipeline": (PIPE_DATA, PIPE_PATHS, _check_pipeline)}


@pytest.mark.parametrize("placement", GENUINE_PLANS)
@given(data=st.data())
def test_fuzz_plan_one_hostile_field(placement, data):
    genuine, paths, check = GENUINE_PLANS[placement]
    check(_hostile(genuine, data.draw(st.sampled_from(paths)), data.draw(JSON_VALUES), data.draw(st.booleans())))


@pytest.mark.parametrize("placement", GENUINE_PLANS)
@given(data=st.data())
def test_fuzz_plan_mutated_bytes(placement, data):
    genuine, _, check = GENUINE_PLANS[placement]
    check(data.draw(mutated(genuine, max_ops=6)))
