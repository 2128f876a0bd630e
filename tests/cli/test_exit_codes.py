"""A bug is never a verdict: an unexpected exception inside a command prints its traceback and exits with the
documented crash code (70), never 1 (untrustworthy), 2 (usage) or 3 (I/O)."""

from __future__ import annotations

import contextlib
import io

import pytest

from shardtool.errors import EXIT_CRASH


def _invoke(args: list[str]) -> tuple[int, str]:
    from shardtool.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    return info.value.code, err.getvalue()


@pytest.mark.parametrize("where", ["shardtool.manifest._io.verify_manifest", "shardtool.manifest.audit.walk"])
def test_injected_crash_in_a_trust_function_exits_with_the_crash_code(where, make_model, tmp_path, monkeypatch):
    from shardtool import keys
    from shardtool.manifest import build_manifest, hash_directory, save_manifest

    model = make_model(tmp_path / "m")
    key = keys.generate()
    keys.write_keypair(tmp_path / "k", key, None, force=False)
    manifest = build_manifest(hash_directory(model), model_id="t/m")
    save_manifest(model / "manifest.msgpack", manifest.with_envelope(manifest.envelope.signed_by(key)))
    args = ["audit", model, "--trust", tmp_path / "k.pub", "--state-dir", tmp_path / "s", "-q"]
    assert _invoke(args)[0] == 0  # the control: the same command passes untouched

    def boom(*a, **k):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(where, boom)
    code, err = _invoke(args)
    assert code == EXIT_CRASH == 70
    assert "Traceback" in err and "RuntimeError: injected bug" in err
    assert "internal error" in err and "not a verdict" in err
