"""The cluster proxy: a coordinator's Ray client, in a child process of its own, so that nothing Ray deserializes
(a node's reply, anything a member put in the object store) is ever unpickled in the process that may hold the
operator's decrypted receipt key.

The child is started with `subprocess` (fork + exec of a fresh interpreter: it holds no copy of the coordinator's
memory) and is handed the cluster's address only, never a key; it drops every capability (a root coordinator's proxy could
otherwise read the coordinator's memory despite PR_SET_DUMPABLE). It dies with the coordinator (PR_SET_PDEATHSIG, and
the end of its input pipe). The coordinator (`ProxyTransport`, a `Transport`) and the child (`serve`) speak frames
over a pipe: a 4-byte big-endian length, then one msgpack map (`strict_map_key`, no ext types, size caps), arrays
as {"dtype", "shape", "data": raw bytes} (`_cluster_wire`). The child re-encodes an info() answer into that form (its
signed body and signature) and forwards a run's answer, bytes the node encoded in that form (body, MAC, outputs),
unread; the coordinator checks all of it (`RemoteExperts`) as it would a direct answer: code a hostile reply runs,
runs in the child, which can then only send frames, and a frame is data. The child carries each session's handshake
(the coordinator's and the node's X25519 public keys) and the session id of every call, never a session key: it can
neither make a run answer's MAC nor read the key from anything it forwards. A frame that
breaks the protocol, a child that exits or answers late, is the proxy failing: it is killed, and every call from
then on fails as a failed node does (`NodeFailed`), never a hang.

    coordinator -> proxy: {"op": "init", "address", "timeout", "insecure", "nodes"}
                                                                             -> {"ok": true} | {"error": {...}}
                          {"op": "info", "node", "nonce", "session", "timeout"} -> {"answer": {...}} | {"failed": line}
                          {"op": "round", "timeout", "calls": [{"id", "node", "call": bytes}, ...]}
                                   -> {"answers": [[id, {"packed": bytes} | {"failed": line}], ...]}
                          {"op": "close"}                                    (no answer; the child exits)
    "session": the coordinator's X25519 public key for this handshake (64 hex digits)
    an answer: {"body": bytes, "signature": bytes} (info)
    a call's bytes and a packed answer: an encoded call (naming its session) and answer (body, MAC, outputs:
    `_cluster_wire`), which the child forwards as they are: a node's actor takes and returns them, so the child
    reads none of a run's arrays

A layer's calls cross the pipe as one round: `submit` only queues a call, and the first `result` of the round sends
every queued call in one frame; the child starts them all at once (Ray's futures, the nodes compute in parallel)
and answers them all in one frame, in the order sent. One pipe round trip a layer, whatever the number of nodes.

When the coordinator asks for it (`connect_cluster(graph=True)`: it names the plan's nodes in init), a round in
the child goes through a Ray Compiled Graph over those nodes (`NodeActor.graph_run`, each node's call picked out of
the round's {node: call}): compiled at the first round, kept while it works. It is torn down without killing any actor (a node's actor is its node's, not this coordinator's: Ray's own
teardown at shutdown would `ray.kill` them, so the graph is taken out of its reach), and the child falls back to
plain actor calls for good when it cannot be compiled, its first execution does not answer (a node whose graph
threads are held by graphs of dead coordinators) or any execution fails, a node's refusal of its call included (Ray's
reader then hands that one error for every node of the round: the round goes out again as plain calls, where it is
that node's alone). The answers are the same bytes either way.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from shardtool.errors import ShardtoolError, UnavailableError, UsageError, VerificationError
from shardtool.private_memory import child_environment
from shardtool.text import printable
from ._cluster_node import NAMESPACE, actor_name, graphs_without_torch, import_ray, init_ray
from ._cluster_wire import MAX_FRAME, NodeFailed, ProtocolError, decode_answer, encode_answer, encode_call, pack, unpack

HEADER = struct.Struct(">I")
MAX_LINE = 300  # characters of a failure line the child sends
MAX_CALLS = 1 << 12  # calls of one round (one per node asked at a layer); also nodes of a plan
MAX_NAME = 256  # characters of a node name sent to the child
GRAPH_START_SECONDS = 10.0  # at most, for a new graph's first execution (the node's loops start) before plain calls
GRAPH_END_SECONDS = 5.0  # for a graph's teardown, before the child goes on without waiting for it
GRACE = 10.0  # seconds the child may take beyond a call's own time-out (Ray's get_actor has no deadline of its own)
START_SECONDS = 60.0  # for the child to import Ray and connect, on top of three of the call time-outs
CLOSE_SECONDS = 5.0
_ERRORS = {cls.__name__: cls for cls in (UsageError, UnavailableError, VerificationError)}  # init's refusals
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAPSET = {"x86_64": 126, "aarch64": 91}  # capset(2)
_CHILD = "import sys; from shardtool.runtime.engine._cluster_proxy import main; main(sys.argv[1:])"
# ------------------------------------------------------------------------------------------------ this process

def _libc():
    return ctypes.CDLL(None, use_errno=True)


# ------------------------------------------------------------------------------------------------ the coordinator's side

class ProxyTransport:
    """A `Transport` whose Ray client runs in a child process (the module docstring); the child connects to the
    cluster at `address` before this returns (raising what `init_ray` raises there: UsageError, UnavailableError,
    VerificationError)."""

    def __init__(self, address: str, timeout: float, *, insecure: bool = False, nodes: tuple[str, ...] = ()):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._broken: str | None = None
        self._queued: list[dict] = []  # calls submitted, not yet sent (the round's first `result` sends them)
        self._answers: dict[int, dict] = {}  # call id -> its answer frame, until `result` takes it
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=child_environment(), close_fds=True)
        self.pid = self._proc.pid
        self._in, self._out = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        try:
            reply = self._ask({"op": "init", "address": address, "timeout": float(timeout), "insecure": insecure,
                               "nodes": list(nodes)}, START_SECONDS + 3 * timeout)
        except NodeFailed as e:
            self.close()
            raise UnavailableError(f"the cluster proxy did not connect to {address}: {e}") from None
        if reply != {"ok": True}:
            self.close()
            raise _init_error(reply)

    # -- Transport

    def info(self, node: str, nonce: str, session: str, timeout: float) -> dict:
        return self._answer(self._ask({"op": "info", "node": node, "nonce": nonce, "session": session,
                                       "timeout": float(timeout)}, timeout + GRACE))

    def submit(self, node, layer, expert_ids, x, rows, nonce, session) -> int:
        """Queue a call; it is sent with the rest of its round by the round's first `result`."""
        return self._queue(node, encode_call(layer, expert_ids, x, rows, nonce, session))

    def submit_span(self, node, call: bytes) -> int:
        """Queue a span call (a pipeline plan's node, its authenticated bytes); sent by its `result`."""
        return self._queue(node, call)

    def _queue(self, node: str, call_bytes: bytes) -> int:
        call = next(self._ids)
        with self._lock:
            self._check()
            self._queued.append({"id": call, "node": node, "call": call_bytes})
        return call

    def result(self, pending: int, timeout: float) -> dict:
        with self._lock:
            if pending not in self._answers and any(c["id"] == pending for c in self._queued):
                self._round(timeout)
            frame = self._answers.pop(pending, None)
        if frame is None:
            self._check()  # the round that carried it broke the proxy: say so
            raise NodeFailed(f"call {pending} was never submitted, or its answer was taken already")
        return self._answer(frame)

    def _round(self, timeout: float) -> None:
        """Send every queued call in one frame, and keep their answers (one frame, in the order sent)."""
        calls, self._queued = self._queued, []
        reply = self._exchange({"op": "round", "timeout": float(timeout), "calls": calls}, timeout + GRACE)
        answers = reply.get("answers") if set(reply) == {"answers"} else None
        if (not isinstance(answers, list) or len(answers) != len(calls)
                or not all(isinstance(a, list) and len(a) == 2 and a[0] == c["id"] and isinstance(a[1], dict)
                           for a, c in zip(answers, calls))):
            self._fail("answered a round with a frame that is not one answer per call, in the order sent")
        # Answers of an earlier round no one asked for (its layer was abandoned) are dropped, not kept forever.
        self._answers = {**dict(list(self._answers.items())[-len(calls):]), **{a[0]: a[1] for a in answers}}

    def close(self) -> None:
        """Ask the child to leave the cluster and exit; killed if it does not within a few seconds."""
        with self._lock:
            if self._proc.poll() is None and self._broken is None:
                try:
                    self._write(pack({"op": "close"}), time.monotonic() + CLOSE_SECONDS)
                except _Broken:
                    pass
            self._broken = self._broken or "was closed"
            for pipe in (self._proc.stdin, self._proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
            try:
                self._proc.wait(CLOSE_SECONDS)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    # -- the pipe

    def _answer(self, reply: dict) -> dict:
        if set(reply) == {"failed"} and isinstance(reply["failed"], str):
            raise NodeFailed(printable(reply["failed"][:MAX_LINE]))
        if set(reply) == {"packed"} and type(reply["packed"]) is bytes:
            try:  # the node's own bytes, forwarded by the child: a wrong answer is the node's failure
                return decode_answer(unpack(reply["packed"]))
            except ProtocolError as e:
                raise NodeFailed(f"the answer is not a signed answer ({e}): refused") from None
        if set(reply) == {"answer"}:
            try:
                return decode_answer(reply["answer"])
            except ProtocolError as e:
                self._fail(str(e))
        self._fail("sent a frame that is neither an answer nor a failure")

    def _ask(self, doc: dict, seconds: float) -> dict:
        with self._lock:
            return self._exchange(doc, seconds)

    def _exchange(self, doc: dict, seconds: float) -> dict:
        """One frame out, one frame back (the caller holds the lock)."""
        self._check()
        deadline = time.monotonic() + seconds
        try:
            self._write(pack(doc), deadline)
            (size,) = HEADER.unpack(self._read(HEADER.size, deadline))
            if size > MAX_FRAME:
                raise _Broken(f"announced a {size}-byte frame, at most {MAX_FRAME}")
            return unpack(self._read(size, deadline))
        except (_Broken, ProtocolError) as e:
            self._fail(str(e))

    def _check(self) -> None:
        if self._broken is not None:
            raise NodeFailed(f"the cluster proxy {self._broken}")

    def _fail(self, why: str):
        """The child broke the protocol, exited or is late: kill it; this call and every later one fail."""
        self._broken = f"failed: {why}"
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        raise NodeFailed(f"the cluster proxy {self._broken}")

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(HEADER.pack(len(data)) + data)
        while view:
            _wait(self._in, select.POLLOUT, deadline, self._proc)
            try:
                n = os.write(self._in, view)
            except BlockingIOError:
                continue
            except OSError as e:  # BrokenPipeError: the child is gone
                raise _Broken(f"exited ({_exit_text(self._proc)}): {e.strerror}") from None
            view = view[n:]

    def _read(self, n: int, deadline: float) -> bytes:
        chunks, left = [], n
        while left:
            _wait(self._out, select.POLLIN, deadline, self._proc)
            try:
                chunk = os.read(self._out, min(left, 1 << 24))
            except BlockingIOError:
                continue
            if not chunk:
                raise _Broken(f"exited ({_exit_text(self._proc)})")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


class _Broken(Exception):
    """The pipe to the child failed: it exited, or did not answer by the deadline."""


def _wait(fd: int, event: int, deadline: float, proc: subprocess.Popen) -> None:
    poller = select.poll()
    poller.register(fd, event)
    left = deadline - time.monotonic()
    if left <= 0 or not poller.poll(left * 1000):
        raise _Broken(f"did not answer within the call's time-out (pid {proc.pid})")


def _exit_text(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(1.0)
    except subprocess.TimeoutExpired:
        return "its pipe closed"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _init_error(reply: dict) -> ShardtoolError:
    """The child's refusal to connect, as the error class it raised there (one of `_ERRORS`), its text escaped."""
    error = reply.get("error") if set(reply) == {"error"} else None
    if (isinstance(error, dict) and set(error) == {"class", "message", "hint"} and error["class"] in _ERRORS
            and isinstance(error["message"], str) and isinstance(error["hint"], (str, type(None)))):
        hint = None if error["hint"] is None else printable(error["hint"][:MAX_LINE])
        return _ERRORS[error["class"]](printable(error["message"][:MAX_LINE]), hint=hint)
    return UnavailableError("the cluster proxy answered its start with a malformed frame")


# ------------------------------------------------------------------------------------------------ the child

class RayTransport:
    """Calls to the named node actors of a Ray cluster (`shardtool node`): what the proxy runs."""

    def __init__(self, address: str, timeout: float, *, insecure: bool = False, nodes: tuple[str, ...] = ()):
        self.ray = import_ray()
        init_ray(self.ray, address, timeout, insecure=insecure)
        self._actors: dict[str, object] = {}
        self.nodes = tuple(nodes)  # the plan's nodes: what a Compiled Graph spans
        self._graph: _Graph | None = None
        self.graph_off: str | None = None if self.nodes else "no nodes named"  # why rounds use plain calls

    def graph_round(self, calls: dict[str, bytes], timeout: float) -> dict[str, object] | None:
        """A round through the Compiled Graph: {node: its answer's bytes}; None when there is no graph (it could not
        be had, or failed, now or before): the round is then made of plain calls."""
        if self.graph_off is not None or not set(calls) <= set(self.nodes):
            return None
        if self._graph is None:
            try:
                self._graph = self._compile()
                self._graph.execute({}, min(timeout, GRAPH_START_SECONDS))  # the nodes' loops answer, or no graph
            except Exception as e:  # noqa: BLE001 - whatever Ray raised: plain calls still work
                self.end_graph(f"no Compiled Graph: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
                return None
        try:
            return self._graph.execute(calls, timeout)
        except Exception as e:  # noqa: BLE001 - the graph broke, or a node raised: plain calls from now on
            self.end_graph(f"the Compiled Graph failed: {_ray_line(e)}")
            return None

    def _compile(self) -> "_Graph":
        from ray.dag import InputNode, MultiOutputNode
        graphs_without_torch()
        actors = [self._actor(node) for node in self.nodes]
        with InputNode() as calls:
            dag = MultiOutputNode([actor.graph_run.bind(calls) for actor in actors])
        return _Graph(self.ray, dag.experimental_compile(), self.nodes)

    def end_graph(self, why: str) -> None:
        """No graph from now on (`why`); the one there was is torn down, its node actors left alive."""
        self.graph_off = why
        graph, self._graph = self._graph, None
        if why != "closed":  # the coordinator's stderr: an operator sees why rounds are plain calls (Ray's text
            # quoted in `why` can be a member's: escaped)
            print(f"shardtool cluster proxy: plain actor calls from now on ({printable(why)})", file=sys.stderr,
                  flush=True)
        if graph is not None:
            graph.end()

    def _actor(self, node: str):
        actor = self._actors.get(node)
        if actor is None:
            try:
                actor = self.ray.get_actor(actor_name(node), namespace=NAMESPACE)
            except ValueError:
                raise NodeFailed(f"no node named {node} has joined the cluster") from None
            self._actors[node] = actor
        return actor

    def info(self, node: str, nonce: str, session: str, timeout: float) -> dict:
        try:
            return self.result(self._actor(node).info.remote(nonce, session), timeout)
        except NodeFailed:
            self._actors.pop(node, None)  # a node that comes back is a new actor under the same name
            raise

    def submit(self, node: str, call: bytes):
        """Start node `node`'s run on a call's bytes (`encode_call`); its answer is bytes too."""
        try:
            # No task events: each would be buffered in both workers and sent to the GCS, CPU the round competes for.
            return self._actor(node).run.options(enable_task_events=False).remote(call)
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
        except Exception as e:  # noqa: BLE001 - what a reply's pickle raised as Ray read it: that node's answer
            raise NodeFailed(f"its answer could not be read: {type(e).__name__}") from None

    def close(self) -> None:
        self.end_graph("closed")
        self.ray.shutdown()


_ENDED: list = []  # graphs torn down: kept, so that no garbage collection runs Ray's teardown of one again


class _Graph:
    """A Compiled Graph over the plan's node actors: one execution a round, every node given the round's calls."""

    def __init__(self, ray, compiled, nodes: tuple[str, ...]):
        from ray.dag import compiled_dag_node
        # Ray tears down the graphs in this registry at shutdown with kill_actors=True: that would kill the nodes.
        compiled_dag_node._compiled_dags.pop(compiled.get_id(), None)
        self.ray, self.compiled, self.nodes = ray, compiled, nodes

    def execute(self, calls: dict[str, bytes], timeout: float) -> dict[str, bytes]:
        """{node asked: its answer (bytes)}; raises when the graph fails (a time-out, a channel or an actor lost) and
        when a node raised (refused its call): Ray's reader then fails fast, handing that one error for every output
        of the round, so whose it is cannot be told here. Either way the caller ends the graph and the round goes
        out as plain calls, where each node's refusal is its own."""
        deadline = time.monotonic() + timeout
        refs = self.compiled.execute(calls)
        out: dict[str, bytes] = {}
        for node, ref in zip(self.nodes, refs):  # every output is read, asked or not: the channels are reused
            value = self.ray.get(ref, timeout=max(deadline - time.monotonic(), 0.001))
            if node in calls:
                out[node] = value
        return out

    def end(self) -> None:
        """Ray's teardown without killing an actor, given GRAPH_END_SECONDS: a loop that does not end (its node
        is gone or stuck) is left to Ray, never waited for without end nor killed."""
        _ENDED.append(self.compiled)
        done = threading.Thread(target=self.compiled.teardown, kwargs={"kill_actors": False}, daemon=True)
        done.start()
        done.join(GRAPH_END_SECONDS)

REFUSED = "refused the call: "  # how the line of a node's own refusal (a ShardtoolError it raised) starts


def _ray_line(e: BaseException) -> str:
    """One line for a Ray error: its class, and for a task error the node's own one-line message."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, ShardtoolError):
        return REFUSED + cause.one_line()
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {' '.join(first.split())[:200]}"



def _drop_capabilities() -> None:
    """No capability for this process or anything it executes. Run as root, the proxy would otherwise hold
    CAP_SYS_PTRACE, which reads a non-dumpable coordinator's memory all the same; a user's proxy has none to drop.
    Best effort beyond Linux x86_64/aarch64 (each step that is refused leaves what it could not drop)."""
    if not sys.platform.startswith("linux"):
        return
    import platform

    libc = _libc()
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):  # EINVAL past the kernel's last capability, EPERM without CAP_SETPCAP: both harmless
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    number = _CAPSET.get(platform.machine())
    if number is not None:
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all empty
        libc.syscall(number, header, data)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the coordinator ends; it may have ended already (then exit now)."""
    if sys.platform.startswith("linux"):
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


class _Child:
    """The proxy's loop: one frame at a time from the coordinator; a round's calls start at once (Ray's futures)."""

    def __init__(self, read: Callable[[int], bytes], write: Callable[[bytes], None]):
        self._read, self._write = read, write
        self.transport = None

    def frame(self) -> dict | None:
        head = self._read(HEADER.size)
        if len(head) < HEADER.size:
            return None
        (size,) = HEADER.unpack(head)
        if size > MAX_FRAME:
            raise ProtocolError(f"a {size}-byte frame")
        return unpack(self._read(size))

    def send(self, doc: dict) -> None:
        data = pack(doc)
        self._write(HEADER.pack(len(data)) + data)

    def answer(self, ask: Callable[[], Any]) -> None:
        self.send(self.wire(ask))

    @staticmethod
    def wire(ask: Callable[[], Any], *, packed: bool = False) -> dict:
        """One call's answer, or its failure: whatever one node's reply does while Ray unpickles it here (raise any
        exception, SystemExit included) fails that call, which drops that node only, not the proxy every node needs.
        `packed`: a run's answer, bytes the node encoded, forwarded as they are."""
        try:
            if not packed:
                return {"answer": encode_answer(ask())}
            answer = ask()
            if type(answer) is not bytes:
                raise NodeFailed(f"the answer is not a signed answer (msgpack bytes), a {type(answer).__name__}: "
                                 f"refused")
            return {"packed": answer}
        except NodeFailed as e:
            return {"failed": str(e)[:MAX_LINE]}
        except BaseException as e:  # noqa: BLE001  (a hostile pickle's doing; the next frame is served as usual)
            return {"failed": printable(f"the node's reply could not be read: {type(e).__name__}: {e}")[:MAX_LINE]}

    def init(self, doc: dict) -> None:
        try:
            nodes = doc.get("nodes", [])
            if (not isinstance(nodes, list) or len(nodes) > MAX_CALLS or len(set(nodes)) != len(nodes)
                    or not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in nodes)):
                raise ProtocolError("init's nodes are not a list of distinct node names")
            self.transport = RayTransport(doc["address"], doc["timeout"], insecure=doc["insecure"],
                                          nodes=tuple(nodes))
        except ShardtoolError as e:
            name = type(e).__name__ if type(e).__name__ in _ERRORS else "UnavailableError"
            self.send({"error": {"class": name, "message": e.message, "hint": e.hint}})
            return
        self.send({"ok": True})

    def start(self, call: dict) -> object:
        """Start one call of a round: its Ray future, or the NodeFailed that kept it from starting."""
        try:
            return self.transport.submit(call["node"], call["call"])
        except NodeFailed as e:
            return e

    def round(self, doc: dict) -> None:
        """Every call of a round started before any is waited for; each waited for until the round's deadline."""
        calls = doc["calls"]
        if not isinstance(calls, list) or not 1 <= len(calls) <= MAX_CALLS:
            raise ProtocolError(f"a round of {len(calls) if isinstance(calls, list) else 'no'} calls")
        deadline = time.monotonic() + doc["timeout"]  # a graph that fails leaves its plain calls what is left
        by_node = {call["node"]: call["call"] for call in calls}
        graph = self.transport.graph_round(by_node, doc["timeout"]) if len(by_node) == len(calls) else None
        if graph is not None:  # every call answered by the graph's one execution
            self.send({"answers": [[call["id"], self.wire(lambda a=graph[call["node"]]: _given(a), packed=True)]
                                   for call in calls]})
            return
        started = [(call["id"], self.start(call)) for call in calls]

        def collect(pending: object) -> Any:
            return self.transport.result(_given(pending), max(deadline - time.monotonic(), 0.001))

        self.send({"answers": [[call, self.wire(lambda p=pending: collect(p), packed=True)] for call, pending in started]})

    def loop(self) -> None:
        while (doc := self.frame()) is not None:
            op = doc.get("op")
            if op == "init":
                self.init(doc)
            elif op == "info":
                self.answer(lambda: self.transport.info(doc["node"], doc["nonce"], doc["session"], doc["timeout"]))
            elif op == "round":
                self.round(doc)
            elif op == "close":
                break
            else:
                raise ProtocolError(f"unknown op {op!r}")
        if self.transport is not None:
            self.transport.close()


def _given(answer: object) -> object:
    """A call's answer or future, or the NodeFailed that stands for it (raised)."""
    if isinstance(answer, Exception):
        raise answer
    return answer


def main(argv: list[str]) -> None:
    _die_with_parent(int(argv[0]))
    _drop_capabilities()
    # A terminal's ^C or a group's SIGTERM is for the coordinator, which ends this process when it is done with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The frames keep fds 0 and 1 to themselves: whatever Ray prints goes to stderr.
    rfd, wfd = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    reader = os.fdopen(rfd, "rb", buffering=0)

    def read(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = reader.read(left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(wfd, view):]

    try:
        _Child(read, write).loop()
    except BrokenPipeError:
        pass
    os._exit(0)  # Ray's threads are not waited for: the coordinator has what it asked for

