"""One verified inference run: verify the manifest, read config and tokenizer through verification,
size the shard cache from the memory budget, generate, and measure where the time and bytes went."""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from shardtool.strict_json import loads_strict
from shardtool.errors import CheckpointFormatError, UsageError, VerificationError
from shardtool.manifest import VerifiedManifest, read_verified
from shardtool.runtime._model import Model, ModelConfig, bytes_per_token, sample_token
from shardtool.runtime._model._activations import step_bytes
from shardtool.runtime._model._sampling import check_sampling
from shardtool.runtime._provider import VerifiedWeights
from shardtool.runtime._store import ShardFormatError, ShardStore

MAX_CONFIG_BYTES = 1024 * 1024
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
# The least the budget keeps for one forward step's temporaries; more when one query over the whole
# sequence needs more (`step_bytes`). Prefill runs in chunks that fit (`prefill_chunk`).
MIN_ACTIVATION_RESERVE = 32 * 1024 * 1024


def _signed_text(root: Path, manifest: VerifiedManifest, path: str, cap: int) -> str | None:
    """The text of signed file `path`, read through verification (size cap first); None when unlisted."""
    entry = manifest.by_path().get(path)
    if entry is None:
        return None
    if entry.size > cap:
        raise VerificationError(f"{path} is {entry.size} bytes, more than the {cap}-byte cap", path=path)
    try:
        return read_verified(root, entry).tobytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise VerificationError(f"signed {path} is not UTF-8: {e.reason}", path=path) from None


def _verified_json(root: Path, manifest: VerifiedManifest, path: str) -> dict:
    """A signed JSON file, parsed by the one strict reader (duplicate keys, NaN, huge integers, deep nesting
    refused) only after its bytes were verified."""
    text = _signed_text(root, manifest, path, MAX_CONFIG_BYTES)
    if text is None:
        raise VerificationError(f"the signed manifest lists no {path}")
    try:
        value = loads_strict(text.encode("utf-8"), path)
    except CheckpointFormatError as e:
        raise VerificationError(f"signed {path} is not valid JSON: {e.message}", path=path) from None
    if not isinstance(value, dict):
        raise VerificationError(f"signed {path} is not a JSON object", path=path)
    return value


@contextlib.contextmanager
def signed_content(path: str | None = None) -> Iterator[None]:
    """The model's format errors here are about signed, verified bytes: the publisher shipped a model that
    cannot run (a shard without a tensor its signed config.json implies, a wrong shape, a config the model
    cannot use). That is a verification failure (exit 1), not a usage error (errors.py, CheckpointFormatError)."""
    try:
        yield
    except CheckpointFormatError as e:
        if path is not None:
            raise VerificationError(f"signed {path} is unusable: {e.message}", path=path, hint=e.hint) from None
        raise ShardFormatError(f"signed shards do not fit the signed config.json: {e.message}", path=e.path,
                               hint=e.hint) from None


def load_tokenizer(root: Path, manifest: VerifiedManifest):
    """The HF tokenizer from the verified tokenizer.json, or None when the model ships none."""
    text = _signed_text(root, manifest, "tokenizer.json", MAX_TOKENIZER_BYTES)
    if text is None:
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception for malformed JSON
        raise VerificationError(f"signed tokenizer.json does not load: {str(e)[:200]}", path="tokenizer.json") from None


