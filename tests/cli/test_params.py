"""Option values of the plain types are converted by cli/_params.py (no pydantic at start-up): the same
verdicts as typer's conversion for good and bad values, through the real command."""

from __future__ import annotations

import subprocess
import sys


def test_plain_option_values_are_checked(cli, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    for value, said in (("0", "below the minimum 1"), ("65", "above the maximum 64"), ("x1", "not a valid int"),
                        ("1.5", "not a valid int")):
        r = cli("audit", model, "--trust", tmp_path / "k.pub", "--workers", value)
        assert r.code == 2, r.err
        assert "--workers" in r.err and said in r.err and "Traceback" not in r.err


def test_start_up_does_not_import_pydantic(tmp_path):
    """The reason for cli/_params.py: an audit converts its options without importing pydantic."""
    code = ("import sys\nfrom shardtool.cli import main\n"
            "try:\n    main(['audit', sys.argv[1], '--trust', sys.argv[2], '--workers', '2', '--quiet'])\n"
            "except SystemExit:\n    pass\n"
            "print('pydantic' in sys.modules)")
    model = tmp_path / "m"
    model.mkdir()
    (tmp_path / "k.pub").write_text("not a key")
    out = subprocess.run([sys.executable, "-c", code, str(model), str(tmp_path / "k.pub")], capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    assert "error" in out.stderr  # the command ran as far as reading the key: the options were converted
