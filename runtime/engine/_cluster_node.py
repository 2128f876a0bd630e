"""A cluster node's expert service: the experts a plan gave this node, each loaded through the verifying shard
store (also after an eviction), run on hidden states sent by a coordinator.

`NodeService` is plain Python; `serve_node` runs it as a Ray actor named `shardtool-node-NAME` in the namespace
"shardtool", owned by the calling process (it dies with it). Every argument that arrives over the wire is
checked (types, shapes, dtypes, caps, that this node holds the layer and expert) before it is used. An expert
whose shard fails verification is marked failed from then on: reported by `info()` and in every reply, while
the node keeps serving its other experts.

info() answers are signed with the node's key (the one the operator's signed plan names for it): `{"body": bytes,
"signature": bytes}`, the signature Ed25519 over PAE(INFO_TYPE, body). A coordinator's info() request carries a fresh
X25519 public key: the node answers with its own in the signed body and both derive a session key (`_cluster_session`);
a run call names that session, and its answer is `{"body": bytes, "mac": bytes, "outputs": {expert: [t_e, H]
float32}}`, the MAC keyed BLAKE3 over PAE(REPLY_TYPE, body) with the session key. Each body is canonical JSON naming
the kind, the node, the manifest root and the caller's nonce, and for run() the layer, the experts asked, the inputs'
digest, each output's BLAKE3 and each failure. Only plain types cross the wire: info() takes strings and answers
bytes in a plain dict; the actor's run() takes and answers one msgpack bytes object each (`_cluster_wire`).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import blake3
import numpy as np

from shardtool.errors import CheckpointFormatError, ShardtoolError, UnavailableError, UsageError, VerificationError
from shardtool.keys import PrivateKey
from shardtool.manifest import Entry, VerifiedManifest, pae
from shardtool.manifest.audit import check_file
from shardtool.remote import RemoteFiles, RemoteSource
from shardtool.runtime.model import ModelConfig, run_expert
from ._cluster_plan import NODE_READERS, ClusterPlan, pipeline_node_floor
from ._cluster_session import Handshake, SessionTable, check_public_key, mac, mac_matches, session_id, session_key
from ._cluster_spans import (DEFAULT_MAX_CONTEXT, DEFAULT_MAX_SEQUENCES, SpanRunner, span_activations, span_input_digest,
                             span_kv_bytes)
from ._plan import MIN_ACTIVATION_RESERVE
from ._cluster_wire import SPAN_CALL_TYPE, decode_any_call, decode_span_call, encode_answer, pack
from ._provider import VerifiedWeights
from ._signed import unusable_shards, verified_config
from shardtool.runtime.store import DEFAULT_POLICY
from shardtool.runtime.store import DEFAULT_PAGE_CACHE, ShardStore, header_memo_bytes, page_cache_mode

NAMESPACE = "shardtool"
ACTOR_PREFIX = "shardtool-node-"
MAX_GRAPH_NODES = 1 << 12  # nodes of one Compiled Graph round (a round's calls, at most one per node)
# Threads of the actor's "_ray_system" group, where each Compiled Graph's loop runs until its coordinator tears it
# down. A coordinator that dies without teardown (SIGKILL) leaves its loop there, blocked for good: with one thread
# the next coordinator's graph would queue behind it and its first execution hang. Each coordinator's graph takes
# one thread; plain calls (info, run, the node's health check) run in the default group beside them.
GRAPH_THREADS = 4
# How long a starting node waits for its name to be released by a killed node process of the same name.
NAME_RELEASE_GRACE = 30.0
NAME_RETRY_INTERVAL = 0.25
MAX_ROWS = 1 << 16  # token rows of one call: a step's batch rows, far below this
INSTALL_HINT = "install the cluster extra: pip install 'shardtool[cluster]'"
INFO_TYPE = "application/vnd.shardtool.node-info+json"
REPLY_TYPE = "application/vnd.shardtool.node-reply+json"
NONCE = re.compile(r"[0-9a-f]{32}", re.ASCII)  # 16 random bytes per call, chosen by the coordinator


def canonical_body(doc: dict) -> bytes:
    """The one encoding of a signed body: JSON, sorted keys, compact, ASCII."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def output_digest(y: np.ndarray) -> str:
    """BLAKE3 of one output's float32 bytes (its shape is checked against the request, not signed)."""
    return blake3.blake3(np.ascontiguousarray(y).tobytes()).hexdigest()


