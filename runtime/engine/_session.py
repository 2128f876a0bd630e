"""One verified inference run (verify-and-run): the engine with a batch of one, and the report of where the
time and bytes went."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from shardtool.errors import UsageError
from shardtool.manifest import VerifiedManifest
from shardtool.runtime.model import Model
from shardtool.runtime.store import DEFAULT_PAGE_CACHE, DEFAULT_POLICY

from ._engine import Engine, ExpertCluster
from ._sampling import SamplingParams, check_sampling
from ._source import verify_all

@dataclass
class RunReport:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_expert_bytes: int = 0
    generated: list[int] = field(default_factory=list)


def peak_rss_bytes() -> int:
    """This process's peak resident set. VmHWM first: ru_maxrss also counts what the parent had resident
    when it forked us (Linux keeps the pre-exec high-water mark), which is not ours."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if tokenizer is None:
        raise UsageError("this model ships no tokenizer.json", hint="pass --prompt-ids")
    return list(tokenizer.encode(prompt, add_special_tokens=True).ids)


class Session:
    """One verify-and-run request: an `Engine` with a batch of one, its KV cache sized for exactly this
    prompt + new tokens. `max_tokens` (prompt + new tokens) sizes the KV cache, so callers encode the prompt
    first: pass the tokenizer they loaded with `load_tokenizer` to avoid reading and verifying it twice."""

    def __init__(self, root: Path, manifest: VerifiedManifest, *, budget: int, max_tokens: int, readers: int = 2,
                 tokenizer=None, remote: ExpertCluster | None = None, fetch_missing=None,
                 cache_policy: str = DEFAULT_POLICY, lookahead: bool = False, page_cache: str = DEFAULT_PAGE_CACHE):
        """`remote`: the routed experts come from a cluster's nodes (the engine's `remote`); `fetch_missing`: the
        shard store's hook for shards the directory does not hold yet (the engine's); `cache_policy`: the shard
        store's eviction policy; `lookahead`: the engine's."""
        self.root = Path(root)
        self.manifest = manifest
        self.remote = remote
        self.fetch_missing = fetch_missing
        self.lookahead_requested = lookahead and remote is None
        self.engine = Engine(self.root, manifest, budget=budget, max_batch=1, max_queue=0, max_context=max_tokens,
                             readers=readers, tokenizer=tokenizer, remote=remote, fetch_missing=fetch_missing,
                             cache_policy=cache_policy, lookahead=lookahead, page_cache=page_cache)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.plan = self.engine.plan
        self.store = self.engine.store
        self.weights = self.engine.weights
        # The forward pass alone, over the same verified weights, for callers that want logits (tests).
        self.model = Model(self.config, self.weights, max_tokens=max_tokens, activation_reserve=self.plan.activations)
        self.report = RunReport()
        self.record = None
        self._kv_cache_bytes = 0

    def close(self) -> None:
        self.engine.close()

    def verify_all(self) -> int:
        """--verify-all-first: every listed file checked before the first token (`_source.verify_all`)."""
        return verify_all(self.root, self.manifest, cluster=self.remote is not None, fetch_missing=self.fetch_missing)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer else ""

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float, top_p: float,
                 seed: int | None, on_token: Callable[[int], None], record: bool = False) -> RunReport:
        """Generate; with `record`, `self.record` is then the RunRecord a receipt is made from. The report (and
        `summary()`'s token counts and rates) describes this call alone: a second call on the session starts a new
        one, rather than adding its tokens to the first call's beside its own seconds."""
        for token in self.tokens(prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 record=record):
            on_token(token)
        return self.report

    def tokens(self, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float, top_p: float,
               seed: int | None, record: bool = False) -> Iterator[int]:
        """`generate` as an iterator of the new token ids, each step run as it is consumed."""
        check_sampling(temperature, top_p)
        report = self.report = RunReport()
        report.prompt_tokens = len(prompt_ids)
        if max_new_tokens <= 0:
            return
        params = SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        ticket, produced = self.engine.generate_one(prompt_ids, params, record=record)
        for token in produced:
            report.generated.append(token)
            report.new_tokens += 1
            yield token
        self.record = ticket.record
        report.prefill_seconds = ticket.prefill_seconds
        report.decode_seconds = ticket.decode_seconds
        report.decode_expert_bytes = ticket.decode_expert_bytes
        self._kv_cache_bytes = ticket.kv_bytes

    def lookahead_summary(self) -> dict:
        """On or off, where the prediction is made, its recall, and what its prefetches read and how many were used."""
        s, on = self.store.stats, self.weights.lookahead
        return {"requested": self.lookahead_requested, "enabled": on, "predicted_from": "the hidden state leaving layer L, for layer L+1" if on else None,
                **self.engine.lookahead_stats.as_dict(),
                "prefetched": s.prefetched.get("expert", 0), "prefetch_used": s.prefetch_used.get("expert", 0)}

    def summary(self) -> dict:
        r, s = self.report, self.store.stats
        decode_steps = max(r.new_tokens - 1, 0)
        wall = r.prefill_seconds + r.decode_seconds
        contract = dict(self.manifest.head.contract or {})
        return {
            "model_id": self.manifest.head.model_id,
            "manifest_version": self.manifest.head.version,
            "prompt_tokens": r.prompt_tokens,
            "new_tokens": r.new_tokens,
            "prefill_tokens_per_s": r.prompt_tokens / r.prefill_seconds if r.prefill_seconds else None,
            "decode_tokens_per_s": decode_steps / r.decode_seconds if r.decode_seconds else None,
            "seconds": {"prefill": r.prefill_seconds, "decode": r.decode_seconds,
                        # reader threads overlap with compute and with each other: these are thread-seconds
                        "read_thread": s.read_seconds, "verify_thread": s.verify_seconds,
                        "read_thread_cpu": s.read_cpu_seconds, "verify_thread_cpu": s.verify_cpu_seconds,
                        "parse_thread": s.parse_seconds, "waiting_for_shards": s.wait_seconds,
                        "waiting_for_experts": s.wait_by_kind.get("expert", 0.0),
                        "compute": max(wall - s.wait_seconds, 0.0)},
            "per_token_seconds": {
                "read": s.read_seconds / max(r.new_tokens, 1), "verify": s.verify_seconds / max(r.new_tokens, 1),
                "compute": max(wall - s.wait_seconds, 0.0) / max(r.new_tokens, 1),
                "waiting_for_shards": s.wait_seconds / max(r.new_tokens, 1)},
            "lookahead": self.lookahead_summary(),
            "verify_share_of_time": s.verify_seconds / wall if wall else None,
            "bytes_read": s.bytes_read,
            "bytes_read_per_token": s.bytes_read / max(r.prompt_tokens + r.new_tokens, 1),
            "decode_expert_bytes_per_token": r.decode_expert_bytes / decode_steps if decode_steps else None,
            "contract_expert_bytes_per_token_cold": contract.get("expert_bytes_per_token_cold"),
            "cache": {"policy": self.store.policy, "page_cache": self.store.page_cache, "hits": s.hits,
                      "misses": s.misses, "evictions": s.evictions,
                      "peak_cached_bytes": s.peak_cached_bytes, "fetched_from_remote": s.fetched,
                      "fetch_seconds": s.fetch_seconds, "expert_requests": s.requests.get("expert", 0),
                      "expert_hits": s.request_hits.get("expert", 0), "expert_hit_rate": s.hit_rate("expert")},
            "budget": self.plan.as_dict(),
            "kv_cache_bytes": self._kv_cache_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
            "generated_ids": r.generated,
            **({"cluster": self.remote.stats.as_dict()} if self.remote is not None else {}),
        }
