"""Shared CLI plumbing: error-to-exit-code mapping, stderr messages, JSON output."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import click
import typer

from shardtool.errors import EXIT_USAGE, ShardtoolError


def say(message: str) -> None:
    """Human text goes to stderr so stdout stays clean for --json."""
    print(message, file=sys.stderr, flush=True)


def emit_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


def fail(err: ShardtoolError) -> "typer.Exit":
    kind = type(err).__name__
    say(f"shardtool: error: {err.one_line()} [{kind}]")
    return typer.Exit(err.exit_code)


def run_app(app: typer.Typer | Callable[..., Any]) -> None:
    """Run a typer app; our errors become one line and an exit code, click usage errors exit 2."""
    command = typer.main.get_command(app) if isinstance(app, typer.Typer) else app
    try:
        rv = command.main(standalone_mode=False, prog_name=None)
    except ShardtoolError as err:
        say(f"shardtool: error: {err.one_line()} [{type(err).__name__}]")
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        say("shardtool: aborted")
        sys.exit(EXIT_USAGE)
    except click.exceptions.Exit as ex:
        sys.exit(ex.exit_code)
    except click.ClickException as ex:
        ex.show()
        sys.exit(EXIT_USAGE)
    sys.exit(rv if isinstance(rv, int) else 0)
