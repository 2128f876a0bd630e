"""Attacks on a cluster: a client without Ray's token, a head that does not enforce it, an impostor node, a reply
MACed with another node's or another session's key, a session key swapped at the handshake, a replayed or re-aimed
reply, an unauthenticated or garbled reply, a plan the operator did not sign, a member whose reply is a pickle that
runs code, a member flooding a node's session table, a cluster proxy that dies or hangs.
In-process nodes (`_clusterkit.Direct`) for the replies; a real local Ray head for the door and the proxy."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import _clusterkit as ck  # noqa: E402
from shardtool.errors import SignatureError, UnavailableError  # noqa: E402
from shardtool.keys import generate, load_private_key, load_public_key  # noqa: E402
from shardtool.manifest import load_trusted_manifest  # noqa: E402
from shardtool.private_memory import memory_private  # noqa: E402
from shardtool.runtime import NodeService, Session, load_signed_plan, prepare_node  # noqa: E402
from shardtool.runtime.engine._cluster_node import REPLY_TYPE  # noqa: E402
from shardtool.runtime.engine._cluster_session import Handshake, mac  # noqa: E402

PROMPT = [5, 77, 300, 12]
NODES = ("a", "b", "c")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A model whose operator-signed plan puts every expert on 2 of nodes a, b, c; the nodes' services and keys."""
    model = ck.build_model(tmp_path_factory.mktemp("cluster"), "mixtral", replicas=2, nodes=NODES)
    verified = load_trusted_manifest(model.full / "manifest.msgpack", [load_public_key(model.work / "a.pub")], 1,
                                     model.work / "state")
    plan = load_signed_plan(model.plan, verified, [load_public_key(model.work / "op.pub")])
    keys = {n: load_private_key(model.work / f"node-{n}.key", None) for n in NODES}
    services = {n: NodeService(prepare_node(model.full, verified, plan, n, budget=1 << 30, key=keys[n])) for n in NODES}
    return model, verified, plan, services, keys


def _generate(cluster, remote=None, on_token=None) -> list[int]:
    """8 greedy tokens; `on_token(i)` is called after the i-th token is out (0 first)."""
    model, verified, *_ = cluster
    session = Session(model.full, verified, budget=1 << 30, max_tokens=len(PROMPT) + 8, remote=remote)
    try:
        out: list[int] = []

        def token(t: int) -> None:
            out.append(t)
            if on_token is not None:
                on_token(len(out) - 1)

        session.generate(PROMPT, 8, temperature=0.0, top_p=1.0, seed=None, on_token=token)
        return out
    finally:
        session.close()


def _transport(cluster, **keys) -> ck.Direct:
    """Nodes a, b, c; a node given in `keys` answers info() (re-signed) with that key instead of its own."""
    _, _, _, services, own = cluster
    transport = ck.Direct(services, {**own, **keys})
    for node in keys:
        transport.edit[node] = lambda doc: doc
    return transport


def _zeros(doc):
    """A made-up answer: every output zero."""
    if "layer" in doc:
        doc = {**doc, "outputs": {e: np.zeros_like(y) for e, y in doc["outputs"].items()}}
    return doc


def test_cluster_impostor_node_is_refused_named_and_its_output_never_used(cluster):
    local = _generate(cluster)
    impostor = generate()
    transport = _transport(cluster, a=impostor)
    transport.edit["a"] = _zeros
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    assert "not signed by node a's key in the plan" in remote.stats.dropped["a"]
    assert _generate(cluster, remote) == local
    assert all(node != "a" for node, _, _ in transport.calls)
    # With no replica left for some experts the run fails; it never answers with made-up output.
    transport = _transport(cluster, a=impostor, b=generate())
    with pytest.raises(UnavailableError, match="no live node holds layer"):
        ck.remote_experts(cluster[2], transport).connect()