def input_digest(x: np.ndarray, ids, rows) -> str:
    """BLAKE3 of what a call computed on: the hidden-state block [n, H] (shape, then float32 bytes) and each
    requested expert's row indices in the order asked (id, count, int64 bytes). A node's authenticated answer
    names it, so an answer computed on inputs someone between the coordinator and the node swapped is refused."""
    h = blake3.blake3(np.asarray(x.shape, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(x, dtype="<f4").tobytes())
    for e in ids:
        r = np.ascontiguousarray(rows[e], dtype="<i8")
        h.update(np.asarray([int(e), r.size], dtype="<i8").tobytes())
        h.update(r.tobytes())
    return h.hexdigest()


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


INSECURE_WARNING = ("warning: --insecure-cluster: Ray token authentication is not required; anyone who can reach "
                    "the Ray head at {address} can join, answer as a node and run code in this process")
TOKEN_HINT = ("give this process the head's token: RAY_AUTH_TOKEN_PATH=FILE (or RAY_AUTH_TOKEN, or ~/.ray/auth_token), "
              "and start the head with RAY_AUTH_MODE=token")


def require_token_auth(host: str, port: int, timeout: float) -> None:
    """Ray's token authentication on, for this process and the head at host:port: RAY_AUTH_MODE must be unset or
    "token", Ray must find a token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), and the head's GCS
    must refuse a request that carries no token and accept one with this token (checked with a raw gRPC
    GetClusterId, before Ray connects: Ray's own client retries a refused token for 20 s, then names no reason)."""
    import grpc
    from ray._raylet import AuthenticationTokenLoader, Config
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    mode = os.environ.get("RAY_AUTH_MODE")
    if mode not in (None, "token"):
        raise UsageError(f"RAY_AUTH_MODE is {mode[:20]!r}: the cluster commands require Ray token authentication",
                         hint="unset it or set RAY_AUTH_MODE=token; --insecure-cluster turns the requirement off")
    loader = AuthenticationTokenLoader.instance()
    if not loader.has_token(ignore_auth_mode=True):
        raise UsageError("no Ray authentication token found for this process", hint=TOKEN_HINT)
    token = loader.get_raw_token(ignore_auth_mode=True)
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray reads its mode once; this process (and the workers it starts) now use the token
    address = f"{host}:{port}"

    def ask(metadata) -> grpc.StatusCode:
        with _gcs_channel(grpc, f"{host.strip('[]')}:{port}") as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            try:
                stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout, metadata=metadata)
            except grpc.RpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    without = ask(None)
    if without == grpc.StatusCode.OK:
        raise VerificationError(f"the Ray head at {address} does not enforce token authentication (it answered a "
                                f"request that carried no token): anyone who reaches it could join the cluster",
                                hint="start the head with RAY_AUTH_MODE=token (docs/scaling.md), or pass "
                                     "--insecure-cluster to accept it anyway")
    if without != grpc.StatusCode.UNAUTHENTICATED:
        raise UnavailableError(f"the Ray head at {address} did not answer its GCS service: {without.name}",
                               hint="a head started with RAY_USE_TLS=1 needs RAY_USE_TLS=1 and RAY_TLS_SERVER_CERT, "
                                    "RAY_TLS_SERVER_KEY, RAY_TLS_CA_CERT here too")
    with_token = ask((("authorization", "Bearer " + token),))
    if with_token == grpc.StatusCode.UNAUTHENTICATED:
        raise VerificationError(f"the Ray head at {address} refuses this process's token", hint=TOKEN_HINT)
    if with_token != grpc.StatusCode.OK:
        raise UnavailableError(f"the Ray head at {address} did not answer its GCS service: {with_token.name}")


def _gcs_channel(grpc, target: str):
    """A gRPC channel to the head's GCS without Ray's token interceptor: TLS when Ray uses it (RAY_USE_TLS and
    RAY_TLS_SERVER_CERT/KEY/CA_CERT, as Ray's own channels are made), plaintext otherwise."""
    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return grpc.insecure_channel(target)
    from ray._common.tls_utils import load_certs_from_env
    try:
        cert, key, ca = load_certs_from_env()
    except (OSError, RuntimeError) as e:
        raise UsageError(f"RAY_USE_TLS is set but its certificates cannot be read: {' '.join(str(e).split())[:200]}"
                         ) from None
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                                     certificate_chain=cert))


