"""The coordinator's side of a cluster: each MoE layer's routed experts computed by the nodes that hold them.

Per layer, every needed expert goes to one live node of its replicas (spread over them by expert id); each node
gets one call with the rows its experts need, all nodes in parallel. Every call has a time-out. A reply must name the
node asked and the coordinator's manifest root, and carry exactly the requested experts' outputs, each
[t_e, H] float32; anything else counts as that node failing. A node that fails (died, timed out, refused, answered
wrongly) is dropped for the rest of the run; an expert a node reports failed (its shard failed verification there)
is not asked of that node again. Either way its experts are retried on their next replica; an expert with no
replica left raises `UnavailableError` for the rows that chose it only (the engine fails just those requests).

The outputs are combined by `moe_experts`, as local ones are, so greedy and sampled output equal one process's.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from shardtool.errors import ShardtoolError, UnavailableError, UsageError
from shardtool.manifest import VerifiedManifest
from shardtool.runtime._cluster_plan import MAX_PLAN_BYTES, ClusterPlan, decode_plan
from shardtool.runtime._cluster_node import NAMESPACE, is_int, actor_name, import_ray, init_ray
from shardtool.runtime.model import ExpertFetch, ExpertOutputs
from shardtool.safeio import read_regular
from shardtool.text import printable

DEFAULT_TIMEOUT = 30.0
MAX_INFO_ENTRIES = 1 << 20  # [layer, expert] pairs (or failures) one node's info() may list
_FAILED_KEY = re.compile(r"[0-9]{1,5}/[0-9]{1,7}")


class NodeFailed(Exception):
    """A node-level failure of one call: the node is dropped. `str()` is one line."""


class Transport(Protocol):
    """How calls reach nodes (Ray actors in production, plain objects in unit tests)."""

    def info(self, node: str, timeout: float) -> dict:
        """The node's info(); raises NodeFailed."""
        ...

    def submit(self, node: str, layer: int, expert_ids: list[int], x: np.ndarray,
               rows: dict[int, np.ndarray]) -> object:
        """Start a call; returns a pending handle for `result`. Raises NodeFailed when it cannot start."""
        ...

    def result(self, pending: object, timeout: float) -> dict:
        """The call's reply, waiting at most `timeout` seconds; raises NodeFailed."""
        ...


@dataclass
class ClusterStats:
    calls: int = 0  # node calls made (one per node per MoE layer per step)
    wire_bytes: int = 0  # hidden states and row indices sent + expert outputs received
    remote_seconds: float = 0.0  # wall seconds the coordinator spent starting and waiting for node calls
    retries: int = 0  # experts sent again to another replica
    dropped: dict[str, str] = field(default_factory=dict)  # node -> why it is no longer asked

    def as_dict(self) -> dict:
        return {"calls": self.calls, "wire_bytes": self.wire_bytes, "remote_seconds": round(self.remote_seconds, 6),
                "retries": self.retries, "dropped_nodes": dict(self.dropped)}


