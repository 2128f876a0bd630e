"""A progress bar on stderr (bytes, files when counted, rate, ETA); silent when stderr is not a terminal.

The rate counts only bytes that moved through `advance` (read, hashed, copied), not files found already in
place, and there is no ETA until a second of such work gives something to estimate from.
"""

from __future__ import annotations

import sys
import threading
import time

from shardtool.text import format_rate, format_size

MIN_ESTIMATE_SECONDS = 1.0  # of work before an ETA is shown: a first block's rate says nothing about the rest


class Progress:
    def __init__(self, total: int, label: str, *, enabled: bool = True, files: int | None = None):
        self.total, self.label = max(total, 1), label
        self.files_total, self.files_done = files, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.done = 0
        self.moved = 0  # of `done`, the bytes that went through `advance`
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last = 0.0
        self._width = 0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._draw(final=True)
            sys.stderr.write("\n")

    def advance(self, n: int) -> None:
        self._add(n, moved=True)

    def file_done(self, size: int, counted: int) -> None:
        """One file finished: `counted` of its `size` bytes went through `advance`; the rest (kept, resumed) are
        added now."""
        with self._lock:
            self.files_done += 1
        self._add(size - counted, moved=False)

    def _add(self, n: int, *, moved: bool) -> None:
        with self._lock:
            self.done += n
            if moved:
                self.moved += n
            now = time.monotonic()
            if self.enabled and now - self._last > 0.1:
                self._last = now
                self._draw()

    def _draw(self, final: bool = False) -> None:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self.moved / elapsed
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        files = f" {self.files_done}/{self.files_total} files" if self.files_total is not None else ""
        if final:
            when = f" in {elapsed:.1f}s"
        elif self.moved > 0 and elapsed >= MIN_ESTIMATE_SECONDS and self.done < self.total:
            when = f" ETA {(self.total - self.done) / rate:.0f}s"
        else:
            when = ""
        line = f"{self.label} [{bar:<30}] {frac:6.1%} {format_size(self.done):>11}{files} {format_rate(rate):>13}{when}"
        # A shorter line than the last one (the ETA gone) must not leave the old tail behind.
        sys.stderr.write("\r" + line.ljust(self._width))
        self._width = max(self._width, len(line))
        sys.stderr.flush()
