"""A real local Ray cluster for the tests: `ray start --head` on 127.0.0.1 and `shardtool node` processes, each in
its own session (process group), ended by those groups' ids only; and tiny split, signed models with a plan and
per-node directories that hold only what the plan gives each node."""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _kit import cli
from _kit.cli import BIN, Result
from examples.make_tiny_moe import make_checkpoint

# No usage report leaves the machine; the workers' BLAS takes one core (two share this machine); a stopped head
# shuts down at once instead of draining for 30 s (nothing is left to drain when the tests stop it).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "OPENBLAS_NUM_THREADS": "1", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
_TOKEN_DIR = Path(tempfile.mkdtemp(prefix="st-ray-token-"))


def token_file() -> Path:
    """This test session's Ray token (0600): every head here enforces it, every node and coordinator gives it."""
    path = _TOKEN_DIR / "auth_token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
    return path


def env(work: Path, *, token: bool = True) -> dict[str, str]:
    """The environment of every process started here: Ray's token by file (RAY_AUTH_TOKEN_PATH), HOME in the work
    directory (so no ~/.ray/auth_token of the user's is found), none of the caller's own Ray auth settings."""
    base = {k: v for k, v in cli.user_env(work, RAY_ENV).items()
            if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    auth = {"RAY_AUTH_TOKEN_PATH": str(token_file())} if token else {}
    return {**base, **auth, "HOME": str(work)}


def run(program: str, *args, cwd: Path, timeout: int = 300) -> Result:
    """The shared runner with Ray's environment and this session's token, XDG state and HOME in `cwd`."""
    return cli.run(program, *args, cwd=cwd, state=cwd, env=env(cwd), timeout=timeout)


def ok(program: str, *args, cwd: Path, timeout: int = 300) -> Result:
    return cli.ok(program, *args, cwd=cwd, state=cwd, env=env(cwd), timeout=timeout)


def free_port() -> int:
    """A port no one listens on, below the kernel's ephemeral range. A port the kernel hands out for `bind(0)` is an
    ephemeral one, which any outgoing connection (Ray's own gRPC clients among them) may take as its source port
    before the head binds it: the head then dies ("Failed to bind"), as seen with two heads starting at once."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def free_ports(n: int) -> list[int]:
    """`n` different free ports (drawn one at a time, two could coincide: Ray refuses a port named twice, as CI saw)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class Model:
    work: Path
    full: Path  # the whole split, signed model
    model_id: str
    plan: Path
    nodes: list[str]
    coordinator: Path  # the plan's coordinator files + the manifest

    def node_dir(self, name: str) -> Path:
        return self.work / f"node-{name}"


def build_model(work: Path, family: str, *, replicas: int, nodes: tuple[str, ...], experts: int = 8,
                layers: int = 2, pipeline: bool = False, **knobs) -> Model:
    """make_tiny_moe -> split -> sign -> a plan over `nodes` (`pipeline`: spans of whole layers) -> one directory
    per node (its planned files, config.json and the manifest) and one for the coordinator (its files and the
    manifest)."""
    work.mkdir(parents=True, exist_ok=True)
    for key in ("a", "op", *(f"node-{n}" for n in nodes)):  # the publisher, the operator (signs the plan), each node
        if not (work / f"{key}.key").exists():
            ok("shardtool", "keygen", "--out", key, "--no-passphrase", cwd=work)
    model_id = f"test/tiny-{family}"
    make_checkpoint(work / "hf", family, experts=experts, layers=layers, **knobs)
    ok("shardtool", "split", "-q", work / "hf", work / "full", "--model-id", model_id, "--version", "1", cwd=work)
    ok("shardtool", "sign", work / "full", "--key", "a.key", cwd=work)
    plan = work / "plan.json"
    _write_plan(work, plan, nodes, replicas, pipeline)
    model = Model(work, work / "full", model_id, plan, list(nodes), work / "coordinator")
    from shardtool.runtime import decode_plan
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest

    verified = load_trusted_manifest(model.full / "manifest.msgpack", [load_public_key(work / "a.pub")], 1,
                                     work / "plan-state")
    decoded = decode_plan(plan.read_bytes(), verified, what=str(plan))
    copy_files(model.full, model.coordinator, decoded.coordinator_files)
    for node in decoded.nodes:
        copy_files(model.full, model.node_dir(node.name), ["config.json", *node.files()])
    return model


def _write_plan(work: Path, plan: Path, nodes: tuple[str, ...], replicas: int, pipeline: bool = False) -> None:
    """`shardtool plan`, each node with the same budget and its own key, signed by the operator (op.key)."""
    ok("shardtool", "plan", work / "full", "--trust", "a.pub", "--state-dir", work / "plan-state", "--replicas",
       replicas, *[x for n in nodes for x in ("--node", f"{n}=256MiB,key=node-{n}.pub")], "--out", plan,
       "--sign-key", "op.key", *(["--pipeline"] if pipeline else []), cwd=work)


def copy_files(src: Path, dst: Path, paths) -> None:
    for rel in [*paths, "manifest.msgpack"]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dst / rel)


