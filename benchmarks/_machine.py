"""An emulated small machine: run a command in a cgroup with a memory cap (charged RSS *and* the page cache it touches)
and a read-bandwidth cap on the disk its files live on, caches dropped first, and record what it took.

cgroup v1 (`memory` + `blkio` hierarchies) and v2 (`memory` + `io` controllers in one hierarchy) are both handled; the
harness creates its cgroup, moves the command into it before exec (a tiny `sh` wrapper), and always removes it.
`run` runs one command to completion; `started` keeps a long-lived one (a server) on the machine for a `with` block
while its clients run outside it, its disk reads readable at any moment.
Needs root. Usage as a command:
    python benchmarks/_machine.py --memory 64MiB --read-bps 200000000 --disk-of DIR -- COMMAND ARGS...
prints one JSON document (the MachineRun) on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

CGROUP_ROOT = Path("/sys/fs/cgroup")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
# Move the wrapper's own pid into each cgroup.procs named before the command, then become the command: everything the
# command allocates or reads is charged from its first instruction.
_ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 126; shift; n=$((n-1)); done; exec "$@"'


class MachineUnavailableError(RuntimeError):
    """No writable cgroup memory + read-bandwidth controllers (or no cache drop) here: the machine cannot be emulated."""


@dataclass(frozen=True)
class Machine:
    memory_bytes: int  # the cap on charged memory: anonymous memory + page cache
    read_bps: int  # the read bandwidth of the disk the data lives on, bytes per second

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "read_bps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be an integer > 0, got {value!r}")


@dataclass(frozen=True)
class MachineRun:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_memory_bytes: int  # the cgroup's high-water charge (RSS + page cache)
    device_read_bytes: int  # bytes the cgroup read from the disk (after the cache drop: every byte it used)
    oom_kills: int  # processes the kernel killed for the memory cap
    cgroup_version: int
    disk: str  # MAJ:MIN of the throttled disk


def disk_of(path: Path) -> str:
    """The MAJ:MIN of the whole disk holding `path` (a partition maps to its disk through /sys/dev/block)."""
    dev = os.stat(path).st_dev
    node = Path("/sys/dev/block") / f"{os.major(dev)}:{os.minor(dev)}"
    if not node.exists():
        raise MachineUnavailableError(f"{path} is on device {os.major(dev)}:{os.minor(dev)}, which is no block "
                                      f"device in /sys/dev/block (tmpfs or overlay?): no disk to throttle")
    real = node.resolve()
    if (real / "partition").exists():
        real = real.parent
    return (real / "dev").read_text().strip()


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller ("" for the v2 hierarchy), from /proc/self/cgroup."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            own[c] = path.lstrip("/")
    return own


def _v2_parent(own: dict[str, str]) -> Path | None:
    for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        parent = root / own.get("", "")
        controllers = parent / "cgroup.subtree_control"
        if controllers.exists() and {"memory", "io"} <= set(controllers.read_text().split()):
            return parent
    return None


class _Cgroup:
    """One fresh cgroup (v1: a directory in each of `memory` and `blkio`; v2: one directory) for one run."""

    def __init__(self, machine: Machine, disk: str):
        name = f"shardtool-machine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Nested below the cgroups this process already runs in: whatever caps those carry still hold.
        own = _own_cgroups()
        v1 = [CGROUP_ROOT / c / own.get(c, "") for c in ("memory", "blkio")]
        v2 = _v2_parent(own)
        if all((d / "cgroup.procs").exists() and os.access(d, os.W_OK) for d in v1):
            self.version, self.dirs = 1, [d / name for d in v1]
        elif v2 is not None and os.access(v2, os.W_OK):
            self.version, self.dirs = 2, [v2 / name]
        else:
            raise MachineUnavailableError(
                "no writable cgroup memory + blkio (v1) or memory + io (v2) controllers under /sys/fs/cgroup "
                "(needs root; on v2 both controllers enabled in cgroup.subtree_control)")
        self.disk = disk
        for d in self.dirs:
            d.mkdir()
        try:
            self._limit(machine)
        except OSError:
            self.remove()
            raise

    def _limit(self, m: Machine) -> None:
        if self.version == 1:
            mem, blk = self.dirs
            (mem / "memory.limit_in_bytes").write_text(str(m.memory_bytes))
            (blk / "blkio.throttle.read_bps_device").write_text(f"{self.disk} {m.read_bps}")
        else:
            d = self.dirs[0]
            (d / "memory.max").write_text(str(m.memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            (d / "io.max").write_text(f"{self.disk} rbps={m.read_bps}")

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def readings(self) -> tuple[int, int, int]:
        """(peak charged bytes, bytes read from the disk, OOM kills)."""
        if self.version == 1:
            mem, blk = self.dirs
            peak = int((mem / "memory.max_usage_in_bytes").read_text())
            oom = _keyed((mem / "memory.oom_control").read_text().splitlines(), "oom_kill")
            read = sum(int(parts[2]) for parts in (line.split() for line in
                       (blk / "blkio.throttle.io_service_bytes").read_text().splitlines())
                       if len(parts) == 3 and parts[0] == self.disk and parts[1] == "Read")
            return peak, read, oom
        d = self.dirs[0]
        peak_file = d / "memory.peak"  # Linux >= 5.19
        peak = int(peak_file.read_text()) if peak_file.exists() else int((d / "memory.current").read_text())
        oom = _keyed((d / "memory.events").read_text().splitlines(), "oom_kill")
        read = 0
        for line in (d / "io.stat").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == self.disk:
                read += sum(int(kv.split("=", 1)[1]) for kv in parts[1:] if kv.startswith("rbytes="))
        return peak, read, oom

    def remove(self) -> None:
        """Kill whatever is left in the cgroup (only processes this harness started can be in it), then rmdir."""
        for d in self.dirs:
            if not d.exists():
                continue
            for _ in range(50):
                pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    d.rmdir()
                    break
                except OSError:  # EBUSY while the killed processes are still exiting
                    time.sleep(0.05)
            else:
                raise RuntimeError(f"could not remove cgroup {d}")


def _keyed(lines: list[str], key: str) -> int:
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def drop_caches() -> None:
    """Write back, then drop the page cache: a file the generator just wrote would otherwise never be read from disk."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError as e:
        raise MachineUnavailableError(f"cannot drop the page cache ({DROP_CACHES}: {e.strerror}): "
                                      "reads would come from memory, not the throttled disk") from e


