"""A cluster node's expert service: the experts a plan gave this node, each loaded through the verifying shard
store (also after an eviction), run on hidden states sent by a coordinator.

`NodeService` is plain Python; `serve_node` runs it as a Ray actor named `shardtool-node-NAME` in the namespace
"shardtool", owned by the calling process (it dies with it). Every argument that arrives over the wire is
checked (types, shapes, dtypes, caps, that this node holds the layer and expert) before it is used. An expert
whose shard fails verification is marked failed from then on: reported by `info()` and in every reply, while
the node keeps serving its other experts.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from shardtool.errors import CheckpointFormatError, ShardtoolError, UnavailableError, UsageError, VerificationError
from shardtool.manifest import Entry, VerifiedManifest
from shardtool.manifest.audit import check_file
from shardtool.remote import RemoteFiles, RemoteSource
from shardtool.runtime.model import ModelConfig, run_expert
from shardtool.runtime._cluster_plan import NODE_READERS, ClusterPlan, node_memory_floor
from shardtool.runtime.engine._signed import unusable_shards, verified_config
from shardtool.runtime.store import DEFAULT_POLICY
from shardtool.runtime.store import ShardStore, header_memo_bytes

NAMESPACE = "shardtool"
ACTOR_PREFIX = "shardtool-node-"
MAX_ROWS = 1 << 16  # token rows of one call: a step's batch rows, far below this
INSTALL_HINT = "install the cluster extra: pip install 'shardtool[cluster]'"


def actor_name(node: str) -> str:
    return ACTOR_PREFIX + node


def import_ray():
    """Ray, or a one-line usage error saying how to get it (it is an optional extra)."""
    try:
        import ray
    except ImportError:
        raise UsageError("the cluster commands need Ray, which is not installed", hint=INSTALL_HINT) from None
    return ray


def check_address(address: str, timeout: float) -> tuple[str, int]:
    """HOST:PORT of a Ray head whose port accepts a connection within `timeout` seconds. Checked before Ray is
    asked: its client retries an unreachable head without end."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536 or len(host) > 255:
        raise UsageError(f"cluster address {address[:80]!r} is not HOST:PORT (the Ray head's GCS port)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise UnavailableError(f"no Ray head answers at {address}: {e.strerror or type(e).__name__}",
                               hint="start it with `ray start --head --port PORT`") from None
    return host, int(port)


def init_ray(ray, address: str, timeout: float) -> None:
    """Connect this process to the Ray cluster at `address` (namespace "shardtool") as a driver, quietly. Ray's
    core worker installs its own SIGTERM handler, which would end the process without a clean exit; the Python
    handlers that were in place are put back."""
    check_address(address, timeout)
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False,
                 include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UnavailableError(f"cannot reach the Ray cluster at {address}: {' '.join(str(e).split())[:200]}") from None
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


@dataclass(frozen=True)
class NodeSetup:
    """What the joining process hands its actor (same machine, same user): checked there before it is sent."""

    name: str
    directory: str
    root: bytes  # the signed manifest's Merkle root the node verified against
    manifest_version: int
    config: ModelConfig
    entries: tuple[Entry, ...]  # this node's planned expert shards (from the verified manifest)
    budget: int  # bytes of verified shards kept cached (the rest of --memory-budget: working buffers)
    readers: int
    remote: RemoteSource | None = None  # --remote: planned experts not on disk are fetched when first asked for
    cache_policy: str = DEFAULT_POLICY  # which cached expert is evicted first


