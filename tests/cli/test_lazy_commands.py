"""A command imports only what it needs: `shardtool audit` loads its own command module, not every other
command's, nor cryptography's PEM and cipher code (the signatures it checks need only Ed25519). The table of
commands that makes this possible must name every command the whole app has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import typer

from shardtool.cli import COMMANDS, build_app


def _names(app: typer.Typer) -> list[str]:
    return [c.name for c in app.registered_commands]


def test_every_command_is_in_the_table_with_the_module_that_registers_it():
    from shardtool.cli import app

    assert sorted(_names(app)) == sorted(COMMANDS)
    for name, module in COMMANDS.items():
        assert name in _names(build_app((module,))), f"{name} is not registered by {module}"


def test_audit_loads_neither_other_commands_nor_pem_code(cli, tmp_path: Path, make_model):
    model = tmp_path / "model"
    make_model(model)
    cli.ok("keygen", "--out", tmp_path / "k", "--no-passphrase")
    cli.ok("manifest", model)
    cli.ok("sign", model, "--key", tmp_path / "k.key")
    code = ("import json, sys\nfrom shardtool.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(json.dumps({'code': code, 'modules': sorted(sys.modules)}))")
    proc = subprocess.run([sys.executable, "-c", code, "audit", str(model), "--trust", str(tmp_path / "k.pub"), "-q",
                           "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, env=cli.env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["code"] == 0
    loaded = set(report["modules"])
    assert "shardtool.cli.manifest_cmd" in loaded and "shardtool.manifest.audit" in loaded
    others = {f"shardtool.cli.{m}" for m in COMMANDS.values()} - {"shardtool.cli.manifest_cmd"}
    assert not loaded & others
    assert not loaded & {"cryptography.hazmat.primitives.serialization", "shardtool.keys._pkcs8",
                         "shardtool.manifest._receipt", "rich"}
