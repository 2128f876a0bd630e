"""Fuzzing the cluster-plan decoder like the receipt's: arbitrary bytes, arbitrary JSON, plan-shaped documents with
one hostile field, and byte-level mutations of a genuine plan.

Contract: only ShardtoolError subclasses escape; a plan that decodes keeps every promise a plan makes (unique
names, budgets in range, each expert of the manifest on at least R distinct nodes, nothing the manifest does
not list) and its one encoding decodes to the same plan.
"""

from __future__ import annotations

import json

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


@given(st.sampled_from(PATHS), JSON_VALUES, st.booleans())
def test_fuzz_plan_one_hostile_field(path, value, delete):
    doc = json.loads(DATA)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    _check(json.dumps(doc).encode())


@given(st.data())
def test_fuzz_plan_mutated_bytes(data):
    _check(data.draw(mutated(DATA, max_ops=6)))