@dataclass
class Proc:
    """A process in its own session; its log file; `stop` signals its group."""

    proc: subprocess.Popen
    log: Path
    handle: object = None

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, seconds: float = 120) -> re.Match:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                m = re.search(pattern, self.text())
                if m:
                    return m
                raise AssertionError(f"process exited {self.proc.returncode} before {pattern!r}:\n{self.text()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} within {seconds}s:\n{self.text()[-3000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the group, wait; SIGKILL what of the group is left. Returns the leader's exit code."""
        if self.proc.poll() is None:
            _killpg(self.pgid, sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(self.pgid, signal.SIGKILL)
            code = self.proc.wait()
        _wait_group_gone(self.pgid, timeout)
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        return code


def start(argv: list[str], log: Path, cwd: Path, *, extra_env: dict[str, str] | None = None,
          token: bool = True) -> Proc:
    handle = open(log, "w")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd,
                            env={**env(cwd, token=token), **(extra_env or {})}, start_new_session=True)
    return Proc(proc, log, handle)


def _killpg(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a Ray session's temp dir: its raylet, GCS and workers
    name it, whatever process group they ended up in)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if text in cmdline and state[state.rindex(")") + 2] != "Z":
            found.append(int(entry))
    return found


def _wait_group_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_members(pgid):
        _killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


@dataclass
class Head:
    """`ray start --head --block` on 127.0.0.1 with its session files under a private temp dir; token
    authentication on (RAY_AUTH_MODE=token, this session's token file) unless `auth=False`."""

    proc: Proc
    address: str
    temp: Path
    groups: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, work: Path, *, auth: bool = True, extra_env: dict[str, str] | None = None) -> "Head":
        # A short path: Ray's unix socket paths below it must stay under the kernel's 107-byte limit.
        temp = Path(tempfile.mkdtemp(prefix="st-ray-", dir="/tmp"))
        port, client, agent, metrics, env_agent, agent_grpc = free_ports(6)
        argv = [str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--block",
                "--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", str(temp),
                "--object-store-memory", str(96 * 2**20), "--disable-usage-stats",
                "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
                "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(env_agent),
                "--dashboard-agent-grpc-port", str(agent_grpc)]
        proc = start(argv, work / "ray-head.log", work, token=auth,
                     extra_env={"RAY_AUTH_MODE": "token" if auth else "disabled", **(extra_env or {})})
        head = cls(proc, f"127.0.0.1:{port}", temp, [proc.pgid])
        proc.wait_for(r"Ray runtime started", 180)
        return head

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.temp, ignore_errors=True)


