"""A real local Ray cluster for the tests: `ray start --head` on 127.0.0.1 and `shardtool node` processes, each in
its own session (process group), ended by those groups' ids only; and tiny split, signed models with a plan and
per-node directories that hold only what the plan gives each node."""

from __future__ import annotations

import os
import re
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


def env(work: Path) -> dict[str, str]:
    return cli.user_env(work, RAY_ENV)


def run(program: str, *args, cwd: Path, timeout: int = 300) -> Result:
    """The shared runner with Ray's environment, XDG state in `cwd`."""
    return cli.run(program, *args, cwd=cwd, state=cwd, env=RAY_ENV, timeout=timeout)


def ok(program: str, *args, cwd: Path, timeout: int = 300) -> Result:
    return cli.ok(program, *args, cwd=cwd, state=cwd, env=RAY_ENV, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                layers: int = 2, **knobs) -> Model:
    """make_tiny_moe -> split -> sign -> a plan over `nodes` -> one directory per node (its planned experts,
    config.json and the manifest) and one for the coordinator (its files and the manifest)."""
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "a.key").exists():
        ok("shardtool", "keygen", "--out", "a", "--no-passphrase", cwd=work)
    model_id = f"test/tiny-{family}"
    make_checkpoint(work / "hf", family, experts=experts, layers=layers, **knobs)
    ok("shardtool", "split", "-q", work / "hf", work / "full", "--model-id", model_id, "--version", "1", cwd=work)
    ok("shardtool", "sign", work / "full", "--key", "a.key", cwd=work)
    plan = work / "plan.json"
    _write_plan(work, plan, nodes, replicas)
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


def _write_plan(work: Path, plan: Path, nodes: tuple[str, ...], replicas: int) -> None:
    """`shardtool plan`, each node with the same budget."""
    ok("shardtool", "plan", work / "full", "--trust", "a.pub", "--state-dir", work / "plan-state", "--replicas",
       replicas, *[x for n in nodes for x in ("--node", f"{n}=256MiB")], "--out", plan, cwd=work)


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


def start(argv: list[str], log: Path, cwd: Path) -> Proc:
    handle = open(log, "w")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd,
                            env=env(cwd), start_new_session=True)
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
    """`ray start --head --block` on 127.0.0.1 with its session files under a private temp dir."""

    proc: Proc
    address: str
    temp: Path
    groups: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, work: Path) -> "Head":
        # A short path: Ray's unix socket paths below it must stay under the kernel's 107-byte limit.
        temp = Path(tempfile.mkdtemp(prefix="st-ray-", dir="/tmp"))
        port = free_port()
        argv = [str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--block",
                "--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", str(temp),
                "--object-store-memory", str(96 * 2**20), "--disable-usage-stats",
                "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
                "--dashboard-agent-grpc-port", str(free_port())]
        proc = start(argv, work / "ray-head.log", work)
        head = cls(proc, f"127.0.0.1:{port}", temp, [proc.pgid])
        proc.wait_for(r"Ray runtime started", 180)
        return head

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.temp, ignore_errors=True)


def node_argv(model: Model, name: str, address: str, *, budget: str = "128MiB") -> list[str]:
    return [str(BIN / "shardtool"), "node", str(model.node_dir(name)), "--trust", str(model.work / "a.pub"),
            "--state-dir", str(model.work / f"state-{name}"), "--plan", str(model.plan), "--name", name,
            "--memory-budget", budget, "--address", address, "--readers", "1"]


def start_node(model: Model, name: str, address: str) -> Proc:
    proc = start(node_argv(model, name, address), model.work / f"node-{name}-{time.monotonic_ns()}.log", model.work)
    proc.wait_for(rf"node {name} ready", 180)
    return proc


def verify_and_run(model: Model, directory: Path, *args, cluster: str | None = None, expect: int = 0,
                   timeout: int = 300) -> subprocess.CompletedProcess:
    extra = ("--cluster", cluster, "--plan", model.plan) if cluster else ()
    r = run("verify-and-run", directory, "--trust", model.work / "a.pub", "--state-dir", model.work / "state-var",
            "--model-id", model.model_id, "-q", *extra, *args, cwd=model.work, timeout=timeout)
    assert r.returncode == expect, f"verify-and-run exited {r.returncode}, expected {expect}:\n{r.stderr[-3000:]}"
    return r
