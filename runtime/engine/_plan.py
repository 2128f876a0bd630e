"""How the memory budget is split: KV cache, working buffers (reads in flight, one forward step's activations, the
one weight still expanded per use, the shard store's parsed headers), and what remains caches verified shards.
Weights are multiplied as they are stored (`model._packed`): the shard cache holds their stored bytes and nothing
else."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardtool.errors import UsageError
from shardtool.manifest import VerifiedManifest
from shardtool.runtime.model import ModelConfig, bytes_per_token, kernels, step_bytes, trunk_shapes
from shardtool.runtime.store import header_memo_bytes

# The least the budget keeps for one forward step's temporaries; more when the step's queries over the whole
# sequence need more (`step_bytes`). A step takes as many rows as fit (`step_rows`, `prefill_chunk`).
MIN_ACTIVATION_RESERVE = 32 * 1024 * 1024
MIB = 2**20


@dataclass(frozen=True)
class BudgetPlan:
    total: int
    kv_cache: int  # shared by every running sequence; each reserves prompt + max_new_tokens of it
    working: int  # reads in flight, weights expanded for one use, the store's parsed headers, plus `activations`
    activations: int
    headers: int  # of `working`: the shard store's parsed headers (`header_memo_bytes`), which the store is given
    shard_cache: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def plan_budget(budget: int, cfg: ModelConfig, manifest: VerifiedManifest, max_tokens: int, readers: int, *,
                max_batch: int = 1, kv_cache: int | None = None) -> BudgetPlan:
    """Split `budget` for up to `max_batch` sequences of at most `max_tokens` tokens (prompt + new) each.

    One sequence (verify-and-run) gets KV cache for exactly its tokens. A batch gets `kv_cache` bytes, by
    default half of what the working buffers and the smallest shard cache leave (at most what `max_batch`
    longest sequences could use). Activations are reserved for a decode step of the whole batch over the
    longest sequence. What remains caches shards and must hold top-k + 1 of the largest. A plan the budget
    cannot hold is refused here, before any token is computed, with the budget it would need.
    """
    experts = [e.size for e in manifest.entries if e.kind == "expert"]
    trunk = [e.size for e in manifest.entries if e.kind == "trunk"]
    largest_expert, largest_trunk = max(experts, default=0), max(trunk, default=0)
    k = max(cfg.top_k, 1)
    # In-flight reads hold raw bytes. Experts are loaded at most k ahead of the one computing
    # (`VerifiedWeights.window`), whatever the batch chose.
    f32 = expanded_bytes(cfg)
    inflight = readers * max(largest_expert, largest_trunk)
    activations = max(MIN_ACTIVATION_RESERVE, step_bytes(cfg, max_batch, max_tokens))
    headers = header_memo_bytes(len(manifest.entries))
    working = f32 + inflight + headers + activations
    need = max(largest_expert, largest_trunk) * (k + 1)
    one_sequence = bytes_per_token(cfg) * max_tokens
    if kv_cache is None:
        spare = budget - working - need
        kv_cache = one_sequence if max_batch == 1 else min(max(spare // 2, 0), one_sequence * max_batch)
    shard_cache = budget - kv_cache - working
    if shard_cache < need or kv_cache < bytes_per_token(cfg) * 2:
        wanted = max(kv_cache, one_sequence if max_batch == 1 else bytes_per_token(cfg) * 2)
        what = (f"{max_tokens} tokens (prompt + --max-new-tokens)" if max_batch == 1 else
                f"a batch of {max_batch} with a KV cache of {wanted / MIB:.1f} MiB")
        raise UsageError(f"memory budget {budget / MIB:.1f} MiB cannot run {what} of this model: KV cache "
                         f"{wanted / MIB:.1f} MiB + activations {activations / MIB:.1f} MiB + other working buffers "
                         f"{(f32 + inflight + headers) / MIB:.1f} MiB + shard cache {need / MIB:.1f} MiB "
                         f"(top-k + 1 shards) need {(wanted + working + need) / MIB:.1f} MiB",
                         hint=f"raise --memory-budget to at least {math.ceil((wanted + working + need) / MIB)}MiB, "
                              f"or shorten the prompt or --max-new-tokens" if max_batch == 1 else
                              f"raise --memory-budget to at least {math.ceil((wanted + working + need) / MIB)}MiB, "
                              f"or lower --max-batch, --max-context or --kv-cache")
    return BudgetPlan(budget, kv_cache, working, activations, headers, shard_cache)


def expanded_bytes(cfg: ModelConfig) -> int:
    """# bytes of float32 the forward pass makes of a weight for one use, at most (one at a time, freed after it)

    With the native kernels every product reads its weight as stored; only MLA's kv_b_proj, split per head rather
    than multiplied whole, is expanded (a float32 one is used as it is; counted anyway). Without them
    (SHARDTOOL_KERNELS=0, or the extension not built) the numpy reference expands each weight it multiplies: the
    largest one counts."""
    if kernels() is None:
        weights = [shape for layer in range(cfg.num_layers) for shape in trunk_shapes(cfg, layer)[0].values()
                   if len(shape) == 2]
        largest = max([cfg.vocab_size * cfg.hidden_size, cfg.moe_intermediate_size * cfg.hidden_size]
                      + [a * b for a, b in weights])
        return 4 * largest
    if cfg.mla is None:
        return 0
    m = cfg.mla
    return 4 * cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