def init_ray(ray, address: str, timeout: float, *, insecure: bool = False) -> None:
    """Connect this process to the Ray cluster at `address` (namespace "shardtool") as a driver, quietly: with
    token authentication required (`require_token_auth`), or with a warning on stderr when `insecure`. Ray's
    core worker installs its own SIGTERM handler, which would end the process without a clean exit; the Python
    handlers that were in place are put back."""
    host, port = check_address(address, timeout)
    if insecure:
        print(INSECURE_WARNING.format(address=address), file=sys.stderr, flush=True)
    else:
        require_token_auth(host, port, timeout)
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
    key_seed: bytes = field(default=b"", repr=False)  # the node's raw 32-byte Ed25519 private key: signs info()
    owner_pid: int = 0  # the `shardtool node` process on this machine: its actor exits when it does (0: no watch)
    owner_pid_namespace: int = 0  # the inode of that process's pid namespace: watched only where it is the actor's (0: unknown, no watch)
    layers: tuple[int, ...] = ()  # a pipeline plan's span: the layers this node runs whole (their trunk in `entries`)
    max_sequences: int = DEFAULT_MAX_SEQUENCES  # a span node's sequences kept (keys and values), least recent out
    max_context: int = DEFAULT_MAX_CONTEXT  # a span node's tokens per sequence


