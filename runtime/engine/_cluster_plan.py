"""The cluster plan: which node of a cluster holds which routed experts (or which whole decoder layers) of a
verified model.

Pure functions over bytes and the verified manifest; no I/O. A plan is made by `shardtool plan` and handed to
the coordinator and to every node, possibly by another machine, so `decode_plan` treats it as untrusted input:
size cap before parsing, strict JSON, unknown keys refused, every field's type and range checked, and the
plan must name exactly the verified manifest (model ID, version, Merkle root) and cover its experts.

The file (`encode_plan`, canonical: sorted keys, no insignificant whitespace, ASCII):

    {"coordinator_files": ["config.json", "trunk/embed.safetensors", ...],   every non-expert path, sorted
     "format": "shardtool-plan/2",
     "manifest_version": 3, "model_id": "org/model", "root": "<64 hex digits: the signed Merkle root>",
     "nodes": [{"disk": null | bytes, "experts": {"<layer>": [expert ids, ascending], ...},
                "key": null | "<64 hex digits: the node's raw Ed25519 public key>",
                "layers": [first, ..., last],        only in a pipeline plan: consecutive decoder layers
                "memory_budget": bytes, "name": "a"}, ...],
     "replicas": 2}

Two placements. Experts (expert parallelism, no node has "layers"): the coordinator runs every layer's trunk and
sends each MoE layer's selected experts to their holders, `replicas` copies of each expert on distinct nodes: one
round per MoE layer per token. Pipeline (every node has "layers"): the nodes, in plan order, hold consecutive spans
of decoder layers that together cover layers 0..n-1 (n: the signed contract's num_layers), each node the trunk
file of each of its layers and every routed expert of them and nothing else (the last node also the experts of
layers past n, DeepSeek's multi-token prediction: stored, never run); replicas is 1. A token makes one
round per node. In both, coordinator_files is every non-expert path: the coordinator keeps the trunk on disk (a
pipeline coordinator loads only the layers outside the spans: embedding and head). A plan with no "layers" key
encodes exactly as before pipeline plans existed, so its signature stays valid.

A plan used by a cluster is signed by the operator (`sign_plan`): a detached signature file beside it (PLAN.sig,
`{"format": "shardtool-plan-signature/1", "keyid": ..., "sig": "<128 hex digits>"}`), an Ed25519 signature over
DSSE's PAE(PLAN_PAYLOAD_TYPE, the plan's exact bytes). `open_signed_plan` checks it against the operator's keys
before the plan is parsed; the node keys the plan names are then what every node's replies are checked against.

Load model (`summarize`): tokens are assumed to route uniformly over a layer's experts, and a node holding a
copy of an expert takes 1/R of that expert's calls (the coordinator spreads an expert's calls over its R
holders). A coordinator that sends every call to the first holder and keeps the others as standby would
put the whole load (R = 1 figures) on the first holders. In a pipeline plan a layer's experts all sit on one
node and the nodes run one after the other, so the cluster's cold reads per token are one machine's: what a
pipeline buys is memory per node (its span's trunk stays resident, counted in its memory floor) and rounds.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from shardtool import layout
from shardtool.errors import ShardtoolError, SignatureError, UsageError, VerificationError
from shardtool.keys import PrivateKey, PublicKey
from shardtool.manifest import MAX_EXPERT, MAX_LAYER, Envelope, Signature, VerifiedManifest, pae, verify_envelope
from ._plan import MIN_ACTIVATION_RESERVE
from shardtool.runtime.store import header_memo_bytes
from shardtool.strict_json import loads_strict

NODE_CONFIG = "config.json"  # the one small file a node reads besides its experts

FORMAT = "shardtool-plan/2"
SIGNATURE_FORMAT = "shardtool-plan-signature/1"
PLAN_PAYLOAD_TYPE = "application/vnd.shardtool.cluster-plan+json"
MAX_SIGNATURE_FILE = 4096
MAX_PLAN_BYTES = 64 * 2**20
MAX_NODES = 1024
MAX_REPLICAS = 16
MAX_BUDGET = 2**62
_UNLIMITED = 2**63 - 1  # a node without a disk limit
NODE_NAME_PATTERN = NAME_PATTERN = r"[a-z0-9][a-z0-9_-]{0,31}"
_NAME = re.compile(NAME_PATTERN, re.ASCII)
_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,4}", re.ASCII)
_TOP_KEYS = ("coordinator_files", "format", "manifest_version", "model_id", "nodes", "replicas", "root")
_NODE_KEYS = ("disk", "experts", "key", "memory_budget", "name")
_NODE_OPTIONAL = ("layers",)  # written only when non-empty: an expert plan encodes as before
_HEX_KEY = re.compile(r"[0-9a-f]{64}", re.ASCII)


@dataclass(frozen=True)
class NodePlan:
    """One node: its name, the budgets the plan was made for, the experts it holds and, in a pipeline plan, the
    decoder layers it runs."""

    name: str
    memory_budget: int  # bytes of memory the node may use (its shard cache, working buffers)
    disk: int | None  # bytes of disk for its files; None: not limited
    experts: dict[int, tuple[int, ...]] = field(hash=False)  # MoE layer -> expert ids this node holds, ascending
    key: bytes | None = None  # the node's raw Ed25519 public key: its replies must verify with it; None: no cluster use
    layers: tuple[int, ...] = ()  # decoder layers whose trunk it holds and runs, consecutive; (): an expert node

    def public_key(self) -> PublicKey:
        """The key this node's replies are checked against; a plan without one cannot run a cluster."""
        if self.key is None:
            raise UsageError(f"the plan names no key for node {self.name}: a cluster checks every node's replies "
                             f"against its key", hint=f"make the plan with --node {self.name}=BUDGET,key={self.name}.pub")
        return PublicKey(self.key)

    def files(self) -> list[str]:
        """The split-layout paths of the experts and layer trunks this node holds, sorted: what it must have and
        audit."""
        return sorted([*(layout.expert_path(layer, e) for layer, ids in self.experts.items() for e in ids),
                       *(layout.trunk_path(layer) for layer in self.layers)])

    def pairs(self) -> list[tuple[int, int]]:
        """(layer, expert) for every expert held, by layer then expert."""
        return [(layer, e) for layer in sorted(self.experts) for e in self.experts[layer]]


