"""Exact --memory-budget figures for tests that need the shard cache to hold only a few shards."""

from __future__ import annotations

import json
from pathlib import Path


def budget_for_top_k_plus(model: Path, pub: Path, tokens: int, extra: int) -> int:
    """A --memory-budget whose shard cache holds top-k + `extra` of the model's largest expert or trunk shard (the
    plan's KV cache and working memory for a run of `tokens` tokens, prompt and new, besides)."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_verified_manifest
    from shardtool.runtime.model import ModelConfig
    from shardtool.runtime.engine._plan import plan_budget

    verified = load_verified_manifest(model / "manifest.msgpack", [load_public_key(pub)], 1)
    cfg = ModelConfig.from_hf_config(json.loads((model / "config.json").read_text()))
    plan = plan_budget(1 << 30, cfg, verified, tokens, 2)
    largest = max(e.size for e in verified.entries if e.kind in ("expert", "trunk"))
    return plan.kv_cache + plan.working + (cfg.top_k + extra) * largest
