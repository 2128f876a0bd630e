"""The one decode loop: continuous batching over verified weights, inside one memory budget.

Requests join and leave the running batch at step boundaries. Each step runs every running sequence's
next rows through the model together (`forward_batch`): one new token per decoding sequence, plus a chunk
of at most one prompt being prefilled, sized so the step's activations fit their reserve. Per MoE layer the
rows are grouped by expert, so an expert chosen by several sequences is fetched (and on a miss read and
verified) once per step.

Memory: each admitted request reserves KV cache for its prompt + max_new_tokens from the plan's KV share
(`BudgetPlan.kv_cache`) before it runs, so the budget holds under any load. A request that does not fit now
waits in a bounded FIFO queue; past it, `OverloadedError`; one that could never fit, `RequestRefusedError`.

Integrity: a shard that fails verification fails the sequences whose rows needed it (an expert: the rows
that chose it; trunk, embedding or head: every sequence in the step) with an `ErrorEvent`; the others
retry the step, since no cache moves until a whole step succeeded. No token computed from unverified bytes
is ever emitted: tokens leave only after the step that produced them finished.

`verify-and-run` runs one request through `run_one` on the caller's thread; `serve` runs the same loop on a
background thread (`start`).
"""

from __future__ import annotations

import itertools
import math
import secrets
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from shardtool.errors import (CheckpointFormatError, OverloadedError, RequestRefusedError, ShardtoolError,
                              UnavailableError, UsageError, VerificationError)
from shardtool.manifest import Entry, VerifiedManifest
from shardtool.runtime.model import (ExpertFetch, ExpertUnavailable, KVCache, Layers, ModelConfig, PackedWeights,
                                     Segment, StepTrace, bytes_per_token, forward_batch, inv_freq, prefill_chunk,
                                     prepare_expert, step_rows)
from shardtool.runtime.store import DEFAULT_PAGE_CACHE, DEFAULT_POLICY, ShardStore, page_cache_mode

from ._plan import BudgetPlan, plan_budget
from ._provider import VerifiedWeights
from ._record import RunRecord
from ._sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs, check_sampling, sample_token, token_logprobs
from ._signed import MAX_CONFIG_BYTES, load_tokenizer, signed_json, signed_text, unusable_shards, verified_config


class ExpertCluster(Protocol):
    """Routed experts computed elsewhere, by a cluster's nodes (the cluster's `RemoteExperts`): what the engine asks
    of them. Defined here so the engine does not import the cluster that implements it."""

    stats: Any  # the cluster's figures: calls, wire_bytes, remote_seconds, retries, dropped, as_dict()
    # The forward pass's `Layers` when the nodes run whole layers (a pipeline plan: the embedding and the head stay
    # here), None when they compute experts only.
    layers: Layers | None

    def fetch(self, layer: int) -> ExpertFetch:
        """The forward pass's `ExpertFetch` for MoE layer `layer`."""
        ...

    def check_span_room(self, max_batch: int, max_context: int) -> None:
        """A pipeline plan's: UsageError unless every span node runs steps of `max_batch` sequences of
        `max_context` tokens."""
        ...


@dataclass(frozen=True)
class TokenEvent:
    token: int
    logprobs: TokenLogprobs | None = None  # for a request submitted with `logprobs`


@dataclass(frozen=True)
class PromptScoresEvent:
    """A request submitted with `score_prompt`: every prompt token's score, before any TokenEvent. The first is
    None (no position predicts the first token)."""

    scores: tuple[TokenLogprobs | None, ...]


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" (a stop token), "length" (max_new_tokens reached), "cancelled"
    record: RunRecord | None = None  # what a receipt needs, for a request submitted with record=True


@dataclass(frozen=True)
class ErrorEvent:
    status: int  # HTTP status: 500 a shard failed verification or the step failed; 503 the engine stopped or a
    # cluster node with no replica left (UnavailableError)
    message: str  # one line
    error: BaseException


Event = TokenEvent | PromptScoresEvent | FinishEvent | ErrorEvent
Sink = Callable[[Event], None]