def test_cluster_info_signed_by_node_a_presented_as_node_b_is_refused(cluster):
    _, _, _, _, keys = cluster
    transport = _transport(cluster, b=keys["a"])  # b's answers, signed with a's (planned, genuine) key
    transport.edit["b"] = _zeros
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    assert "not signed by node b's key" in remote.stats.dropped["b"]
    assert _generate(cluster, remote) == _generate(cluster)


def _other_session(cluster) -> bytes:
    """Node b's session key with another coordinator (its own handshake with b)."""
    other = ck.remote_experts(cluster[2], _transport(cluster))
    other.connect()
    return other._sessions["b"][1]


MAC_KEYS = {  # whose key b's replies are MACed with, once the run started: none is b's session with this coordinator
    "impostor (b's actor replaced, no session key)": lambda cluster, remote: secrets.token_bytes(32),
    "node a's session key with this coordinator": lambda cluster, remote: remote._sessions["a"][1],
    "node b's session key with another coordinator": lambda cluster, remote: _other_session(cluster),
}


@pytest.mark.parametrize("whose", MAC_KEYS)
def test_cluster_reply_macd_with_a_key_other_than_the_nodes_session_is_refused(cluster, whose):
    transport = _transport(cluster)
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    transport.mac_keys["b"], transport.edit["b"] = MAC_KEYS[whose](cluster, remote), _zeros
    assert _generate(cluster, remote) == _generate(cluster)
    assert "the reply is not authenticated by node b's session key" in remote.stats.dropped["b"]


def test_cluster_session_key_swapped_at_the_handshake_is_refused(cluster):
    """Someone between the coordinator and node b (the proxy, Ray) puts its own X25519 key in b's info() request:
    b derives its session with that one and signs it; the coordinator sees a session that is not its own."""
    transport = _transport(cluster)
    info = transport.info
    transport.info = lambda node, nonce, session, timeout: info(
        node, nonce, Handshake().public if node == "b" else session, timeout)
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    assert "swapped between this coordinator and the node: refused" in remote.stats.dropped["b"]
    assert set(remote.stats.dropped) == {"b"} and "b" not in remote._sessions


def test_cluster_info_without_the_session_asked_is_refused(cluster):
    """b answers info() as to a health check (no session): the coordinator asked for one and has no key for b."""
    transport = _transport(cluster)
    info = transport.info
    transport.info = lambda node, nonce, session, timeout: info(node, nonce, None if node == "b" else session, timeout)
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    assert "answered info() without a session" in remote.stats.dropped["b"]


@pytest.mark.parametrize("forge", [
    lambda d: {**d, "layer": d["layer"] + 1},
    lambda d: {**d, "experts": d["experts"][::-1] if len(d["experts"]) > 1 else d["experts"] + [99]},
    lambda d: {**d, "nonce": "f" * 32},
    lambda d: {**d, "name": "a"},
], ids=["other-layer", "other-experts", "other-nonce", "other-name"])
def test_cluster_reply_for_another_call_is_refused(cluster, forge):
    """A reply genuinely signed by the node asked, but for another layer, other experts, another call's nonce
    (a replay) or another node's name."""
    transport = _transport(cluster)
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    transport.edit["b"] = lambda d: forge(_zeros(d)) if "layer" in d else d
    assert _generate(cluster, remote) == _generate(cluster)
    assert "refused" in remote.stats.dropped["b"] or "asked" in remote.stats.dropped["b"]


def test_cluster_answer_computed_on_swapped_inputs_is_refused(cluster):
    """Someone between the coordinator and node b (the proxy, Ray) hands b other hidden states: b computes and signs
    honestly, but on inputs the coordinator never sent. The signed input digest refuses it, b is named and dropped,
    and the replicas' answers give one process's tokens."""
    transport = _transport(cluster)
    submit = transport.submit

    def swapped(node, layer, ids, x, rows, nonce, session):
        return submit(node, layer, ids, x * 2 if node == "b" else x, rows, nonce, session)

    transport.submit = swapped
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    assert _generate(cluster, remote) == _generate(cluster)
    assert "other inputs than the ones sent" in remote.stats.dropped["b"]


