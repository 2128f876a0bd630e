"""Where a passphrase comes from: --passphrase-file, then SHARDTOOL_PASSPHRASE, then a terminal prompt.

Every source goes through the same rules: the file is read like a private key (owner-only, regular, capped),
and a passphrase for a new key must pass `keys.check_new_passphrase` whichever source it came from.
"""

from __future__ import annotations

import getpass
import os
import sys
from pathlib import Path

from shardtool.errors import KeyFileError, UsageError

ENV_VAR = "SHARDTOOL_PASSPHRASE"
# The --help of every option that names a passphrase file: where else the passphrase comes from.
FILE_HELP = (f"File whose first line is the passphrase; it must be readable by its owner only. Without it: the "
             f"{ENV_VAR} environment variable, else a prompt on the terminal (no terminal: an error).")


def get_passphrase(passphrase_file: Path | None, *, new_key: bool, option: str = "--passphrase-file") -> bytes:
    """The passphrase; for a `new_key` it is asked twice at a terminal and must meet the minimum length.

    `option` is the command's own name for the passphrase file, for the hint."""
    from shardtool.keys import MAX_PASSPHRASE_FILE, check_new_passphrase, read_key_file

    if passphrase_file is not None:
        source = str(passphrase_file)
        data = read_key_file(passphrase_file, "passphrase file", secret=True, cap=MAX_PASSPHRASE_FILE)
        secret = data.split(b"\n", 1)[0].rstrip(b"\r")
    elif os.environ.get(ENV_VAR):
        source = ENV_VAR
        secret = os.environ[ENV_VAR].encode("utf-8")
    elif sys.stdin.isatty():
        source = "terminal prompt"
        secret = getpass.getpass("Passphrase: ").encode("utf-8")
        if new_key and getpass.getpass("Passphrase (again): ").encode("utf-8") != secret:
            raise UsageError("the two passphrases differ")
    else:
        raise UsageError("a passphrase is needed and there is no terminal to ask on",
                         hint=f"use {option} or {ENV_VAR}" + (", or --no-passphrase for keygen" if new_key else ""))
    if not secret:
        raise KeyFileError("empty passphrase", path=source,
                           hint="use --no-passphrase to write an unencrypted key deliberately")
    if new_key:
        check_new_passphrase(secret, source=source)
    return secret