@dataclass(frozen=True)
class BudgetPlan:
    total: int
    kv_cache: int
    working: int  # float32 copies and reads in flight, plus `activations`
    activations: int
    shard_cache: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def plan_budget(budget: int, cfg: ModelConfig, manifest: VerifiedManifest, max_tokens: int, readers: int) -> BudgetPlan:
    """Split the memory budget: KV cache for the whole sequence (prompt + new tokens), working buffers
    (float32 copies of the layer being computed, reads in flight, one forward step's activations), and
    what remains caches verified shards. A sequence the budget cannot hold is refused here, before any
    token is computed, with the budget it would need."""
    experts = [e.size for e in manifest.entries if e.kind == "expert"]
    trunk = [e.size for e in manifest.entries if e.kind == "trunk"]
    largest_expert, largest_trunk = max(experts, default=0), max(trunk, default=0)
    k = max(cfg.top_k, 1)
    # A shard's float32 copy is at most 4x its bytes (FP8); in-flight reads hold raw bytes.
    f32 = 4 * (largest_trunk + k * largest_expert)
    inflight = readers * max(largest_expert, largest_trunk)
    kv = bytes_per_token(cfg) * max_tokens  # allocated once at this capacity (KVCache)
    activations = max(MIN_ACTIVATION_RESERVE, step_bytes(cfg, 1, max_tokens))  # decode's last step must fit
    working = f32 + inflight + activations
    need = max(largest_expert, largest_trunk) * (k + 1)
    shard_cache = budget - kv - working
    if shard_cache < need:
        mib = 2**20
        raise UsageError(f"memory budget {budget / mib:.1f} MiB cannot run {max_tokens} tokens (prompt + "
                         f"--max-new-tokens) of this model: KV cache {kv / mib:.1f} MiB + activations "
                         f"{activations / mib:.1f} MiB + other working buffers {(f32 + inflight) / mib:.1f} MiB + "
                         f"shard cache {need / mib:.1f} MiB (top-k + 1 shards) need "
                         f"{(kv + working + need) / mib:.1f} MiB",
                         hint=f"raise --memory-budget to at least {math.ceil((kv + working + need) / mib)}MiB, "
                              f"or shorten the prompt or --max-new-tokens")
    return BudgetPlan(budget, kv, working, activations, shard_cache)


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
    """`max_tokens` (prompt + new tokens) sizes the KV cache, so callers encode the prompt first: pass the
    tokenizer they loaded with `load_tokenizer` to avoid reading and verifying it twice."""

    def __init__(self, root: Path, manifest: VerifiedManifest, *, budget: int, max_tokens: int, readers: int = 2,
                 tokenizer=None):
        self.root = Path(root)
        self.manifest = manifest
        with signed_content("config.json"):
            self.config = ModelConfig.from_hf_config(_verified_json(self.root, manifest, "config.json"))
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.root, manifest)
        self.plan = plan_budget(budget, self.config, manifest, max_tokens, readers)
        self.store = ShardStore(self.root, budget_bytes=self.plan.shard_cache, readers=readers)
        self.weights = VerifiedWeights(self.store, manifest, self.config.num_layers)
        self.model = Model(self.config, self.weights, max_tokens=max_tokens,
                           activation_reserve=self.plan.activations)
        self.report = RunReport()

    def close(self) -> None:
        self.store.close()

    def verify_all(self) -> int:
        """--verify-all-first: every listed file checked before the first token. The bytes are not used
        (shards are read and verified again when needed), so they are streamed, as audit does, rather
        than held whole in memory; the errors are the ones a verified read gives."""
        from shardtool.manifest import verify_entry

        for entry in self.manifest.entries:
            verify_entry(self.root, entry)
        return sum(entry.size for entry in self.manifest.entries)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer else ""

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float, top_p: float,
                 seed: int | None, on_token: Callable[[int], None]) -> RunReport:
        check_sampling(temperature, top_p)
        rng = np.random.default_rng(seed)
        stops = set(self.config.eos_token_ids)
        report = self.report
        report.prompt_tokens = len(prompt_ids)
        if max_new_tokens <= 0:
            return report
        t0 = time.perf_counter()
        with signed_content():
            logits = self.model.prefill(prompt_ids, last_only=True)[0]
        report.prefill_seconds = time.perf_counter() - t0
        expert_bytes_before = self.store.stats.by_kind.get("expert", 0)
        for i in range(max_new_tokens):
            if not np.isfinite(logits).all():
                raise VerificationError(f"the signed weights give non-finite logits at new token {i}: they overflow "
                                        f"float32")
            token = sample_token(logits, temperature=temperature, top_p=top_p, rng=rng)
            report.generated.append(token)
            report.new_tokens += 1
            on_token(token)
            if token in stops or i == max_new_tokens - 1:
                break
            t1 = time.perf_counter()
            with signed_content():
                logits = self.model.decode(token)
            report.decode_seconds += time.perf_counter() - t1
        report.decode_expert_bytes = self.store.stats.by_kind.get("expert", 0) - expert_bytes_before
        return report

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
                        "compute": max(wall - s.wait_seconds, 0.0)},
            "per_token_seconds": {
                "read": s.read_seconds / max(r.new_tokens, 1), "verify": s.verify_seconds / max(r.new_tokens, 1),
                "compute": max(wall - s.wait_seconds, 0.0) / max(r.new_tokens, 1)},
            "verify_share_of_time": s.verify_seconds / wall if wall else None,
            "bytes_read": s.bytes_read,
            "bytes_read_per_token": s.bytes_read / max(r.prompt_tokens + r.new_tokens, 1),
            "decode_expert_bytes_per_token": r.decode_expert_bytes / decode_steps if decode_steps else None,
            "contract_expert_bytes_per_token_cold": contract.get("expert_bytes_per_token_cold"),
            "cache": {"hits": s.hits, "misses": s.misses, "evictions": s.evictions,
                      "peak_cached_bytes": s.peak_cached_bytes},
            "budget": self.plan.as_dict(),
            "kv_cache_bytes": self.model.cache.nbytes,
            "peak_rss_bytes": peak_rss_bytes(),
            "generated_ids": r.generated,
        }