def node_argv(model: Model, name: str, address: str, *, budget: str = "128MiB", key: str | None = None) -> list[str]:
    return [str(BIN / "shardtool"), "node", str(model.node_dir(name)), "--trust", str(model.work / "a.pub"),
            "--state-dir", str(model.work / f"state-{name}"), "--plan", str(model.plan), "--name", name,
            "--plan-trust", str(model.work / "op.pub"), "--node-key", str(model.work / f"node-{key or name}.key"),
            "--memory-budget", budget, "--address", address, "--readers", "1"]


def start_node(model: Model, name: str, address: str) -> Proc:
    proc = start(node_argv(model, name, address), model.work / f"node-{name}-{time.monotonic_ns()}.log", model.work)
    proc.wait_for(rf"node {name} ready", 180)
    return proc


def verify_and_run(model: Model, directory: Path, *args, cluster: str | None = None, expect: int = 0,
                   timeout: int = 300) -> subprocess.CompletedProcess:
    extra = ("--cluster", cluster, "--plan", model.plan, "--plan-trust", model.work / "op.pub") if cluster else ()
    r = run("verify-and-run", directory, "--trust", model.work / "a.pub", "--state-dir", model.work / "state-var",
            "--model-id", model.model_id, "-q", *extra, *args, cwd=model.work, timeout=timeout)
    assert r.returncode == expect, f"verify-and-run exited {r.returncode}, expected {expect}:\n{r.stderr[-3000:]}"
    return r


# ------------------------------------------------------------------------------ in-process nodes (no Ray)

class Direct:
    """A coordinator transport that calls NodeService objects in-process. `edit[node](plain) -> plain` makes that
    node lie with its own keys (an info() is re-signed with `keys[node]`, a reply re-MACed with `mac_keys[node]`, by
    default its session's key); `answer[node](answer) -> anything` replaces its answer as it crosses the wire (an
    impostor, a replay, garbage); `down` nodes fail."""

    def __init__(self, services: dict, keys: dict):
        self.services, self.keys = services, keys
        self.mac_keys: dict[str, bytes] = {}
        self.edit: dict = {}
        self.answer: dict = {}
        self.down: set[str] = set()
        self.calls: list[tuple[str, int, list[int]]] = []

    def _out(self, node: str, answer, key):
        if node in self.edit:
            answer = resign(answer, self.edit[node], key)
        return self.answer.get(node, lambda r: r)(answer)

    def info(self, node, nonce, session, timeout):
        from shardtool.runtime.engine._cluster import NodeFailed
        if node in self.down or node not in self.services:
            raise NodeFailed(f"no node named {node} has joined the cluster")
        return self._out(node, self.services[node].info(nonce, session), self.keys[node])

    def submit(self, node, layer, expert_ids, x, rows, nonce, session):
        self.calls.append((node, layer, list(expert_ids)))
        return node, layer, expert_ids, x, rows, nonce, session

    def submit_span(self, node, call):
        """A span call's wire bytes (what a node's actor takes), run by `result`; `sent` keeps them."""
        self.calls.append((node, call))
        return node, call

    def result(self, pending, timeout):
        from shardtool.errors import ShardtoolError
        from shardtool.runtime.engine._cluster import NodeFailed
        from shardtool.runtime.engine._cluster_wire import decode_any_call
        node = pending[0]
        if node in self.down:
            raise NodeFailed("ActorDiedError: the actor died unexpectedly")
        service = self.services[node]
        try:
            if len(pending) == 2:  # a span call's bytes
                _, args = decode_any_call(pending[1])
                answer, session = service.run_span(*args), args[0]
            else:
                _, layer, ids, x, rows, nonce, session = pending
                answer = service.run(layer, ids, x, rows, nonce, session)
        except ShardtoolError as e:  # what Ray hands the proxy as a RayTaskError, and the proxy says so
            raise NodeFailed(f"refused the call: {e.one_line()}") from None
        return self._out(node, answer, self.mac_keys.get(node) or service.sessions.key(session))


