"""A progress bar on stderr (bytes, files when counted, rate, ETA); silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    def __init__(self, total: int, label: str, *, enabled: bool = True, files: int | None = None):
        self.total, self.label = max(total, 1), label
        self.files_total, self.files_done = files, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.done = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last = 0.0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._draw(final=True)
            sys.stderr.write("\n")

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and now - self._last > 0.1:
                self._last = now
                self._draw()

    def file_done(self, size: int, counted: int) -> None:
        """One file finished: `counted` of its `size` bytes went through `advance`; the rest (kept, resumed) are
        added now."""
        with self._lock:
            self.files_done += 1
        self.advance(size - counted)

    def _draw(self, final: bool = False) -> None:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        files = f" {self.files_done}/{self.files_total} files" if self.files_total is not None else ""
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {self.done / 1e9:7.2f} GB{files} "
                         f"{rate / 1e9:6.2f} GB/s ETA {0 if final else eta:5.0f}s")
        sys.stderr.flush()
