"""The `shardtool` command: one module per command group, joined here.

Human text goes to stderr, `--json` prints one document on stdout. Only our own error base class is
caught at the top; a programming bug stays a traceback rather than a fake "verification failed".

A run imports only the module of the command it names: `shardtool audit ...` never loads the serve,
receipt or remote commands (each costs imports and typer's work on its signature at every start). With no
command, an unknown one or a top-level option (`--help`), every command is registered, so the help lists
them all and click answers an unknown name as before. `app` is that whole app. With no arguments at all the
help is printed (exit 0).

`verify-and-run` is also a program of its own (the `verify-and-run` script runs `run_cmd`'s app); here the
same command function is registered as a subcommand, so both spellings take the same options.
"""

from __future__ import annotations

import importlib
from typing import Any

# command -> the module that registers it, in the order `--help` lists the commands.
_MODULES = ("keys_cmd", "manifest_cmd", "checkpoint_cmd", "run_cmd", "serve_cmd", "receipt_cmd", "plan_cmd", "node_cmd",
            "remote_cmd")
COMMANDS = {
    "keygen": "keys_cmd",
    "manifest": "manifest_cmd", "sign": "manifest_cmd", "audit": "manifest_cmd", "prove": "manifest_cmd",
    "verify-shard": "manifest_cmd", "export-oms": "manifest_cmd",
    "split": "checkpoint_cmd", "join": "checkpoint_cmd", "inspect": "checkpoint_cmd",
    "verify-and-run": "run_cmd",
    "serve": "serve_cmd",
    "verify-receipt": "receipt_cmd",
    "plan": "plan_cmd",
    "node": "node_cmd",
    "pull": "remote_cmd", "push": "remote_cmd",
}


# Modules that are a program of their own (a typer app of one command) rather than a `register(app)`:
# module -> (subcommand name, the command function).
_PROGRAMS = {"run_cmd": ("verify-and-run", "verify_and_run")}


def _print_version(value: bool) -> None:
    if value:
        import typer
        from importlib.metadata import version

        print(f"shardtool {version('shardtool')}")
        raise typer.Exit(0)


def build_app(modules: tuple[str, ...] = _MODULES) -> Any:
    """A typer app with the commands of `modules` registered (all of them by default)."""
    import typer

    app = typer.Typer(
        name="shardtool",
        help="Signed weight supply chain for Mixture-of-Experts models.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                              help="Print shardtool's version and exit.")) -> None:
        pass

    for name in modules:
        module = importlib.import_module(f"shardtool.cli.{name}")
        if name in _PROGRAMS:
            command, function = _PROGRAMS[name]
            app.command(command)(getattr(module, function))
        else:
            module.register(app)
    return app


_whole_app: Any = None


def __getattr__(name: str) -> Any:
    if name == "app":  # the whole app, built at first use (tests drive it with typer's CliRunner)
        global _whole_app
        if _whole_app is None:
            _whole_app = build_app()
        return _whole_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(args: list[str] | None = None) -> None:
    """`args`: the command line without the program name (default: sys.argv[1:])."""
    import sys

    from shardtool.cli import _common

    argv = list(sys.argv[1:] if args is None else args) or ["--help"]
    module = COMMANDS.get(argv[0]) if argv else None
    _common.run_app(build_app((module,)) if module is not None else __getattr__("app"), argv,
                    group=True)