@pytest.mark.parametrize("session, refused", [
    ("same", "a replay"),
    ("another", "the reply is not authenticated by node b's session key"),
], ids=["same-session", "another-session"])
def test_cluster_replayed_reply_is_refused(cluster, session, refused):
    """b's genuine replies of one run, answered again in order to the same calls of a second run: in the same
    session only the nonce tells them apart; in another (a new coordinator, or b readmitted) the MAC does."""
    recorded: list = []
    transport = _transport(cluster)
    transport.answer["b"] = lambda r: recorded.append(r) or r if "outputs" in r else r
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    local = _generate(cluster, remote)
    assert recorded and "b" not in remote.stats.dropped
    replay = iter(recorded)
    if session == "another":
        transport = _transport(cluster)
        remote = ck.remote_experts(cluster[2], transport)
        remote.connect()
    transport.answer["b"] = lambda r: next(replay) if "outputs" in r else r
    assert _generate(cluster, remote) == local
    assert refused in remote.stats.dropped["b"]


NOT_AUTHENTIC = "the reply is not authenticated by node c's session key"
NOT_FORM = "the reply is not an authenticated answer"
GARBLED = {  # c's genuine reply, changed as it crosses the wire -> what the coordinator says
    "no-mac": (lambda r: {k: v for k, v in r.items() if k != "mac"}, NOT_FORM),
    "mac-bit-flipped": (lambda r: {**r, "mac": bytes([r["mac"][0] ^ 1]) + r["mac"][1:]}, NOT_AUTHENTIC),
    "mac-short": (lambda r: {**r, "mac": r["mac"][:16]}, NOT_AUTHENTIC),
    "mac-empty": (lambda r: {**r, "mac": b""}, NOT_AUTHENTIC),
    "mac-text": (lambda r: {**r, "mac": r["mac"].hex()}, NOT_FORM),
    "signature-instead-of-mac": (lambda r: {"body": r["body"], "signature": r["mac"] * 2, "outputs": r["outputs"]},
                                 NOT_FORM),
    "body-changed-after-mac": (lambda r: {**r, "body": r["body"] + b" "}, NOT_AUTHENTIC),
    "outputs-changed": (lambda r: {**r, "outputs": {e: y + 1 for e, y in r["outputs"].items()}},
                        "is not the one the node authenticated"),
    "extra-field": (lambda r: {**r, "extra": 1}, NOT_FORM),
    "not-a-dict": (lambda r: [r], NOT_FORM),
    "bytes": (lambda r: b"\x80\x04garbage", NOT_FORM),
}


@pytest.mark.parametrize("garble", GARBLED)
def test_cluster_unauthenticated_or_garbled_reply_is_refused(cluster, garble):
    forge, refused = GARBLED[garble]
    transport = _transport(cluster)
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    transport.answer["c"] = lambda r: forge(r) if isinstance(r, dict) and "outputs" in r else r
    assert _generate(cluster, remote) == _generate(cluster)
    assert refused in remote.stats.dropped["c"]


def test_cluster_authenticated_body_that_is_not_json_is_refused(cluster):
    transport = _transport(cluster)
    remote = ck.remote_experts(cluster[2], transport)
    remote.connect()
    body, key = b"\xff not json", remote._sessions["c"][1]
    transport.answer["c"] = lambda r: {**r, "body": body, "mac": mac(key, REPLY_TYPE, body)} if "outputs" in r else r
    assert _generate(cluster, remote) == _generate(cluster)
    assert "not a JSON object" in remote.stats.dropped["c"]