class RemoteExperts:
    """`fetch(layer)` is the forward pass's ExpertFetch for a cluster (`Float32Weights(remote=...)`)."""

    def __init__(self, placement: Mapping[tuple[int, int], Sequence[str]], root: bytes, transport: Transport, *, timeout: float = DEFAULT_TIMEOUT, log: Callable[[str], None] | None = None):
        """`placement`: (layer, expert) -> the nodes holding it, in the order they are tried."""
        self.placement = {key: tuple(nodes) for key, nodes in placement.items()}
        self.root = root.hex()
        self.transport = transport
        self.timeout = timeout
        self.stats = ClusterStats()
        self._log = log or (lambda line: print(printable(line), file=sys.stderr, flush=True))
        self._failed: dict[str, set[tuple[int, int]]] = {}  # node -> experts it reported failed
        self._lock = threading.Lock()

    @property
    def nodes(self) -> list[str]:
        return sorted({n for nodes in self.placement.values() for n in nodes})

    def connect(self) -> dict[str, dict]:
        """Ask every planned node for its info(); drop those that do not answer, answer for another root or name,
        or do not hold what the plan gave them. Raises UnavailableError when some planned expert is then left with
        no node (naming it). Returns the info of the nodes kept."""
        infos = {}
        for node in self.nodes:
            try:
                info = self.transport.info(node, self.timeout)
                self._check_info(node, info)
            except NodeFailed as e:
                self._drop(node, str(e))
                continue
            infos[node] = info
            self._failed.setdefault(node, set()).update(_failed_pairs(info["failed"]))
        for (layer, expert), nodes in sorted(self.placement.items()):
            if not self._candidates(layer, expert, set()):
                raise UnavailableError(f"no live node holds layer {layer} expert {expert} (planned on "
                                       f"{', '.join(nodes)})", hint="start the missing nodes, or plan more replicas")
        return infos

    def _check_identity(self, node: str, doc, what: str) -> None:
        """An info() or a reply must be a mapping that names the node asked and this coordinator's root."""
        if not isinstance(doc, dict):
            raise NodeFailed(f"{what} with a {type(doc).__name__}: refused")
        if doc.get("name") != node:
            raise NodeFailed(f"{what} as node {printable(str(doc.get('name'))[:80])}: refused")
        if doc.get("root") != self.root:
            raise NodeFailed(f"{what} for manifest root {printable(str(doc.get('root'))[:80])}, not this "
                             f"coordinator's {self.root}: refused")

    def _check_info(self, node: str, info) -> None:
        self._check_identity(node, info, f"node {node} answered info()")
        experts, failed = info.get("experts"), info.get("failed")
        if not isinstance(experts, list) or len(experts) > MAX_INFO_ENTRIES or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_index(v) for v in p) for p in experts):
            raise NodeFailed(f"node {node} answered info() without a list of [layer, expert] pairs: refused")
        if (not isinstance(failed, dict) or len(failed) > MAX_INFO_ENTRIES
                or not all(isinstance(k, str) and _FAILED_KEY.fullmatch(k) for k in failed)):
            raise NodeFailed(f"node {node} answered info() without a mapping of 'layer/expert' failures: refused")
        held = {(int(a), int(b)) for a, b in experts}
        planned = {key for key, nodes in self.placement.items() if node in nodes}
        if not planned <= held:
            layer, expert = min(planned - held)
            raise NodeFailed(f"node {node} does not hold layer {layer} expert {expert}, which the plan gives it")

    def _drop(self, node: str, why: str) -> None:
        with self._lock:
            if node in self.stats.dropped:
                return
            self.stats.dropped[node] = why
        self._log(f"cluster: node {node} dropped: {why}")

    def _candidates(self, layer: int, expert: int, tried: set[str]) -> list[str]:
        return [n for n in self.placement.get((layer, expert), ())
                if n not in self.stats.dropped and n not in tried and (layer, expert) not in self._failed.get(n, ())]

    def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def fetch(self, layer: int) -> ExpertFetch:
        def fetch(x: np.ndarray, rows: Mapping[int, np.ndarray]) -> ExpertOutputs:
            return _RemoteOutputs(self, layer, x, rows)
        return fetch

    # ---------------------------------------------------------------- one layer's calls

    def _send(self, node: str, layer: int, experts: list[int], x: np.ndarray, rows: Mapping[int, np.ndarray]):
        """Start one call with only the rows these experts need (renumbered into the sent block)."""
        used = np.unique(np.concatenate([rows[e] for e in experts]))
        block = np.ascontiguousarray(x[used], dtype=np.float32)
        local = {e: np.searchsorted(used, rows[e]).astype(np.int64) for e in experts}
        self.stats.calls += 1
        self.stats.wire_bytes += block.nbytes + sum(r.nbytes for r in local.values())
        return self.transport.submit(node, layer, list(experts), block, local)

    def run(self, layer: int, x: np.ndarray, rows: Mapping[int, np.ndarray]) -> tuple[dict, dict]:
        """All requested experts' outputs, retried across replicas: ({expert: [t_e, H]}, {expert: why it could
        not be had})."""
        return _LayerCalls(self, layer, x, rows).finish()

    def _check_reply(self, node: str, layer: int, experts: list[int], rows: Mapping[int, np.ndarray], reply,
                     hidden: int) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        self._check_identity(node, reply, "the reply")
        if reply.get("layer") != layer or isinstance(reply.get("layer"), bool):
            raise NodeFailed(f"the reply is for layer {printable(str(reply.get('layer'))[:20])}, asked {layer}: refused")
        outputs, failed = reply.get("outputs"), reply.get("failed")
        if not isinstance(outputs, dict) or not isinstance(failed, dict):
            raise NodeFailed("the reply has no outputs/failed mappings")
        if set(outputs) | set(failed) != set(experts) or set(outputs) & set(failed):
            raise NodeFailed(f"the reply covers experts {sorted(set(outputs) | set(failed))}, asked {experts}")
        for e, y in outputs.items():
            want = (len(rows[e]), hidden)
            # exactly an ndarray (a subclass could change what `*` and `+=` do), finite: a NaN from a node would
            # otherwise surface as 'the signed weights give non-finite logits' and never drop the node.
            if type(y) is not np.ndarray or y.dtype != np.float32 or y.shape != want:
                raise NodeFailed(f"expert {e}'s output is not a float32 array of shape {want}")
            if not np.isfinite(y).all():
                raise NodeFailed(f"expert {e}'s output is not finite")
        return outputs, {e: printable(str(why)[:300]) for e, why in failed.items()}