class NodeService:
    """Runs this node's experts; thread-safe (Ray may call it from one thread at a time, tests from several)."""

    def __init__(self, setup: NodeSetup):
        self.setup = setup
        self.config = setup.config
        self.held: dict[tuple[int, int], Entry] = {(e.layer, e.expert): e for e in setup.entries if e.kind == "expert"}
        self.fetcher = RemoteFiles(Path(setup.directory), setup.remote) if setup.remote is not None else None
        self.store = ShardStore(Path(setup.directory), budget_bytes=setup.budget, readers=setup.readers,
                                fetch_missing=self.fetcher.fetch if self.fetcher is not None else None,
                                policy=setup.cache_policy, header_memo=header_memo_bytes(len(setup.entries)),
                                page_cache=page_cache_mode(DEFAULT_PAGE_CACHE, sum(e.size for e in setup.entries),
                                                           setup.budget))
        self.failed: dict[tuple[int, int], str] = {}
        self.calls = 0
        self._lock = threading.Lock()
        self._key = key_from_seed(setup.key_seed)
        # Drawn once per service, which `shardtool node` starts only after its subset check passed: a coordinator
        # that lost this node takes it back only under a boot id other than the lost one's.
        self.boot = new_nonce()
        self.sessions = SessionTable()
        self.spans = None if not setup.layers else SpanRunner(
            self.config, VerifiedWeights(self.store, _Listed(setup.entries), self.config.num_layers,
                                         window=self.config.top_k),
            setup.layers, max_sequences=setup.max_sequences, max_context=setup.max_context)

    def _body(self, doc: dict, nonce: str) -> bytes:
        return canonical_body({**doc, "name": self.setup.name, "root": self.setup.root.hex(), "nonce": nonce})

    def info(self, nonce, session=None) -> dict:
        """This node's name, root, boot id, experts and failures, signed for the caller's `nonce`. With `session`
        (the caller's X25519 public key, 64 hex digits) a session is made: both public keys are in the signed body,
        and the key derived from them authenticates this process's answers to that session's run calls."""
        nonce = _check_nonce(nonce)
        s = self.setup
        with self._lock:
            failed = {f"{layer}/{expert}": why for (layer, expert), why in sorted(self.failed.items())}
        doc = {"manifest_version": s.manifest_version, "boot": self.boot, "experts": sorted(
            [layer, expert] for layer, expert in self.held), "failed": failed, "calls": self.calls,
            "store": self.store.stats.as_dict(),
            # what a coordinator's steps must fit (`RemoteExperts.check_span_room`)
            **({"layers": list(s.layers), "max_sequences": s.max_sequences, "max_context": s.max_context}
               if s.layers else {})}
        if session is not None:
            coordinator = check_public_key(session, "info()'s session")
            mine = Handshake()
            try:
                shared = mine.shared(coordinator)
            except ValueError:
                raise UsageError("info()'s session key is of low order (no secret can be shared with it)") from None
            key = session_key(shared, coordinator, mine.public, s.name, s.root, nonce, self.boot)
            self.sessions.add(session_id(coordinator, mine.public), key)
            doc["session"] = {"coordinator": coordinator, "node": mine.public}
        body = self._body(doc, nonce)
        return {"body": body, "signature": self._key.sign(pae(INFO_TYPE, body))}

    def _maced(self, doc: dict, nonce: str, key: bytes) -> dict:
        body = self._body(doc, nonce)
        return {"body": body, "mac": mac(key, REPLY_TYPE, body)}

    def run(self, layer, expert_ids, x, rows, nonce, session) -> dict:
        """Each requested expert's unweighted output on its rows, `run_expert(x[rows[e]])` [t_e, H] float32; an
        expert that cannot be had is in `failed` with one line. Arguments are checked before anything runs, first
        that `session` is one of this process's; the answer is authenticated by that session's key over the nonce,
        layer, experts, the inputs' digest, each output's digest, root and this node's name."""
        nonce = _check_nonce(nonce)
        key = self.sessions.key(session)  # the answer's MAC key, looked up once
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
        body = {"layer": int(layer), "experts": [int(e) for e in ids], "input": input_digest(x, ids, rows),
                "outputs": {str(e): output_digest(y) for e, y in outputs.items()},
                "failed": {str(e): why for e, why in failed.items()}, "seconds": time.perf_counter() - t0}
        return {**self._maced(body, nonce, key), "outputs": {int(e): y for e, y in outputs.items()}}

    def run_span(self, session, call, tag) -> dict:
        """A pipeline node's layers on a step's rows (`SpanRunner`): {body, mac, outputs: {0: x' [n, H] float32}},
        the body naming the span, the inputs' digest, the output's digest, a failure of some rows (then no output)
        and, when asked, the experts each row chose at each MoE layer. The call's bytes must carry `session`'s MAC
        (checked before they are read) and a number above the session's last: this node's keys and values outlive
        the call, so a forged or replayed one would change what later authenticated answers compute on. Then
        checked as `run`'s call is."""
        key = self.sessions.key(session)
        if not mac_matches(key, SPAN_CALL_TYPE, call, tag):
            raise UsageError(f"the span call is not authenticated by session {session}'s key: refused")
        span, x, segments, drop, routes, nonce, number = decode_span_call(call)
        nonce = _check_nonce(nonce)
        if self.spans is None:
            raise UsageError(f"node {self.setup.name} holds experts, not a span of layers (the plan is not a "
                             f"pipeline plan)")
        self.sessions.advance(session, number)
        checked, dropped = self.spans.check(span, x, segments, drop, routes)
        t0 = time.perf_counter()
        with self._lock:
            self.calls += 1
        y, chosen, failed = self.spans.run(session, x, checked, dropped, routes)
        body = {"span": list(self.spans.span), "input": span_input_digest(span, x, segments, drop, routes),
                "outputs": {} if y is None else {"0": output_digest(y)}, "failed": failed,
                "routes": [idx.tolist() for idx in chosen] if routes and y is not None else None,
                "seconds": time.perf_counter() - t0}
        return {**self._maced(body, nonce, key), "outputs": {} if y is None else {0: y}}

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


class _Listed:
    """A span node's entries as `VerifiedWeights` looks them up (by path): its own shards of the verified manifest."""

    def __init__(self, entries: tuple[Entry, ...]):
        self._by_path = MappingProxyType({e.path: e for e in entries})

    def by_path(self) -> Mapping[str, Entry]:
        return self._by_path


class NodeActor:
    """What the cluster may call on a node: info(), run() and graph_run() only (NodeService.close, which shuts the reader
    pool, is not reachable over the wire; the store ends with the node's process)."""

    def __init__(self, setup: NodeSetup):
        if setup.owner_pid and setup.owner_pid_namespace and setup.owner_pid_namespace == pid_namespace():
            exit_with_owner(setup.owner_pid)
        self._service = NodeService(setup)
        graphs_without_torch()

    def info(self, nonce, session=None) -> dict:
        return self._service.info(nonce, session)

    def run(self, call) -> bytes:
        """A run call as one bytes object (`_cluster_wire.encode_call`), its answer as one too (`encode_answer`,
        packed): Ray carries bytes as they are, where it would pickle and rebuild every array both ways."""
        kind, args = decode_any_call(call)
        service = self._service
        return pack(encode_answer(service.run_span(*args) if kind == "span" else service.run(*args)))

    def graph_run(self, calls) -> bytes:
        """A coordinator's Compiled Graph round: every node of the graph gets the round's {node name: call bytes};
        this node runs its own call as `run` does, and answers b"" when the round asks nothing of it."""
        if not isinstance(calls, dict) or len(calls) > MAX_GRAPH_NODES:
            raise UsageError(f"a graph round must map at most {MAX_GRAPH_NODES} node names to calls, got "
                             f"{_describe(calls)}")
        call = calls.get(self._service.setup.name)
        return b"" if call is None else self.run(call)