def _plan_refused(cluster, tmp_path, plan_bytes: bytes, sig: bytes | None, trusted=None) -> SignatureError:
    model, verified, *_ = cluster
    tmp_path.mkdir()
    plan = tmp_path / "plan.json"
    plan.write_bytes(plan_bytes)
    if sig is not None:
        (tmp_path / "plan.json.sig").write_bytes(sig)
    with pytest.raises(SignatureError) as info:
        load_signed_plan(plan, verified, trusted or [load_public_key(model.work / "op.pub")])
    return info.value


def test_cluster_plan_not_signed_by_the_operator_or_tampered_is_refused(cluster, tmp_path):
    from shardtool.runtime import sign_plan
    model = cluster[0]
    data, sig = model.plan.read_bytes(), (model.work / "plan.json.sig").read_bytes()
    assert "not signed" in _plan_refused(cluster, tmp_path / "none", data, None).message
    swapped = data.replace(cluster[2].node("a").key.hex().encode(), generate().public.raw.hex().encode())
    assert swapped != data
    _plan_refused(cluster, tmp_path / "tampered", swapped, sig)  # a node's key swapped after signing
    _plan_refused(cluster, tmp_path / "other-signer", data, sign_plan(data, generate()))
    _plan_refused(cluster, tmp_path / "garbled", data, b'{"format":"x"}')
    _plan_refused(cluster, tmp_path / "trusted-other", data, sig, [generate().public])


def test_cluster_cli_refuses_a_tampered_plan_before_using_the_cluster(cluster, tmp_path):
    model = cluster[0]
    plan = tmp_path / "plan.json"
    plan.write_bytes(model.plan.read_bytes().replace(b'"replicas":2', b'"replicas":1'))
    (tmp_path / "plan.json.sig").write_bytes((model.work / "plan.json.sig").read_bytes())
    r = ck.run("verify-and-run", model.coordinator, "--trust", model.work / "a.pub", "--state-dir",
               model.work / "state-cli", "--model-id", model.model_id, "--prompt-ids", "5,77", "--max-new-tokens", "1",
               "--cluster", "127.0.0.1:1", "--plan", plan, "--plan-trust", model.work / "op.pub", cwd=model.work)
    assert r.returncode == 1 and "signature" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------ the door: a real Ray head

TOKENLESS = """
import sys, grpc, ray
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
host, port = sys.argv[1].rsplit(":", 1)
try:
    gcs_service_pb2_grpc.NodeInfoGcsServiceStub(grpc.insecure_channel(sys.argv[1])).GetClusterId(
        gcs_service_pb2.GetClusterIdRequest(), timeout=10)
    print("GCS ANSWERED")
except grpc.RpcError as e:
    print("GCS", e.code().name)
try:
    ray.init(address=sys.argv[1], namespace="shardtool", logging_level="ERROR", log_to_driver=False)
    print("JOINED")
except Exception as e:
    print("REFUSED", type(e).__name__)
"""


def test_cluster_tokenless_client_is_refused(cluster, tmp_path):
    """A client without the token cannot even ask the GCS; its ray.init fails, so it can register no actor and
    put nothing in the object store (nothing it sends is deserialized by a member)."""
    head = ck.Head.start(tmp_path)
    try:
        env = {**ck.env(tmp_path, token=False), "RAY_AUTH_MODE": "disabled"}
        r = subprocess.run([sys.executable, "-c", TOKENLESS, head.address], capture_output=True, text=True, env=env,
                           timeout=180, stdin=subprocess.DEVNULL)
        assert "GCS UNAUTHENTICATED" in r.stdout and "REFUSED" in r.stdout and "JOINED" not in r.stdout, r.stdout
        # shardtool's own commands: no token, or the wrong one, is one line, before Ray is asked.
        model = cluster[0]
        base = (model.coordinator, "--trust", model.work / "a.pub", "--state-dir",
                model.work / "state-door", "--model-id", model.model_id, "--prompt-ids", "5,77", "--max-new-tokens",
                "1", "--cluster", head.address, "--plan", model.plan, "--plan-trust", model.work / "op.pub")
        none = subprocess.run([str(ck.BIN / "verify-and-run"), *map(str, base)], capture_output=True, text=True,
                              env=ck.env(tmp_path, token=False), timeout=120, stdin=subprocess.DEVNULL)
        assert none.returncode == 2 and "no Ray authentication token" in none.stderr, none.stderr
        wrong = subprocess.run([str(ck.BIN / "verify-and-run"), *map(str, base)], capture_output=True, text=True,
                               env={**ck.env(tmp_path, token=False), "RAY_AUTH_TOKEN": "0" * 64}, timeout=120,
                               stdin=subprocess.DEVNULL)
        assert wrong.returncode == 1 and "refuses this process's token" in wrong.stderr, wrong.stderr
    finally:
        head.stop()


