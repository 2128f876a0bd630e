"""Audit's hashing processes: batches of listed files checked in forked worker processes, supervised.

Why processes: the per-file work of an audit (open beneath the directory, fstat, read, compare) is Python,
and threads share one interpreter lock, so 20,000 small files ran on one core; workers run it on all.
Why supervised: a worker hashes large files from a read-only mapping (no copy into a buffer), and a file
truncated while it is mapped raises SIGBUS on the next access past the new end, which kills the process.
Before mapping a file the worker names it to the supervisor (`mapping(k)`), so a worker's death becomes a
finding for that file ("unreadable: changed while it was being hashed"), the rest of its batch goes to a
fresh worker, and the audit goes on; once the file is unmapped the worker says so (`mapping(None)`), so a
later death blames no file. Only SIGBUS under a mapping is a finding: a worker killed any other way (the
out-of-memory killer, kill -9) ends the audit with a StorageError, never a verdict.

Workers end with the audit: they ignore SIGINT (the parent handles Ctrl-C and ends them; a parent that
ignores SIGINT, a background job, goes on with them), die with the parent (PR_SET_PDEATHSIG on Linux), and
a SIGTERM to the parent ends its workers before it dies. Each worker costs the parent two descriptors, so
their number is capped by RLIMIT_NOFILE, and an EMFILE when starting one leaves the audit with fewer.

Workers are forked (they share the parent's loaded manifest; nothing is pickled but indices and
findings). A forked process must not use BLAKE3's shared thread pool: its threads did not survive the
fork (see `digest_fd`'s `threads`).
"""

from __future__ import annotations

import errno
import faulthandler
import os
import pickle
import resource
import selectors
import signal
import struct
import sys
import threading
import traceback
from array import array
from collections import deque
from typing import Callable

from shardtool.errors import StorageError

# run(indices, mapping) -> findings; called in a worker. mapping(k): the k-th of `indices` is about to be mapped;
# mapping(None): it is unmapped.
Run = Callable[[list[int], Callable[[int | None], None]], list]
_HEADER = struct.Struct("<cI")
_SIGBUS_DETAIL = ("file changed while it was being hashed, or the disk failed: SIGBUS under the audit's read-only "
                  "mapping (the file shrank, or a page could not be read)")


def available() -> bool:
    return hasattr(os, "fork")


