"""`verify-and-run`: the verifying MoE runtime (placeholder until its issue lands)."""

from __future__ import annotations

import sys

from shardtool.errors import EXIT_USAGE


def main() -> None:
    print("verify-and-run: not built yet", file=sys.stderr)
    sys.exit(EXIT_USAGE)