def test_cluster_head_without_token_auth_is_refused_unless_insecure(cluster, tmp_path):
    model = cluster[0]
    head = ck.Head.start(tmp_path, auth=False)
    try:
        r = ck.run("shardtool", *ck.node_argv(model, "a", head.address)[1:], cwd=model.work, timeout=120)
        assert r.returncode == 1 and "does not enforce token authentication" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        node = ck.start([*ck.node_argv(model, "a", head.address), "--insecure-cluster"], tmp_path / "node.log",
                        model.work, extra_env={"RAY_AUTH_MODE": "disabled"})
        try:
            node.wait_for(r"node a ready", 180)
            assert "warning: --insecure-cluster" in node.text()
        finally:
            node.stop()
    finally:
        head.stop()


JOIN = """
import sys, ray
from shardtool.errors import ShardtoolError
from shardtool.runtime.engine._cluster_node import init_ray
try:
    init_ray(ray, sys.argv[1], 10.0)
    print("JOINED", ray.get(ray.remote(lambda: 41 + 1).remote()))
except ShardtoolError as e:
    print("REFUSED", e.one_line())
"""


def test_cluster_tls_head_with_token_is_joined_and_a_plaintext_client_refused(tmp_path):
    """Ray's TLS (RAY_USE_TLS) with token auth: shardtool's check and Ray both speak TLS to the head; a client
    without TLS is refused."""
    from ray._common.tls_utils import generate_self_signed_tls_certs

    cert, key = generate_self_signed_tls_certs()
    (tmp_path / "cert.pem").write_text(cert)
    (tmp_path / "key.pem").write_text(key)
    tls = {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(tmp_path / "cert.pem"),
           "RAY_TLS_SERVER_KEY": str(tmp_path / "key.pem"), "RAY_TLS_CA_CERT": str(tmp_path / "cert.pem")}
    head = ck.Head.start(tmp_path, extra_env=tls)
    try:
        def join(env):
            return subprocess.run([sys.executable, "-c", JOIN, head.address], capture_output=True, text=True,
                                  env=env, timeout=180, stdin=subprocess.DEVNULL).stdout
        assert "JOINED 42" in join({**ck.env(tmp_path), **tls})
        plain = join(ck.env(tmp_path))
        assert "REFUSED" in plain and "RAY_USE_TLS" in plain, plain
    finally:
        head.stop()


# ------------------------------------------------------------------------------ a member's pickle: the cluster proxy

