"""Kill a CLI process at a chosen moment, and the checks that follow a crash.

Moments are chosen without ptrace or LD_PRELOAD: by elapsed time, or by polling the file system until the
process has produced k new files (temp files included) or a given name appears, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

from _kit import cli
from _kit.cli import Result


def run(program: str, *args, cwd: Path, timeout: int = 120) -> Result:
    """The shared runner, XDG state in `cwd/xdg`."""
    return cli.run(program, *args, cwd=cwd, timeout=timeout)


def kill_when(argv: list, trigger: Callable[[], bool], *, cwd: Path, timeout: float = 60) -> bool:
    """Start `shardtool ...`/`verify-and-run ...`; SIGKILL it as soon as trigger() is true.

    Returns True when the process was killed, False when it finished first (its exit code must then be 0).
    """
    proc = subprocess.Popen(cli.argv(*argv), cwd=cwd, env=cli.user_env(cwd / "xdg"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if trigger():
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
            if time.monotonic() > deadline:
                raise AssertionError(f"{argv} did not finish in {timeout} s")
            time.sleep(0.0003)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
    assert proc.returncode == 0, f"{argv} failed on its own (exit {proc.returncode}):\n{err}"
    return False


def after(seconds: float) -> Callable[[], bool]:
    start = time.monotonic()
    return lambda: time.monotonic() - start >= seconds


def files_under(root: Path) -> Iterator[os.DirEntry]:
    stack = [str(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for d in it:
                    if d.is_dir(follow_symlinks=False):
                        stack.append(d.path)
                    else:
                        yield d
        except FileNotFoundError:
            continue


def new_files(root: Path, k: int) -> Callable[[], bool]:
    """True once at least k files under `root` were created or modified after this call."""
    since = time.time_ns()

    def trigger() -> bool:
        n = 0
        for d in files_under(root):
            try:
                if d.stat(follow_symlinks=False).st_mtime_ns >= since:
                    n += 1
            except FileNotFoundError:
                continue
        return n >= k
    return trigger


def appears(directory: Path, prefix: str) -> Callable[[], bool]:
    """True once a name starting with `prefix` exists in `directory` (a temp file being written, say)."""
    def trigger() -> bool:
        try:
            return any(name.startswith(prefix) for name in os.listdir(directory))
        except FileNotFoundError:
            return False
    return trigger


def replaced(path: Path) -> Callable[[], bool]:
    """True once `path` names another file than when this was called (created, or renamed over)."""
    def ino() -> int | None:
        try:
            return os.stat(path).st_ino
        except FileNotFoundError:
            return None
    before = ino()
    return lambda: ino() not in (before, None)


def is_temp(name: str) -> bool:
    """The atomic writers' temp names: hidden, `.{final name}.XXXXXXXX.tmp`."""
    return name.startswith(".") and name.endswith(".tmp")


def make_checkpoint(out: Path, **knobs) -> Path:
    from examples import make_tiny_moe  # the repository root is on pytest's pythonpath
    return make_tiny_moe.make_checkpoint(out, "mixtral", **knobs)