def exit_with_owner(pid: int, exit=os._exit) -> threading.Thread | None:
    """End this process as soon as process `pid` (the `shardtool node` that started this actor, on this machine)
    has ended. Ray ends an actor whose owner died too, once it has noticed (0.1-0.6 s measured here, a loaded
    machine included); until then a node the operator killed still answers the cluster and holds its name. This
    makes that wait the kernel's, not Ray's. A pidfd (not a pid, which the kernel may hand to another process) says
    when it ended.
    Where no pidfd can be had (no os.pidfd_open, a kernel or seccomp profile refusing it), no watch (None): Ray's
    own, slower, detection remains, and the actor still starts."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        exit(0)  # already gone: nobody is behind this actor
        raise  # only reached when `exit` returns (tests)
    except (OSError, AttributeError):
        return None

    def watch() -> None:
        poller = select.poll()  # not select(): it cannot watch a descriptor numbered 1024 or more
        poller.register(fd, select.POLLIN)
        poller.poll()  # readable once the process has exited
        exit(0)

    thread = threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True)
    thread.start()
    return thread


def pid_namespace() -> int:
    """This process's pid namespace (0 when unknown): a pid means the same process only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def graphs_without_torch() -> None:
    """Tell this process's Ray Compiled Graph channels that torch is not there. Our graphs carry bytes, never
    tensors; otherwise, with torch installed, each process imports it at its first channel read (10 s cold on a
    loaded node), and a graph's first execution misses its deadline: the "hang" of a fresh cluster."""
    from ray.experimental.channel.common import ChannelContext
    ChannelContext.get_current()._torch_available = False


def key_seed(key: PrivateKey) -> bytes:
    """The raw 32-byte private key, the form a NodeSetup carries to the node's actor (plain bytes cross Ray)."""
    from cryptography.hazmat.primitives import serialization
    return key.key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())


def key_from_seed(seed: bytes) -> PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    if not isinstance(seed, bytes) or len(seed) != 32:
        raise UsageError("a node needs its 32-byte Ed25519 private key (--node-key) to sign its info()")
    return PrivateKey(Ed25519PrivateKey.from_private_bytes(seed))


def _check_nonce(nonce) -> str:
    if not isinstance(nonce, str) or not NONCE.fullmatch(nonce):
        raise UsageError("nonce must be 32 lowercase hex digits")
    return nonce


def new_nonce() -> str:
    import secrets
    return secrets.token_hex(16)


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


def serve_node(setup: NodeSetup, address: str, *, timeout: float, insecure: bool = False) -> tuple[object, dict]:
    """Join the Ray cluster at `address` as a driver, start this node's actor on this machine's Ray node (where the
    audited directory is), and wait until it answers. Returns (actor handle, its info()). The actor is owned by
    this process: it ends when this process ends (or `leave` is called)."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    init_ray(ray, address, timeout, insecure=insecure)
    here = ray.get_runtime_context().get_node_id()
    # The actor runs on this machine (affinity below) and ends with this process.
    setup = replace(setup, owner_pid=os.getpid(), owner_pid_namespace=pid_namespace())
    actor_class = ray.remote(concurrency_groups={"_ray_system": GRAPH_THREADS})(NodeActor)
    actor = claim_name(setup.name, lambda: actor_class.options(
        name=actor_name(setup.name), namespace=NAMESPACE, num_cpus=0, max_concurrency=1, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(setup),
        grace=min(timeout, NAME_RELEASE_GRACE))
    try:
        answer = ray.get(actor.info.remote(new_nonce()), timeout=timeout)
    except ray.exceptions.RayError as e:
        raise UnavailableError(f"node {setup.name} did not start: {type(e).__name__}") from None
    return actor, json.loads(answer["body"])


def claim_name(name: str, create, *, grace: float, clock=time.monotonic, sleep=time.sleep):
    """Create this node's named actor, waiting up to `grace` seconds for the name to be released. A node process
    that was SIGKILLed leaves its actor, and so its name, in the cluster until Ray notices that the actor's owner
    is gone (0.1-0.6 s measured here, under load too): a node restarted at once must wait for that,
    not be refused. A name still held after `grace` is another live node's: UsageError."""
    taken = import_ray().exceptions.ActorAlreadyExistsError  # a ValueError, as Ray's other refusals: only this one
    deadline = clock() + grace
    while True:
        try:
            return create()
        except taken as e:
            if clock() >= deadline:
                raise UsageError(f"node name {name!r} is already in use in this cluster (still held after {grace:g} s): "
                                 f"{' '.join(str(e).split())[:200]}") from None
            sleep(NAME_RETRY_INTERVAL)


