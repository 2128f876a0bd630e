"""Reading key material from disk: private keys, public keys and passphrase files all come through here.

One open rule for every such file: non-blocking (a FIFO named as a key cannot hang us in open()), regular files
only (checked on the opened descriptor), a size cap; and one permission rule for secrets, checked on that same
descriptor (no stat-then-open race): a file group or others can access is refused, as ssh does.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from shardtool.errors import KeyFileError, StorageError

MAX_KEY_FILE = 64 * 1024
MAX_PASSPHRASE_FILE = 4096

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(mode: int, path: Path | str, what: str) -> KeyFileError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return KeyFileError(f"{what} is {kind}, expected a regular file", path=str(path))


def check_owner_only(mode: int, path: Path | str, what: str) -> None:
    """Refuse a secret whose file group or others can access: it is only as secret as its file."""
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{what} has mode {stat.S_IMODE(mode):04o}; group or others have access to it, "
                           "expected owner-only (0600 or 0400)", path=str(path), hint=f"run: chmod 600 {path}")


def read_key_file(path: Path | str, what: str, *, secret: bool, cap: int = MAX_KEY_FILE) -> bytes:
    """The bytes of a small regular file (at most `cap`); with `secret`, only if its owner alone has access."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyFileError(f"{what} not found", path=str(path)) from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket (or a device with no driver) cannot be opened at all
            try:
                mode = os.stat(path).st_mode
            except OSError:
                mode = 0
            raise _not_regular(mode, path, what) from None
        raise StorageError(f"cannot read {what}: {e.strerror}", path=str(path)) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode, path, what)
        if secret:
            check_owner_only(st.st_mode, path, what)
        if st.st_size > cap:
            raise KeyFileError(f"{what} is {st.st_size} bytes, expected at most {cap}", path=str(path))
        # O_NONBLOCK does not affect reads of a regular file. Read one byte past the cap: a file that grew
        # after fstat is refused too, never silently cut.
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(cap + 1)
    except OSError as e:
        raise StorageError(f"cannot read {what}: {e.strerror}", path=str(path)) from e
    finally:
        os.close(fd)
    if len(data) > cap:
        raise KeyFileError(f"{what} is larger than {cap} bytes", path=str(path))
    return data
