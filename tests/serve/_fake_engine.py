"""A scripted stand-in for the runtime's Engine, with exactly its interface (constructor aside): the HTTP
layer's tests control what each request generates, when, and how it ends, without a model.

`reply(prompt_ids, params)` gives the tokens a request generates, in order; an ErrorEvent in the list fails
the request at that point. Generation stops at a stop token (params.stop_token_ids, default the eos ids:
"stop"), at max_new_tokens ("length"), or when the list runs out ("length" too). Events reach the sink on
the engine's thread, one token per step. Scores (`logprobs`, `score_prompt`) are made up from the token ids
(`fake_score`): the HTTP layer's shapes are tested here, the values against transformers in test_serve_e2e.py.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

from shardtool.errors import OverloadedError, RequestRefusedError
from shardtool.runtime import ErrorEvent, FinishEvent, PromptScoresEvent, SamplingParams, TokenEvent, TokenLogprobs

EOS = 1


def fake_score(token: int, top: int) -> TokenLogprobs:
    """A made-up score: token t has log-probability -(t % 7 + 1) / 8; its alternatives are t+1, t+2, ..."""
    def lp(t: int) -> float:
        return -(t % 7 + 1) / 8
    return TokenLogprobs(token, lp(token), tuple((token + 1 + i, lp(token + 1 + i) - 1) for i in range(top)))


@dataclass(eq=False)
class FakeTicket:
    id: int
    prompt: list[int]
    params: SamplingParams
    sink: Callable
    script: list
    generated: int = 0
    cancelled: bool = False
    logprobs: int | None = None
    score_prompt: bool = False
    prompt_scored: bool = False


@dataclass
class FakeEngine:
    tokenizer: object
    reply: Callable[[list[int], SamplingParams], list] = lambda prompt, params: []
    max_context: int = 64
    max_batch: int = 2
    max_queue: int = 2
    step_seconds: float = 0.002
    tokenizer_config: dict | None = None
    retry_after: int = 3
    manifest: object = None  # what the status page shows of the verified manifest (None: nothing)
    # Observations for the tests:
    submitted: list = field(default_factory=list)
    cancels: list = field(default_factory=list)

    @property
    def max_request_tokens(self) -> int:
        return self.max_context

    def __post_init__(self):
        vocab = self.tokenizer.get_vocab_size() if self.tokenizer is not None else 512
        self.config = SimpleNamespace(vocab_size=vocab, eos_token_ids=(EOS,), max_position_embeddings=self.max_context)
        self.gate = threading.Event()  # clear it to hold every request in the wait queue
        self.gate.set()
        self._lock = threading.Condition()
        self._waiting: list[FakeTicket] = []
        self._running: list[FakeTicket] = []
        self._ids = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.steps = self.finished = self.failed = self.generated = 0

    # -- the Engine interface
    def expert_cache(self) -> dict:
        """Two MoE layers (1 and 3) of four experts: expert (tokens generated) % 4 is cached, and each layer's hits
        are its tokens generated so far, all on that expert."""
        with self._lock:
            g = self.generated
        return {"layers": [{"layer": layer, "experts": 4, "cached": [g % 4],
                            "hits": [g if x == g % 4 else 0 for x in range(4)]} for layer in (1, 3)]}

    def signed_json(self, path: str) -> dict | None:
        return self.tokenizer_config if path == "tokenizer_config.json" else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending, self._waiting, self._running = self._waiting + self._running, [], []
            self._lock.notify_all()
        self.gate.set()
        for t in pending:
            t.sink(ErrorEvent(503, "the engine stopped", RuntimeError("closed")))
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, prompt_ids, params: SamplingParams, sink, *, record: bool = False, logprobs: int | None = None,
               score_prompt: bool = False) -> FakeTicket:
        prompt = list(prompt_ids)
        if params.max_new_tokens < (0 if score_prompt else 1):
            raise RequestRefusedError(f"max_tokens {params.max_new_tokens}")
        if not prompt:
            raise RequestRefusedError("the prompt is empty")
        bad = next((i for i in prompt if not 0 <= i < self.config.vocab_size), None)
        if bad is not None:
            raise RequestRefusedError(f"token id {bad} is outside this model's vocabulary of {self.config.vocab_size}")
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise RequestRefusedError(f"{len(prompt)} prompt tokens + max_tokens {params.max_new_tokens} exceed "
                                      f"the context of {self.max_context}", code="context_length_exceeded")
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise OverloadedError(f"the wait queue is full ({self.max_queue})", retry_after=self.retry_after)
            ticket = FakeTicket(next(self._ids), prompt, params, sink, list(self.reply(prompt, params)), logprobs=logprobs,
                                score_prompt=score_prompt)
            self._waiting.append(ticket)
            self.submitted.append(ticket)
            self._lock.notify_all()
        return ticket

    def cancel(self, ticket: FakeTicket) -> None:
        with self._lock:
            ticket.cancelled = True
            self.cancels.append(ticket.id)

    def metrics(self) -> dict:
        with self._lock:
            return {"queue_depth": len(self._waiting), "running": len(self._running),
                    "kv_cache_bytes_capacity": 1 << 20, "kv_cache_bytes_reserved": 0, "kv_cache_bytes_in_use": 0,
                    "prompt_tokens_total": sum(len(t.prompt) for t in self.submitted),
                    "generation_tokens_total": self.generated, "steps_total": self.steps,
                    "step_sequences_total": self.steps, "last_batch_size": len(self._running),
                    "requests_finished_total": self.finished, "requests_failed_total": self.failed,
                    "verification_failures_total": 0, "cache_hits_total": 0, "cache_misses_total": 0,
                    "cache_evictions_total": 0, "bytes_read_total": 0, "bytes_verified_total": 0,
                    "read_seconds_total": 0.0, "verify_seconds_total": 0.0}

    # -- the scripted decode loop
    def _loop(self) -> None:
        while True:
            self.gate.wait()
            with self._lock:
                while not self._closed and not (self._waiting or self._running):
                    self._lock.wait()
                if self._closed:
                    return
                while self._waiting and len(self._running) < self.max_batch:
                    self._running.append(self._waiting.pop(0))
                batch = list(self._running)
            for ticket in batch:
                self._step(ticket)
            self.steps += 1
            time.sleep(self.step_seconds)

    def _step(self, t: FakeTicket) -> None:
        def end(event):
            with self._lock:
                if t in self._running:
                    self._running.remove(t)
            t.sink(event)

        if t.cancelled:
            self.finished += 1
            return end(FinishEvent("cancelled"))
        if t.score_prompt and not t.prompt_scored:
            t.sink(PromptScoresEvent((None, *(fake_score(p, t.logprobs or 0) for p in t.prompt[1:]))))
            t.prompt_scored = True
            if t.params.max_new_tokens == 0:
                self.finished += 1
                return end(FinishEvent("length"))
        if t.generated >= len(t.script):
            self.finished += 1
            return end(FinishEvent("length"))
        item = t.script[t.generated]
        t.generated += 1
        if isinstance(item, ErrorEvent):
            self.failed += 1
            return end(item)
        self.generated += 1
        t.sink(TokenEvent(item, None if t.logprobs is None else fake_score(item, t.logprobs)))
        stops = t.params.stop_token_ids if t.params.stop_token_ids is not None else self.config.eos_token_ids
        if item in stops:
            self.finished += 1
            return end(FinishEvent("stop"))
        if t.generated >= t.params.max_new_tokens:
            self.finished += 1
            return end(FinishEvent("length"))
