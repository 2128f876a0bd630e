"""What a run records for its receipt, and the receipt made from it.

Per fed position (every prompt token and every generated token but the last) the engine keeps the experts
each MoE layer chose and a fingerprint of the last hidden state; `make_receipt` binds them with the
weights (the verified manifest's head), the request and the answer into a receipt signed by the operator.
The format is `shardtool.manifest._receipt`; the check is `_replay.py`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from shardtool.keys import PrivateKey
from shardtool.manifest import Receipt, VerifiedManifest, encode_trace, routing_leaves, routing_root, sign_receipt
from shardtool.runtime.model import ModelConfig, StepTrace

from ._sampling import SamplingParams


def fingerprint_rows(hidden: np.ndarray) -> np.ndarray:
    """# [t, H] last hidden state -> [t] records (i: u32 LE, v: f32 LE): each row's entry of largest
    magnitude (first on a tie) and its value."""
    idx = np.argmax(np.abs(hidden), axis=1)
    out = np.empty(len(hidden), dtype=np.dtype([("i", "<u4"), ("v", "<f4")]))
    out["i"] = idx
    out["v"] = hidden[np.arange(len(hidden)), idx]
    return out


@dataclass
class RunRecord:
    """One request's routing and fingerprints, step by step, and its answer once it finished."""

    prompt: tuple[int, ...]
    params: SamplingParams  # with the seed the engine used
    stop_token_ids: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    routes: list[np.ndarray] = field(default_factory=list)  # per step: [t, layers, k]
    fingerprints: list[np.ndarray] = field(default_factory=list)  # per step: [t] records

    def add_step(self, trace: StepTrace) -> None:
        self.routes.append(np.stack(trace.routes, axis=1))
        self.fingerprints.append(fingerprint_rows(trace.hidden))


@dataclass(frozen=True)
class SignedReceipt:
    id: str
    data: bytes  # the receipt file
    trace: bytes  # the routing trace file (unsigned; its root is in the receipt)


def new_receipt_id() -> str:
    return "rcpt-" + secrets.token_hex(12)


def make_receipt(record: RunRecord, manifest: VerifiedManifest, config: ModelConfig, key: PrivateKey, *,
                 receipt_id: str | None = None, now: int | None = None) -> SignedReceipt:
    """Sign what `record` saw. Refuses a record that is not a finished answer (a cancelled or failed request
    gets no receipt)."""
    if record.finish_reason not in ("stop", "length") or not record.tokens:
        raise ValueError("a receipt needs a finished answer")
    routes = np.concatenate(record.routes)  # [positions, layers, k]
    fingerprint = np.concatenate(record.fingerprints)
    positions = len(record.prompt) + len(record.tokens) - 1
    if len(routes) != positions or len(fingerprint) != positions:
        raise ValueError(f"record covers {len(routes)} positions, the answer needs {positions}")
    rid = receipt_id or new_receipt_id()
    moe_layers = tuple(i for i, moe in enumerate(config.moe_layers) if moe)
    p = record.params
    receipt = Receipt(
        id=rid, created=int(time.time()) if now is None else now, model_id=manifest.head.model_id,
        manifest_version=manifest.head.version, merkle_root=manifest.head.merkle_root,
        prompt_ids=record.prompt, max_new_tokens=p.max_new_tokens, temperature=float(p.temperature),
        top_p=float(p.top_p), seed=int(p.seed), stop_token_ids=record.stop_token_ids,
        token_ids=tuple(record.tokens), finish_reason=record.finish_reason, moe_layers=moe_layers,
        top_k=config.top_k, routing_root=routing_root(routing_leaves(routes)), fingerprint=fingerprint.tobytes())
    return SignedReceipt(rid, sign_receipt(receipt, key), encode_trace(rid, moe_layers, config.top_k, routes))
