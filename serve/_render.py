"""Chat templates rendered in worker processes, each render bounded in time and memory.

A signed template is still a program: two nested `range(100000)` loops are ten billion iterations, and a thread
cannot be stopped. So the server renders in a few child processes (`python -m shardtool.serve._render`), waits
for each answer on threads of its own (never the event loop's shared pool, which the other routes need), and a
render that overruns its deadline, or whose client went away, has its process killed and replaced. A worker
also caps its address space, and the rendered text is capped as it is produced (`ChatTemplate.render`).

Frames on the worker's stdin and stdout: a 4-byte big-endian length, then a JSON document. The first frame is
the template ({"source", "special_tokens"}), answered with {"ready": true}; then one {"messages"} per render,
answered with {"text"} or {"error": class name, "message"}.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import selectors
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from shardtool.errors import InvalidRequestError, OverloadedError, ShardtoolError, VerificationError
from shardtool.private_memory import child_environment

_LENGTH = struct.Struct(">I")
MAX_FRAME = 64 << 20  # a render's messages (1 Mi characters, 4 bytes each in UTF-8 at most) or its text, as JSON
WORKER_MEMORY = 1 << 30  # address space of a worker (RLIMIT_AS): a template that builds a huge string fails there
START_SECONDS = 60.0  # a new worker has this long to import jinja2 and compile the template


class RenderPool:
    """`render(messages)` from the event loop: at most `workers` renders at once, `max_waiting` more queued (503
    past that), each within `seconds`. Workers start on first use; `close()` kills them (also at exit)."""

    def __init__(self, template, *, workers: int = 2, seconds: float = 5.0, max_waiting: int = 64):
        self.template = template
        self.seconds = seconds
        self.max_waiting = max_waiting
        self._init = _frame({"source": template.source, "special_tokens": template.special_tokens,
                             "where": template.where})
        self.workers = workers
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="chat-render")
        self._slots = asyncio.Semaphore(workers)
        self._waiting = 0
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self.overruns = 0  # renders killed at their deadline
        atexit.register(self.close)

    async def render(self, messages: Sequence[dict[str, Any]]) -> str:
        if self.template.problem is not None:
            raise self.template.problem
        if self._waiting >= self.max_waiting:
            raise OverloadedError(f"{self._waiting} chat requests are waiting for their template to render",
                                  retry_after=max(1, int(self.seconds)))
        request = _frame({"messages": list(messages)})
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._render_on_a_worker(request)
        finally:
            self._slots.release()

    async def _render_on_a_worker(self, request: bytes) -> str:
        loop = asyncio.get_running_loop()
        while self._idle and not self._idle[-1].alive():
            self._forget(self._idle.pop())
        worker = self._idle.pop() if self._idle else self._start()  # (a fork and exec: the imports run in the child)
        job = loop.run_in_executor(self._threads, worker.ask, request, self.seconds)
        try:
            reply = await asyncio.shield(job)
        except asyncio.CancelledError:  # the client left: stop its render now rather than at its deadline
            worker.stop()  # the thread's read then ends (EOF); the pipes close after it has returned
            job.add_done_callback(lambda _: worker.close())
            self._forget(worker)
            raise
        if reply is None:
            self.overruns += 1
            worker.kill()
            self._forget(worker)
            where = self.template.where
            raise VerificationError(f"the chat template in signed {where} exceeded its render limit "
                                    f"({self.seconds:g} seconds, {WORKER_MEMORY >> 20} MiB): the template, not "
                                    f"these messages, is at fault", path=where)
        if worker.alive():
            self._idle.append(worker)
        else:
            self._forget(worker)
        if "text" in reply:
            return reply["text"]
        return _raise(reply, self.template.where)

    def warm(self) -> None:
        """Start the workers now (in parallel, blocking until they are ready), so the first chat request does
        not wait for a process to start. Call before the event loop runs."""
        if self.template.problem is not None:
            return
        workers = [self._start() for _ in range(self.workers)]
        for worker in workers:
            worker.send_template()
        for worker in workers:
            if worker.wait_ready():
                self._idle.append(worker)
            else:
                worker.kill()
                self._forget(worker)

    def _start(self) -> "_Worker":
        worker = _Worker(self._init)
        with self._lock:
            self._all.add(worker)
        return worker

    def _forget(self, worker: "_Worker") -> None:
        with self._lock:
            self._all.discard(worker)

    @property
    def running(self) -> int:
        """Worker processes alive now."""
        with self._lock:
            return sum(worker.alive() for worker in self._all)

    def close(self) -> None:
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()
        self._idle.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _raise(reply: dict, where: str) -> str:
    message = str(reply.get("message", ""))[:2000]
    if reply.get("error") == "InvalidRequestError":
        raise InvalidRequestError(message, param="messages")
    raise VerificationError(message, path=where)


class _Worker:
    """One render process. `ask` blocks its thread until the answer, the deadline, or the process's end."""

    def __init__(self, init: bytes):
        self.proc = subprocess.Popen([sys.executable, "-m", "shardtool.serve._render"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True, env=child_environment())
        self.ready = False
        self._init = init

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.stop()
        self.close()

    def stop(self) -> None:
        """End the process; its pipes stay open (a thread may still be reading one: see `close`)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Close the pipes, once no thread reads them: a closed descriptor's number can be reused at once (by a new
        client's socket), and a read still selecting on it would take that socket's bytes."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def send_template(self) -> None:
        self.proc.stdin.write(self._init)
        self.proc.stdin.flush()

    def wait_ready(self) -> bool:
        if not self.ready:
            self.ready = _read_frame(self.proc.stdout, time.monotonic() + START_SECONDS) == {"ready": True}
        return self.ready

    def ask(self, request: bytes, seconds: float) -> dict | None:
        try:
            if not self.ready:
                self.send_template()
                if not self.wait_ready():
                    return None
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
            return _read_frame(self.proc.stdout, time.monotonic() + seconds)
        except (OSError, ValueError):  # killed under us (a client that left), or died: as an overrun
            return None


def _frame(document: dict) -> bytes:
    data = json.dumps(document, ensure_ascii=True).encode("ascii")
    return _LENGTH.pack(len(data)) + data


def _read_frame(stream, deadline: float) -> dict | None:
    """One frame from `stream` by `deadline` (None: too late, or the stream ended)."""
    fd = stream.fileno()
    buf = bytearray()
    need = _LENGTH.size
    header = True
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            while len(buf) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, min(need - len(buf), 1 << 20))
                if not chunk:
                    return None
                buf += chunk
            if not header:
                return json.loads(bytes(buf[_LENGTH.size:]))
            size = _LENGTH.unpack(bytes(buf[:_LENGTH.size]))[0]
            if size > MAX_FRAME:
                return None
            need, header = _LENGTH.size + size, False


# ---------------------------------------------------------------------------------------------------------
# The worker process


def _serve_renders() -> None:
    import resource

    from shardtool.serve._chat import ChatTemplate

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    os.nice(10)  # a render that spins until its deadline takes CPU time from the engine's steps last
    _die_with_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def read() -> dict | None:
        head = stdin.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return None  # the server is gone
        return json.loads(stdin.read(_LENGTH.unpack(head)[0]))

    def write(document: dict) -> None:
        stdout.write(_frame(document))
        stdout.flush()

    init = read()
    if init is None:
        return
    template = ChatTemplate(init["source"], init["special_tokens"], where=init["where"])
    write({"ready": True})
    while (request := read()) is not None:
        try:
            reply = {"text": template.render(request["messages"])}
        except ShardtoolError as e:
            reply = {"error": type(e).__name__, "message": e.message}
        except MemoryError:
            reply = {"error": "VerificationError", "message": f"the chat template in signed {template.where} "
                     f"exceeded its render limit ({WORKER_MEMORY >> 20} MiB of memory)"}
        write(reply)


def _die_with_parent() -> None:
    """Linux: SIGKILL when the server dies, even by SIGKILL (a spinning render reads no end of its stdin)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the server died before the line above
        sys.exit(0)


if __name__ == "__main__":
    _serve_renders()
