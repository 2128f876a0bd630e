"""The default model ID comes from the source checkpoint, never from the output directory: two releases of one
checkpoint split into differently named directories share one ID, so the rollback floor applies."""

from __future__ import annotations

import json

import pytest

from examples.make_tiny_moe import make_checkpoint


def make_mixtral(out):
    return make_checkpoint(out, "mixtral", seed=0, layers=2, experts=2, experts_per_tok=2, hidden=32,
                           moe_intermediate=16, intermediate=48, vocab=300, heads=4, kv_heads=2)


def test_releases_split_into_differently_named_directories_share_the_rollback_floor(cli, tmp_path):
    src = make_mixtral(tmp_path / "acme-tiny")
    cli.ok("keygen", "--out", tmp_path / "k", "--no-passphrase")
    for version in (1, 2):
        cli.ok("split", src, tmp_path / f"out-v{version}", "--version", version, "-q")
        cli.ok("sign", tmp_path / f"out-v{version}", "--key", tmp_path / "k.key")
    state = ["--state-dir", tmp_path / "state", "--trust", tmp_path / "k.pub", "-q"]
    newer = cli("audit", tmp_path / "out-v2", *state, "--json")
    assert newer.code == 0, newer.err
    assert json.loads(newer.out)["head"]["model_id"] == "acme-tiny"
    assert "warning: no --model-id given" in newer.err  # the operator is told to pin the model
    older = cli("audit", tmp_path / "out-v1", *state)
    assert older.code == 1 and "RollbackError" in older.err, older.err
    pinned = cli("audit", tmp_path / "out-v2", *state, "--model-id", "acme-tiny")
    assert pinned.code == 0 and "warning" not in pinned.err


def test_name_or_path_in_config_wins(cli, tmp_path):
    src = make_mixtral(tmp_path / "ckpt")
    config = json.loads((src / "config.json").read_text())
    config["_name_or_path"] = "acme/Tiny-MoE-8x1M"
    (src / "config.json").write_text(json.dumps(config))
    r = cli.ok("split", src, tmp_path / "out", "--json", "-q")
    assert json.loads(r.out)["model_id"] == "acme/Tiny-MoE-8x1M"


# name: (files in DIR, DIR below tmp_path, the model ID `manifest DIR` records)
MANIFEST_CASES = {
    "name-or-path-in-config": ({"config.json": '{"_name_or_path": "acme/Tiny-MoE"}'}, "out-v2", "acme/Tiny-MoE"),
    "config-without-a-name": ({"config.json": '{"model_type": "mixtral"}'}, "out-v2", "out-v2"),
    "no-config": ({"weights.bin": "w"}, "out-v2", "out-v2"),
    "unusable-name-falls-back": ({"config.json": '{"_name_or_path": "/home/me/ckpt"}'}, "out-v2", "out-v2"),
    "hugging-face-cache-snapshot": ({"config.json": "{}"}, "hub/models--acme--moe/snapshots/0123abcd", "acme/moe"),
}


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_manifest_dir_takes_the_model_id_as_split_does(cli, tmp_path, case):
    files, where, expected = MANIFEST_CASES[case]
    directory = tmp_path / where
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    r = cli.ok("manifest", directory, "--json")
    assert json.loads(r.out)["model_id"] == expected
    pinned = cli.ok("manifest", directory, "--model-id", "acme/pinned", "--json")
    assert json.loads(pinned.out)["model_id"] == "acme/pinned"


BAD_CONFIGS = {
    "not-json": "{",
    "not-an-object": '["acme/x"]',
    "duplicate-key": '{"_name_or_path": "acme/a", "_name_or_path": "acme/b"}',
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_manifest_dir_with_a_malformed_config_is_refused_in_one_line(cli, tmp_path, case):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(BAD_CONFIGS[case])
    r = cli("manifest", directory)
    assert r.code == 2 and "CheckpointFormatError" in r.err and "config.json" in r.err, r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    assert not (directory / "manifest.msgpack").exists()
    assert cli.ok("manifest", directory, "--model-id", "acme/x")  # a pinned ID never reads config.json
