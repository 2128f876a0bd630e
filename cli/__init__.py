"""The `shardtool` command: one module per command group, joined here.

Human text goes to stderr, `--json` prints one document on stdout. Only our own error base class is
caught at the top; a programming bug stays a traceback rather than a fake "verification failed".
"""

from __future__ import annotations

import typer

from shardtool.cli import _common
from shardtool.cli import (keys_cmd, manifest_cmd, checkpoint_cmd, node_cmd, plan_cmd, receipt_cmd, remote_cmd,
                           serve_cmd)

app = typer.Typer(
    name="shardtool",
    help="Signed weight supply chain for Mixture-of-Experts models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
keys_cmd.register(app)
manifest_cmd.register(app)
checkpoint_cmd.register(app)
serve_cmd.register(app)
receipt_cmd.register(app)
plan_cmd.register(app)
node_cmd.register(app)
remote_cmd.register(app)


def main(args: list[str] | None = None) -> None:
    """`args`: the command line without the program name (default: sys.argv[1:])."""
    _common.run_app(app, args)