def _read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _send(fd: int, tag: bytes, payload: bytes) -> None:
    data = memoryview(_HEADER.pack(tag, len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


_ENDING = {signal.SIGINT, signal.SIGTERM}  # blocked while a worker is forked, so no handler runs half-way


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux); a parent already gone: exit now."""
    if sys.platform.startswith("linux"):
        import ctypes  # only here: an audit's start-up imports nothing it does not use

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(0)


def _mapping_said(result_w: int) -> Callable[[int | None], None]:
    def said(k: int | None) -> None:
        if k is None:
            _send(result_w, b"U", b"")
        else:
            _send(result_w, b"M", struct.pack("<I", k))
    return said


def _worker(task_r: int, result_w: int, run: Run, parent: int, inherited: list[int]) -> None:
    """A worker's whole life (never returns): tasks in, findings out, until an empty task."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _ENDING)
        _die_with(parent)
        for fd in inherited:  # another worker's pipe held open here would hide that worker's death
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGBUS is expected, a core file is not
        if faulthandler.is_enabled():
            faulthandler.disable()  # the supervisor reports a worker's death; no traceback on stderr
        said = _mapping_said(result_w)
        while True:
            (n,) = struct.unpack("<I", _read_exact(task_r, 4))
            if n == 0:
                break
            indices = array("i")
            indices.frombytes(_read_exact(task_r, n))
            found = run(indices.tolist(), said)
            _send(result_w, b"R", pickle.dumps(found, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as e:  # noqa: BLE001 - the supervisor re-raises it; a worker never unwinds into the caller
        code = 70
        try:
            e.__traceback__ = None
            _send(result_w, b"E", pickle.dumps((e, traceback.format_exc())))
        except BaseException:  # noqa: BLE001 - unpicklable: the supervisor names the exit code instead
            pass
    finally:
        os._exit(code)


class _Worker:
    def __init__(self, pid: int, task_w: int, result_r: int):
        self.pid, self.task_w, self.result_r = pid, task_w, result_r
        self.task: list[int] | None = None
        self.mapping: int | None = None  # index into self.task of the file mapped now (None once unmapped)
        self.buf = bytearray()

    def give(self, task: list[int] | None) -> None:
        self.task, self.mapping = task, None
        payload = array("i", task or ()).tobytes()
        data = memoryview(struct.pack("<I", len(payload)) + payload)
        while data:
            data = data[os.write(self.task_w, data):]


class _Terminated(BaseException):
    """SIGTERM reached the parent during `run_batches`: its workers are ended, then it dies of the signal."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise _Terminated


def _fd_cap(workers: int) -> int:
    """At most as many workers as the descriptor limit leaves room for (two each, more while one starts)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return workers
    return max(1, min(workers, (soft - 16) // 3))


class _Pool:
    """The forked workers of one `run_batches` call: the tasks not yet given out, the live workers by their result
    pipe, and the selector over those pipes."""

    def __init__(self, tasks: list[list[int]], workers: int, run: Run):
        self.pending = deque(tasks)
        self.live: dict[int, _Worker] = {}
        self.selector = selectors.DefaultSelector()
        self.workers = _fd_cap(workers)
        self.run = run
        self.parent = os.getpid()

    def spawn(self) -> bool:
        """Start a worker on the next task; False (with one or more already running) when the system has
        no descriptors or processes left for another."""
        signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING)
        try:
            opened: list[int] = []
            try:
                opened += os.pipe()
                opened += os.pipe()
                task_r, task_w, result_r, result_w = opened
                pid = os.fork()
                if pid == 0:
                    try:
                        inherited = [fd for w in self.live.values() for fd in (w.task_w, w.result_r)]
                        _worker(task_r, result_w, self.run, self.parent, inherited + [task_w, result_r])
                    finally:
                        os._exit(70)
            except OSError as e:
                for fd in opened:
                    os.close(fd)
                if self.live and e.errno in (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM):
                    self.workers = len(self.live)  # run on with the workers there are
                    return False
                raise StorageError(f"cannot start an audit worker process: {e.strerror}") from e
            os.close(task_r)
            os.close(result_w)
            worker = _Worker(pid, task_w, result_r)
            self.live[result_r] = worker
            self.selector.register(result_r, selectors.EVENT_READ)
            self._give_next(worker)
            return True
        finally:  # a SIGINT or SIGTERM held back until now finds this worker registered, so it is ended
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _ENDING)

    def _give_next(self, worker: _Worker) -> None:
        worker.give(self.pending.popleft() if self.pending else None)

    def retire(self, worker: _Worker) -> int:
        del self.live[worker.result_r]
        self.selector.unregister(worker.result_r)
        os.close(worker.task_w)
        os.close(worker.result_r)
        _, status = os.waitpid(worker.pid, 0)
        return status

    def read(self, worker: _Worker, done: Callable[[list[int], list], None],
             died_mapping: Callable[[int, str], object]) -> None:
        """What a worker's result pipe holds now: its end (a fresh worker takes its place while tasks are
        left), or messages, each handled whole."""
        chunk = os.read(worker.result_r, 1 << 20)
        if not chunk:
            _ended(worker, self.retire(worker), self.pending, done, died_mapping)
            if self.pending and len(self.live) < self.workers:
                self.spawn()
            return
        worker.buf += chunk
        while len(worker.buf) >= _HEADER.size:
            tag, n = _HEADER.unpack_from(worker.buf)
            if len(worker.buf) < _HEADER.size + n:
                break
            payload = bytes(worker.buf[_HEADER.size:_HEADER.size + n])
            del worker.buf[:_HEADER.size + n]
            if tag == b"M":
                (worker.mapping,) = struct.unpack("<I", payload)
            elif tag == b"U":
                worker.mapping = None
            elif tag == b"R":
                task = worker.task
                self._give_next(worker)
                done(task, pickle.loads(payload))
            else:
                err, trace = pickle.loads(payload)
                raise err from StorageError(f"in an audit worker process:\n{trace}")

    def close(self) -> None:
        """Kill and reap every worker still running."""
        for worker in list(self.live.values()):
            try:
                os.kill(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.retire(worker)
        self.selector.close()


def run_batches(tasks: list[list[int]], workers: int, run: Run, done: Callable[[list[int], list], None],
                died_mapping: Callable[[int, str], object]) -> None:
    """Run every task (a list of indices) through `run` in up to `workers` forked processes; `done(task,
    findings)` is called in this process as each finishes. A worker killed by SIGBUS while it has a file
    mapped costs that file a finding, `died_mapping(index, detail)`, passed to `done`; the rest of its task
    is run again by a fresh worker. A worker that dies otherwise, or raises, ends the audit with its error."""
    pool = _Pool(tasks, workers, run)
    own_sigterm = (threading.current_thread() is threading.main_thread()
                   and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if own_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)
    terminated = False
    try:
        for _ in range(min(pool.workers, len(pool.pending))):
            if not pool.spawn():
                break
        while pool.live:
            for key, _ in pool.selector.select():
                pool.read(pool.live[key.fd], done, died_mapping)
    except _Terminated:
        terminated = True
    finally:
        pool.close()
        if own_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if terminated:
        signal.raise_signal(signal.SIGTERM)  # die of it, as without this handler, its workers now gone


def _ended(worker: _Worker, status: int, pending: deque, done, died_mapping) -> None:
    """A worker's pipe closed: after its empty task that is its exit; with a task in hand, its death."""
    code = os.waitstatus_to_exitcode(status)
    if worker.task is None and code == 0:
        return
    if worker.task is None or worker.mapping is None or code != -signal.SIGBUS:
        how = f"signal {_signal_name(-code)}" if code < 0 else f"exit status {code}"
        raise StorageError(f"an audit worker process ended unexpectedly ({how}; killed from outside, e.g. out of "
                           f"memory?): no verdict")
    task, k = worker.task, worker.mapping
    rest = task[:k] + task[k + 1:]
    if rest:
        pending.appendleft(rest)
    done([task[k]], [died_mapping(task[k], _SIGBUS_DETAIL)])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