class NodeService:
    """Runs this node's experts; thread-safe (Ray may call it from one thread at a time, tests from several)."""

    def __init__(self, setup: NodeSetup):
        self.setup = setup
        self.config = setup.config
        self.held: dict[tuple[int, int], Entry] = {(e.layer, e.expert): e for e in setup.entries}
        self.fetcher = RemoteFiles(Path(setup.directory), setup.remote) if setup.remote is not None else None
        self.store = ShardStore(Path(setup.directory), budget_bytes=setup.budget, readers=setup.readers,
                                fetch_missing=self.fetcher.fetch if self.fetcher is not None else None,
                                policy=setup.cache_policy, header_memo=header_memo_bytes(len(setup.entries)))
        self.failed: dict[tuple[int, int], str] = {}
        self.calls = 0
        self._lock = threading.Lock()

    def info(self) -> dict:
        s = self.setup
        with self._lock:
            failed = {f"{layer}/{expert}": why for (layer, expert), why in sorted(self.failed.items())}
        return {"name": s.name, "root": s.root.hex(), "manifest_version": s.manifest_version,
                "experts": sorted([layer, expert] for layer, expert in self.held), "failed": failed,
                "calls": self.calls, "store": self.store.stats.as_dict()}

    def run(self, layer, expert_ids, x, rows) -> dict:
        """Each requested expert's unweighted output on its rows, `run_expert(x[rows[e]])` [t_e, H] float32; an
        expert that cannot be had is in `failed` with one line. Arguments are checked before anything runs."""
        ids, x, rows = self._check(layer, expert_ids, x, rows)
        t0 = time.perf_counter()
        with self._lock:
            self.calls += 1
            failed = {e: self.failed[(layer, e)] for e in ids if (layer, e) in self.failed}
        todo = [e for e in ids if e not in failed]
        # Every load starts now (the reader pool), and each expert computes as soon as it is verified.
        waiters = self.store.request([self.held[(layer, e)] for e in todo])
        outputs = {}
        for e, wait in zip(todo, waiters):
            try:
                outputs[e] = run_expert(self.config, layer, e, wait(), x[rows[e]])
            except ShardtoolError as err:
                if isinstance(err, CheckpointFormatError):
                    err = unusable_shards(err)
                why = err.one_line()
                with self._lock:
                    self.failed[(layer, e)] = why
                failed[e] = why
        return {"name": self.setup.name, "root": self.setup.root.hex(), "layer": layer, "outputs": outputs,
                "failed": failed, "seconds": time.perf_counter() - t0}

    def _check(self, layer, expert_ids, x, rows) -> tuple[list[int], np.ndarray, dict[int, np.ndarray]]:
        cfg = self.config
        if not is_int(layer) or not 0 <= layer < cfg.num_layers or not cfg.moe_layers[layer]:
            raise UsageError(f"layer {_short(layer)} is not a MoE layer of this model (it has {cfg.num_layers} layers)")
        if not isinstance(expert_ids, (list, tuple)) or not 1 <= len(expert_ids) <= cfg.num_experts:
            raise UsageError(f"expert ids must be a list of 1 to {cfg.num_experts} ids")
        ids = list(expert_ids)
        for e in ids:
            if not is_int(e) or (layer, e) not in self.held:
                raise UsageError(f"node {self.setup.name} does not hold expert {_short(e)} of layer {layer}")
        if len(set(ids)) != len(ids):
            raise UsageError("expert ids repeat")
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
            raise UsageError(f"hidden states must be a 2-D float32 array, got {_describe(x)}")
        if x.shape[1] != cfg.hidden_size or not 1 <= x.shape[0] <= MAX_ROWS:
            raise UsageError(f"hidden states have shape {x.shape}, expected [1..{MAX_ROWS}, {cfg.hidden_size}]")
        if not isinstance(rows, Mapping) or set(rows) != set(ids):
            raise UsageError("rows must map exactly the requested expert ids to row indices")
        checked = {}
        for e in ids:
            r = rows[e]
            if (not isinstance(r, np.ndarray) or r.dtype != np.int64 or r.ndim != 1 or not 1 <= len(r) <= len(x)
                    or r[0] < 0 or r[-1] >= len(x) or (len(r) > 1 and not (np.diff(r) > 0).all())):
                raise UsageError(f"rows of expert {e}: expected increasing int64 indices below {len(x)}, got "
                                 f"{_describe(r)}")
            checked[e] = r
        # Each token row chooses top-k experts: more rows than that asks for outputs no step needs (memory).
        if sum(len(r) for r in checked.values()) > len(x) * max(cfg.top_k, 1):
            raise UsageError(f"rows ask for more than top-{cfg.top_k} experts per token row")
        return ids, x, checked

    def close(self) -> None:
        self.store.close()
        if self.fetcher is not None:
            self.fetcher.close()


class NodeActor:
    """What the cluster may call on a node: info() and run() only (NodeService.close, which shuts the reader
    pool, is not reachable over the wire; the store ends with the node's process)."""

    def __init__(self, setup: NodeSetup):
        self._service = NodeService(setup)

    def info(self) -> dict:
        return self._service.info()

    def run(self, layer, expert_ids, x, rows) -> dict:
        return self._service.run(layer, expert_ids, x, rows)


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _short(v) -> str:
    """A value from the wire, quoted at most 40 characters long (a 10 MB `layer` is not a 10 MB error line)."""
    text = repr(v)
    return text if len(text) <= 40 else text[:40] + "…"


