"""The coordinator's side of a cluster: each MoE layer's routed experts computed by the nodes that hold them.

Per layer, every needed expert goes to the least loaded live node of its replicas (`choose_replica`: fewest expert
calls in flight from this coordinator, then fewest asked so far, then plan order); each node gets one call with the
rows its experts need, all nodes in parallel. Every call has a time-out and a fresh nonce.
Each node connection (at connect, and at each readmission) makes a session: the info() request carries a fresh
X25519 public key of this coordinator's, the node's answer, signed by the key the operator's signed plan names for
it, carries that key and the node's own, and both sides derive the session key (`_cluster_session`); a signed
session naming another coordinator key (swapped by someone in between) is refused. A reply must carry the keyed
BLAKE3 of its body under that session's key (checked first, before its body is parsed), its body must name that
node, the coordinator's manifest root, the call's nonce, layer and experts, and it must carry exactly the requested
experts' outputs, each [t_e, H] float32 with the BLAKE3 the body names; anything else (an impostor, another node's
or another session's reply, a replay, a garbled answer) counts as that node failing. A node that fails (died, timed out, refused, answered
wrongly) is dropped for the rest of the run; an expert a node reports failed (its shard failed verification there)
is not asked of that node again. Either way its experts are retried at once on another replica, whose bytes that
node verified itself (its subset check at join, BLAKE3 on every read); an expert with no replica left raises
`UnavailableError` naming the lost node and the experts it held, for the rows that chose it only (the engine fails
just those requests).

A lost node is asked for its signed info() again (`probe`, backing off while it stays away) and taken back only
when it answers as a new process: every info() carries the node process's boot id, drawn when its service starts,
and `shardtool node` starts that service only after hashing every file the plan gives it against the manifest. A
boot id other than the lost one's is therefore, for an unmodified node, one that verified its subset again (the id is
the node's signed word: a node that holds its key and runs other code can present a fresh one, as it could already
return wrong outputs); the same boot id (a node that was slow, or answered wrongly, and is still the same process) is
not readmitted, unless that process was lost for refusing a call in a session it no longer held (evicted from its
bounded table): it is taken back in a new session.

With a pipeline plan each node runs a span of whole layers instead (`_cluster_spans`): `span` makes one call per
node per step, checked as a reply is (the MAC first; the body names the node, root, nonce, span and inputs; the one
output [n, H] float32 with the BLAKE3 the body names; the routes, when asked, [n, k] expert ids per MoE layer). A node
that fails is dropped and probed as above; with one copy of each span the step's requests fail (503) naming it.

The outputs are combined by `moe_experts`, as local ones are, so greedy and sampled output equal one process's.
`connect_cluster` reaches Ray through a cluster proxy (`_cluster_proxy`): this process never deserializes anything
from Ray, and every check above runs on what the proxy's pipe carries.
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

from shardtool.errors import ShardtoolError, SignatureError, UnavailableError, UsageError
from shardtool.keys import PublicKey
from shardtool.manifest import VerifiedManifest, pae
from shardtool.private_memory import keep_memory_private
from shardtool.runtime.model import ExpertFetch, ExpertOutputs
from shardtool.safeio import read_regular
from shardtool.strict_json import loads_strict
from shardtool.text import printable

from ._cluster_node import INFO_TYPE, REPLY_TYPE, input_digest, is_int, new_nonce, output_digest
from ._cluster_plan import MAX_PLAN_BYTES, MAX_SIGNATURE_FILE, ClusterPlan, decode_plan, open_signed_plan
from ._cluster_proxy import REFUSED, NodeFailed, ProxyTransport
from ._cluster_spans import PipelineLayers, span_failure, span_input_digest
from ._cluster_wire import encode_span_call
from ._cluster_session import PUBLIC_KEY, Handshake, mac_matches, session_id, session_key, unknown_session

DEFAULT_TIMEOUT = 30.0
PROBE_SECONDS = 2.0  # a lost node is asked again this long after it was lost; the gap doubles while it stays away
MAX_PROBE_SECONDS = 60.0
PROBE_TIMEOUT = 2.0  # at most this long for a probe's info() (the generation waits for it)
MAX_HELD_NAMED = 24  # experts a lost node held named in an error line; the rest are counted
MAX_INFO_ENTRIES = 1 << 20  # [layer, expert] pairs (or failures) one node's info() may list
MAX_BODY_BYTES = 64 * 2**20  # one answer's body (an info() listing every expert of a large model fits)
_FAILED_KEY = re.compile(r"[0-9]{1,5}/[0-9]{1,7}")
_BOOT = re.compile(r"[0-9a-f]{32}")


class Transport(Protocol):
    """How calls reach nodes (Ray actors in production, plain objects in unit tests)."""

    def info(self, node: str, nonce: str, session: str, timeout: float) -> dict:
        """The node's signed info(nonce, session), `session` this coordinator's X25519 public key (64 hex digits);
        raises NodeFailed."""
        ...

    def submit(self, node: str, layer: int, expert_ids: list[int], x: np.ndarray,
               rows: dict[int, np.ndarray], nonce: str, session: str) -> object:
        """Start a call in session `session` (its id); returns a pending handle for `result`. Raises NodeFailed
        when it cannot start."""
        ...

    def submit_span(self, node: str, call: bytes) -> object:
        """Start a span call at `node` (a pipeline plan's; its authenticated bytes, `encode_span_call`); its answer
        comes from `result`."""
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
    readmitted: int = 0  # lost nodes taken back after answering as a new process (that verified its subset again)
    expert_calls: dict[str, int] = field(default_factory=dict)  # node -> experts it was asked to compute

    def busiest_over_mean(self) -> float | None:
        """The busiest node's expert calls over the mean of every planned node's (1.0: perfectly even)."""
        total = sum(self.expert_calls.values())
        return max(self.expert_calls.values()) * len(self.expert_calls) / total if total else None

    def as_dict(self) -> dict:
        balance = self.busiest_over_mean()
        return {"calls": self.calls, "wire_bytes": self.wire_bytes, "remote_seconds": round(self.remote_seconds, 6),
                "retries": self.retries, "dropped_nodes": dict(self.dropped), "readmitted": self.readmitted,
                "expert_calls": dict(sorted(self.expert_calls.items())),
                "busiest_over_mean": None if balance is None else round(balance, 4)}


def choose_replica(candidates: Sequence[str], in_flight: Mapping[str, int], asked: Mapping[str, int]) -> str:
    """The holder an expert's rows go to: the fewest expert calls in flight from this coordinator (the ones already
    given out in this layer count), then the fewest asked so far, then the first in plan order. Deterministic: the
    same calls in the same order choose the same nodes."""
    return min(candidates, key=lambda node: (in_flight.get(node, 0), asked.get(node, 0)))


class RemoteExperts:
    """`fetch(layer)` is the forward pass's ExpertFetch for a cluster (`PackedWeights(remote=...)`)."""

    def __init__(self, placement: Mapping[tuple[int, int], Sequence[str]], root: bytes, transport: Transport, *,
                 keys: Mapping[str, PublicKey], timeout: float = DEFAULT_TIMEOUT,
                 log: Callable[[str], None] | None = None, probe_seconds: float = PROBE_SECONDS,
                 spans: Sequence[tuple[str, tuple[int, ...]]] = ()):
        """`placement`: (layer, expert) -> the nodes holding it, in plan order (ties of `choose_replica` go to the
        first); `keys`: node -> the key its answers must be signed with (from the operator-signed plan);
        `probe_seconds`: how long after it was lost a node is first asked again; `spans`: a pipeline plan's (node,
        its layers) in layer order (`ClusterPlan.spans`), empty for an expert-parallel plan."""
        self.spans = tuple((node, tuple(layers)) for node, layers in spans)
        self.layers = PipelineLayers(self, self.spans) if self.spans else None  # the engine's `ExpertCluster.layers`
        self._span_of = dict(self.spans)  # node -> its layers
        self.placement = {key: tuple(nodes) for key, nodes in placement.items()}
        by_layer: dict[int, list[int]] = {}
        for layer, expert in self.placement:
            by_layer.setdefault(layer, []).append(expert)
        self._layer_experts = {layer: np.asarray(sorted(ids), dtype=np.int64) for layer, ids in by_layer.items()}
        unkeyed = sorted({n for nodes in self.placement.values() for n in nodes} - set(keys))
        if unkeyed:
            raise UsageError(f"no key for node {unkeyed[0]}: every node's answers are checked against its key")
        self.keys = dict(keys)
        self.root = root.hex()
        self.transport = transport
        self.timeout = timeout
        self.stats = ClusterStats()
        self._log = log or (lambda line: print(printable(line), file=sys.stderr, flush=True))
        self._failed: dict[str, set[tuple[int, int]]] = {}  # node -> experts it reported failed
        self._lock = threading.Lock()
        self.stats.expert_calls = {node: 0 for node in self.nodes}
        self._in_flight: dict[str, int] = dict.fromkeys(self.nodes, 0)  # expert calls started and not yet collected
        self._boots: dict[str, str] = {}  # node -> the boot id of the process that answered for it
        self._sessions: dict[str, tuple[str, bytes]] = {}  # node -> (session id, key) of its current session
        self.probe_seconds = probe_seconds
        self._probe_at: dict[str, tuple[float, float]] = {}  # lost node -> (when to ask it next, the gap after that)
        self._span_room: tuple[int, int] | None = None  # (max batch, max context) every span node must hold
        self._span_infos: dict[str, dict] = {}  # span node -> its info() at connect
        self._call_numbers: dict[str, int] = {}  # session id -> the number of its last span call

    @property
    def nodes(self) -> list[str]:
        """Every planned node: those holding experts and a pipeline's span nodes (one may run dense layers only)."""
        return sorted({n for nodes in self.placement.values() for n in nodes} | {node for node, _ in self.spans})

    def connect(self) -> dict[str, dict]:
        """Ask every planned node for its info(); drop those that do not answer, answer for another root or name,
        or do not hold what the plan gave them. Raises UnavailableError when some planned expert is then left with
        no node (naming it). Returns the info of the nodes kept."""
        infos = {}
        for node in self.nodes:
            try:
                info, session = self._handshake(node, self.timeout)
            except NodeFailed as e:
                self._drop(node, str(e))
                continue
            infos[node] = info
            if node in self._span_of:
                self._span_infos[node] = info
            self._boots[node] = info["boot"]
            self._sessions[node] = session
            self._failed.setdefault(node, set()).update(_failed_pairs(info["failed"]))
        for node, layers in self.spans:
            if node in self.stats.dropped:
                raise UnavailableError(self._lost_span(node, (layers[0], layers[-1] + 1)),
                                       hint="start the missing nodes")
        for (layer, expert), nodes in sorted(self.placement.items()):
            if not self._candidates(layer, expert, set()):
                raise UnavailableError(f"no live node holds layer {layer} expert {expert} (planned on "
                                       f"{', '.join(nodes)})", hint="start the missing nodes, or plan more replicas")
        return infos

    def _body(self, answer, proof: str, what: str, extra: tuple[str, ...] = ()) -> bytes:
        """An answer's body, once the answer is exactly {body, `proof`, *extra} with bytes in the first two and a
        body of at most MAX_BODY_BYTES."""
        if (not isinstance(answer, dict) or set(answer) != {"body", proof, *extra}
                or type(answer["body"]) is not bytes or type(answer[proof]) is not bytes):
            kind = "a signed" if proof == "signature" else "an authenticated"
            raise NodeFailed(f"{what} is not {kind} answer (a mapping of body and {proof} bytes"
                             f"{' and ' + ', '.join(extra) if extra else ''}): refused")
        body = answer["body"]
        if len(body) > MAX_BODY_BYTES:
            raise NodeFailed(f"{what} has a {len(body)}-byte body, at most {MAX_BODY_BYTES}: refused")
        return body

    def _doc(self, node: str, body: bytes, nonce: str, what: str) -> dict:
        """An authenticated body -> its JSON object, once it names `node`, this coordinator's root and `nonce`."""
        try:
            doc = loads_strict(body)
        except ShardtoolError:
            doc = None
        if not isinstance(doc, dict):
            raise NodeFailed(f"{what} has an authenticated body that is not a JSON object: refused")
        if doc.get("name") != node:
            raise NodeFailed(f"{what} as node {printable(str(doc.get('name'))[:80])}: refused")
        if doc.get("root") != self.root:
            raise NodeFailed(f"{what} for manifest root {printable(str(doc.get('root'))[:80])}, not this "
                             f"coordinator's {self.root}: refused")
        if doc.get("nonce") != nonce:
            raise NodeFailed(f"{what} for another call (nonce {printable(str(doc.get('nonce'))[:40])}, sent "
                             f"{nonce}): a replay: refused")
        return doc

    def _handshake(self, node: str, timeout: float) -> tuple[dict, tuple[str, bytes]]:
        """Ask `node` for its signed info() with a fresh session key pair of this coordinator's: (the checked info,
        (session id, session key)). The private half of the pair ends with this call."""
        nonce, mine = new_nonce(), Handshake()
        info = self._check_info(node, self.transport.info(node, nonce, mine.public, timeout), nonce)
        session = info.get("session")
        if not isinstance(session, dict) or set(session) != {"coordinator", "node"} or not all(
                isinstance(v, str) and PUBLIC_KEY.fullmatch(v) for v in session.values()):
            raise NodeFailed(f"node {node} answered info() without a session (its and this coordinator's X25519 "
                             f"public keys, 64 lowercase hex digits each): refused")
        if session["coordinator"] != mine.public:
            raise NodeFailed(f"node {node} answered info() for the session key {session['coordinator'][:16]}..., not "
                             f"the one sent ({mine.public[:16]}...): swapped between this coordinator and the node: "
                             f"refused")
        try:
            shared = mine.shared(session["node"])
        except ValueError:
            raise NodeFailed(f"node {node} answered info() with a session key of low order: refused") from None
        key = session_key(shared, mine.public, session["node"], node, bytes.fromhex(self.root), nonce, info["boot"])
        return info, (session_id(mine.public, session["node"]), key)

    def _check_info(self, node: str, answer, nonce: str) -> dict:
        """A node's info() answer -> its body, once the signature verifies with the plan's key for `node` (before
        the body is parsed), the body names `node`, this coordinator's root and `nonce`, and its fields are sound."""
        what = f"node {node} answered info()"
        body, key = self._body(answer, "signature", what), self.keys[node]
        try:
            key.verify(answer["signature"], pae(INFO_TYPE, body))
        except SignatureError:
            raise NodeFailed(f"{what} is not signed by node {node}'s key in the plan (key ID {key.keyid}): an "
                             f"impostor or another node answering under its name: refused") from None
        info = self._doc(node, body, nonce, what)
        experts, failed = info.get("experts"), info.get("failed")
        if not isinstance(experts, list) or len(experts) > MAX_INFO_ENTRIES or not all(
                isinstance(p, list) and len(p) == 2 and all(_is_index(v) for v in p) for p in experts):
            raise NodeFailed(f"node {node} answered info() without a list of [layer, expert] pairs: refused")
        if (not isinstance(failed, dict) or len(failed) > MAX_INFO_ENTRIES
                or not all(isinstance(k, str) and _FAILED_KEY.fullmatch(k) for k in failed)):
            raise NodeFailed(f"node {node} answered info() without a mapping of 'layer/expert' failures: refused")
        if not isinstance(info.get("boot"), str) or not _BOOT.fullmatch(info["boot"]):
            raise NodeFailed(f"node {node} answered info() without a boot id (32 lowercase hex digits): refused")
        span = self._span_of.get(node)
        if span is not None:
            if info.get("layers") != list(span):
                raise NodeFailed(f"node {node} runs layers {printable(str(info.get('layers'))[:40])}, the plan gives "
                                 f"it {list(span)[:8]}: refused")
            if not all(_is_index(info.get(k)) and info[k] >= 1 for k in ("max_sequences", "max_context")):
                raise NodeFailed(f"node {node} answered info() without the sequences and tokens it keeps "
                                 f"(max_sequences, max_context): refused")
            short = self._span_room and _short_room(node, info, *self._span_room)
            if short:
                raise NodeFailed(short)
        held = {(int(a), int(b)) for a, b in experts}
        planned = {key for key, nodes in self.placement.items() if node in nodes}
        if not planned <= held:
            layer, expert = min(planned - held)
            raise NodeFailed(f"node {node} does not hold layer {layer} expert {expert}, which the plan gives it")
        return info

    def check_span_room(self, max_batch: int, max_context: int) -> None:
        """A pipeline coordinator stepping up to `max_batch` sequences of up to `max_context` tokens: each span node
        (as its info() at connect said) must keep that many sequences of that many tokens, so every call of a step fits it
        (its rows then fit the node's activation reserve, `span_activations`). UsageError naming the first that
        does not; a node readmitted later must hold as much."""
        for node, _ in self.spans:
            short = _short_room(node, self._span_infos[node], max_batch, max_context)
            if short:
                raise UsageError(short, hint="lower --max-batch or --max-context here (verify-and-run: the prompt "
                                             "plus --max-new-tokens), or start the node with larger ones")
        self._span_room = (max_batch, max_context)

    def _drop(self, node: str, why: str) -> None:
        with self._lock:
            if node in self.stats.dropped:
                return
            self.stats.dropped[node] = why
            self._probe_at[node] = (time.monotonic() + self.probe_seconds, self.probe_seconds)
        self._log(f"cluster: node {node} dropped: {why}")

    def _forgot_session(self, node: str) -> bool:
        """Whether `node` was dropped because its process refused a call for not holding this coordinator's
        session (evicted from its table by newer ones): a process that neither stopped nor answered wrongly, taken
        back in a new session. The line is not authenticated; whoever could forge it (the node, the proxy, a Ray
        member) could already fail that node's every call or make it answer anything, and the new session still
        takes a signed info() that passes every check of connect."""
        with self._lock:
            session, why = self._sessions.get(node), self.stats.dropped.get(node, "")
        return session is not None and why.startswith(REFUSED + unknown_session(session[0]))

    def probe(self) -> None:
        """Ask each lost node whose time has come for its signed info() again. One that answers, checked as at
        connect, with a boot id other than the lost process's is readmitted (with the failures its new process
        reports), and so is the same process when it was lost for no longer holding this coordinator's session;
        any other outcome leaves it lost and doubles the wait before it is asked again."""
        now = time.monotonic()
        with self._lock:
            due = sorted(node for node, (at, _) in self._probe_at.items() if at <= now)
        for node in due:
            old, forgot = self._boots.get(node), self._forgot_session(node)
            try:
                info, session = self._handshake(node, min(self.timeout, PROBE_TIMEOUT))
                if info["boot"] == old and not forgot:
                    raise NodeFailed("it answers as the same process that was lost (boot id unchanged): it was "
                                     "not started and checked again")
            except NodeFailed:
                with self._lock:
                    if node in self._probe_at:  # (not readmitted meanwhile by a probe on another thread)
                        gap = min(2 * self._probe_at[node][1], MAX_PROBE_SECONDS)
                        self._probe_at[node] = (time.monotonic() + gap, gap)
                continue
            with self._lock:
                if self._probe_at.pop(node, None) is None:
                    continue
                self._boots[node] = info["boot"]
                lost_session = self._sessions.get(node)
                self._sessions[node] = session  # the lost process's session is never accepted again
                if lost_session is not None:  # nor called: its span calls' counter goes with it
                    self._call_numbers.pop(lost_session[0], None)
                self._failed[node] = _failed_pairs(info["failed"])
                del self.stats.dropped[node]
                self.stats.readmitted += 1
            if info["boot"] == old:
                self._log(f"cluster: node {node} readmitted in a new session: its process (boot id {old[:8]}, "
                          f"unchanged) had dropped this coordinator's session from its table")
            else:
                self._log(f"cluster: node {node} readmitted: it answered as a new process (boot id "
                          f"{info['boot'][:8]}), which checked its {len(info['experts'])} planned experts against the "
                          f"manifest before joining")

    def _lost_text(self, node: str) -> str:
        """'node N was lost (why); it held layer 0 experts 1, 3; layer 1 experts 2' (at most MAX_HELD_NAMED named)."""
        held = sorted(pair for pair, nodes in self.placement.items() if node in nodes)
        by_layer: dict[int, list[str]] = {}
        for layer, expert in held[:MAX_HELD_NAMED]:
            by_layer.setdefault(layer, []).append(str(expert))
        named = "; ".join(f"layer {layer} expert{'s' if len(ids) > 1 else ''} {', '.join(ids)}"
                          for layer, ids in by_layer.items())
        more = f" and {len(held) - MAX_HELD_NAMED} more ({len(held)} in all)" if len(held) > MAX_HELD_NAMED else ""
        return f"node {node} was lost ({self.stats.dropped[node]}); it held {named}{more}"

    def _no_replica(self, layer: int, expert: int, last: str | None) -> str:
        """Why (layer, expert) cannot be had: every planned holder lost or refusing it, the lost ones named with
        what they held."""
        planned = self.placement.get((layer, expert), ())
        with self._lock:
            lost = [self._lost_text(n) for n in planned if n in self.stats.dropped]
        return (f"no replica left for layer {layer} expert {expert} (planned on {', '.join(planned) or 'no node'})"
                + "".join(f": {text}" for text in lost[:2]) + (f"; last: {last}" if last else ""))

    def _candidates(self, layer: int, expert: int, tried: set[str]) -> list[str]:
        return [n for n in self.placement.get((layer, expert), ())
                if n not in self.stats.dropped and n not in tried and (layer, expert) not in self._failed.get(n, ())]

    def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def fetch(self, layer: int) -> ExpertFetch:
        def fetch(x: np.ndarray, rows: Mapping[int, np.ndarray]) -> ExpertOutputs:
            self.probe()
            return _RemoteOutputs(self, layer, x, rows)
        return fetch

    # ---------------------------------------------------------------- one layer's calls

    def _send(self, node: str, layer: int, experts: list[int], x: np.ndarray, rows: Mapping[int, np.ndarray]):
        """Start one call with only the rows these experts need (renumbered into the sent block)."""
        if len(x) == 1 and all(len(rows[e]) == 1 and rows[e][0] == 0 for e in experts):
            # A decode step of one sequence (every round of it): the block is x and the rows are [0] as they are;
            # what the general path below computes, without its ~50 us of numpy set operations per call.
            block = np.ascontiguousarray(x, dtype=np.float32)
            local = {e: np.zeros(1, dtype=np.int64) for e in experts}
        else:
            used = np.unique(np.concatenate([rows[e] for e in experts]))
            block = np.ascontiguousarray(x[used], dtype=np.float32)
            local = {e: np.searchsorted(used, rows[e]).astype(np.int64) for e in experts}
        self.stats.calls += 1
        self.stats.wire_bytes += block.nbytes + sum(r.nbytes for r in local.values())
        nonce = new_nonce()
        sent = input_digest(block, experts, local)  # what the node must say it computed on
        with self._lock:
            sid, key = self._sessions[node]
        return self.transport.submit(node, layer, list(experts), block, local, nonce, sid), (nonce, sent, key)

    def run(self, layer: int, x: np.ndarray, rows: Mapping[int, np.ndarray]) -> tuple[dict, dict]:
        """All requested experts' outputs, retried across replicas: ({expert: [t_e, H]}, {expert: why it could
        not be had})."""
        return _LayerCalls(self, layer, x, rows).finish()

    # ---------------------------------------------------------------- a pipeline node's span

    def span(self, node: str, span: tuple[int, int], x: np.ndarray, segments: list[tuple[int, int, int]],
             drop: list[int], routes: bool) -> tuple[np.ndarray, list[np.ndarray]]:
        """# x [n, H] through node `node`'s layers span[0]..span[1]-1 -> (x' [n, H], per MoE layer of the span the
        experts each row chose [n, k] when `routes`). A node that fails is dropped (UnavailableError naming it and
        its layers); rows it could not run raise ExpertUnavailable for those rows."""
        self.probe()
        t0 = time.perf_counter()
        try:
            with self._lock:
                lost = node in self.stats.dropped
                sid, key = self._sessions.get(node, ("", b""))
                number = self._call_numbers[sid] = self._call_numbers.get(sid, 0) + 1
            if lost:
                raise UnavailableError(self._lost_span(node, span))
            x = np.ascontiguousarray(x, dtype=np.float32)
            nonce = new_nonce()
            sent = span_input_digest(span, x, segments, drop, routes)
            self.stats.calls += 1
            self.stats.wire_bytes += 2 * x.nbytes
            try:
                call = encode_span_call(span, x, segments, drop, routes, nonce, number, (sid, key))
                pending = self.transport.submit_span(node, call)
                reply = self.transport.result(pending, self.timeout)
                return self._check_span_reply(node, span, x.shape, routes, reply, (nonce, sent, key))
            except NodeFailed as err:
                self._drop(node, str(err))
                raise UnavailableError(self._lost_span(node, span)) from None
        finally:
            self.stats.remote_seconds += time.perf_counter() - t0

    def _lost_span(self, node: str, span: tuple[int, int]) -> str:
        with self._lock:
            why = self.stats.dropped.get(node, "")
        layers = f"layers {span[0]}..{span[1] - 1} have" if span[1] - span[0] > 1 else f"layer {span[0]} has"
        return (f"{layers} no node left: node {node}, which runs them (the plan keeps one copy of each span), was "
                f"lost ({why})")

    def _check_span_reply(self, node: str, span: tuple[int, int], shape: tuple[int, int], routes: bool, reply,
                          call: tuple[str, str, bytes]) -> tuple[np.ndarray, list[np.ndarray]]:
        doc, digests, failed, outputs = self._reply(node, reply, call)
        if doc.get("span") != list(span):
            raise NodeFailed(f"the reply is for layers {printable(str(doc.get('span'))[:40])}, asked {list(span)}: "
                             f"refused")
        if failed:
            if digests or outputs:
                raise NodeFailed("the reply both fails and answers the span: refused")
            try:
                raise span_failure(node, span, failed, shape[0])
            except ValueError as e:
                raise NodeFailed(f"the reply's failure is malformed ({e}): refused") from None
        y = outputs.get(0)
        if set(digests) != {"0"} or set(outputs) != {0}:
            raise NodeFailed("the reply does not carry exactly the span's one output")
        _check_output(y, shape, digests["0"], "the span's output")
        return y, self._span_routes(doc.get("routes"), span, shape[0]) if routes else []

    def _span_routes(self, raw, span: tuple[int, int], rows: int) -> list[np.ndarray]:
        """The routes a span reply names: per MoE layer of the span, [rows, k] expert ids in [0, E)."""
        moe = [layer for layer in range(*span) if layer in self._layer_experts]  # its MoE layers
        if not isinstance(raw, list) or len(raw) != len(moe):
            raise NodeFailed(f"the reply names routes for {len(raw) if isinstance(raw, list) else 'no'} MoE layers, "
                             f"the span has {len(moe)}: refused")
        out = []
        for layer, idx in zip(moe, raw):
            experts = self._layer_experts[layer]
            a = None
            # JSON integers only: numpy would turn 1.5, true or "3" into an expert id
            if isinstance(idx, list) and all(isinstance(r, list) and all(type(v) is int for v in r) for r in idx):
                try:
                    a = np.asarray(idx, dtype=np.int64)
                except (ValueError, OverflowError):
                    pass
            if a is None or a.ndim != 2 or a.shape[0] != rows or not 1 <= a.shape[1] <= len(experts) or (
                    a.size and not np.isin(a, experts).all()):
                raise NodeFailed(f"the reply's routes at layer {layer} are not [{rows}, k] ids of that layer's "
                                 f"experts: refused")
            out.append(a)
        return out

    def _reply(self, node: str, reply, call: tuple[str, str, bytes]) -> tuple[dict, dict, dict, dict]:
        """A run or span answer -> (its body, the body's output digests and failures, the outputs), once its MAC
        verifies under the call's session key (before the body is parsed) and the body names `node`, this
        coordinator's root, the call's nonce and the digest of the inputs sent. `call`: (nonce, that digest, key)."""
        nonce, sent, key = call
        body = self._body(reply, "mac", "the reply", ("outputs",))
        if not mac_matches(key, REPLY_TYPE, body, reply["mac"]):
            raise NodeFailed(f"the reply is not authenticated by node {node}'s session key (made at its signed "
                             f"info()): an impostor, another node or another session answering under its name: "
                             f"refused")
        doc = self._doc(node, body, nonce, "the reply")
        if doc.get("input") != sent:
            raise NodeFailed("the reply was computed on other inputs than the ones sent: refused")
        digests, failed, outputs = doc.get("outputs"), doc.get("failed"), reply["outputs"]
        if not isinstance(digests, dict) or not isinstance(failed, dict) or not isinstance(outputs, dict):
            raise NodeFailed("the reply has no outputs/failed mappings")
        return doc, digests, failed, outputs

    def _check_reply(self, node: str, layer: int, experts: list[int], rows: Mapping[int, np.ndarray], reply,
                     hidden: int, call: tuple[str, str, bytes]) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        """`call`: the call's (nonce, digest of the inputs sent, key of the session it was sent in)."""
        doc, digests, failed, outputs = self._reply(node, reply, call)
        if doc.get("layer") != layer or isinstance(doc.get("layer"), bool):
            raise NodeFailed(f"the reply is for layer {printable(str(doc.get('layer'))[:20])}, asked {layer}: refused")
        if doc.get("experts") != list(experts):
            raise NodeFailed(f"the reply is for experts {printable(str(doc.get('experts'))[:80])}, asked {experts}: "
                             f"refused")
        asked = {str(e): e for e in experts}
        if (set(digests) | set(failed) != set(asked) or set(digests) & set(failed)
                or set(outputs) != {asked[k] for k in digests}):
            raise NodeFailed(f"the reply covers experts {printable(str(sorted(set(digests) | set(failed)))[:80])}, "
                             f"asked {experts}")
        for e, y in outputs.items():
            _check_output(y, (len(rows[e]), hidden), digests[str(e)], f"expert {e}'s output")
        return outputs, {asked[e]: printable(str(why)[:300]) for e, why in failed.items()}