class _LayerCalls:
    """One MoE layer's calls: started at once (`__init__`), gathered and retried on replicas by `finish`."""

    def __init__(self, remote: RemoteExperts, layer: int, x: np.ndarray, rows: Mapping[int, np.ndarray]):
        self.remote, self.layer, self.x, self.rows = remote, layer, x, rows
        self.outputs: dict[int, np.ndarray] = {}
        self.missing: dict[int, str] = {}
        self.tried: dict[int, set[str]] = {e: set() for e in rows}
        self.last: dict[int, str] = {}
        self._round: dict[str, tuple[list[int], object | None]] = {}
        self._deadline = 0.0
        self._timed(self._dispatch, list(rows))

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.remote.stats.remote_seconds += time.perf_counter() - t0

    def _dispatch(self, pending: list[int]) -> None:
        """Give each pending expert to one live replica it was not yet tried on, and start one call per node."""
        remote, layer = self.remote, self.layer
        by_node: dict[str, list[int]] = {}
        for e in pending:
            nodes = remote._candidates(layer, e, self.tried[e])
            if not nodes:
                planned = ", ".join(remote.placement.get((layer, e), ())) or "no node"
                self.missing[e] = (f"layer {layer} expert {e}: no replica left (planned on {planned}"
                                   + (f"; last: {self.last[e]}" if e in self.last else "") + ")")
                continue
            # Each expert has a home among its live replicas, spread so each holder takes ~1/R of the calls (and
            # keeps its own experts cached); it moves only when that node fails.
            node = nodes[(layer + e) % len(nodes)]
            by_node.setdefault(node, []).append(e)
            self.tried[e].add(node)
            if len(self.tried[e]) > 1:
                remote.stats.retries += 1
        self._round = {}
        for node, experts in by_node.items():
            try:
                self._round[node] = (experts, remote._send(node, layer, experts, self.x, self.rows))
            except NodeFailed as err:
                remote._drop(node, str(err))
                self._round[node] = (experts, None)
        self._deadline = time.monotonic() + remote.timeout

    def _collect(self) -> list[int]:
        """The replies of the round in flight; returns the experts to ask again elsewhere."""
        remote, layer, pending = self.remote, self.layer, []
        for node, (experts, call) in self._round.items():
            if call is None:
                pending += experts
                continue
            try:
                reply = remote.transport.result(call, max(self._deadline - time.monotonic(), 0.001))
                got, failed = remote._check_reply(node, layer, experts, self.rows, reply, self.x.shape[1])
            except NodeFailed as err:
                remote._drop(node, str(err))
                for e in experts:
                    self.last[e] = f"node {node}: {err}"
                pending += experts
                continue
            self.outputs.update(got)
            remote.stats.wire_bytes += sum(y.nbytes for y in got.values())
            for e, why in failed.items():
                with remote._lock:
                    remote._failed.setdefault(node, set()).add((layer, e))
                remote._log(f"cluster: node {node} stopped serving layer {layer} expert {e}: {why}")
                self.last[e] = f"node {node}: {why}"
                pending.append(e)
        self._round = {}
        return pending

    def finish(self) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        pending = self._timed(self._collect)
        while pending:
            self._timed(self._dispatch, pending)
            pending = self._timed(self._collect)
        return self.outputs, self.missing