def plain(answer: dict) -> dict:
    """An answer's body as a dict, with a reply's output arrays under "outputs" (what a forge edits)."""
    import json
    doc = json.loads(answer["body"])
    return {**doc, "outputs": answer["outputs"]} if "outputs" in answer else doc


def sign_plain(doc, key):
    """`doc` (the `plain` form) as a node answers it: an info() signed with `key` (an Ed25519 PrivateKey), a reply
    (a body with a layer or a span) MACed with `key` (a session key, bytes), its output digests made from its arrays;
    anything but a dict is returned as it is."""
    from shardtool.manifest import pae
    from shardtool.runtime.engine._cluster_node import INFO_TYPE, REPLY_TYPE, canonical_body, output_digest
    from shardtool.runtime.engine._cluster_session import mac
    if not isinstance(doc, dict):
        return doc
    arrays = doc.get("outputs") if "layer" in doc or "span" in doc else None
    if arrays is None:
        body = canonical_body(doc)
        return {"body": body, "signature": key.sign(pae(INFO_TYPE, body))}
    body = canonical_body({**doc, "outputs": {str(e): output_digest(y) for e, y in arrays.items()}})
    return {"body": body, "mac": mac(key, REPLY_TYPE, body), "outputs": arrays}


def resign(answer: dict, edit, key):
    return sign_plain(edit(plain(answer)), key)


def remote_experts(plan, transport, **kwargs):
    """The coordinator's RemoteExperts over `transport`, with the plan's placement, root and node keys."""
    from shardtool.runtime import RemoteExperts
    from shardtool.runtime.engine._cluster import plan_placement
    return RemoteExperts(plan_placement(plan), plan.root, transport,
                         keys={n.name: n.public_key() for n in plan.nodes}, **{"log": lambda _: None, **kwargs})


def session(service, nonce: str = "0" * 32) -> tuple[str, bytes]:
    """A session with `service` made as a coordinator makes one (its info() with a fresh X25519 key): (session id,
    the key this side derives)."""
    import json
    from shardtool.runtime.engine._cluster_session import Handshake, session_id, session_key
    mine = Handshake()
    info = json.loads(service.info(nonce, mine.public)["body"])
    theirs = info["session"]["node"]
    key = session_key(mine.shared(theirs), mine.public, theirs, service.setup.name, service.setup.root, nonce,
                      info["boot"])
    return session_id(mine.public, theirs), key


def receipt_runs(model: Model, address: str, sampling: tuple[str, ...], prompt_ids: str) -> dict:
    """The same `verify-and-run` one process on the whole model ("local") and as a cluster's coordinator ("cluster"),
    each signing a receipt and writing its trace: where -> (token ids, the receipt's fields but its id and time, the
    trace). Each run must say nothing on stderr (-q, and no node dropped)."""
    import msgpack

    from shardtool.keys import load_public_key
    from shardtool.manifest import open_receipt

    operator = [load_public_key(model.work / "op.pub")]
    runs = {}
    for where, directory, cluster in (("local", model.full, None), ("cluster", model.coordinator, address)):
        r = verify_and_run(model, directory, "--prompt-ids", prompt_ids, "--print-ids", "--max-new-tokens", "16",
                           *sampling, "--receipt-key", "op.key", "--receipt-out", f"{where}.receipt", "--trace-out",
                           f"{where}.trace", cluster=cluster)
        receipt, _ = open_receipt((model.work / f"{where}.receipt").read_bytes(), operator)
        trace = msgpack.unpackb((model.work / f"{where}.trace").read_bytes())
        assert trace.pop("receipt_id") == receipt.id
        # All but the receipt's own id and time: tokens, routing root, hidden-state fingerprints, the trace.
        runs[where] = ([int(t) for t in r.stdout.split()],
                       {k: v for k, v in receipt.__dict__.items() if k not in ("id", "created")}, trace)
        assert r.stderr.strip() == ""
    return runs