# A member of the cluster hosting nodes a, b, c on a real Ray head: b and c honest; a answers info() honestly (a
# member can read a node's key on its machine) and every run() with an object whose pickle calls exec: Ray runs that
# code wherever the reply is deserialized. The code records its pid, tries to mark the coordinator's cluster module,
# looks for the test's secret in every module it can see and in its parent's memory (/proc/PPID/mem).
MEMBER = r"""
import sys, time, ray
from pathlib import Path
from shardtool.keys import load_private_key, load_public_key
from shardtool.manifest import load_trusted_manifest
from shardtool.runtime import load_signed_plan, prepare_node
from shardtool.runtime.engine._cluster_node import NAMESPACE, NodeActor, actor_name, init_ray

full, work, address, log = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
CODE = '''
import json, os, re, sys
pid = os.getpid()
mod = sys.modules.get("shardtool.runtime.engine._cluster")
if mod is not None:
    mod.HOSTILE_MARKER = pid
seen = [getattr(m, "PROXY_TEST_SECRET") for m in list(sys.modules.values()) if hasattr(m, "PROXY_TEST_SECRET")]
try:
    mem = open(f"/proc/{os.getppid()}/mem", "rb", buffering=0)
except OSError as e:
    memory = "refused: " + type(e).__name__
else:
    memory = "opened"
    with open(f"/proc/{os.getppid()}/maps") as maps:
        for line in maps:
            span, perms, *rest = line.split()
            lo, hi = (int(v, 16) for v in span.split("-"))
            if perms.startswith("rw") and (len(rest) < 4 or rest[3] == "[heap]") and hi - lo < 1 << 30:
                try:
                    mem.seek(lo)
                    seen += [m.decode() for m in re.findall(rb"st-secret-[0-9a-f]{32}", mem.read(hi - lo))]
                except OSError:
                    pass
with open(LOG, "a") as f:
    f.write(json.dumps({"pid": pid, "ppid": os.getppid(), "seen": seen, "memory": memory}) + "\\n")
'''.replace("LOG", repr(log))


class Exec:
    def __reduce__(self):
        return exec, (CODE,)


class Hostile(NodeActor):
    def run(self, call):
        return Exec()


verified = load_trusted_manifest(full / "manifest.msgpack", [load_public_key(work / "a.pub")], 1, work / "member-state")
plan = load_signed_plan(work / "plan.json", verified, [load_public_key(work / "op.pub")])
init_ray(ray, address, 30.0)
actors = []
for name, cls in (("a", Hostile), ("b", NodeActor), ("c", NodeActor)):
    key = load_private_key(work / f"node-{name}.key", None)
    setup = prepare_node(full, verified, plan, name, budget=1 << 30, key=key)
    actors.append(ray.remote(cls).options(name=actor_name(name), namespace=NAMESPACE, num_cpus=0,
                                          max_concurrency=1).remote(setup))
for actor in actors:
    ray.get(actor.info.remote("0" * 32))
print("MEMBER READY", flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def member(cluster, tmp_path_factory):
    """A Ray head and the member above; the coordinator (this process) reaches it with this session's token."""
    work = tmp_path_factory.mktemp("member")
    head = ck.Head.start(work)
    log = work / "exec.log"
    proc = ck.start([sys.executable, "-c", MEMBER, str(cluster[0].full), str(cluster[0].work), head.address,
                     str(log)], work / "member.log", cluster[0].work)
    try:
        proc.wait_for("MEMBER READY", 240)
        yield head, log
    finally:
        proc.stop()
        head.stop()


@pytest.fixture
def coordinator(member, monkeypatch):
    """This process as a coordinator of the member's cluster: Ray's token in its environment, a passphrase in
    SHARDTOOL_PASSPHRASE; dumpable again afterwards (connect_cluster makes it not)."""
    from shardtool import private_memory
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(ck.token_file()))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("SHARDTOOL_PASSPHRASE", "pass-" + secrets.token_hex(16))
    yield member
    private_memory._libc().prctl(private_memory.PR_SET_DUMPABLE, 1, 0, 0, 0)


def _connect(cluster, head, timeout=30.0, graph=False):
    from shardtool.runtime import connect_cluster
    return connect_cluster(head.address, cluster[2], timeout=timeout, graph=graph)


