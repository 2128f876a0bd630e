"""`open_model`: a verified model a Python caller generates with, in one call: the signed manifest checked against
trusted keys, the model read from a directory or fetched from a store, the cluster joined, and every shard verified
before its weights are used. `verify-and-run` and `serve` are this call plus their arguments and printing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from shardtool.errors import UsageError
from shardtool.manifest import VerifiedManifest
from shardtool.runtime.store import DEFAULT_PAGE_CACHE, DEFAULT_POLICY

from ._cluster import connect_cluster, load_signed_plan
from ._detok import Detokenizer
from ._engine import Engine
from ._record import make_receipt
from ._session import Session, encode_prompt
from ._signed import load_tokenizer, verified_config
from ._source import ModelSource, open_source, verify_all

@dataclass(frozen=True)
class Generation:
    """What one `generate` produced: the new token ids and their text ("" for a model without a tokenizer)."""

    ids: tuple[int, ...]
    text: str


class VerifiedModel:
    """A model whose signed manifest was verified; its weights are verified as they are read. Close it (or use it as
    a context manager): it holds reader threads, the cache directory's lock and the cluster connection."""

    def __init__(self, source: ModelSource, *, budget: int, readers: int, cache_policy: str, lookahead: bool,
                 cluster=None, page_cache: str = DEFAULT_PAGE_CACHE):
        self.source, self.budget, self.cluster = source, budget, cluster
        self._options = dict(readers=readers, cache_policy=cache_policy, lookahead=lookahead, page_cache=page_cache)
        self.tokenizer = load_tokenizer(source.directory, source.manifest)  # verified before it is parsed
        self._session: Session | None = None
        self._capacity = 0  # tokens the session's KV cache holds
        self._config = None

    @property
    def manifest(self) -> VerifiedManifest:
        return self.source.manifest

    @property
    def model_id(self) -> str:
        return self.manifest.head.model_id

    @property
    def config(self):
        """The signed config.json, verified and validated (a `ModelConfig`)."""
        if self._config is None:
            self._config = (self._session.config if self._session is not None
                            else verified_config(self.source.directory, self.manifest))
        return self._config

    @property
    def record(self):
        """The last `generate(record=True)`'s RunRecord (what a run receipt is made from), else None."""
        return self._session.record if self._session is not None else None

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    def prepare(self, max_tokens: int) -> Session:
        """The batch-of-one engine, its KV cache sized for `max_tokens` (prompt + new tokens): a sequence the memory
        budget cannot hold is refused here, before the first token. Kept while later generations fit in it."""
        if self._session is not None and self._capacity >= max_tokens:
            return self._session
        if self._session is not None:
            self._session.close()
            self._session = None
        self._session = Session(self.source.directory, self.manifest, budget=self.budget, max_tokens=max_tokens,
                                tokenizer=self.tokenizer, remote=self.cluster, fetch_missing=self.source.fetch_missing,
                                **self._options)
        self._capacity, self._config = max_tokens, self._session.config
        return self._session

    def verify_all(self) -> int:
        """Every listed file this model reads checked now (size, then BLAKE3); raises the first failure. Returns
        the bytes checked."""
        return verify_all(self.source.directory, self.manifest, cluster=self.cluster is not None,
                          fetch_missing=self.source.fetch_missing)

    def _ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise UsageError("the prompt encodes to no tokens" if isinstance(prompt, str) else "the prompt is empty")
        return ids

    def tokens(self, prompt: str | Sequence[int], max_new_tokens: int = 32, *, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, record: bool = False) -> Iterator[int]:
        """The new token ids, each generated as it is consumed."""
        ids = self._ids(prompt)
        session = self.prepare(len(ids) + max(max_new_tokens, 0))
        return session.tokens(ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, record=record)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, record: bool = False,
                 on_token: Callable[[int], None] | None = None) -> Generation:
        """Generate from a prompt (text, or token ids); greedy at temperature 0."""
        new = []
        for token in self.tokens(prompt, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 record=record):
            new.append(token)
            if on_token is not None:
                on_token(token)
        return Generation(tuple(new), self.decode(new))

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 32, **sampling) -> Iterator[str]:
        """`generate`'s text, piece by piece as the tokens come (a character split over tokens comes whole)."""
        detok = Detokenizer(self.decode)
        for token in self.tokens(prompt, max_new_tokens, **sampling):
            piece = detok.push(token)
            if piece:
                yield piece
        rest = detok.finish()
        if rest:
            yield rest

    def summary(self) -> dict:
        """The last generation's report: tokens, rates, where the time and bytes went, the cache, the budget."""
        if self._session is None:
            raise UsageError("nothing generated yet: summary() reports on the last generate()")
        return self._session.summary()

    def receipt(self, operator_key):
        """A signed run receipt for the last `generate(record=True)` (`SignedReceipt`: `.data`, `.trace`, `.id`)."""
        if self.record is None:
            raise UsageError("a receipt covers a generation made with record=True")
        return make_receipt(self.record, self.manifest, self.config, operator_key)

    def engine(self, **options) -> Engine:
        """A serving engine over the same verified source (continuous batching; `Engine`'s options)."""
        return Engine(self.source.directory, self.manifest, budget=self.budget, tokenizer=self.tokenizer,
                      remote=self.cluster, fetch_missing=self.source.fetch_missing, **self._options, **options)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        self.source.close()

    def __enter__(self) -> VerifiedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_model(source: str | Path | Sequence[str], *, trust: Sequence, threshold: int = 1, model_id: str | None = None,
               memory_budget: int | str = "8GiB", cache_dir: str | Path | None = None, fetch_timeout: float = 60.0,
               manifest: str | Path | None = None, state_dir: str | Path | None = None, cluster: str | None = None,
               plan: str | Path | None = None, plan_trust: Sequence = (), insecure_cluster: bool = False,
               cluster_graph: bool = False, cluster_timeout: float = 30.0, readers: int = 2,
               cache_policy: str = DEFAULT_POLICY, lookahead: bool = False,
               page_cache: str = DEFAULT_PAGE_CACHE) -> VerifiedModel:
    """Verify a split model's signed manifest and open it for generation.

    `source`: a split model directory, or a store URL (https://, s3://, hf://; a list of them: mirrors tried in
    order) whose files are fetched into `cache_dir`. `trust`: trusted public keys (key files or loaded keys), of
    which `threshold` must have signed; `model_id` pins the model the manifest must be signed for. `cluster`
    (HOST:PORT of a Ray head) with a signed `plan` (checked against `plan_trust`) has the nodes compute the experts;
    `cluster_graph`: each layer's calls through a Ray Compiled Graph (`connect_cluster(graph=True)`).
    Raises a `ShardtoolError` subclass on anything untrustworthy or malformed; nothing unverified is ever used."""
    from shardtool.keys import trusted_keys
    from shardtool.sizes import parse_size

    budget = parse_size(memory_budget, "memory_budget") if isinstance(memory_budget, str) else int(memory_budget)
    trusted = trusted_keys(trust)
    urls = [str(source)] if isinstance(source, str) and "://" in source else (
        [str(u) for u in source] if not isinstance(source, (str, Path)) else [])
    if urls and cache_dir is None:
        raise UsageError("a model from a store needs cache_dir: where the fetched files are kept")
    if cluster is not None and plan is None:
        raise UsageError("a cluster needs its signed plan")
    opened = open_source(None if urls else Path(source), trusted, threshold=threshold, remote=urls,
                         manifest_file=_path(manifest), cache_dir=_path(cache_dir), fetch_timeout=fetch_timeout,
                         state_dir=_path(state_dir), model_id=model_id, lazy=cluster is None)
    remote = None
    try:
        if cluster is not None:
            signed_plan = load_signed_plan(Path(plan), opened.manifest, trusted_keys(plan_trust, "plan_trust"))
            remote = connect_cluster(cluster, signed_plan, timeout=cluster_timeout, insecure=insecure_cluster,
                                     graph=cluster_graph)
        return VerifiedModel(opened, budget=budget, readers=readers, cache_policy=cache_policy, lookahead=lookahead,
                             cluster=remote, page_cache=page_cache)
    except BaseException:
        if remote is not None:
            remote.close()
        opened.close()
        raise


def _path(value) -> Path | None:
    return Path(value) if value is not None else None