def _check_output(y, shape: tuple[int, int], digest: str, what: str) -> None:
    """One output a node authenticated: exactly an ndarray (a subclass could change what `*` and `+=` do), float32 of
    `shape`, with the BLAKE3 the body names, finite (a NaN from a node would otherwise surface as 'the signed weights
    give non-finite logits' and never drop the node)."""
    if type(y) is not np.ndarray or y.dtype != np.float32 or y.shape != shape:
        raise NodeFailed(f"{what} is not a float32 array of shape {shape}")
    if output_digest(y) != digest:
        raise NodeFailed(f"{what} is not the one the node authenticated: refused")
    if not np.isfinite(y).all():
        raise NodeFailed(f"{what} is not finite")


class _LayerCalls:
    """One MoE layer's calls: started at once (`__init__`), gathered and retried on replicas by `finish`."""

    def __init__(self, remote: RemoteExperts, layer: int, x: np.ndarray, rows: Mapping[int, np.ndarray]):
        self.remote, self.layer, self.x, self.rows = remote, layer, x, rows
        self.outputs: dict[int, np.ndarray] = {}
        self.missing: dict[int, str] = {}
        self.tried: dict[int, set[str]] = {e: set() for e in rows}
        self.last: dict[int, str] = {}
        self._round: dict[str, tuple[list[int], object | None, str]] = {}
        self._deadline = 0.0
        self._charged: dict[str, int] = {}  # node -> this layer's expert calls counted in flight there
        self._timed(self._dispatch, sorted(rows))

    def _release(self, node: str) -> None:
        with self.remote._lock:
            self.remote._in_flight[node] -= self._charged.pop(node, 0)

    def __del__(self):
        # A layer whose outputs were never waited for (the step failed first) must not stay in flight for ever.
        for node in list(getattr(self, "_charged", ())):
            self._release(node)

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
                self.missing[e] = remote._no_replica(layer, e, self.last.get(e))
                continue
            with remote._lock:
                node = choose_replica(nodes, remote._in_flight, remote.stats.expert_calls)
                remote._in_flight[node] += 1
                remote.stats.expert_calls[node] += 1
            self._charged[node] = self._charged.get(node, 0) + 1
            by_node.setdefault(node, []).append(e)
            self.tried[e].add(node)
            if len(self.tried[e]) > 1:
                remote.stats.retries += 1
        self._round = {}
        for node, experts in by_node.items():
            try:
                self._round[node] = (experts, *remote._send(node, layer, experts, self.x, self.rows))
            except NodeFailed as err:
                remote._drop(node, str(err))
                self._round[node] = (experts, None, ("", "", b""))
        self._deadline = time.monotonic() + remote.timeout

    def _collect(self) -> list[int]:
        """The replies of the round in flight; returns the experts to ask again elsewhere."""
        remote, layer, pending = self.remote, self.layer, []
        for node, (experts, call, sent) in self._round.items():
            self._release(node)  # collected (or failed) now, whatever comes of it
            if call is None:
                pending += experts
                continue
            try:
                reply = remote.transport.result(call, max(self._deadline - time.monotonic(), 0.001))
                got, failed = remote._check_reply(node, layer, experts, self.rows, reply, self.x.shape[1], sent)
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