class _RemoteOutputs(Mapping):
    """expert -> thunk; the calls start at once (so nodes compute while the coordinator runs the shared expert),
    and the first thunk called waits for all of them."""

    def __init__(self, remote: RemoteExperts, layer: int, x: np.ndarray, rows: Mapping[int, np.ndarray]):
        self._layer, self._rows = layer, rows
        self._calls = _LayerCalls(remote, layer, x, rows)
        self._done: tuple[dict, dict] | None = None

    def _result(self, expert: int) -> np.ndarray:
        if self._done is None:
            self._done = self._calls.finish()
        outputs, missing = self._done
        if expert in outputs:
            return outputs[expert]
        raise UnavailableError(missing.get(expert, f"layer {self._layer} expert {expert}: no output"))

    def __getitem__(self, expert: int) -> Callable[[], np.ndarray]:
        if expert not in self._rows:
            raise KeyError(expert)
        return lambda: self._result(expert)

    def __iter__(self):
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


class RayTransport:
    """Calls to the named node actors of a Ray cluster (`shardtool node`)."""

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT):
        self.ray = import_ray()
        init_ray(self.ray, address, timeout)
        self._actors: dict[str, object] = {}

    def _actor(self, node: str):
        actor = self._actors.get(node)
        if actor is None:
            try:
                actor = self.ray.get_actor(actor_name(node), namespace=NAMESPACE)
            except ValueError:
                raise NodeFailed(f"no node named {node} has joined the cluster") from None
            self._actors[node] = actor
        return actor

    def info(self, node: str, timeout: float) -> dict:
        return self.result(self._actor(node).info.remote(), timeout)

    def submit(self, node, layer, expert_ids, x, rows):
        try:
            return self._actor(node).run.remote(layer, expert_ids, x, rows)
        except self.ray.exceptions.RayError as e:
            raise NodeFailed(_ray_line(e)) from None

    def result(self, pending, timeout: float) -> dict:
        try:
            return self.ray.get(pending, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            try:
                self.ray.cancel(pending)  # a call still queued at the node is dropped there
            except Exception:  # noqa: BLE001 - best effort: the node is dropped either way
                pass
            raise NodeFailed(f"no reply within {timeout:.1f}s") from None
        except self.ray.exceptions.RayError as e:
            raise NodeFailed(_ray_line(e)) from None

    def close(self) -> None:
        self.ray.shutdown()


def load_plan(path: Path, manifest: VerifiedManifest) -> ClusterPlan:
    """A plan file, refused by size before it is read, decoded and checked against the verified manifest."""
    data = read_regular(path, MAX_PLAN_BYTES, what="plan", too_large=UsageError)
    return decode_plan(data, manifest, what=str(path))


def plan_placement(plan: ClusterPlan) -> dict[tuple[int, int], tuple[str, ...]]:
    """(layer, expert) -> the nodes a ClusterPlan puts it on, in plan order."""
    return {pair: plan.holders(*pair) for node in plan.nodes for pair in node.pairs()}


def connect_cluster(address: str, plan: ClusterPlan, *, timeout: float = DEFAULT_TIMEOUT) -> RemoteExperts:
    """A coordinator's RemoteExperts over the Ray cluster at `address`, every planned node asked for its info
    (UnavailableError when some planned expert has no node left that answers for this plan's root)."""
    transport = RayTransport(address, timeout)
    remote = RemoteExperts(plan_placement(plan), plan.root, transport, timeout=timeout)
    try:
        remote.connect()
    except BaseException:
        transport.close()
        raise
    return remote


def _ray_line(e: BaseException) -> str:
    """One line for a Ray error: its class, and for a task error the node's own one-line message."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, ShardtoolError):
        return f"refused the call: {cause.one_line()}"
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {' '.join(first.split())[:200]}"


def _is_index(v) -> bool:
    return is_int(v) and 0 <= v < 1 << 31


def _failed_pairs(failed: Mapping[str, str]) -> set[tuple[int, int]]:
    """{"layer/expert": why} of a checked info() -> the (layer, expert) pairs a node reports failed."""
    return {tuple(int(v) for v in key.split("/")) for key in failed}
