"""Where a passphrase comes from: --passphrase-file, then SHARDTOOL_PASSPHRASE, then a terminal prompt."""

from __future__ import annotations

import getpass
import os
import sys
from pathlib import Path

from shardtool.errors import KeyFileError, StorageError, UsageError

ENV_VAR = "SHARDTOOL_PASSPHRASE"


def get_passphrase(passphrase_file: Path | None, *, confirm: bool) -> bytes:
    if passphrase_file is not None:
        try:
            data = Path(passphrase_file).read_bytes()[:4096]
        except FileNotFoundError:
            raise UsageError("passphrase file not found", path=str(passphrase_file)) from None
        except OSError as e:
            raise StorageError(f"cannot read passphrase file: {e.strerror}", path=str(passphrase_file)) from e
        secret = data.split(b"\n", 1)[0].rstrip(b"\r")
    elif os.environ.get(ENV_VAR):
        secret = os.environ[ENV_VAR].encode("utf-8")
    elif sys.stdin.isatty():
        secret = getpass.getpass("Passphrase: ").encode("utf-8")
        if confirm and getpass.getpass("Passphrase (again): ").encode("utf-8") != secret:
            raise UsageError("the two passphrases differ")
    else:
        raise UsageError("a passphrase is needed and there is no terminal to ask on",
                         hint=f"use --passphrase-file or {ENV_VAR}, or --no-passphrase for keygen")
    if not secret:
        raise KeyFileError("empty passphrase", hint="use --no-passphrase to write an unencrypted key deliberately")
    return secret
