"""What a new user meets first, through the installed commands: `--version`, `shardtool` alone, every command's
`--help`, and `verify-and-run` spelled both as its own program and as a `shardtool` subcommand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardtool.cli import COMMANDS

MODEL_KNOBS = dict(layers=2, experts=2, experts_per_tok=2, hidden=32, moe_intermediate=16, intermediate=48,
                   heads=4, kv_heads=2, vocab=300)


def test_version_prints_the_installed_package_version(cli):
    from importlib.metadata import version

    r = cli("--version")
    assert (r.code, r.out, r.err) == (0, f"shardtool {version('shardtool')}\n", "")
    assert r.out == "shardtool 0.1.0\n"


def test_no_arguments_prints_the_help_and_exits_0(cli):
    r = cli()
    assert r.code == 0, r.err
    assert "Usage: shardtool" in r.out and "verify-and-run" in r.out
    assert "usage error" not in r.err and "()" not in r.err


def test_help_lists_verify_and_run_and_the_version_option(cli):
    r = cli.ok("--help")
    assert re.search(r"^\W*verify-and-run\s", r.out, re.MULTILINE), r.out
    assert "--version" in r.out


_PLACEHOLDER = re.compile(r"<[a-z][\w\[\], ]*>")


def _flags(argv: list[str]) -> set[str]:
    """The value-less options of the command `argv` names (the top level for []), --help included."""
    import typer

    from shardtool.cli import app

    command = typer.main.get_group(app)
    ctx = command.make_context("shardtool", ["--help"] if not argv else [*argv, "--help"], resilient_parsing=True)
    if argv:
        command = command.get_command(ctx, argv[0])
        ctx = command.make_context(argv[0], [], parent=ctx, resilient_parsing=True)
    found = {"--help"}
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False):
            found.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
    return found


@pytest.mark.parametrize("argv", [[], *([c] for c in sorted(COMMANDS))], ids=lambda a: " ".join(a) or "shardtool")
def test_help_shows_no_type_placeholder_beside_a_flag(cli, argv):
    r = cli.ok(*argv, "--help")
    assert "<bool>" not in r.out, r.out
    flags = _flags(argv)
    rows = [line for line in r.out.splitlines()
            if any(re.search(rf"(^|[\s,]){re.escape(f)}(\s|,|$)", line) for f in flags)]
    assert len(rows) >= len(flags) // 2 and any("--help" in row for row in rows), r.out
    for row in rows:
        assert not _PLACEHOLDER.search(row), row
    assert _PLACEHOLDER.search(r.out) or not argv or argv == ["keygen"], "the value options keep their type"


def test_verify_and_run_help_lists_the_same_options_in_both_spellings(cli):
    def options(text: str) -> list[str]:
        return sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)))

    alone = cli.ok("--help", program="verify-and-run")
    sub = cli.ok("verify-and-run", "--help")
    assert options(alone.out) == options(sub.out)
    assert "--prompt-ids" in options(sub.out)


def test_verify_and_run_subcommand_generates_like_the_program(cli, tmp_path: Path):
    from examples import make_tiny_moe  # the repository root is on pytest's pythonpath

    ckpt = make_tiny_moe.make_checkpoint(tmp_path / "ckpt", "mixtral", seed=5, **MODEL_KNOBS)
    model = tmp_path / "model"
    cli.ok("split", ckpt, model, "--model-id", "acme/tiny", "-q")
    cli.ok("keygen", "--out", tmp_path / "k", "--no-passphrase")
    cli.ok("sign", model, "--key", tmp_path / "k.key")
    args = [model, "--trust", tmp_path / "k.pub", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--print-ids",
            "--model-id", "acme/tiny", "--memory-budget", "256MiB", "--state-dir", tmp_path / "state", "-q"]
    alone = cli.ok(*args, program="verify-and-run")
    sub = cli.ok("verify-and-run", *args)
    assert len(alone.out.split()) == 4
    assert (sub.out, sub.err) == (alone.out, alone.err)
    bad = [cli(*args[:1], "--prompt-ids", "x", program="verify-and-run"), cli("verify-and-run", *args[:1],
                                                                             "--prompt-ids", "x")]
    assert [b.code for b in bad] == [2, 2]
    assert bad[0].err.replace("verify-and-run: ", "shardtool: ", 1) == bad[1].err


@pytest.mark.parametrize("command, said", [
    ("keygen", ["SHARDTOOL_PASSPHRASE", "--passphrase-file", "asked twice", "12 characters"]),
    ("sign", ["SHARDTOOL_PASSPHRASE", "--passphrase-file", "terminal prompt", "--no-passphrase"]),
    ("audit", ["No progress bar", "still printed", "exit code"]),
])
def test_help_says_where_a_passphrase_comes_from_and_what_quiet_hides(cli, command, said):
    text = " ".join(cli.ok(command, "--help").out.replace("│", " ").split())
    for words in said:
        assert words in text, (words, text)


def test_docs_describe_keys_and_passphrases():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "manifest-format.md").read_text()
    section = doc[doc.index("### Keys and passphrases"):]
    for words in ("SHARDTOOL_PASSPHRASE", "--passphrase-file", "--receipt-passphrase-file", "audit --quiet",
                  "`sign` reads the key"):
        assert words in section, words
