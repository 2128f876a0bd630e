"""Shared CLI plumbing: error-to-exit-code mapping, stderr messages, JSON output."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from shardtool.errors import EXIT_IO, ShardtoolError


def say(message: str) -> None:
    """Human text goes to stderr so stdout stays clean for --json."""
    print(message, file=sys.stderr, flush=True)


def emit_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


def run_app(app: typer.Typer) -> None:
    """Run a typer app. Usage errors are typer's (exit 2); our errors become one line and their exit code.

    Only ShardtoolError is caught: a programming bug stays a traceback, never a fake verdict.
    """
    command = typer.main.get_command(app)
    try:
        command.main(prog_name=app.info.name)
    except ShardtoolError as err:
        say(f"{app.info.name}: error: {err.one_line()} [{type(err).__name__}]")
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        say(f"{app.info.name}: interrupted")
        sys.exit(EXIT_IO)