def node_alive(actor, timeout: float) -> bool:
    """Whether this node's actor still answers info() within `timeout` seconds."""
    ray = import_ray()
    try:
        ray.get(actor.info.remote(new_nonce()), timeout=timeout)
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
                 key: PrivateKey, readers: int = NODE_READERS, remote: RemoteSource | None = None,
                 cache_policy: str = DEFAULT_POLICY, max_sequences: int = DEFAULT_MAX_SEQUENCES,
                 max_context: int = DEFAULT_MAX_CONTEXT) -> NodeSetup:
    """Check this node before it may join. `key` must be the key the (operator-signed) plan names for node
    `name`: it signs every info() answer, which makes the sessions that authenticate its run answers
    (VerificationError otherwise). The signed config.json (the experts' shapes) is read through
    verification; `budget` must hold a step over this node's experts; then every file the plan gives node `name`
    is hashed whole and must be present and match the manifest: the first missing or failing one is a
    VerificationError naming it (the node refuses to join). Files the plan gives other nodes may be absent
    (present-only semantics) and are not read. With `remote`, a planned expert not on disk yet is not a refusal:
    it is fetched (verified) the first time the coordinator asks for it; one present but wrong still is. A node of a
    pipeline plan also holds its span's trunk files (kept cached whole) and the keys and values of up to
    `max_sequences` sequences of `max_context` tokens: its budget must hold those too."""
    node = plan.node(name)
    planned = node.public_key()
    if key.public != planned:
        raise VerificationError(f"--node-key (key ID {key.public.keyid}) is not the key the plan names for node "
                                f"{name} ({planned.keyid}); node {name} refuses to join",
                                hint="pass the node's own key, or make and sign the plan again with its .pub")
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
    experts = [e for e in entries if e.kind == "expert"]
    trunk = sum(e.size for e in entries if e.kind != "expert")
    layers = node.layers
    # the floor reserves MIN_ACTIVATION_RESERVE for a step's temporaries; a span's steps may need more
    kv = (span_kv_bytes(config, layers, max_sequences, max_context)
          + span_activations(config, max_sequences, max_context) - MIN_ACTIVATION_RESERVE) if layers else 0
    need = pipeline_node_floor(node, {e.path: e.size for e in entries}, config.top_k, readers) + kv
    if budget < need:
        raise UsageError(f"--memory-budget {budget} bytes cannot hold a step of node {name}: it needs {need} bytes "
                         f"(a shard cache of top-k + 1 of its experts and working buffers"
                         f"{', its layers trunk, keys and values and step temporaries' if layers else ''})",
                         hint=f"raise --memory-budget to at least {-(-need // 2**20)}MiB")
    for entry in entries:
        finding = check_file(root, entry)
        if finding is not None and not (remote is not None and finding.finding == "missing"):
            raise VerificationError(f"{finding.finding}: {finding.detail}; node {name} refuses to join",
                                    path=finding.path)
    # The floor's shard cache is top-k + 1 experts; what the budget has beyond the floor caches more.
    k = min(max(config.top_k, 1), per_layer)
    largest = max((e.size for e in experts), default=0)
    head = manifest.head
    return NodeSetup(name=name, directory=str(Path(directory).resolve()), root=head.merkle_root, manifest_version=head.version,
                     config=config, entries=tuple(entries), budget=budget - need + largest * (k + 1) + trunk,
                     readers=readers, remote=remote, cache_policy=cache_policy, key_seed=key_seed(key), layers=layers,
                     max_sequences=max_sequences, max_context=max_context)