def load_plan(path: Path, manifest: VerifiedManifest) -> ClusterPlan:
    """A plan file, refused by size before it is read, decoded and checked against the verified manifest. Its
    signature is not checked: for choosing which verified files to fetch (`pull --plan`), never to run a cluster."""
    data = read_regular(path, MAX_PLAN_BYTES, what="plan", too_large=UsageError)
    return decode_plan(data, manifest, what=str(path))


def signature_path(plan: Path) -> Path:
    """Where a plan's detached signature lives: beside it, PLAN.sig."""
    return plan.with_name(plan.name + ".sig")


def load_signed_plan(path: Path, manifest: VerifiedManifest, operators: Sequence[PublicKey]) -> ClusterPlan:
    """A plan for running a cluster: its signature file (PLAN.sig) must verify with one of the operator's keys
    over the plan's exact bytes before they are parsed; then decoded and checked against the verified manifest."""
    data = read_regular(path, MAX_PLAN_BYTES, what="plan", too_large=UsageError)
    sig = signature_path(Path(path))
    if not sig.exists():
        raise SignatureError(f"the plan is not signed: there is no {sig.name} beside it", path=str(path),
                             hint="sign it with `shardtool plan --sign-key OPERATOR.key --out PLAN`")
    signature = read_regular(sig, MAX_SIGNATURE_FILE, what="plan signature", too_large=SignatureError)
    return open_signed_plan(data, signature, operators, manifest, what=str(path))