@dataclass(eq=False)
class Ticket:
    """A submitted request. Its state belongs to the engine; callers only hold it to cancel."""

    id: int
    prompt: np.ndarray  # [P] int64
    params: SamplingParams
    sink: Sink
    kv_bytes: int  # reserved from the plan's KV share while admitted
    stops: frozenset[int]
    rng: np.random.Generator
    cache: KVCache | None = None
    fed: int = 0  # prompt tokens already in the cache
    next_token: int | None = None  # the sampled token the next step feeds
    generated: int = 0
    cancelled: bool = False
    done: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    prefill_seconds: float = 0.0  # wall seconds of the steps that fed its prompt
    decode_seconds: float = 0.0  # ... and of the steps that fed its generated tokens
    decode_expert_bytes: int = 0  # expert bytes read by steps in which it decoded
    record: RunRecord | None = None  # routing and fingerprints of every fed position, for a receipt
    logprobs: int | None = None  # score every generated token, with this many alternatives
    score_prompt: bool = False  # score every prompt token too (its prefill asks for every row's logits)
    prompt_scores: list[TokenLogprobs | None] = field(default_factory=lambda: [None])

    @property
    def total_tokens(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens


def _weight_bytes(manifest: VerifiedManifest, with_experts: bool) -> int:
    """The bytes of the shard files this engine's store may read: the trunk, and the experts unless a cluster holds
    them."""
    kinds = ("trunk", "expert") if with_experts else ("trunk",)
    return sum(e.size for e in manifest.entries if e.kind in kinds)


@dataclass
class EngineStats:
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected_full: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_sequences: int = 0  # sum over steps of the sequences in the step
    step_rows: int = 0
    last_batch_size: int = 0
    verification_failures: int = 0
    step_seconds: float = 0.0


class Engine:
    """Continuous-batching generation over the verifying shard store. Thread-safe: `submit` and `cancel` may be
    called from any thread; the steps run on one thread (the caller's in `run_one`, or `start`'s)."""

    def __init__(self, root: Path, manifest: VerifiedManifest, *, budget: int, max_batch: int = 16,
                 max_queue: int = 64, kv_cache: int | None = None, max_context: int | None = None,
                 readers: int = 2, tokenizer=None, remote: ExpertCluster | None = None,
                 fetch_missing: Callable[[Entry], None] | None = None, cache_policy: str = DEFAULT_POLICY,
                 lookahead: bool = False, page_cache: str = DEFAULT_PAGE_CACHE):
        """`remote`: a cluster's nodes compute the routed experts (`shardtool node`); `root` then needs to hold
        only the trunk and the model's small files (the plan's coordinator_files). `fetch_missing`: the shard
        store's hook for a shard `root` does not hold (`--remote URL --cache-dir D`). `cache_policy`: the
        store's eviction policy (`_cache_policy.POLICIES`). `lookahead`: predict each next layer's experts and
        start loading them early (`VerifiedWeights`; not with `remote`). `page_cache`: the store's."""
        if max_batch < 1:
            raise UsageError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise UsageError(f"max_queue must be >= 0, got {max_queue}")
        self.root = Path(root)
        self.manifest = manifest
        self.config: ModelConfig = verified_config(self.root, manifest)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.root, manifest)
        if max_context is None:
            max_context = self.config.max_position_embeddings
            if max_context < 1:
                raise UsageError("the signed config.json gives no max_position_embeddings",
                                 hint="pass the longest prompt + max_tokens to serve (--max-context)")
        if max_context < 2:
            raise UsageError(f"max_context must be >= 2 tokens (a prompt and one new token), got {max_context}")
        self.max_context = max_context
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.plan: BudgetPlan = plan_budget(budget, self.config, manifest, max_tokens=max_context, readers=readers,
                                            max_batch=max_batch, kv_cache=kv_cache)
        self.store = ShardStore(self.root, budget_bytes=self.plan.shard_cache, readers=readers,
                                fetch_missing=fetch_missing, policy=cache_policy, prepare=self._prepare_shard,
                                header_memo=self.plan.headers,
                                page_cache=page_cache_mode(page_cache, _weight_bytes(manifest, remote is None),
                                                           self.plan.shard_cache))
        self.weights = VerifiedWeights(self.store, manifest, self.config.num_layers, window=self.config.top_k,
                                       lookahead=lookahead and remote is None)
        self.remote = remote
        self._weights = PackedWeights(self.config, self.weights, remote.fetch if remote is not None else None)
        self._layers = remote.layers if remote is not None else None  # a pipeline plan's nodes run the layers
        if self._layers is not None:  # every step's call must fit each node, or the node refuses it (and is lost)
            remote.check_span_room(max_batch, max_context)
        self._rope = inv_freq(self.config.rope)
        self.bytes_per_token = bytes_per_token(self.config)
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[Ticket] = deque()
        self._running: list[Ticket] = []
        self._kv_reserved = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def _prepare_shard(self, entry: Entry, arrays) -> None:
        """Reader thread: a verified expert shard's weights checked and packed as it loads (`prepare_expert`)."""
        if entry.kind == "expert" and entry.layer is not None and entry.expert is not None \
                and entry.layer < self.config.num_layers:
            prepare_expert(self.config, entry.layer, entry.expert, arrays)

    # ------------------------------------------------------------------ requests (any thread)

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + max_tokens one request can ever hold: the context, or the whole KV share."""
        return min(self.max_context, self.plan.kv_cache // self.bytes_per_token)

    def signed_json(self, path: str) -> dict | None:
        """A signed JSON file of the model (e.g. tokenizer_config.json), read through verification; None when
        the manifest lists none."""
        return signed_json(self.root, self.manifest, path)

    def signed_text(self, path: str) -> str | None:
        """A signed text file of the model (e.g. chat_template.jinja), read through verification, capped as a
        config is; None when the manifest lists none."""
        return signed_text(self.root, self.manifest, path, MAX_CONFIG_BYTES)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, score_prompt: bool = False,
                      logprobs: int | None = None) -> np.ndarray:
        """The prompt as int64 ids, or RequestRefusedError naming what can never run. `score_prompt` allows
        max_new_tokens 0 (the prompt scored, nothing generated)."""
        least = 0 if score_prompt else 1
        if not isinstance(params.max_new_tokens, int) or params.max_new_tokens < least:
            raise RequestRefusedError(f"max_tokens must be an integer >= {least}, got {params.max_new_tokens!r}")
        if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise RequestRefusedError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {logprobs!r}")
        try:
            check_sampling(params.temperature, params.top_p)
        except UsageError as e:
            raise RequestRefusedError(e.message) from None
        prompt = np.asarray(prompt_ids, dtype=np.int64) if len(prompt_ids) else np.zeros(0, np.int64)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise RequestRefusedError("the prompt is empty: it needs at least one token")
        vocab = self.config.vocab_size
        bad = prompt[(prompt < 0) | (prompt >= vocab)]
        if len(bad):
            raise RequestRefusedError(f"token id {int(bad[0])} is outside this model's vocabulary of {vocab} ids")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_context:
            raise RequestRefusedError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_new_tokens}) = "
                                      f"{total} tokens, more than the context of {self.max_context}",
                                      code="context_length_exceeded")
        need = self.bytes_per_token * total
        if need > self.plan.kv_cache:
            fits = self.plan.kv_cache // self.bytes_per_token
            raise RequestRefusedError(f"prompt + max_tokens = {total} tokens need {need} bytes of KV cache; the "
                                      f"whole KV cache is {self.plan.kv_cache} bytes ({fits} tokens)",
                                      code="context_length_exceeded")
        return prompt

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, *,
               record: bool = False, logprobs: int | None = None, score_prompt: bool = False) -> Ticket:
        """Queue a request; its events go to `sink` (called on the engine thread, must not block). With
        `record`, its FinishEvent carries the RunRecord a receipt is made from. With `logprobs` (0 to 20), each
        TokenEvent carries the token's score and that many alternatives; with `score_prompt`, a PromptScoresEvent
        scores the prompt first (max_new_tokens may then be 0)."""
        prompt = self.check_request(prompt_ids, params, score_prompt=score_prompt, logprobs=logprobs)
        if params.seed is None:
            params = replace(params, seed=secrets.randbits(64))
        stops = self.config.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        ticket = Ticket(next(self._ids), prompt, params, sink, self.bytes_per_token * (len(prompt) +
                        params.max_new_tokens), frozenset(stops), np.random.default_rng(params.seed),
                        logprobs=logprobs, score_prompt=score_prompt)
        if record:
            ticket.record = RunRecord(prompt=tuple(int(t) for t in prompt), params=params,
                                      stop_token_ids=tuple(sorted(ticket.stops)))
        with self._lock:
            if self._closed:
                raise OverloadedError("the engine is shutting down", retry_after=1)
            if not self._waiting and self._fits(ticket):
                self._admit(ticket)
            elif len(self._waiting) < self.max_queue:
                self._waiting.append(ticket)
            else:
                self.stats.rejected_full += 1
                raise OverloadedError(f"{len(self._running)} requests running and {len(self._waiting)} waiting, the "
                                      f"most this server queues", retry_after=self._retry_after())
            self._wake.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request: a waiting one leaves the queue at once; a running one leaves the batch (and frees its
        KV cache) at the next step boundary. Its sink gets FinishEvent("cancelled") unless it had ended."""
        with self._lock:
            if ticket.done or ticket.cancelled:
                return
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                ticket.done = True
                self.stats.cancelled += 1
            else:
                self._wake.notify_all()
                return
        _deliver(ticket, FinishEvent("cancelled"))

    # Caller holds the lock for the four below.
    def _fits(self, ticket: Ticket) -> bool:
        return len(self._running) < self.max_batch and self._kv_reserved + ticket.kv_bytes <= self.plan.kv_cache

    def _admit(self, ticket: Ticket) -> None:
        self._running.append(ticket)
        self._kv_reserved += ticket.kv_bytes
        self.stats.admitted += 1
        self.stats.prompt_tokens += len(ticket.prompt)

    def _release(self, ticket: Ticket) -> None:
        """Take a finished ticket out of the batch, free its cache, and admit waiters in order while they fit
        (the queue's head is never overtaken, so a long request cannot starve)."""
        ticket.done = True
        ticket.cache = None
        if ticket in self._running:
            self._running.remove(ticket)
            self._kv_reserved -= ticket.kv_bytes
        while self._waiting and self._fits(self._waiting[0]):
            self._admit(self._waiting.popleft())

    def _retry_after(self) -> int:
        """Seconds until a slot is likely free: the fewest tokens any running request still has to generate, at
        the rate steps have run so far; between 1 and 60."""
        left = min((t.params.max_new_tokens - t.generated for t in self._running), default=0)
        per_step = self.stats.step_seconds / self.stats.steps if self.stats.steps else 0.0
        return int(min(60, max(1, math.ceil(left * per_step))))

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        """Run steps on a background thread until `close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve_forever, name="shardtool-engine", daemon=True)
            self._thread.start()

    def _serve_forever(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._running:
                    self._wake.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - outside a forward pass (a bug, MemoryError): fail the batch,
                traceback.print_exc(file=sys.stderr)  # keep the loop, so no request waits forever
                with self._lock:
                    batch = list(self._running)
                self._fail(batch, e)

    def close(self) -> None:
        """Stop the loop; requests still waiting or running get ErrorEvent(503)."""
        with self._lock:
            self._closed = True
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._lock:  # a ticket that ended in the last step already had its one terminal event
            pending = [ticket for ticket in pending if not ticket.done]
            for ticket in pending:
                self._release(ticket)
        err = OverloadedError("the server is shutting down")
        for ticket in pending:
            _deliver(ticket, ErrorEvent(503, err.message, err))
        self.store.close()

    def run_one(self, prompt_ids: Sequence[int], params: SamplingParams,
                on_token: Callable[[int], None], *, record: bool = False) -> Ticket:
        """Generate for one request on this thread (verify-and-run). Raises what failed it, as it was raised.
        With `record`, the returned ticket's `record` is complete (RunRecord.finish_reason set)."""
        ticket, tokens = self.generate_one(prompt_ids, params, record=record)
        for token in tokens:
            on_token(token)
        return ticket

    def generate_one(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                     record: bool = False) -> tuple[Ticket, Iterator[int]]:
        """Submit one request (refused here if it cannot be admitted); its tokens come as the iterator is consumed,
        each step run on the consumer's thread. The iterator raises what failed the request, after the tokens it
        produced first; closed early, it cancels the request and frees its KV cache."""
        produced: deque[int] = deque()
        failure: list[BaseException] = []

        def sink(event: Event) -> None:
            if isinstance(event, TokenEvent):
                produced.append(event.token)
            elif isinstance(event, ErrorEvent):
                failure.append(event.error)

        ticket = self.submit(prompt_ids, params, sink, record=record)
        return ticket, self._steps(ticket, produced, failure)

    def _steps(self, ticket: Ticket, produced: deque, failure: list) -> Iterator[int]:
        try:
            while not ticket.done:
                self.step()
                while produced:
                    yield produced.popleft()
            while produced:
                yield produced.popleft()
        finally:
            if not ticket.done:
                self.cancel(ticket)
                self.step()  # a running request leaves the batch at a step boundary
        if failure:
            raise failure[0]

    def step(self) -> None:
        """One batched forward step over every running sequence; emits the tokens it produced."""
        with self._lock:
            cancelled = [t for t in self._running if t.cancelled]
            for ticket in cancelled:
                self._release(ticket)
                self.stats.cancelled += 1
            batch = list(self._running)
        for ticket in cancelled:
            _deliver(ticket, FinishEvent("cancelled"))
        if not batch:
            return
        for ticket in batch:
            if ticket.cache is None:  # allocated at its capacity; untouched pages cost no memory
                ticket.cache = KVCache(self.config, max_tokens=ticket.total_tokens)
        plan = self._plan_rows(batch)
        t0 = time.perf_counter()
        expert_bytes = self.store.stats.by_kind.get("expert", 0)
        logits, plan, traces = self._forward(plan)
        seconds = time.perf_counter() - t0
        for (ticket, _), trace in zip(plan, traces):
            if ticket.record is not None:
                ticket.record.add_step(trace)
        expert_bytes = self.store.stats.by_kind.get("expert", 0) - expert_bytes
        with self._lock:
            s = self.stats
            s.steps += 1
            s.step_seconds += seconds
            s.step_sequences += len(plan)
            s.step_rows += sum(len(ids) for _, ids in plan)
            s.last_batch_size = len(plan)
        row = 0
        for ticket, ids in plan:
            rows = {"all": len(ids), "last": 1, "none": 0}[_wanted(ticket, ids)]  # asked before `fed` moves
            block = logits[row:row + rows] if rows else None  # [rows, V]; None: a prompt chunk before its last
            row += rows
            decoding = ticket.next_token is not None
            if decoding:
                ticket.decode_seconds += seconds
                ticket.decode_expert_bytes += expert_bytes
            else:
                ticket.prefill_seconds += seconds
                if ticket.score_prompt and not self._score_prompt(ticket, block):
                    continue
                ticket.fed += len(ids)
                if ticket.fed < len(ticket.prompt):
                    continue  # more prompt to go
                if ticket.score_prompt and not ticket.cancelled:
                    _deliver(ticket, PromptScoresEvent(tuple(ticket.prompt_scores)))
                    ticket.prompt_scores = []
                    if ticket.params.max_new_tokens == 0:
                        self._finish(ticket, "length")
                        continue
            self._emit(ticket, block[-1])

    def _plan_rows(self, batch: list[Ticket]) -> list[tuple[Ticket, np.ndarray]]:
        """Every decoding sequence's next token, then prompt chunks in admission order, as many rows as the
        activation reserve holds for a step over the longest sequence in it (at least one chunk)."""
        decoding = [(t, np.array([t.next_token], np.int64)) for t in batch if t.next_token is not None]
        prefilling = [t for t in batch if t.next_token is None]
        if not prefilling:
            return decoding
        keys = max([t.cache.length + 1 for t, _ in decoding] + [len(t.prompt) for t in prefilling])
        room = step_rows(self.config, self.plan.activations, keys) - len(decoding)
        plan = list(decoding)
        for ticket in prefilling:
            if room <= 0 and plan:
                break
            chunk = ticket.prompt[ticket.fed:ticket.fed + max(room, 1)]
            plan.append((ticket, chunk))
            room -= len(chunk)
        return plan

    def _forward(self, plan: list[tuple[Ticket, np.ndarray]]) -> tuple[np.ndarray | None, list, list]:
        """forward_batch over the plan; a failure fails the sequences it concerns and the rest try again.
        Returns the logits, the plan that ran, and each planned sequence's StepTrace (None unless recording)."""
        while plan:
            segments = [Segment(ids, ticket.cache, _wanted(ticket, ids),
                                StepTrace() if ticket.record is not None else None)
                        for ticket, ids in plan]
            try:
                logits = forward_batch(self.config, self._weights, self._rope, segments, self._layers)
                return logits, plan, [seg.trace for seg in segments]
            except ExpertUnavailable as e:  # only the sequences whose rows chose that expert needed it
                bounds = np.cumsum([0] + [len(ids) for _, ids in plan])
                hit = {int(np.searchsorted(bounds, r, side="right")) - 1 for r in e.rows}
                self._fail([plan[i][0] for i in sorted(hit)], e.cause)
                plan = [p for i, p in enumerate(plan) if i not in hit]
            except ShardtoolError as e:  # trunk, embedding or head: every sequence in the step needs it
                self._fail([ticket for ticket, _ in plan], e)
                return None, [], []
            except Exception as e:  # noqa: BLE001 - a bug or MemoryError fails this step's requests, not the server
                if self._thread is None:
                    raise  # verify-and-run: a crash keeps its traceback and exit code
                traceback.print_exc(file=sys.stderr)
                self._fail([ticket for ticket, _ in plan], e)
                return None, [], []
        return None, [], []

    def _fail(self, tickets: list[Ticket], error: BaseException) -> None:
        if isinstance(error, CheckpointFormatError):
            error = unusable_shards(error)
        message = error.one_line() if isinstance(error, ShardtoolError) else f"internal error: {type(error).__name__}"
        with self._lock:
            for ticket in tickets:
                self._release(ticket)
                self.stats.failed += 1
                if isinstance(error, VerificationError):
                    self.stats.verification_failures += 1
        status = 503 if isinstance(error, UnavailableError) else 500  # a node down: the request may work later
        for ticket in tickets:
            _deliver(ticket, ErrorEvent(status, message, error))

    def _score_prompt(self, ticket: Ticket, block: np.ndarray) -> bool:
        """Score the prompt tokens this prefill chunk's rows [t, V] predict (row j: the token after position
        fed + j). False when the request ended (cancelled, or failed on non-finite logits)."""
        if ticket.cancelled:
            return False  # the next step boundary releases it
        if not np.isfinite(block).all():
            self._fail([ticket], VerificationError(f"the signed weights give non-finite logits in prompt positions "
                                                   f"{ticket.fed} to {ticket.fed + len(block) - 1} (NaN or infinity "
                                                   f"in float32)"))
            return False
        top = ticket.logprobs or 0
        for j, row in enumerate(block):
            at = ticket.fed + j + 1
            if at < len(ticket.prompt):
                ticket.prompt_scores.append(token_logprobs(row, int(ticket.prompt[at]), top))
        return True

    def _emit(self, ticket: Ticket, logits: np.ndarray) -> None:
        """Sample the next token from a finished step's logits and hand it over; end the request on a stop
        token or at max_new_tokens."""
        if ticket.cancelled:
            return  # the next step boundary releases it
        if not np.isfinite(logits).all():
            self._fail([ticket], VerificationError(f"the signed weights give non-finite logits at new token "
                                                   f"{ticket.generated} (NaN or infinity in float32)"))
            return
        p = ticket.params
        token = sample_token(logits, temperature=p.temperature, top_p=p.top_p, rng=ticket.rng)
        score = None if ticket.logprobs is None else token_logprobs(logits, token, ticket.logprobs)
        ticket.generated += 1
        if ticket.record is not None:
            ticket.record.tokens.append(token)
        if ticket.first_token_at is None:
            ticket.first_token_at = time.perf_counter()
        with self._lock:
            self.stats.generated_tokens += 1
        _deliver(ticket, TokenEvent(token, score))
        reason = "stop" if token in ticket.stops else "length" if ticket.generated >= p.max_new_tokens else None
        if reason is None:
            ticket.next_token = token
            return
        self._finish(ticket, reason)

    def _finish(self, ticket: Ticket, reason: str) -> None:
        with self._lock:
            self._release(ticket)
            self.stats.finished += 1
        if ticket.record is not None:
            ticket.record.finish_reason = reason
        _deliver(ticket, FinishEvent(reason, ticket.record))

    def teacher_forced(self, ids: np.ndarray, *, logits_from: int = 0):
        """Feed one whole sequence [T] through the model at once (a receipt's replay), in prefill chunks that fit
        the activation reserve; yield (start, logits [t, V] or None, StepTrace with alternatives) per chunk.
        Logits are asked only of chunks that reach row `logits_from`. Not for use while `start` runs."""
        ids = np.asarray(ids, dtype=np.int64)
        cache = KVCache(self.config, max_tokens=len(ids))
        chunk = prefill_chunk(self.config, self.plan.activations, len(ids))
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            segment = Segment(part, cache, "all" if start + len(part) > logits_from else "none",
                              StepTrace(alternatives=True))
            try:
                logits = forward_batch(self.config, self._weights, self._rope, [segment], self._layers)
            except ExpertUnavailable as e:
                raise e.cause from None
            yield start, logits, segment.trace

    # ------------------------------------------------------------------ observation

    def metrics(self) -> dict[str, int | float]:
        with self._lock:
            s, st = self.stats, self.store.stats
            in_use = sum(t.cache.length for t in self._running if t.cache is not None) * self.bytes_per_token
            return {
                "queue_depth": len(self._waiting), "running": len(self._running),
                "kv_cache_bytes_capacity": self.plan.kv_cache, "kv_cache_bytes_reserved": self._kv_reserved,
                "kv_cache_bytes_in_use": in_use,
                "prompt_tokens_total": s.prompt_tokens, "generation_tokens_total": s.generated_tokens,
                "steps_total": s.steps, "step_sequences_total": s.step_sequences, "step_rows_total": s.step_rows,
                "last_batch_size": s.last_batch_size, "requests_admitted_total": s.admitted,
                "requests_finished_total": s.finished, "requests_failed_total": s.failed,
                "requests_cancelled_total": s.cancelled, "requests_rejected_queue_full_total": s.rejected_full,
                "verification_failures_total": s.verification_failures,
                "cache_hits_total": st.hits, "cache_misses_total": st.misses, "cache_evictions_total": st.evictions,
                "bytes_read_total": st.bytes_read, "bytes_verified_total": st.bytes_read,
                "expert_bytes_read_total": st.by_kind.get("expert", 0),
                "read_seconds_total": st.read_seconds, "verify_seconds_total": st.verify_seconds,
                "step_seconds_total": s.step_seconds,
                **(self._cluster_metrics() if self.remote is not None else {}),
            }

    def expert_cache(self) -> dict:
        """The routed-expert cache as a map, for the status page's heat map: per MoE layer (ascending), which experts
        the shard cache holds now and each expert's cache hits since start. Read from the store's two small maps
        (no lock of the engine's, no step touched); the layers and expert counts are the signed manifest's."""
        layers = self.__dict__.get("_expert_layers")
        if layers is None:  # layer -> experts listed for it, from the manifest once
            counts: dict[int, int] = {}
            for e in self.manifest.entries:
                if e.kind == "expert":
                    counts[e.layer] = max(counts.get(e.layer, 0), e.expert + 1)
            layers = self._expert_layers = dict(sorted(counts.items()))
        paths, hits = self.store.expert_cache()
        by_path = self.manifest.by_path()
        cached: dict[int, list[int]] = {}
        for path in paths:
            e = by_path.get(path)
            if e is not None and e.kind == "expert":
                cached.setdefault(e.layer, []).append(e.expert)
        return {"layers": [{"layer": layer, "experts": n, "cached": sorted(cached.get(layer, [])),
                            "hits": [hits.get((layer, x), 0) for x in range(n)]} for layer, n in layers.items()]}

    @property
    def lookahead_stats(self):
        """How well the lookahead predicted each next layer's experts (a `LookaheadStats`)."""
        return self._weights.lookahead_stats

    def _cluster_metrics(self) -> dict[str, int | float | dict[str, int]]:
        c = self.remote.stats
        balance = c.busiest_over_mean()
        return {"cluster_node_calls_total": c.calls, "cluster_wire_bytes_total": c.wire_bytes,
                "cluster_call_seconds_total": c.remote_seconds, "cluster_expert_retries_total": c.retries,
                "cluster_nodes_dropped": len(c.dropped), "cluster_nodes_readmitted_total": c.readmitted,
                "cluster_expert_calls_total": dict(c.expert_calls),
                **({"cluster_expert_calls_busiest_over_mean": balance} if balance is not None else {})}


def _wanted(ticket: Ticket, ids: np.ndarray) -> str:
    """Which logits a sequence's rows in a step ask for: a decoding token's or a prompt's last row (to sample
    from), every prompt row when the prompt is scored, none for a prompt chunk before its last."""
    if ticket.next_token is not None:
        return "last"
    if ticket.score_prompt:
        return "all"
    return "last" if ticket.fed + len(ids) >= len(ticket.prompt) else "none"


def _deliver(ticket: Ticket, event: Event) -> None:
    try:
        ticket.sink(event)
    except Exception:  # noqa: BLE001 - a broken sink must not stop the batch
        traceback.print_exc(file=sys.stderr)