@dataclass(frozen=True)
class ClusterPlan:
    """Which node holds which experts (and, in a pipeline plan, which decoder layers) of one verified manifest;
    every non-expert file also stays with the coordinator."""

    model_id: str
    manifest_version: int
    root: bytes  # the manifest's signed Merkle root (32 bytes)
    replicas: int  # copies of each expert, each on a distinct node
    coordinator_files: tuple[str, ...]  # every manifest path that is not a routed expert, sorted
    nodes: tuple[NodePlan, ...]

    def _index(self) -> Mapping[tuple[int, int], tuple[str, ...]]:
        index = self.__dict__.get("_holders")
        if index is None:
            found: dict[tuple[int, int], list[str]] = defaultdict(list)
            for node in self.nodes:
                for pair in node.pairs():
                    found[pair].append(node.name)
            index = MappingProxyType({k: tuple(v) for k, v in found.items()})
            object.__setattr__(self, "_holders", index)  # a derived cache on a frozen instance
        return index

    @property
    def pipeline(self) -> bool:
        """True when the nodes hold spans of decoder layers (`check_plan`: then every node does)."""
        return any(node.layers for node in self.nodes)

    def spans(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(node name, its layers) in plan order, which `check_plan` made layer order; () for an expert plan."""
        return tuple((node.name, node.layers) for node in self.nodes) if self.pipeline else ()

    def holders(self, layer: int, expert: int) -> tuple[str, ...]:
        """Names of the nodes holding this expert, in plan order (empty if none does)."""
        return self._index().get((layer, expert), ())

    def node(self, name: str) -> NodePlan:
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes[:8]) + (", ..." if len(self.nodes) > 8 else "")
        raise UsageError(f"the plan has no node named {name!r} (it names {known})")


# ---------------------------------------------------------------------------------------------- encoding

def encode_plan(plan: ClusterPlan) -> bytes:
    """The one encoding of a plan: JSON with sorted keys, compact separators, ASCII, a final newline."""
    import json

    doc = {
        "format": FORMAT, "model_id": plan.model_id, "manifest_version": plan.manifest_version,
        "root": plan.root.hex(), "replicas": plan.replicas, "coordinator_files": list(plan.coordinator_files),
        "nodes": [{"name": n.name, "memory_budget": n.memory_budget, "disk": n.disk,
                   "key": None if n.key is None else n.key.hex(),
                   "experts": {str(layer): list(n.experts[layer]) for layer in sorted(n.experts)},
                   **({"layers": list(n.layers)} if n.layers else {})}
                  for n in plan.nodes],
    }
    return (json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
            + "\n").encode("ascii")


def _fields(obj: Any, keys: Sequence[str], what: str, optional: Sequence[str] = ()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise UsageError(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    unknown = sorted(set(obj) - set(keys) - set(optional))
    if missing or unknown:
        parts = ([f"lacks {', '.join(missing)}"] if missing else []) + \
                ([f"has unknown key(s) {', '.join(repr(k[:40]) for k in unknown[:4])}"] if unknown else [])
        raise UsageError(f"{what} {' and '.join(parts)}")
    return obj


def _int(value: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{what} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise UsageError(f"{what} must be in [{lo}, {hi}], got {value if abs(value) < 10**30 else 'a huge number'}")
    return value


def _node(raw: Any, i: int) -> NodePlan:
    d = _fields(raw, _NODE_KEYS, f"node {i}", _NODE_OPTIONAL)
    name = d["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UsageError(f"node {i}: name must match {NAME_PATTERN}, got {str(name)[:40]!r}")
    budget = _int(d["memory_budget"], 1, MAX_BUDGET, f"node {name}: memory_budget")
    disk = None if d["disk"] is None else _int(d["disk"], 1, MAX_BUDGET, f"node {name}: disk")
    node_key = d["key"]
    if node_key is not None and (not isinstance(node_key, str) or not _HEX_KEY.fullmatch(node_key)):
        raise UsageError(f"node {name}: key must be null or 64 lowercase hex digits (a raw Ed25519 public key)")
    raw_experts = d["experts"]
    if not isinstance(raw_experts, dict):
        raise UsageError(f"node {name}: experts must be an object of layer -> expert ids")
    experts: dict[int, tuple[int, ...]] = {}
    for key, ids in raw_experts.items():
        if not _LAYER_KEY.fullmatch(key) or int(key) > MAX_LAYER:
            raise UsageError(f"node {name}: layer key {key[:40]!r} is not a layer number in [0, {MAX_LAYER}]")
        layer = int(key)
        if not isinstance(ids, list) or not ids:
            raise UsageError(f"node {name}: layer {layer} must list at least one expert id")
        seen: set[int] = set()
        for e in ids:
            _int(e, 0, MAX_EXPERT, f"node {name}: layer {layer} expert id")
            if e in seen:
                raise UsageError(f"node {name}: holds layer {layer} expert {e} more than once")
            seen.add(e)
        experts[layer] = tuple(sorted(seen))
    return NodePlan(name, budget, disk, dict(sorted(experts.items())),
                    None if node_key is None else bytes.fromhex(node_key),
                    _layers(d["layers"], name) if "layers" in d else ())


def _layers(raw: Any, name: str) -> tuple[int, ...]:
    """A node's "layers": 1 to MAX_LAYER + 1 layer numbers, each one more than the one before."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_LAYER + 1:
        found = (("an empty list" if not raw else f"{len(raw)} entries") if isinstance(raw, list)
                 else type(raw).__name__)
        raise UsageError(f"node {name}: layers must be a list of 1 to {MAX_LAYER + 1} consecutive layer numbers, got "
                         f"{found} (an expert node has no layers key)")
    for i, layer in enumerate(raw):
        _int(layer, 0, MAX_LAYER, f"node {name}: layers entry {i}")
        if i and layer != raw[i - 1] + 1:
            raise UsageError(f"node {name}: layers must be consecutive and ascending, got {raw[i - 1]} then {layer}")
    return tuple(raw)


def decode_plan(data: bytes, manifest: VerifiedManifest, *, what: str) -> ClusterPlan:
    """Parse and check an untrusted plan against the verified manifest; every refusal is one line naming
    `what` (the plan file). A plan for other weights (model ID, version or root) is a VerificationError;
    anything else wrong with it is a UsageError (malformed input)."""
    try:
        return _decode(data, manifest)
    except ShardtoolError as e:
        raise type(e)(e.message, path=what, hint=e.hint) from None


def _decode(data: bytes, manifest: VerifiedManifest) -> ClusterPlan:
    if not isinstance(data, (bytes, bytearray)):
        raise UsageError("plan must be bytes")
    if len(data) > MAX_PLAN_BYTES:
        raise UsageError(f"plan is {len(data)} bytes, at most {MAX_PLAN_BYTES} allowed")
    try:
        doc = loads_strict(bytes(data))
    except ShardtoolError as e:
        raise UsageError(f"plan is not strict JSON: {e.message}") from None
    d = _fields(doc, _TOP_KEYS, "plan")
    if d["format"] != FORMAT:
        raise UsageError(f"plan format is {str(d['format'])[:40]!r}, expected {FORMAT!r}")
    model_id = d["model_id"]
    if not isinstance(model_id, str) or len(model_id) > 256:
        raise UsageError("plan model_id must be a string of at most 256 characters")
    version = _int(d["manifest_version"], 1, 2**63 - 1, "plan manifest_version")
    root_hex = d["root"]
    if not isinstance(root_hex, str) or not re.fullmatch(r"[0-9a-f]{64}", root_hex, re.ASCII):
        raise UsageError("plan root must be 64 lowercase hex digits")
    root = bytes.fromhex(root_hex)
    replicas = _int(d["replicas"], 1, MAX_REPLICAS, "plan replicas")
    files = d["coordinator_files"]
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise UsageError("plan coordinator_files must be a list of paths")
    raw_nodes = d["nodes"]
    if not isinstance(raw_nodes, list) or not 1 <= len(raw_nodes) <= MAX_NODES:
        raise UsageError(f"plan nodes must be a list of 1 to {MAX_NODES} nodes")
    nodes = tuple(_node(raw, i) for i, raw in enumerate(raw_nodes))
    head = manifest.head
    if (root, version, model_id) != (head.merkle_root, head.version, head.model_id):
        raise VerificationError(
            f"plan is for {model_id[:80]!r} version {version} root {root_hex}, the verified manifest is "
            f"{head.model_id!r} version {head.version} root {head.merkle_root.hex()}",
            hint="make the plan again from this manifest")
    plan = ClusterPlan(model_id, version, root, replicas, tuple(files), nodes)
    check_plan(plan, manifest)
    return plan


# ---------------------------------------------------------------------------------------------- checks

def _model(manifest: VerifiedManifest) -> tuple[dict[tuple[int, int], int], tuple[str, ...]]:
    """(layer, expert) -> bytes for every routed expert, and every other path, from the verified manifest."""
    experts: dict[tuple[int, int], int] = {}
    others = []
    for entry in manifest.entries:
        if entry.kind == "expert":
            if entry.path != layout.expert_path(entry.layer, entry.expert):
                raise UsageError(f"manifest entry {entry.path!r} is an expert outside the split layout "
                                 f"(expected {layout.expert_path(entry.layer, entry.expert)})",
                                 hint="plan needs a directory made by shardtool split")
            experts[(entry.layer, entry.expert)] = entry.size
        else:
            others.append(entry.path)
    if not experts:
        raise UsageError("the manifest lists no routed expert: there is nothing to place on nodes")
    return experts, tuple(sorted(others))


def node_files(plan: ClusterPlan, name: str) -> list[str]:
    """What node `name` needs on disk to join: its planned experts and the signed config.json (their shapes)."""
    return sorted({*plan.node(name).files(), NODE_CONFIG})


def experts_per_token(manifest: VerifiedManifest) -> int:
    """The signed contract's routed experts per token (what one step of one layer may select)."""
    contract = manifest.head.contract or {}
    k = contract.get("experts_per_token")
    if not isinstance(k, int) or k < 1:
        raise UsageError("the manifest carries no resource contract with experts_per_token >= 1",
                         hint="plan needs a manifest written by shardtool split")
    return k


# A node's reader threads when `shardtool node --readers` is not given: a plan's memory floors assume it.
NODE_READERS = 2


def node_memory_floor(sizes: Iterable[int], per_layer: int, top_k: int, readers: int = NODE_READERS) -> int:
    """The least memory an expert node needs to compute one step, after plan_budget (engine/_plan.py) with
    no trunk and no KV cache: a shard cache of k + 1 of its largest expert, float32 copies of the k in use
    (4x, FP8 worst case), a read in flight on each of its `readers` threads, the store's parsed headers
    (`header_memo_bytes` of its experts) and the activation reserve. k is the contract's experts per token, capped by
    the most experts the node holds in one layer (it never computes more at once). A plan checks each node with the
    default readers; a node started with more checks its own budget against its own floor."""
    sizes = list(sizes)
    largest = max(sizes, default=0)
    k = min(top_k, per_layer)
    return (largest * (k + 1) + 4 * k * largest + readers * largest + header_memo_bytes(len(sizes))
            + MIN_ACTIVATION_RESERVE)


def pipeline_node_floor(node: NodePlan, sizes: Mapping[str, int], top_k: int, readers: int = NODE_READERS) -> int:
    """The least memory node `node` needs: `node_memory_floor` over its experts plus, for a pipeline node, the trunk
    files of its layers (they stay resident). `sizes`: path -> bytes from the verified manifest, with every path of
    `node.files()` (`check_plan` made sure)."""
    per_layer = max(map(len, node.experts.values()), default=0)
    expert_floor = node_memory_floor([sizes[layout.expert_path(layer, e)] for layer, e in node.pairs()], per_layer,
                                     top_k, readers)
    return expert_floor + sum(sizes[layout.trunk_path(layer)] for layer in node.layers)


def _sizes(manifest: VerifiedManifest) -> dict[str, int]:
    return {entry.path: entry.size for entry in manifest.entries}


def _decoder_layers(manifest: VerifiedManifest) -> list[int]:
    """The trunk file's bytes of each decoder layer 0..n-1 (n: the signed contract's num_layers), what a pipeline
    plan places; the manifest must list trunk/layer-NNN for every one of them. Layers past n (DeepSeek's
    multi-token-prediction layers: stored, never run to generate) stay out of the spans: their trunk with the
    coordinator's files, their experts with the last node."""
    contract = manifest.head.contract or {}
    n = contract.get("num_layers")
    if type(n) is not int or not 1 <= n <= MAX_LAYER + 1:
        raise UsageError("the manifest carries no resource contract with num_layers: a pipeline plan places whole "
                         "decoder layers", hint="plan needs a manifest written by shardtool split")
    listed = manifest.by_path()
    lacking = next((layer for layer in range(n) if layout.trunk_path(layer) not in listed), None)
    if lacking is not None:
        raise UsageError(f"the manifest does not list {layout.trunk_path(lacking)}: a pipeline plan needs the trunk "
                         f"of every decoder layer 0..{n - 1}", hint="plan needs a directory made by shardtool split")
    return [listed[layout.trunk_path(layer)].size for layer in range(n)]


def check_plan(plan: ClusterPlan, manifest: VerifiedManifest) -> None:
    """Everything a plan must satisfy for this manifest (raises UsageError naming the first problem)."""
    experts, others = _model(manifest)
    top_k = experts_per_token(manifest)
    if plan.coordinator_files != others:
        extra = sorted(set(plan.coordinator_files) - set(others))
        lacking = sorted(set(others) - set(plan.coordinator_files))
        detail = (f"names {extra[0][:80]!r}, which is not a non-expert file of the manifest" if extra else
                  f"lacks {lacking[0]!r}" if lacking else "is not sorted or repeats a path")
        raise UsageError(f"plan coordinator_files {detail}")
    names = [n.name for n in plan.nodes]
    if len(set(names)) != len(names):
        raise UsageError(f"plan names node {next(n for n in names if names.count(n) > 1)!r} more than once")
    if plan.replicas > len(plan.nodes):
        raise UsageError(f"plan wants {plan.replicas} replicas on distinct nodes but has {len(plan.nodes)} node(s)")
    _check_distinct_keys([(n.name, n.key) for n in plan.nodes])
    count: dict[tuple[int, int], int] = defaultdict(int)
    for node in plan.nodes:
        for pair in node.pairs():
            if pair not in experts:
                raise UsageError(f"node {node.name} holds layer {pair[0]} expert {pair[1]}, which the manifest "
                                 f"does not list")
            count[pair] += 1
    if plan.pipeline:
        _check_spans(plan, experts, len(_decoder_layers(manifest)))
    for pair in sorted(experts):
        if count[pair] < plan.replicas:
            raise UsageError(f"layer {pair[0]} expert {pair[1]} is held by {count[pair]} node(s), the plan "
                             f"promises {plan.replicas} replica(s)")
    sizes = _sizes(manifest)
    for node in plan.nodes:
        _check_fit(node, sizes, top_k)


def _check_spans(plan: ClusterPlan, experts: Mapping[tuple[int, int], int], layers: int) -> None:
    """A pipeline plan: every node holds a span, one copy, the spans in plan order cover layers 0..layers-1
    once, and each node holds exactly the experts of its layers."""
    bare = next((n.name for n in plan.nodes if not n.layers), None)
    if bare is not None:
        raise UsageError(f"node {bare} holds no layers but other nodes of the plan do: a plan places whole layers "
                         f"on every node or on none")
    if plan.replicas != 1:
        raise UsageError(f"pipeline plans have one copy of each layer (replicas 1), the plan has replicas "
                         f"{plan.replicas}")
    of_layer: dict[int, list[int]] = defaultdict(list)
    for layer, e in sorted(experts):
        of_layer[layer].append(e)
    start = 0  # the first layer no node before this one holds
    for node in plan.nodes:
        first, last = node.layers[0], node.layers[-1]
        if first > start:
            raise UsageError(f"layer {start} is held by no node: node {node.name} starts at layer {first}"
                             + (" (the first node starts at layer 0)" if start == 0 else ""))
        if first < start:
            raise UsageError(f"node {node.name} holds layers {_span(node.layers)}, overlapping the nodes before it "
                             f"(they hold up to layer {start - 1})")
        if last >= layers:
            raise UsageError(f"node {node.name} holds layer {last}, the manifest has layers 0..{layers - 1}")
        start = last + 1
        for layer in node.layers:
            lacking = sorted(set(of_layer.get(layer, ())) - set(node.experts.get(layer, ())))
            if lacking:
                raise UsageError(f"node {node.name} lacks layer {layer} expert {lacking[0]}: a pipeline node holds "
                                 f"every routed expert of its layers")
        last_node = node is plan.nodes[-1]  # it also holds the experts of layers past the decoder's, never run
        outside = next((layer for layer in node.experts
                        if layer not in node.layers and not (last_node and layer >= layers)), None)
        if outside is not None:
            raise UsageError(f"node {node.name} holds layer {outside} expert {node.experts[outside][0]}, outside its "
                             f"layers {_span(node.layers)}")
    if start < layers:
        raise UsageError(f"layer {start} is held by no node: the last node, {plan.nodes[-1].name}, ends at layer "
                         f"{start - 1}")


def _span(layers: Sequence[int]) -> str:
    return f"{layers[0]}..{layers[-1]}" if len(layers) > 1 else str(layers[0])


def _check_fit(node: NodePlan, sizes: Mapping[str, int], top_k: int) -> None:
    held = sum(sizes[path] for path in node.files())
    what = "its experts and layer trunks" if node.layers else "its experts"
    if node.disk is not None and held > node.disk:
        raise UsageError(f"node {node.name} is short of disk by {held - node.disk} bytes: {what} take "
                         f"{held} bytes, its disk is {node.disk}")
    floor = pipeline_node_floor(node, sizes, top_k)
    if node.memory_budget < floor:
        raise UsageError(f"node {node.name} is short of memory by {floor - node.memory_budget} bytes: one step "
                         f"over {what} needs {floor} bytes, its budget is {node.memory_budget}",
                         hint=f"raise its budget to at least {math.ceil(floor / 2**20)}MiB")


# ---------------------------------------------------------------------------------------------- making a plan

def _check_distinct_keys(keys: Sequence[tuple[str, bytes | None]]) -> None:
    """One key per node: with a shared key one node could sign replies in the other's name."""
    seen: dict[bytes, str] = {}
    for name, key in keys:
        if key is not None and key in seen:
            raise UsageError(f"nodes {seen[key]} and {name} have the same key: each node needs its own")
        if key is not None:
            seen[key] = name


def make_plan(manifest: VerifiedManifest, nodes: Sequence[tuple[str, int, int | None]], replicas: int,
              keys: Mapping[str, PublicKey] | None = None, *, pipeline: bool = False) -> ClusterPlan:
    """Place `replicas` copies of every routed expert on distinct nodes, balancing expert bytes (and so the
    expected per-token load) across nodes in proportion to their memory budgets, within each node's disk.

    Deterministic: layer by layer, experts by decreasing size then id, each copy goes to the node (not yet
    holding it, with room on its disk) whose held bytes after taking it are the smallest share of its budget;
    ties go to the node listed first. The trunk and every other non-expert file stay with the coordinator.
    `keys`: node name -> its public key, named in the plan (a node without one cannot serve a cluster).

    `pipeline`: instead, give the nodes, in the order listed, consecutive spans of decoder layers (each layer's
    trunk file and all its experts), cut where the bytes so far cross each node's share of the budgets
    (`_cut_spans`); replicas must be 1."""
    node_keys = dict(keys or {})
    _check_request(nodes, replicas, node_keys)
    if pipeline and replicas != 1:
        raise UsageError(f"pipeline plans have one copy of each layer (replicas 1), got --replicas {replicas}")
    experts, others = _model(manifest)
    top_k = experts_per_token(manifest)
    if pipeline:
        spans = _cut_spans(_layer_bytes(manifest, experts), [budget for _, budget, _ in nodes])
        # the last node also holds the experts of layers past the decoder's (stored, never run)
        held = [_experts_of(experts, (span[0], 1 << 30) if i == len(spans) - 1 else span)
                for i, span in enumerate(spans)]
    else:
        spans = [()] * len(nodes)
        held = _place(experts, nodes, replicas)
    plan_nodes = tuple(NodePlan(name, budget, disk, {layer: tuple(sorted(ids)) for layer, ids in sorted(h.items())},
                                key=node_keys[name].raw if name in node_keys else None, layers=span)
                       for (name, budget, disk), h, span in zip(nodes, held, spans))
    _check_distinct_keys([(n.name, n.key) for n in plan_nodes])
    head = manifest.head
    plan = ClusterPlan(head.model_id, head.version, head.merkle_root, replicas, others, plan_nodes)
    sizes = _sizes(manifest)
    for node in plan.nodes:
        _check_fit(node, sizes, top_k)
    return plan


def _layer_bytes(manifest: VerifiedManifest, experts: Mapping[tuple[int, int], int]) -> list[int]:
    """Bytes of each decoder layer 0..n-1: its trunk file and its routed experts."""
    total = _decoder_layers(manifest)
    for (layer, _), size in experts.items():
        if layer < len(total):
            total[layer] += size
    return total


def _experts_of(experts: Mapping[tuple[int, int], int], span: Sequence[int]) -> dict[int, list[int]]:
    """Layer -> its expert ids, for the MoE layers of `span` (a dense layer has no entry)."""
    held: dict[int, list[int]] = defaultdict(list)
    for layer, e in sorted(experts):
        if span[0] <= layer <= span[-1]:
            held[layer].append(e)
    return held


def _cut_spans(layer_bytes: Sequence[int], budgets: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive spans of layers, one per budget in order, each at least one layer: node i's span ends at the
    layer where the bytes so far come nearest the budgets' share up to node i (a layer goes to the earlier node
    when its midpoint is at or before the share). Exact integer arithmetic: the same input cuts the same way."""
    n, m = len(layer_bytes), len(budgets)
    if m > n:
        raise UsageError(f"a pipeline plan gives each node at least one decoder layer: {m} nodes for {n} layers",
                         hint="give fewer --node, or leave out --pipeline")
    total, whole = sum(layer_bytes), sum(budgets)
    spans: list[tuple[int, ...]] = []
    start = done = 0  # the first layer not placed yet; the bytes of the layers before it
    share = 0  # the budgets of the nodes placed so far, this one included
    for i, budget in enumerate(budgets):
        share += budget
        end = start + 1  # every node gets a layer
        done += layer_bytes[start]
        # Take the next layer while its midpoint is within this node's cumulative share and enough layers
        # remain for the nodes after it; the last node takes the rest.
        while end < n - (m - 1 - i) and (i == m - 1 or (2 * done + layer_bytes[end]) * whole <= 2 * total * share):
            done += layer_bytes[end]
            end += 1
        spans.append(tuple(range(start, end)))
        start = end
    return spans


def _check_request(nodes: Sequence[tuple[str, int, int | None]], replicas: int,
                   node_keys: Mapping[str, PublicKey]) -> None:
    """What `make_plan` is asked for, checked before the manifest is read: every key for a node of the plan,
    the replica count, the node count, each node's name, budget and disk, no name twice, enough nodes."""
    unknown = sorted(set(node_keys) - {n[0] for n in nodes if isinstance(n[0], str)})
    if unknown:
        raise UsageError(f"a key is given for {unknown[0][:40]!r}, which is not a node of the plan")
    for name, key in sorted(node_keys.items()):
        if key.algorithm != "ed25519":  # a node signs its info() with Ed25519; a plan names 32 raw bytes
            raise UsageError(f"node {name[:40]!r}: its key is {key.algorithm}; a node key is Ed25519")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise UsageError(f"--replicas must be an integer in [1, {MAX_REPLICAS}], got {replicas!r}")
    if not 1 <= len(nodes) <= MAX_NODES:
        raise UsageError(f"give 1 to {MAX_NODES} nodes, got {len(nodes)}")
    for name, budget, disk in nodes:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise UsageError(f"node name {str(name)[:40]!r} must match {NAME_PATTERN}")
        _int(budget, 1, MAX_BUDGET, f"node {name}: memory budget")
        if disk is not None:
            _int(disk, 1, MAX_BUDGET, f"node {name}: disk")
    names = [n[0] for n in nodes]
    if len(set(names)) != len(names):
        raise UsageError(f"node {next(n for n in names if names.count(n) > 1)!r} is named more than once")
    if replicas > len(nodes):
        raise UsageError(f"--replicas {replicas} needs at least {replicas} nodes, got {len(nodes)}")


def _place(experts: Mapping[tuple[int, int], int], nodes: Sequence[tuple[str, int, int | None]],
           replicas: int) -> list[dict[int, list[int]]]:
    """Per node (in plan order), layer -> the experts it holds, placed as `make_plan` says; a copy no node has
    disk left for is a `UsageError` naming the node to grow."""
    budgets = np.array([budget for _, budget, _ in nodes], dtype=np.float64)
    disks = np.array([_UNLIMITED if disk is None else disk for _, _, disk in nodes], dtype=np.int64)
    held_bytes = np.zeros(len(nodes), dtype=np.int64)  # at most 2^62 + one expert: exact in int64
    held: list[dict[int, list[int]]] = [defaultdict(list) for _ in nodes]
    by_layer: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for (layer, expert), size in experts.items():
        by_layer[layer].append((-size, expert))
    unplaced = 0
    for layer in sorted(by_layer):
        for neg_size, expert in sorted(by_layer[layer]):
            after = held_bytes - neg_size
            keys = np.where(after <= disks, after / budgets, np.inf)
            for _ in range(replicas):
                best = int(np.argmin(keys))  # the first of equal keys: plan order
                if keys[best] == np.inf:
                    unplaced -= neg_size
                    continue
                keys[best] = np.inf  # one copy per node
                held_bytes[best] = after[best]
                held[best][layer].append(expert)
    if unplaced:
        # Every node that could take the copies left is full: name the one with the most room left (the
        # cheapest to grow); growing its disk by the bytes left over places every copy.
        free = [(disk - int(held_bytes[i]), -i) for i, (_, _, disk) in enumerate(nodes) if disk is not None]
        _, neg_i = max(free)
        name, _, disk = nodes[-neg_i]
        raise UsageError(f"the plan does not fit the nodes' disks: node {name} is short of disk by {unplaced} "
                         f"bytes ({unplaced} bytes of expert copies have no node with room; {name} has "
                         f"{disk - int(held_bytes[-neg_i])} of {disk} bytes free)",
                         hint="give a node more disk, add a node, or lower --replicas")
    return held


# ---------------------------------------------------------------------------------------------- the signature

def sign_plan(plan_bytes: bytes, key: PrivateKey) -> bytes:
    """The detached signature file (PLAN.sig) of a plan's exact bytes, by the operator's `key`."""
    import json

    sig = key.sign(pae(PLAN_PAYLOAD_TYPE, plan_bytes))
    doc = {"format": SIGNATURE_FORMAT, "keyid": key.public.keyid, "sig": sig.hex()}
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode("ascii")


def open_signed_plan(plan_bytes: bytes, signature: bytes, operators: Sequence[PublicKey],
                     manifest: VerifiedManifest, *, what: str) -> ClusterPlan:
    """A plan whose detached signature verifies with one of the operator's keys, then decoded and checked against
    the verified manifest (`decode_plan`); every node of it must name its key. The signature is checked over the
    plan's exact bytes before they are parsed: a plan not signed by the operator, or changed since, is a
    SignatureError naming `what`."""
    try:
        if len(signature) > MAX_SIGNATURE_FILE:
            raise SignatureError(f"the plan's signature file is {len(signature)} bytes, at most {MAX_SIGNATURE_FILE}")
        try:
            doc = _fields(loads_strict(signature), ("format", "keyid", "sig"), "the plan's signature file")
        except ShardtoolError as e:
            raise SignatureError(f"the plan's signature file is malformed: {e.message}") from None
        sig = doc["sig"]
        if (doc["format"] != SIGNATURE_FORMAT or not isinstance(doc["keyid"], str)
                or not isinstance(sig, str) or not re.fullmatch(r"[0-9a-f]{128}", sig, re.ASCII)):
            raise SignatureError(f"the plan's signature file is not {SIGNATURE_FORMAT} with a 128-hex-digit sig")
        try:
            envelope = Envelope(PLAN_PAYLOAD_TYPE, bytes(plan_bytes), (Signature(doc["keyid"], bytes.fromhex(sig)),),
                                max_payload=MAX_PLAN_BYTES)
        except ShardtoolError as e:
            raise SignatureError(f"the plan's signature file is malformed: {e.message}") from None
        verify_envelope(envelope, operators, 1, PLAN_PAYLOAD_TYPE, what="the plan",
                        signer_hint="sign it with `shardtool plan --sign-key OPERATOR.key`, and pass that key's "
                                    ".pub as --plan-trust")
    except ShardtoolError as e:
        raise type(e)(e.message, path=what, hint=e.hint) from None
    plan = decode_plan(plan_bytes, manifest, what=what)
    for node in plan.nodes:
        try:
            node.public_key()
        except ShardtoolError as e:
            raise type(e)(e.message, path=what, hint=e.hint) from None
    return plan


# ---------------------------------------------------------------------------------------------- the summary

def summarize(plan: ClusterPlan, manifest: VerifiedManifest, disk_gbps: float) -> dict[str, Any]:
    """Per node: files, bytes on disk, expected expert bytes per token and the seconds per token its disk
    needs for them at `disk_gbps` GB/s (cold: no expert cached); the cluster's figure (each layer waits for
    its busiest node: the sum over layers of the largest per-node share) next to one machine's
    (the contract's expert_bytes_per_token_cold). See the module docstring for the load model. A pipeline node's
    row also has its layers, and its bytes on disk and memory floor count its layers' trunk files."""
    if not (isinstance(disk_gbps, (int, float)) and math.isfinite(disk_gbps) and disk_gbps > 0):
        raise UsageError(f"--disk-gbps must be a finite number > 0, got {disk_gbps!r}")
    experts, others = _model(manifest)
    top_k = experts_per_token(manifest)
    rate = disk_gbps * 1e9
    per_layer: dict[int, int] = defaultdict(int)  # experts in each MoE layer
    for layer, _ in experts:
        per_layer[layer] += 1
    by_entry = manifest.by_path()
    sizes = _sizes(manifest)
    rows = []
    layer_load: dict[int, list[float]] = defaultdict(list)
    for node in plan.nodes:
        files = node.files()
        load = 0.0
        for layer, ids in node.experts.items():
            share = top_k * sum(experts[(layer, e)] for e in ids) / (per_layer[layer] * plan.replicas)
            layer_load[layer].append(share)
            load += share
        rows.append({"name": node.name, "memory_budget": node.memory_budget, "disk": node.disk,
                     "layers": list(node.layers), "files": len(files), "bytes_on_disk": sum(sizes[p] for p in files),
                     "memory_floor": pipeline_node_floor(node, sizes, top_k),
                     "expert_bytes_per_token": round(load),
                     "seconds_per_token": load / rate})
    contract = manifest.head.contract or {}
    single = contract.get("expert_bytes_per_token_cold") or sum(
        top_k * max(s for (lay, _), s in experts.items() if lay == layer) for layer in per_layer)
    cluster = sum(max(loads) for loads in layer_load.values())
    return {"model_id": plan.model_id, "manifest_version": plan.manifest_version, "root": plan.root.hex(),
            "placement": "pipeline" if plan.pipeline else "experts",
            "replicas": plan.replicas, "disk_gbps": disk_gbps, "experts_per_token": top_k,
            "coordinator": {"files": len(plan.coordinator_files),
                            "bytes_on_disk": sum(by_entry[p].size for p in plan.coordinator_files)},
            "nodes": rows,
            "cluster": {"expert_bytes_per_token": round(cluster), "seconds_per_token": cluster / rate},
            "single_machine": {"expert_bytes_per_token": single, "seconds_per_token": single / rate}}
