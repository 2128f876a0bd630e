"""The default model ID comes from the source checkpoint, never from the output directory: two releases of one
checkpoint split into differently named directories share one ID, so the rollback floor applies."""

from __future__ import annotations

import json

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