def _exec_records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_cluster_member_pickle_runs_in_the_proxy_not_the_coordinator(cluster, coordinator):
    """A member's reply whose pickle runs code: the code runs in the proxy (its pid), cannot mark the coordinator's
    memory, find a secret put in a module global before connecting (the proxy is spawned, not forked) or read the
    coordinator's memory (not dumpable); the reply is refused naming node a, and b and c serve its experts."""
    from shardtool.runtime.engine import _cluster, _cluster_proxy
    head, log = coordinator
    secret = "st-secret-" + secrets.token_hex(16)
    _cluster.PROXY_TEST_SECRET = secret
    try:
        local = _generate(cluster)
        remote = _connect(cluster, head)
        try:
            # Refuses /proc/PID/mem and ptrace to another process of this user; run as root, the proxy is refused
            # anyway (it holds no capability, fewer than this process): the flag is checked on its own.
            assert memory_private()
            before = len(_exec_records(log))
            assert _generate(cluster, remote) == local
            runs = _exec_records(log)[before:]
        finally:
            remote.close()
    finally:
        del _cluster.PROXY_TEST_SECRET
    assert runs, "the member's pickle never ran: nothing was tested"
    assert {r["pid"] for r in runs} == {remote.transport.pid} != {os.getpid()}
    assert all(r["ppid"] == os.getpid() for r in runs)
    assert not hasattr(_cluster, "HOSTILE_MARKER")
    assert all(r["seen"] == [] for r in runs), runs
    assert all(r["memory"].startswith("refused") for r in runs), runs
    assert set(remote.stats.dropped) == {"a"} and "not a signed answer" in remote.stats.dropped["a"]


def test_cluster_proxy_gets_no_key_in_argv_environment_or_pipe(cluster, coordinator, monkeypatch):
    """The coordinator holds a decrypted receipt key and its passphrase is in its environment, and a session key
    per node: none is in the proxy's command line or environment, nor in any frame sent to it."""
    from shardtool.runtime.engine import _cluster_proxy
    from shardtool.runtime.engine._cluster_node import key_seed
    head, _ = coordinator
    seed = key_seed(generate())
    hidden = [seed, seed.hex().encode(), os.environ["SHARDTOOL_PASSPHRASE"].encode()]
    sent: list[bytes] = []
    write = _cluster_proxy.ProxyTransport._write
    monkeypatch.setattr(_cluster_proxy.ProxyTransport, "_write",
                        lambda self, data, deadline: sent.append(bytes(data)) or write(self, data, deadline))
    remote = _connect(cluster, head)
    try:
        _generate(cluster, remote)
        pid = remote.transport.pid
        seen = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
    finally:
        remote.close()
    sessions = [key for _, key in remote._sessions.values()]
    assert len(sessions) == 3 and b"RAY_AUTH_TOKEN_PATH" in seen
    hidden += [form for key in sessions for form in (key, key.hex().encode())]
    assert len(sent) > 3 and all(sid.encode() in b"".join(sent) for sid, _ in remote._sessions.values())
    assert not any(s in blob for s in hidden for blob in [seen, *sent])


# A member's flood of node NAME's session table: MAX_SESSIONS handshakes, each with a fresh key of its own.
FLOOD = r"""
import sys, ray
from shardtool.runtime.engine._cluster_node import NAMESPACE, actor_name, init_ray
from shardtool.runtime.engine._cluster_session import MAX_SESSIONS, Handshake
init_ray(ray, sys.argv[1], 30.0)
node = ray.get_actor(actor_name(sys.argv[2]), namespace=NAMESPACE)
ray.get([node.info.remote("0" * 32, Handshake().public) for _ in range(MAX_SESSIONS)])
print("FLOODED", flush=True)
"""