def plan_placement(plan: ClusterPlan) -> dict[tuple[int, int], tuple[str, ...]]:
    """(layer, expert) -> the nodes a ClusterPlan puts it on, in plan order."""
    return {pair: plan.holders(*pair) for node in plan.nodes for pair in node.pairs()}


def connect_cluster(address: str, plan: ClusterPlan, *, timeout: float = DEFAULT_TIMEOUT,
                    insecure: bool = False, graph: bool = False) -> RemoteExperts:
    """A coordinator's RemoteExperts over the Ray cluster at `address` (token authentication required unless
    `insecure`), through a cluster proxy (`_cluster_proxy`: this process never deserializes anything from Ray, and
    is made non-dumpable first), every planned node asked for its signed info (UnavailableError when some planned expert has no
    node left that answers for this plan's root with its planned key). `plan` comes from `load_signed_plan`."""
    keys = {node.name: node.public_key() for node in plan.nodes}
    # Before a byte of the cluster's arrives: the proxy (and whatever a reply runs in it) is a process of this
    # user, which must not be able to read this one's memory (where a receipt key may be).
    keep_memory_private()
    # `graph`: a layer's round through a Ray Compiled Graph over the plan's nodes (off by default: on this project's
    # loaded 2-core loopback its readers' polling made a round slower, docs/scaling.md).
    nodes = tuple(node.name for node in plan.nodes) if graph else ()
    transport = ProxyTransport(address, timeout, insecure=insecure, nodes=nodes)
    remote = RemoteExperts(plan_placement(plan), plan.root, transport, keys=keys, timeout=timeout,
                           spans=plan.spans())
    try:
        remote.connect()
    except BaseException:
        transport.close()
        raise
    return remote


def _is_index(v) -> bool:
    return is_int(v) and 0 <= v < 1 << 31


def _short_room(node: str, info: Mapping, max_batch: int, max_context: int) -> str | None:
    """Why span node `node` (its checked info()) cannot run a coordinator's steps of up to `max_batch` sequences of
    up to `max_context` tokens; None when it can."""
    if info["max_sequences"] < max_batch:
        return (f"node {node} keeps {info['max_sequences']} sequences (its --max-sequences), this coordinator steps "
                f"up to {max_batch} at once")
    if info["max_context"] < max_context:
        return (f"node {node} runs sequences of at most {info['max_context']} tokens (its --max-context), this "
                f"coordinator's may reach {max_context}")
    return None


def _failed_pairs(failed: Mapping[str, str]) -> set[tuple[int, int]]:
    """{"layer/expert": why} of a checked info() -> the (layer, expert) pairs a node reports failed."""
    return {tuple(int(v) for v in key.split("/")) for key in failed}