@contextlib.contextmanager
def _prepared(machine: Machine, data_dir: Path) -> Iterator[_Cgroup]:
    """A fresh cgroup capped as `machine`, throttling the disk holding `data_dir`, caches dropped; always removed."""
    group = _Cgroup(machine, disk_of(data_dir))
    try:
        drop_caches()
        yield group
    finally:
        group.remove()


def _launch(group: _Cgroup, argv: Sequence[str], *, env: dict | None, cwd: Path | None, stdout, stderr,
            text: bool) -> subprocess.Popen:
    """`argv` started inside `group` from its first instruction, in a session of its own (its pgid is its pid)."""
    wrapped = ["/bin/sh", "-c", _ENTER, "sh", str(len(group.procs_files)), *group.procs_files, *map(str, argv)]
    return subprocess.Popen(wrapped, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                            text=text, errors="replace" if text else None, start_new_session=True)


def _end_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group we started (by its id: the session leader's pid), if it is still there."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _result(argv: Sequence[str], group: _Cgroup, returncode: int, out: str, err: str, seconds: float) -> MachineRun:
    peak, read, oom = group.readings()
    return MachineRun(tuple(map(str, argv)), returncode, out, err, seconds, peak, read, oom, group.version, group.disk)


def run(argv: Sequence[str], machine: Machine, *, data_dir: Path, env: dict | None = None, cwd: Path | None = None,
        timeout: float = 300) -> MachineRun:
    """Run `argv` on `machine`: caches dropped, memory capped, reads of the disk holding `data_dir` throttled."""
    with _prepared(machine, data_dir) as group:
        start = time.perf_counter()
        proc = _launch(group, argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n[machine] killed after {timeout}s"
        return _result(argv, group, proc.returncode, out, err, time.perf_counter() - start)


class Started:
    """A long-lived command (a server) running on the machine, measured from outside it while it runs.

    `pid` is also its process group's id. `readings()` and `device_read_bytes()` can be taken at any moment (take
    the difference over a window of requests); `run` is the MachineRun once the `started` block has ended it, with
    its stdout and stderr (interleaved in `log`) as `stderr`.
    """

    def __init__(self, argv: Sequence[str], group: _Cgroup, proc: subprocess.Popen, log: Path, start: float):
        self.argv, self.group, self.proc, self.log, self._start = tuple(map(str, argv)), group, proc, log, start
        self.run: MachineRun | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def readings(self) -> tuple[int, int, int]:
        """(peak charged bytes so far, bytes read from the disk so far, OOM kills so far)."""
        return self.group.readings()

    def device_read_bytes(self) -> int:
        return self.group.readings()[1]

    def rss_peak_bytes(self) -> int:
        """The command's own high-water resident set (VmHWM; its children not included), 0 once it has exited: the
        cgroup's peak counts the page cache too, which fills to the cap."""
        return _vm(self.proc.pid, "VmHWM:")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def _stop(self, grace: float) -> None:
        """SIGTERM to the process group, SIGKILL to it after `grace` seconds; figures read before the cgroup goes."""
        if self.alive():
            _end_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        _end_group(self.proc, signal.SIGKILL)  # whatever of the group outlived its leader
        self.proc.wait()
        self.run = _result(self.argv, self.group, self.proc.returncode, "", self.log_text(),
                           time.perf_counter() - self._start)


@contextlib.contextmanager
def started(argv: Sequence[str], machine: Machine, *, data_dir: Path, log: Path, env: dict | None = None,
            cwd: Path | None = None, grace: float = 30, pipe_stdout: bool = False) -> Iterator[Started]:
    """Start `argv` on `machine` (as `run` does) and keep it running for the block; its clients run outside the
    machine. On leaving the block the process group gets SIGTERM, SIGKILL after `grace` seconds, the figures are
    read into `handle.run`, and the cgroup (with anything left in it) is removed, whatever the block raised.
    `pipe_stdout`: the command's stdout is `handle.proc.stdout` (bytes, for the block to read as it comes: the time
    each token appears) and only its stderr goes to `log`."""
    with _prepared(machine, data_dir) as group, open(log, "w") as sink:
        start = time.perf_counter()
        proc = _launch(group, argv, env=env, cwd=cwd, stdout=subprocess.PIPE if pipe_stdout else sink,
                       stderr=sink if pipe_stdout else subprocess.STDOUT, text=False)
        handle = Started(argv, group, proc, log, start)
        try:
            yield handle
        finally:
            handle._stop(grace)


class Holding:
    """A machine whose processes were started elsewhere and moved in (`adopt`): a process a supervisor spawns (a Ray
    actor's worker, a child of the raylet) cannot be started inside the cgroup, only moved there."""

    def __init__(self, group: _Cgroup, machine: Machine):
        self.group, self.machine = group, machine
        self.pids: list[int] = []
        self.outside_bytes = 0  # resident memory the adopted processes had charged elsewhere before they moved in

    def adopt(self, pid: int) -> None:
        """Move process `pid` (all its threads) in. Its memory so far stays charged where it was (the kernel moves no
        charges here), so the cap is lowered by its resident size: the machine still holds all of it within M."""
        rss = _vm(pid, "VmRSS:")
        for procs in self.group.procs_files:
            Path(procs).write_text(str(pid))
        self.pids.append(pid)
        self.outside_bytes += rss
        limit = self.machine.memory_bytes - self.outside_bytes
        if limit <= 0:
            raise ValueError(f"process {pid} alone ({rss} bytes resident) fills the "
                             f"{self.machine.memory_bytes}-byte cap")
        mem = self.group.dirs[0]
        (mem / ("memory.limit_in_bytes" if self.group.version == 1 else "memory.max")).write_text(str(limit))

    def readings(self) -> tuple[int, int, int]:
        """(peak charged bytes so far, the adopted processes' memory from before they moved in included; bytes read
        from the disk so far; OOM kills so far)."""
        peak, read, oom = self.group.readings()
        return peak + self.outside_bytes, read, oom

    def device_read_bytes(self) -> int:
        return self.group.readings()[1]


def _vm(pid: int, key: str) -> int:
    """A memory line of /proc/PID/status in bytes ("VmRSS:   92572 kB"), 0 when the process has none (a zombie)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == key and parts[2] == "kB":
            return int(parts[1]) * 1024
    return 0


@contextlib.contextmanager
def holding(machine: Machine, *, data_dir: Path) -> Iterator[Holding]:
    """A machine with nothing in it yet, caches dropped, for the block: `adopt(pid)` moves processes in. On leaving,
    whatever is still in it is killed (only adopted processes can be) and the cgroup removed."""
    with _prepared(machine, data_dir) as group:
        yield Holding(group, machine)


def parse_size(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(float(text))


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory", required=True, help="memory cap, e.g. 64MiB")
    p.add_argument("--read-bps", required=True, help="disk read bandwidth in bytes/s, e.g. 200e6")
    p.add_argument("--disk-of", type=Path, default=Path.cwd(), help="throttle the disk holding this path")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(args)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the command to run after --")
    try:
        r = run(command, Machine(parse_size(a.memory), parse_size(a.read_bps)), data_dir=a.disk_of)
    except MachineUnavailableError as e:
        print(f"machine: {e}", file=sys.stderr)
        return 3
    print(json.dumps(asdict(r), indent=2))
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