@pytest.mark.parametrize("graph", [False, True], ids=["plain-calls", "compiled-graph"])
def test_cluster_member_flooding_a_nodes_sessions_drops_it_only_until_the_next_probe(cluster, coordinator, graph):
    """A member fills node b's session table with its own handshakes: b refuses the coordinator's next call, through
    Ray and the proxy, as a session it does not hold; b is dropped and c serves its experts; the next probe shakes
    hands with the same process again (boot id unchanged), and b serves in the new session. Through a Compiled
    Graph, whose reader hands b's refusal for c's output too, the round is sent again as plain calls: c is not
    dropped under b's refusal."""
    head, _ = coordinator
    model, _, _, services, _ = cluster
    remote = _connect(cluster, head, graph=graph)
    try:
        shared = sorted(pair for pair, nodes in remote.placement.items() if set(nodes) == {"b", "c"})
        layer = shared[0][0]
        rows = {e: np.zeros(1, np.int64) for lay, e in shared if lay == layer}
        x = np.ones((1, services["b"].config.hidden_size), np.float32)
        old = remote._sessions["b"][0]
        flood = ck.start([sys.executable, "-c", FLOOD, head.address, "b"], model.work / "flood.log", model.work)
        try:
            flood.wait_for("FLOODED", 240)
        finally:
            flood.stop()
        outputs, missing = remote.run(layer, x, rows)
        assert set(outputs) == set(rows) and not missing and set(remote.stats.dropped) == {"b"}
        assert remote.stats.dropped["b"].startswith(f"refused the call: session {old} is not one of this node "
                                                    f"process's"), remote.stats.dropped
        remote._probe_at["b"] = (0.0, 1.0)  # due now
        remote.probe()
        assert "b" not in remote.stats.dropped and remote.stats.readmitted == 1 and remote._sessions["b"][0] != old
        asked = remote.stats.expert_calls["b"]
        outputs, missing = remote.run(layer, x, rows)
        assert set(outputs) == set(rows) and not missing and "b" not in remote.stats.dropped
        assert remote.stats.expert_calls["b"] > asked
    finally:
        remote.close()


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_cluster_proxy_that_dies_or_hangs_mid_run_fails_the_request_without_a_hang(cluster, coordinator, fault):
    """The proxy SIGKILLed, or SIGSTOPped (hung), while a run is under way: every node fails with it, the run raises
    UnavailableError (exit 3, HTTP 503) within the call time-out plus the proxy's grace: never a hang, no answer."""
    from shardtool.runtime.engine._cluster_proxy import GRACE
    head, _ = coordinator
    timeout = 3.0
    remote = _connect(cluster, head, timeout)
    sig = signal.SIGKILL if fault == "killed" else signal.SIGSTOP

    def fault_after_the_first_token(i: int) -> None:  # the run is under way, whatever the machine's speed
        if i == 0:
            os.kill(remote.transport.pid, sig)

    try:
        t0 = time.monotonic()
        with pytest.raises(UnavailableError, match="no replica left"):
            _generate(cluster, remote, on_token=fault_after_the_first_token)
        elapsed = time.monotonic() - t0
    finally:
        remote.close()
    assert elapsed < timeout + GRACE + 10, elapsed
    assert any("the cluster proxy failed" in why for why in remote.stats.dropped.values()), remote.stats.dropped


@pytest.mark.parametrize("raised", [RuntimeError("boom"), SystemExit(3)], ids=["exception", "system-exit"])
def test_cluster_member_reply_that_raises_while_unpickled_fails_only_its_call(raised):
    """A member's reply whose pickle raises (anything, SystemExit included) while the proxy's Ray client reads it
    fails that one call, as a node failure, and the proxy goes on serving the next frame: one member cannot take
    down the proxy every node's calls go through."""
    from shardtool.runtime.engine import _cluster_proxy as cp

    sent: list[dict] = []
    child = cp._Child(lambda n: b"", lambda data: sent.append(cp.unpack(data[cp.HEADER.size:])))

    def hostile():
        raise raised

    child.answer(hostile)
    child.answer(lambda: (_ for _ in ()).throw(cp.NodeFailed("node b timed out")))
    assert [set(doc) for doc in sent] == [{"failed"}, {"failed"}]
    assert type(raised).__name__ in sent[0]["failed"] and sent[1]["failed"] == "node b timed out"
