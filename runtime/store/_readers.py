"""The shard store's reader threads: loads the forward pass is waiting for go before guesses.

A FIFO pool (ThreadPoolExecutor) runs a load in the order it was asked for, so a lookahead's wrong guesses, queued
first, delay the shard the forward pass then blocks on. Here a load is submitted as a demand or a prefetch; a reader
always takes the oldest demand first, a queued prefetch that the forward pass then asks for is promoted to a demand,
and queued prefetches that a newer guess made stale can be withdrawn before any reader spent time on them.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable


class ReaderPool:
    """`threads` daemon reader threads running `fn(arg)` for each submitted load, demands before prefetches."""

    def __init__(self, threads: int, name: str):
        self._cv = threading.Condition()
        self._demand: deque[tuple[Future, Callable[[Any], Any], Any]] = deque()
        self._prefetch: deque[tuple[Future, Callable[[Any], Any], Any]] = deque()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[Any], Any], arg: Any, *, prefetch: bool = False) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the shard store is closed")
            (self._prefetch if prefetch else self._demand).append((fut, fn, arg))
            self._cv.notify()
        return fut

    def promote(self, fut: Future) -> None:
        """A queued prefetch the forward pass now waits for: moved behind the demands already queued."""
        with self._cv:
            for i, item in enumerate(self._prefetch):
                if item[0] is fut:
                    del self._prefetch[i]
                    self._demand.append(item)
                    return

    def withdraw_prefetches(self, keep: Callable[[Any], bool]) -> list[Any]:
        """Remove the queued (not started) prefetches whose `arg` fails `keep`; returns their args. Their futures
        are cancelled: whoever withdraws them must forget them."""
        dropped = []
        with self._cv:
            kept: deque = deque()
            for fut, fn, arg in self._prefetch:
                if keep(arg):
                    kept.append((fut, fn, arg))
                else:
                    fut.cancel()
                    dropped.append(arg)
            self._prefetch = kept
        return dropped

    def shutdown(self) -> None:
        """Cancel what is queued, let running loads finish, and end the threads."""
        with self._cv:
            self._closed = True
            for fut, _, _ in (*self._demand, *self._prefetch):
                fut.cancel()
            self._demand.clear()
            self._prefetch.clear()
            self._cv.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._demand or self._prefetch or self._closed):
                    self._cv.wait()
                if self._closed:
                    return
                fut, fn, arg = (self._demand or self._prefetch).popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(arg)
            except BaseException as e:  # handed to whoever waits on the load
                fut.set_exception(e)
            else:
                fut.set_result(result)