def _describe(v) -> str:
    if isinstance(v, np.ndarray):
        return f"an array of shape {v.shape} and dtype {v.dtype}"
    return f"a {type(v).__name__}"


def serve_node(setup: NodeSetup, address: str, *, timeout: float) -> tuple[object, dict]:
    """Join the Ray cluster at `address` as a driver, start this node's actor on this machine's Ray node (where the
    audited directory is), and wait until it answers. Returns (actor handle, its info()). The actor is owned by
    this process: it ends when this process ends (or `leave` is called)."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    init_ray(ray, address, timeout)
    here = ray.get_runtime_context().get_node_id()
    actor_class = ray.remote(NodeActor)
    try:
        actor = actor_class.options(name=actor_name(setup.name), namespace=NAMESPACE, num_cpus=0,
                                    max_concurrency=1, max_restarts=0,
                                    scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
                                    ).remote(setup)
    except ValueError as e:  # the name is taken: another node process already serves under it
        raise UsageError(f"node name {setup.name!r} is already in use in this cluster: {' '.join(str(e).split())[:200]}") from None
    try:
        info = ray.get(actor.info.remote(), timeout=timeout)
    except ray.exceptions.RayError as e:
        raise UnavailableError(f"node {setup.name} did not start: {type(e).__name__}") from None
    return actor, info


def node_alive(actor, timeout: float) -> bool:
    """Whether this node's actor still answers info() within `timeout` seconds."""
    ray = import_ray()
    try:
        ray.get(actor.info.remote(), timeout=timeout)
        return True
    except ray.exceptions.RayError:
        return False


def leave_cluster(actor) -> None:
    ray = import_ray()
    try:
        ray.kill(actor)
    finally:
        ray.shutdown()


def prepare_node(directory: Path, manifest: VerifiedManifest, plan: ClusterPlan, name: str, *, budget: int,
                 readers: int = NODE_READERS, remote: RemoteSource | None = None,
                 cache_policy: str = DEFAULT_POLICY) -> NodeSetup:
    """Check this node before it may join. The signed config.json (the experts' shapes) is read through
    verification; `budget` must hold a step over this node's experts; then every file the plan gives node `name`
    is hashed whole and must be present and match the manifest: the first missing or failing one is a
    VerificationError naming it (the node refuses to join). Files the plan gives other nodes may be absent
    (present-only semantics) and are not read. With `remote`, a planned expert not on disk yet is not a refusal:
    it is fetched (verified) the first time the coordinator asks for it; one present but wrong still is."""
    node = plan.node(name)
    listed = manifest.by_path()
    entries = []
    for path in node.files():
        entry = listed.get(path)
        if entry is None:
            raise VerificationError(f"the signed manifest lists no {path}; node {name} cannot join")
        entries.append(entry)
    root = Path(directory)
    config = verified_config(root, manifest)
    per_layer = max((len(ids) for ids in node.experts.values()), default=0)
    need = node_memory_floor([e.size for e in entries], per_layer, config.top_k, readers)
    if budget < need:
        raise UsageError(f"--memory-budget {budget} bytes cannot hold a step of node {name}: it needs {need} bytes "
                         f"(a shard cache of top-k + 1 of its experts and working buffers)",
                         hint=f"raise --memory-budget to at least {-(-need // 2**20)}MiB")
    for entry in entries:
        finding = check_file(root, entry)
        if finding is not None and not (remote is not None and finding.finding == "missing"):
            raise VerificationError(f"{finding.finding}: {finding.detail}; node {name} refuses to join",
                                    path=finding.path)
    # The floor's shard cache is top-k + 1 experts; what the budget has beyond the floor caches more.
    k = min(max(config.top_k, 1), per_layer)
    largest = max((e.size for e in entries), default=0)
    head = manifest.head
    return NodeSetup(name=name, directory=str(Path(directory).resolve()), root=head.merkle_root, manifest_version=head.version,
                     config=config, entries=tuple(entries), budget=budget - need + largest * (k + 1), readers=readers,
                     remote=remote, cache_policy=cache_policy)
