"""The cluster plan (runtime/engine/_cluster_plan.py): made from a verified manifest and node budgets, encoded once,
decoded as untrusted input with one-line refusals."""

from __future__ import annotations

import json

import pytest

from shardtool import layout
from shardtool.errors import ShardtoolError, UsageError, VerificationError
from shardtool.keys import generate
from shardtool.manifest import Entry, VerifiedManifest, build_manifest
from shardtool.runtime import (ClusterPlan, NodePlan, decode_plan, encode_plan, make_plan, node_files, node_memory_floor,
                               summarize)
from shardtool.runtime.engine._cluster_plan import MAX_PLAN_BYTES, pipeline_node_floor
from shardtool.runtime.engine._plan import MIN_ACTIVATION_RESERVE
from shardtool.runtime.store._store import HEADER_MEMO_MIN

MIB = 2**20
WHAT = "cluster.plan"


def _digest(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _manifest(layers: int = 2, experts: int = 8, size=lambda layer, e: 1000, top_k: int = 2, version: int = 3,
              model_id: str = "test/plan", contract: bool = True, dense: tuple[int, ...] = (),
              trunk=lambda layer: 300, without: tuple[str, ...] = (), mtp: int = 0) -> VerifiedManifest:
    """`dense`: layers without routed experts; `trunk`: bytes of a layer's trunk file; `without`: paths left out;
    `mtp`: how many of the layers come after the decoder's (the contract's num_layers is `layers - mtp`)."""
    entries = [Entry("config.json", "config", 20, _digest(1)), Entry("tokenizer.json", "tokenizer", 30, _digest(2)),
               Entry(layout.EMBED, "trunk", 500, _digest(3)), Entry(layout.HEAD, "trunk", 400, _digest(4))]
    n = 10
    for layer in range(layers):
        entries.append(Entry(layout.trunk_path(layer), "trunk", trunk(layer), _digest(n), layer=layer))
        n += 1
        for e in range(0 if layer in dense else experts):
            entries.append(Entry(layout.expert_path(layer, e), "expert", size(layer, e), _digest(n), layer=layer,
                                 expert=e))
            n += 1
    cold = sum(top_k * max((size(layer, e) for e in range(experts)), default=0) for layer in range(layers)
               if layer not in dense)
    entries = [entry for entry in entries if entry.path not in without]
    built = build_manifest(entries, model_id=model_id, version=version, contract={
        "experts_per_token": top_k, "expert_bytes_per_token_cold": cold, "num_layers": layers - mtp}
        if contract else None)
    return VerifiedManifest(built.head, built.entries, ())


M = _manifest()
BUDGET = 64 * MIB


def _doc(plan: ClusterPlan) -> dict:
    return json.loads(encode_plan(plan))


def _bytes(doc: dict) -> bytes:
    return json.dumps(doc).encode()


def test_round_trip_and_one_encoding():
    plan = make_plan(M, [("a", BUDGET, None), ("b", BUDGET, 10**6), ("c", 2 * BUDGET, None)], replicas=2)
    data = encode_plan(plan)
    got = decode_plan(data, M, what=WHAT)
    assert got == plan and encode_plan(got) == data
    assert data.endswith(b"\n") and b" " not in data
    assert list(json.loads(data)) == sorted(json.loads(data))
    # Any JSON spelling of the same plan decodes to the same plan and encodes back to the one encoding.
    assert encode_plan(decode_plan(json.dumps(json.loads(data), indent=3).encode(), M, what=WHAT)) == data
    assert plan.coordinator_files == tuple(sorted(e.path for e in M.entries if e.kind != "expert"))
    assert plan.node("b").files() == sorted(layout.expert_path(layer, e) for layer, e in plan.node("b").pairs())


def test_replicas_are_on_distinct_nodes_and_every_expert_is_covered():
    plan = make_plan(M, [("a", BUDGET, None), ("b", BUDGET, None), ("c", BUDGET, None)], replicas=2)
    for layer in range(2):
        for e in range(8):
            holders = plan.holders(layer, e)
            assert len(holders) == 2 and len(set(holders)) == 2
            assert list(holders) == [n.name for n in plan.nodes if e in n.experts.get(layer, ())]
    assert plan.holders(0, 99) == ()
    one = make_plan(M, [("a", BUDGET, None), ("b", BUDGET, None)], replicas=1)
    assert all(len(one.holders(layer, e)) == 1 for layer in range(2) for e in range(8))
    assert sum(len(n.files()) for n in one.nodes) == 16


def test_balance_follows_the_budgets_within_one_expert():
    sizes = lambda layer, e: 1000 + 37 * ((layer * 8 + e) % 5)  # noqa: E731 - uneven experts
    m = _manifest(layers=3, experts=24, size=sizes)
    budgets = {"a": BUDGET, "b": 2 * BUDGET, "c": 3 * BUDGET}
    for replicas in (1, 2):
        plan = make_plan(m, [(k, v, None) for k, v in budgets.items()], replicas)
        held = {n.name: sum(sizes(layer, e) for layer, e in n.pairs()) for n in plan.nodes}
        total = sum(held.values())
        assert total == replicas * sum(sizes(layer, e) for layer in range(3) for e in range(24))
        for name, b in budgets.items():
            assert abs(held[name] - total * b / sum(budgets.values())) <= 1200, (replicas, held)
        # Each layer is spread too (the expected per-token load of every layer follows the budgets).
        for layer in range(3):
            counts = [len(n.experts.get(layer, ())) for n in plan.nodes]
            assert abs(counts[0] * 3 - counts[2]) <= 3 and abs(counts[0] * 2 - counts[1]) <= 2, counts


def test_disk_limits_move_experts_to_other_nodes():
    plan = make_plan(M, [("small", BUDGET, 2500), ("big", BUDGET, None)], replicas=1)
    assert sum(1 for _ in plan.node("small").pairs()) == 2  # 2 x 1000 bytes fit in 2500
    assert len(plan.node("big").pairs()) == 14


def test_a_node_short_of_disk_is_named_with_the_bytes():
    # 16 experts x 1000 bytes x 2 copies = 32000 bytes; disks 15000 + 15500 leave 1500 bytes of copies unplaced,
    # whole experts only: a holds 15, b holds 15 -> 2 copies (2000 bytes) have no room; b has 500 bytes free.
    with pytest.raises(UsageError) as e:
        make_plan(M, [("a", BUDGET, 15000), ("b", BUDGET, 15500)], replicas=2)
    msg = str(e.value)
    assert "\n" not in msg and "node b is short of disk by 2000 bytes" in msg, msg


def test_a_node_short_of_memory_is_named_with_the_bytes():
    floor = node_memory_floor([1000], 8, 2)
    assert floor == 1000 * 3 + 4 * 2 * 1000 + 2 * 1000 + HEADER_MEMO_MIN + MIN_ACTIVATION_RESERVE  # 2 reads in flight
    assert node_memory_floor([1000], 8, 2, readers=5) == floor + 3 * 1000
    with pytest.raises(UsageError) as e:
        make_plan(M, [("a", BUDGET, None), ("tiny", floor - 123, None)], replicas=1)
    assert "node tiny is short of memory by 123 bytes" in str(e.value) and "\n" not in str(e.value)
    make_plan(M, [("a", BUDGET, None), ("tiny", floor, None)], replicas=1)


@pytest.mark.parametrize("nodes, replicas, expected", [
    ([("a", BUDGET, None)], 2, "--replicas 2 needs at least 2 nodes"),
    ([("a", BUDGET, None), ("a", BUDGET, None)], 1, "'a' is named more than once"),
    ([("A", BUDGET, None)], 1, "must match"),
    ([("a", 0, None)], 1, "memory budget must be in"),
    ([("a", BUDGET, 0)], 1, "disk must be in"),
    ([("a", BUDGET, None)], 17, "--replicas must be an integer in [1, 16]"),
    ([], 1, "give 1 to"),
])
def test_make_plan_refuses_bad_nodes(nodes, replicas, expected):
    with pytest.raises(UsageError, match=None) as e:
        make_plan(M, nodes, replicas)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_make_plan_needs_a_contract_and_experts():
    with pytest.raises(UsageError, match="no resource contract"):
        make_plan(_manifest(contract=False), [("a", BUDGET, None)], 1)
    with pytest.raises(UsageError, match="lists no routed expert"):
        make_plan(_manifest(experts=0), [("a", BUDGET, None)], 1)


def test_node_lookup():
    plan = make_plan(M, [("a", BUDGET, None), ("b", BUDGET, None)], 1)
    assert plan.node("b").name == "b"
    with pytest.raises(UsageError, match="no node named 'zz'"):
        plan.node("zz")


KEYS = {name: generate().public for name in ("a", "b", "c")}
GOOD = make_plan(M, [("a", BUDGET, None), ("b", BUDGET, 20000), ("c", BUDGET, None)], replicas=2, keys=KEYS)


def _edit(change):
    doc = _doc(GOOD)
    change(doc)
    return _bytes(doc)


def _set(path, value):
    def change(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _add_holder(doc):
    doc["nodes"][0]["experts"].setdefault("0", [])
    doc["nodes"][0]["experts"]["0"] = sorted(set(range(8)))


REFUSALS = [
    (b"\xff\xfe", UsageError, "not UTF-8"),
    (b"[1, 2", UsageError, "not valid JSON"),
    (b'{"format": 1, "format": 2}', UsageError, "names 'format' twice"),
    (b'{"a": NaN}', UsageError, "NaN"),
    (b"[]", UsageError, "plan must be a JSON object"),
    (_edit(lambda d: d.pop("replicas")), UsageError, "plan lacks replicas"),
    (_edit(_set(["extra"], 1)), UsageError, "unknown key(s) 'extra'"),
    (_edit(_set(["nodes", 0, "extra"], 1)), UsageError, "node 0 has unknown key(s) 'extra'"),
    (_edit(_set(["format"], "shardtool-plan/1")), UsageError, "plan format is 'shardtool-plan/1'"),
    (_edit(lambda d: d["nodes"][0].pop("key")), UsageError, "node 0 lacks key"),
    (_edit(_set(["nodes", 0, "key"], "AB" * 32)), UsageError, "node a: key must be null or 64 lowercase hex"),
    (_edit(_set(["nodes", 0, "key"], 7)), UsageError, "node a: key must be null or 64 lowercase hex"),
    (_edit(_set(["nodes", 1, "key"], KEYS["a"].raw.hex())), UsageError, "nodes a and b have the same key"),
    (_edit(_set(["root"], "ab" * 31)), UsageError, "root must be 64 lowercase hex digits"),
    (_edit(_set(["root"], "AB" * 32)), UsageError, "root must be 64 lowercase hex digits"),
    (_edit(_set(["root"], "ab" * 32)), VerificationError, "root " + "ab" * 32),
    (_edit(_set(["manifest_version"], 4)), VerificationError, "version 4"),
    (_edit(_set(["manifest_version"], True)), UsageError, "manifest_version must be an integer"),
    (_edit(_set(["model_id"], "other/model")), VerificationError, "'other/model'"),
    (_edit(_set(["replicas"], 0)), UsageError, "replicas must be in [1, 16]"),
    (_edit(_set(["replicas"], 17)), UsageError, "replicas must be in [1, 16]"),
    (_edit(_set(["replicas"], 2.0)), UsageError, "replicas must be an integer"),
    (_edit(_set(["replicas"], 3)), UsageError, "is held by 2 node(s), the plan promises 3"),
    (_edit(_set(["nodes"], [])), UsageError, "nodes must be a list of 1 to"),
    (_edit(_set(["nodes", 0, "name"], "Bad")), UsageError, "name must match"),
    (_edit(_set(["nodes", 0, "name"], "a" * 33)), UsageError, "name must match"),
    (_edit(_set(["nodes", 0, "name"], "a\n")), UsageError, "name must match"),
    (_edit(_set(["nodes", 1, "name"], "a")), UsageError, "names node 'a' more than once"),
    (_edit(_set(["nodes", 0, "memory_budget"], 0)), UsageError, "memory_budget must be in [1, "),
    (_edit(_set(["nodes", 0, "memory_budget"], 2**62 + 1)), UsageError, "memory_budget must be in [1, "),
    (_edit(_set(["nodes", 0, "memory_budget"], 10**400)), UsageError, "a huge number"),
    (_edit(_set(["nodes", 0, "memory_budget"], "1GiB")), UsageError, "memory_budget must be an integer"),
    (_edit(_set(["nodes", 0, "memory_budget"], 1000)), UsageError, "node a is short of memory by"),
    (_edit(_set(["nodes", 1, "disk"], 0)), UsageError, "node b: disk must be in"),
    (_edit(_set(["nodes", 1, "disk"], 1000)), UsageError, "node b is short of disk by"),
    (_edit(_set(["nodes", 0, "experts"], [])), UsageError, "experts must be an object"),
    (_edit(_set(["nodes", 0, "experts", "01"], [1])), UsageError, "layer key '01' is not a layer number"),
    (_edit(_set(["nodes", 0, "experts", "x"], [1])), UsageError, "layer key 'x' is not a layer number"),
    (_edit(_set(["nodes", 0, "experts", "0"], [])), UsageError, "layer 0 must list at least one expert id"),
    (_edit(_set(["nodes", 0, "experts", "0"], [1, 1])), UsageError, "holds layer 0 expert 1 more than once"),
    (_edit(_set(["nodes", 0, "experts", "0"], [-1])), UsageError, "expert id must be in [0, "),
    (_edit(_set(["nodes", 0, "experts", "9"], [0])), UsageError, "holds layer 9 expert 0, which the manifest"),
    (_edit(_set(["nodes", 0, "experts", "0"], [8])), UsageError, "holds layer 0 expert 8, which the manifest"),
    (_edit(lambda d: [n["experts"].pop("1", None) for n in d["nodes"]]), UsageError,
     "layer 1 expert 0 is held by 0 node(s)"),
    (_edit(_set(["coordinator_files"], [])), UsageError, "coordinator_files lacks 'config.json'"),
    (_edit(lambda d: d["coordinator_files"].append("zz.bin")), UsageError, "names 'zz.bin'"),
    (_edit(lambda d: d["coordinator_files"].reverse()), UsageError, "is not sorted"),
    (_edit(_set(["coordinator_files"], "config.json")), UsageError, "coordinator_files must be a list"),
    (b" " * (MAX_PLAN_BYTES + 1), UsageError, f"at most {MAX_PLAN_BYTES} allowed"),
]


@pytest.mark.parametrize("data, cls, expected", REFUSALS, ids=[r[2][:40] for r in REFUSALS])
def test_every_refusal_is_one_line_naming_the_plan(data, cls, expected):
    with pytest.raises(ShardtoolError) as e:
        decode_plan(data, M, what=WHAT)
    assert type(e.value) is cls, (type(e.value), str(e.value))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{WHAT}: ") and expected in msg, msg


def test_the_refusal_table_starts_from_a_plan_that_decodes():
    assert decode_plan(_bytes(_doc(GOOD)), M, what=WHAT) == GOOD


def test_a_plan_for_another_release_names_both_roots():
    other = _manifest(version=4, size=lambda layer, e: 1001)
    plan = make_plan(other, [("a", BUDGET, None)], 1)
    with pytest.raises(VerificationError) as e:
        decode_plan(encode_plan(plan), M, what=WHAT)
    assert other.head.merkle_root.hex() in str(e.value) and M.head.merkle_root.hex() in str(e.value)


def test_an_extra_copy_is_allowed_but_not_twice_on_one_node():
    doc = _doc(GOOD)
    _add_holder(doc)
    plan = decode_plan(_bytes(doc), M, what=WHAT)
    assert "a" in plan.holders(0, 7)


def test_summary_puts_the_cluster_next_to_one_machine():
    s1 = summarize(make_plan(M, [("a", BUDGET, None)], 1), M, 2.0)
    assert s1["single_machine"]["expert_bytes_per_token"] == 2 * 2 * 1000
    assert s1["cluster"]["expert_bytes_per_token"] == 4000 == s1["nodes"][0]["expert_bytes_per_token"]
    assert s1["coordinator"] == {"files": 6, "bytes_on_disk": 20 + 30 + 500 + 400 + 2 * 300}
    s2 = summarize(make_plan(M, [("a", BUDGET, None), ("b", BUDGET, None)], 1), M, 2.0)
    assert [n["expert_bytes_per_token"] for n in s2["nodes"]] == [2000, 2000]
    assert s2["cluster"]["seconds_per_token"] == pytest.approx(s1["cluster"]["seconds_per_token"] / 2)
    # Two copies on two nodes: each node holds everything and, sharing the calls, reads half.
    s3 = summarize(make_plan(M, [("a", BUDGET, None), ("b", BUDGET, None)], 2), M, 4.0)
    assert [n["files"] for n in s3["nodes"]] == [16, 16]
    assert [n["bytes_on_disk"] for n in s3["nodes"]] == [16000, 16000]
    assert s3["cluster"]["expert_bytes_per_token"] == 2000
    assert s3["single_machine"]["seconds_per_token"] == pytest.approx(4000 / 4e9)
    with pytest.raises(UsageError, match="--disk-gbps"):
        summarize(GOOD, M, float("nan"))


def test_make_plan_names_each_nodes_key_once():
    assert [n.public_key() for n in GOOD.nodes] == [KEYS["a"], KEYS["b"], KEYS["c"]]
    with pytest.raises(UsageError, match="'zz', which is not a node"):
        make_plan(M, [("a", BUDGET, None)], 1, keys={"zz": KEYS["a"]})
    with pytest.raises(UsageError, match="nodes a and b have the same key"):
        make_plan(M, [("a", BUDGET, None), ("b", BUDGET, None)], 1, keys={"a": KEYS["a"], "b": KEYS["a"]})
    with pytest.raises(UsageError, match="names no key for node a"):
        make_plan(M, [("a", BUDGET, None)], 1).node("a").public_key()


def test_nodeplan_and_plan_are_values():
    node = NodePlan("a", 1, None, {0: (1, 2)})
    assert node.files() == [layout.expert_path(0, 1), layout.expert_path(0, 2)]
    assert hash(node) == hash(NodePlan("a", 1, None, {0: (3,)}))  # experts are not hashed (a dict)


def test_a_plan_assumes_the_readers_a_node_starts_with_by_default():
    """The plan checks each node's budget with NODE_READERS reads in flight: `shardtool node`'s own default."""
    import typer.main

    from shardtool.cli import build_app
    from shardtool.runtime.engine._cluster_plan import NODE_READERS

    command = typer.main.get_command(build_app(("node_cmd",))).commands["node"]  # the group's one command
    readers = next(p for p in command.params if p.name == "readers")
    assert readers.default == NODE_READERS


# ---------------------------------------------------------------------------------------------- pipeline plans

def test_expert_plans_encode_to_the_bytes_they_had_before_pipeline_plans():
    """A plan made before nodes could hold layers (SHA-256 of its encoding, recorded then): same bytes, so every
    signed expert plan still verifies; no node writes a "layers" key."""
    import hashlib

    plan = make_plan(M, [("a", BUDGET, None), ("b", BUDGET, 20000), ("c", 2 * BUDGET, None)], replicas=2)
    data = encode_plan(plan)
    assert hashlib.sha256(data).hexdigest() == "b5ee4e4247f3d1c29276bfd41ad026c0f9531c66f8b0e6ea1882a37209090ea3"
    assert b'"layers"' not in data and b'"layers"' not in encode_plan(GOOD)
    assert not plan.pipeline and plan.spans() == () and all(n.layers == () for n in plan.nodes)


# Four decoder layers, layer 0 dense (DeepSeek-V3's layout), four 1000-byte experts in each MoE layer: layer
# bytes 300, 4300, 4300, 4300. Equal budgets cut after layer 1 (its midpoint 2450 is within a third of 13200).
P_M = _manifest(layers=4, experts=4, dense=(0,))
P_KEYS = {name: generate().public for name in ("a", "b", "c")}
PIPE = make_plan(P_M, [("a", BUDGET, None), ("b", BUDGET, 20000), ("c", BUDGET, None)], 1, keys=P_KEYS,
                 pipeline=True)


def test_a_pipeline_plan_round_trips_and_names_each_nodes_files():
    assert PIPE.pipeline and PIPE.spans() == (("a", (0, 1)), ("b", (2,)), ("c", (3,)))
    data = encode_plan(PIPE)
    got = decode_plan(data, P_M, what=WHAT)
    assert got == PIPE and encode_plan(got) == data and got.spans() == PIPE.spans()
    assert [n["layers"] for n in json.loads(data)["nodes"]] == [[0, 1], [2], [3]]
    a = PIPE.node("a")
    assert a.experts == {1: (0, 1, 2, 3)}  # layer 0 is dense: no "0" key
    assert a.files() == sorted([layout.trunk_path(0), layout.trunk_path(1), *(layout.expert_path(1, e)
                                                                              for e in range(4))])
    assert node_files(PIPE, "b") == sorted(["config.json", layout.trunk_path(2),
                                            *(layout.expert_path(2, e) for e in range(4))])
    # The coordinator keeps every non-expert file, the nodes' layer trunks too.
    assert PIPE.holders(3, 2) == ("c",)
    assert PIPE.coordinator_files == tuple(sorted(e.path for e in P_M.entries if e.kind != "expert"))


def _pipe_edit(change):
    doc = _doc(PIPE)
    change(doc)
    return _bytes(doc)


def _drop_node(i):
    return lambda d: d["nodes"].pop(i)


EXPERT_FLOOR_A = node_memory_floor([1000] * 4, 4, 2)  # node a's experts alone; its trunk adds 300 + 300
PIPE_REFUSALS = [
    ("layers not a list", _set(["nodes", 0, "layers"], 5), "node a: layers must be a list of 1 to 65536"),
    ("layers an object", _set(["nodes", 0, "layers"], {"0": 1}), "got dict"),
    ("layers empty", _set(["nodes", 0, "layers"], []), "got an empty list (an expert node has no layers key)"),
    ("layers too long", _set(["nodes", 0, "layers"], list(range(65537))), "got 65537 entries"),
    ("a bool layer", _set(["nodes", 0, "layers"], [True]), "node a: layers entry 0 must be an integer, got bool"),
    ("a float layer", _set(["nodes", 0, "layers"], [0, 1.0]), "node a: layers entry 1 must be an integer, got float"),
    ("a str layer", _set(["nodes", 0, "layers"], ["0"]), "layers entry 0 must be an integer, got str"),
    ("a null layer", _set(["nodes", 0, "layers"], [None]), "layers entry 0 must be an integer, got NoneType"),
    ("a negative layer", _set(["nodes", 0, "layers"], [-1, 0]), "layers entry 0 must be in [0, 65535], got -1"),
    ("a layer past MAX_LAYER", _set(["nodes", 2, "layers"], [65536]), "node c: layers entry 0 must be in [0, 65535]"),
    ("descending", _set(["nodes", 0, "layers"], [1, 0]), "consecutive and ascending, got 1 then 0"),
    ("a gap", _set(["nodes", 0, "layers"], [0, 2]), "consecutive and ascending, got 0 then 2"),
    ("a repeat", _set(["nodes", 0, "layers"], [0, 0, 1]), "consecutive and ascending, got 0 then 0"),
    ("mixing", lambda d: d["nodes"][1].pop("layers"), "node b holds no layers but other nodes of the plan do"),
    ("replicas 2", _set(["replicas"], 2), "pipeline plans have one copy of each layer (replicas 1), the plan has "
                                          "replicas 2"),
    ("overlapping spans", _set(["nodes", 1, "layers"], [1, 2]),
     "node b holds layers 1..2, overlapping the nodes before it (they hold up to layer 1)"),
    ("a layer in the middle held by none", _drop_node(1), "layer 2 is held by no node: node c starts at layer 3"),
    ("the last layer held by none", _drop_node(2), "layer 3 is held by no node: the last node, b, ends at layer 2"),
    ("not starting at 0", _set(["nodes", 0, "layers"], [1]),
     "layer 0 is held by no node: node a starts at layer 1 (the first node starts at layer 0)"),
    ("a layer past the model", _set(["nodes", 2, "layers"], [3, 4]), "node c holds layer 4, the manifest has "
                                                                     "layers 0..3"),
    ("a node missing one expert of its layer", _set(["nodes", 1, "experts", "2"], [0, 1, 3]),
     "node b lacks layer 2 expert 2: a pipeline node holds every routed expert of its layers"),
    ("an expert outside the span", _set(["nodes", 2, "experts", "2"], [0]),
     "node c holds layer 2 expert 0, outside its layers 3"),
    ("an expert the manifest does not list", _set(["nodes", 2, "experts", "3"], [0, 1, 2, 3, 4]),
     "node c holds layer 3 expert 4, which the manifest does not list"),
    ("too little memory for the trunk", _set(["nodes", 0, "memory_budget"], EXPERT_FLOOR_A + 599),
     "node a is short of memory by 1 bytes: one step over its experts and layer trunks needs"),
    ("too little disk for the trunk", _set(["nodes", 1, "disk"], 4000),
     "node b is short of disk by 300 bytes: its experts and layer trunks take 4300 bytes"),
]


@pytest.mark.parametrize("change, expected", [c[1:] for c in PIPE_REFUSALS], ids=[c[0] for c in PIPE_REFUSALS])
def test_every_pipeline_refusal_is_one_usage_error_line(change, expected):
    with pytest.raises(ShardtoolError) as e:
        decode_plan(_pipe_edit(change), P_M, what=WHAT)
    assert type(e.value) is UsageError, (type(e.value), str(e.value))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{WHAT}: ") and expected in msg, msg


def test_the_pipeline_refusal_table_starts_from_a_plan_that_decodes():
    assert decode_plan(_bytes(_doc(PIPE)), P_M, what=WHAT) == PIPE
    decode_plan(_pipe_edit(_set(["nodes", 0, "memory_budget"], EXPERT_FLOOR_A + 600)), P_M, what=WHAT)
    decode_plan(_pipe_edit(_set(["nodes", 1, "disk"], 4300)), P_M, what=WHAT)


# Eight layers of uneven bytes, layer 0 dense: the cuts must follow the bytes, not the layer count.
U_EXPERT = lambda layer, e: 800 + 150 * layer + 10 * e  # noqa: E731
U_M = _manifest(layers=8, experts=6, dense=(0,), size=U_EXPERT, trunk=lambda layer: 200 + 50 * layer)
U_LAYER = [200 + 50 * layer + (0 if layer == 0 else sum(U_EXPERT(layer, e) for e in range(6))) for layer in range(8)]


@pytest.mark.parametrize("budgets", [(1, 1), (1, 3), (3, 1), (1, 1, 1), (1, 2, 4), (4, 1, 1)])
def test_make_plan_pipeline_cuts_consecutive_spans_by_budget(budgets):
    nodes = [(name, b * BUDGET, None) for name, b in zip("abc", budgets)]
    plan = make_plan(U_M, nodes, 1, pipeline=True)
    spans = [layers for _, layers in plan.spans()]
    assert [layer for span in spans for layer in span] == list(range(8)) and all(spans)
    held = [sum(U_LAYER[layer] for layer in span) for span in spans]
    total, whole = sum(held), sum(budgets)
    for i in range(len(budgets)):  # each cut within one layer of the budgets' share
        assert abs(sum(held[:i + 1]) - total * sum(budgets[:i + 1]) / whole) <= max(U_LAYER), (budgets, held)
    for i in range(len(budgets)):
        for j in range(len(budgets)):
            if budgets[i] > budgets[j]:
                assert held[i] >= held[j], (budgets, held)
    for node in plan.nodes:  # every expert of its layers, nothing else
        assert node.pairs() == [(layer, e) for layer in node.layers if layer != 0 for e in range(6)]
    assert encode_plan(make_plan(U_M, nodes, 1, pipeline=True)) == encode_plan(plan)  # deterministic
    assert decode_plan(encode_plan(plan), U_M, what=WHAT) == plan


def test_make_plan_pipeline_puts_the_trunk_in_the_memory_floor():
    sizes = {e.path: e.size for e in P_M.entries}
    floor = pipeline_node_floor(PIPE.node("a"), sizes, 2)
    assert floor == EXPERT_FLOOR_A + 600
    assert pipeline_node_floor(GOOD.node("a"), {e.path: e.size for e in M.entries}, 2) == \
        node_memory_floor([1000] * len(GOOD.node("a").pairs()), max(map(len, GOOD.node("a").experts.values())), 2)
    with pytest.raises(UsageError) as e:
        make_plan(P_M, [("a", floor - 1, None), ("b", BUDGET, None), ("c", BUDGET, None)], 1, pipeline=True)
    assert "node a is short of memory by 1 bytes" in str(e.value)


@pytest.mark.parametrize("manifest, nodes, replicas, expected", [
    (P_M, 5, 1, "a pipeline plan gives each node at least one decoder layer: 5 nodes for 4 layers"),
    (P_M, 2, 2, "pipeline plans have one copy of each layer (replicas 1), got --replicas 2"),
    (_manifest(without=(layout.trunk_path(0), layout.trunk_path(1))), 1, 1,
     "the manifest does not list trunk/layer-000.safetensors: a pipeline plan needs the trunk of every decoder "
     "layer 0..1"),
    (_manifest(layers=3, without=(layout.trunk_path(1),)), 1, 1,
     "the manifest does not list trunk/layer-001.safetensors"),
    (_manifest(layers=3, without=(layout.trunk_path(2),)), 1, 1,
     "the manifest does not list trunk/layer-002.safetensors"),
])
def test_make_plan_pipeline_refusals(manifest, nodes, replicas, expected):
    with pytest.raises(UsageError) as e:
        make_plan(manifest, [(f"n{i}", BUDGET, None) for i in range(nodes)], replicas, pipeline=True)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_summary_of_a_pipeline_plan_counts_each_nodes_trunk():
    s = summarize(PIPE, P_M, 2.0)
    assert s["placement"] == "pipeline" and s["replicas"] == 1
    assert [n["layers"] for n in s["nodes"]] == [[0, 1], [2], [3]]
    assert [n["files"] for n in s["nodes"]] == [6, 5, 5]
    assert [n["bytes_on_disk"] for n in s["nodes"]] == [4600, 4300, 4300]
    assert s["nodes"][0]["memory_floor"] == EXPERT_FLOOR_A + 600
    # Each layer's experts sit on one node: per token, 2 of 4 experts of each MoE layer, on that layer's node.
    assert [n["expert_bytes_per_token"] for n in s["nodes"]] == [2000, 2000, 2000]
    assert s["cluster"]["expert_bytes_per_token"] == 6000 == s["single_machine"]["expert_bytes_per_token"]
    expert = summarize(GOOD, M, 2.0)
    assert expert["placement"] == "experts" and all(n["layers"] == [] for n in expert["nodes"])


def test_a_pipeline_plan_leaves_layers_past_the_decoder_out_of_the_spans_and_their_experts_to_the_last_node():
    """DeepSeek's multi-token-prediction layers are stored, never run to generate: the contract's num_layers stops
    before them. Their trunk stays with the coordinator's files, their experts go to the last node."""
    m = _manifest(layers=4, mtp=1)  # decoder layers 0..2, layer 3 past them
    plan = make_plan(m, [("a", BUDGET, None), ("b", BUDGET, None)], 1, pipeline=True)
    assert [n.layers for n in plan.nodes][-1][-1] == 2 and sum(len(n.layers) for n in plan.nodes) == 3
    assert 3 in plan.nodes[-1].experts and 3 not in plan.nodes[0].experts
    assert layout.trunk_path(3) in plan.coordinator_files
    assert decode_plan(encode_plan(plan), m, what="plan.json") == plan
    moved = json.loads(encode_plan(plan))
    moved["nodes"][0]["experts"]["3"] = moved["nodes"][1]["experts"].pop("3")  # the first node may not hold them
    with pytest.raises(UsageError, match="holds layer 3 expert 0, outside its layers"):
        decode_plan(json.dumps(moved).encode(), m, what="plan.json")
