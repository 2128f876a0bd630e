"""A process that holds a secret (a decrypted private key) keeps its memory to itself: not dumpable, so no other
process of the same user can ptrace it or read /proc/PID/mem, and it leaves no core dump (prctl(2),
PR_SET_DUMPABLE). Root, with CAP_SYS_PTRACE, still can: that is the kernel's rule, not ours. Its secrets are not
handed to the helper processes it starts either (`child_environment`)."""

from __future__ import annotations

import ctypes
import os
import sys

PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def keep_memory_private() -> None:
    """PR_SET_DUMPABLE 0 for this process (Linux; elsewhere a no-op). It stays so for the process's life."""
    if sys.platform.startswith("linux") and _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def memory_private() -> bool:
    """Whether this process is not dumpable (`keep_memory_private` took effect)."""
    return sys.platform.startswith("linux") and _libc().prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0


def child_environment() -> dict[str, str]:
    """The environment to start a helper process with (a chat-template renderer, the cluster proxy): this one's, less
    shardtool's own secrets (SHARDTOOL_PASSPHRASE, SHARDTOOL_API_KEY), which no child needs."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SHARDTOOL_")}
