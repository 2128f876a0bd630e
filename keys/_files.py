"""Reading key material from disk: private keys, public keys and passphrase files all come through here.

The open rule is the tool's one safe-open (`shardtool.safeio`: non-blocking, regular files only, size cap
before reading); added here is one permission rule for secrets, checked on that same descriptor (no
stat-then-open race): a file group or others can access is refused, as ssh does.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shardtool.safeio import read_regular
from shardtool.errors import KeyFileError, MissingFileError, NotARegularFileError, UnreadableFileError

MAX_KEY_FILE = 64 * 1024
MAX_PASSPHRASE_FILE = 4096

def check_owner_only(mode: int, path: Path | str, what: str) -> None:
    """Refuse a secret whose file group or others can access: it is only as secret as its file."""
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{what} has mode {stat.S_IMODE(mode):04o}; group or others have access to it, "
                           "expected owner-only (0600 or 0400)", path=str(path), hint=f"run: chmod 600 {path}")


def read_key_file(path: Path | str, what: str, *, secret: bool, cap: int = MAX_KEY_FILE) -> bytes:
    """The bytes of a small regular file (at most `cap`), through the one safe-open; with `secret`, only if
    its owner alone has access (checked on the opened descriptor). A key is the operator's own input:
    every refusal is a KeyFileError (exit 2)."""
    def owner_only(st: os.stat_result) -> None:
        if secret:
            check_owner_only(st.st_mode, path, what)

    try:
        return read_regular(path, cap, what=what, too_large=KeyFileError, check=owner_only)
    except MissingFileError:
        raise KeyFileError(f"{what} not found", path=str(path)) from None
    except (NotARegularFileError, UnreadableFileError) as e:
        raise KeyFileError(f"{what} {e.message}", path=str(path)) from None
