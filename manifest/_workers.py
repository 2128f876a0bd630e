"""Audit's hashing processes: batches of listed files checked in forked worker processes, supervised.

Why processes: the per-file work of an audit (open beneath the directory, fstat, read, compare) is Python,
and threads share one interpreter lock, so 20,000 small files ran on one core; workers run it on all.
Why supervised: a worker hashes large files from a read-only mapping (no copy into a buffer), and a file
truncated while it is mapped raises SIGBUS on the next access past the new end, which kills the process.
Before mapping a file the worker names it to the supervisor (`mapping(k)`), so a worker's death becomes a
finding for that file ("unreadable: changed while it was being hashed"), the rest of its batch goes to a
fresh worker, and the audit goes on. Nothing a worker maps is used afterwards: it only yields a digest.

Workers are forked (they share the parent's loaded manifest; nothing is pickled but indices and
findings). A forked process must not use BLAKE3's shared thread pool: its threads did not survive the
fork (see `digest_fd`'s `threads`).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import resource
import selectors
import signal
import struct
import traceback
from array import array
from collections import deque
from typing import Callable

from shardtool.errors import StorageError

# run(indices, mapping) -> findings; called in a worker. mapping(k): the k-th of `indices` is about to be mapped.
Run = Callable[[list[int], Callable[[int], None]], list]
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


def _worker(task_r: int, result_w: int, run: Run) -> None:
    """A worker's whole life (never returns): tasks in, findings out, until an empty task."""
    code = 0
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGBUS is expected, a core file is not
        if faulthandler.is_enabled():
            faulthandler.disable()  # the supervisor reports a worker's death; no traceback on stderr
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        while True:
            (n,) = struct.unpack("<I", _read_exact(task_r, 4))
            if n == 0:
                break
            indices = array("i")
            indices.frombytes(_read_exact(task_r, n))
            found = run(indices.tolist(), lambda k: _send(result_w, b"M", struct.pack("<I", k)))
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
        self.mapping: int | None = None  # index into self.task of the file being hashed from a mapping
        self.buf = bytearray()

    def give(self, task: list[int] | None) -> None:
        self.task, self.mapping = task, None
        payload = array("i", task or ()).tobytes()
        data = memoryview(struct.pack("<I", len(payload)) + payload)
        while data:
            data = data[os.write(self.task_w, data):]


def run_batches(tasks: list[list[int]], workers: int, run: Run, done: Callable[[list[int], list], None],
                died_mapping: Callable[[int, str], object]) -> None:
    """Run every task (a list of indices) through `run` in up to `workers` forked processes; `done(task,
    findings)` is called in this process as each finishes. A worker that dies while it has a file mapped
    costs that file a finding, `died_mapping(index, detail)`, passed to `done`; the rest of its task is
    run again by a fresh worker. A worker that dies otherwise, or raises, ends the audit with its error."""
    pending = deque(tasks)
    live: dict[int, _Worker] = {}
    selector = selectors.DefaultSelector()

    def spawn() -> None:
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            for w in live.values():  # another worker's pipe held open here would hide that worker's death
                os.close(w.task_w)
                os.close(w.result_r)
            os.close(task_w)
            os.close(result_r)
            _worker(task_r, result_w, run)
        os.close(task_r)
        os.close(result_w)
        worker = _Worker(pid, task_w, result_r)
        live[result_r] = worker
        selector.register(result_r, selectors.EVENT_READ)
        worker.give(pending.popleft() if pending else None)

    def retire(worker: _Worker) -> int:
        del live[worker.result_r]
        selector.unregister(worker.result_r)
        os.close(worker.task_w)
        os.close(worker.result_r)
        _, status = os.waitpid(worker.pid, 0)
        return status

    try:
        for _ in range(min(workers, len(pending))):
            spawn()
        while live:
            for key, _ in selector.select():
                fd = key.fd
                worker = live[fd]
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    _ended(worker, retire(worker), pending, done, died_mapping)
                    if pending and len(live) < workers:
                        spawn()
                    continue
                worker.buf += chunk
                while len(worker.buf) >= _HEADER.size:
                    tag, n = _HEADER.unpack_from(worker.buf)
                    if len(worker.buf) < _HEADER.size + n:
                        break
                    payload = bytes(worker.buf[_HEADER.size:_HEADER.size + n])
                    del worker.buf[:_HEADER.size + n]
                    if tag == b"M":
                        (worker.mapping,) = struct.unpack("<I", payload)
                    elif tag == b"R":
                        task = worker.task
                        worker.give(pending.popleft() if pending else None)
                        done(task, pickle.loads(payload))
                    else:
                        err, trace = pickle.loads(payload)
                        raise err from StorageError(f"in an audit worker process:\n{trace}")
    finally:
        for worker in list(live.values()):
            try:
                os.kill(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            retire(worker)
        selector.close()


def _ended(worker: _Worker, status: int, pending: deque, done, died_mapping) -> None:
    """A worker's pipe closed: after its empty task that is its exit; with a task in hand, its death."""
    if worker.task is None and os.waitstatus_to_exitcode(status) == 0:
        return
    code = os.waitstatus_to_exitcode(status)
    if worker.task is None or worker.mapping is None:
        raise StorageError(f"an audit worker process ended unexpectedly (exit status {code})")
    task, k = worker.task, worker.mapping
    if code == -signal.SIGBUS:
        detail = _SIGBUS_DETAIL
    else:
        detail = f"the process hashing it ended with {'signal ' + str(-code) if code < 0 else 'status ' + str(code)}"
    rest = task[:k] + task[k + 1:]
    if rest:
        pending.appendleft(rest)
    done([task[k]], [died_mapping(task[k], detail)])
