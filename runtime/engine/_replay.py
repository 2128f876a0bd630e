"""Checking a run receipt: replay the prompt and the answer teacher-forced through the verified weights and
compare every claim.

The receipt's signature and structure are checked before this runs (`shardtool.manifest.open_receipt`);
here it is taken as a set of claims. The weights are the operator's own manifest only if its model ID,
version and Merkle root are the verified manifest's; then one batched prefill over prompt + answer (all but
the last token) gives, per fed position, the logits, the routing and the last hidden state, and each is
compared with a documented tolerance (`Tolerances`): floating point differs with thread counts, batch
composition and chunking, a different model or request does not stay within it. docs/receipt-format.md
gives the rules and the margins measured.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from shardtool.errors import ReceiptMismatchError, UsageError
from shardtool.manifest import Receipt, VerifiedManifest, decode_trace, routing_leaves, routing_root
from shardtool.runtime.model import ModelConfig, StepTrace

from ._engine import Engine
from ._sampling import sampling_slack
from ._signed import verified_config


# Leaf hashes the near-tie search may recompute in all (2^ties roots of `positions` leaves each): a few seconds.
MAX_SEARCH_LEAVES = 1 << 22


@dataclass(frozen=True)
class Tolerances:
    """How far an honest replay may differ from the run, each in its own unit."""

    logit: float = 1e-4  # greedy: a token other than the argmax is accepted when (max - its logit) <= this * max|logit|
    # sampled: the seeded draw may miss the token's probability interval by this much. Honest runs measured 0
    # (benchmarks/bench_receipts.py); at 1e-4 an operator could pick among dozens of tail tokens of a large
    # vocabulary at one step.
    sample_mass: float = 1e-6
    route_gap: float = 1e-4  # routing: a swap of the k-th and (k+1)-th expert when their scores differ by <= this
    # |committed - replayed| <= this * max|h| of the position's hidden state. Measured (benchmarks/bench_receipts.py):
    # honest runs <= 1.2e-6, one expert's output scaled by 1.01 >= 7e-4 (1e-3 let such receipts pass).
    fingerprint: float = 3e-5
    # sampled: tokens whose logits differ by <= this * max|logit| may have sorted either way round in the run (a
    # near-tie token). Honest replays measured differences up to 2.4e-6 in logits of magnitude ~1 (stop 37); two
    # near-equal tokens swapped in 2 of 609 sampled steps, which rejected an honest receipt when the draw fell on them.
    sample_order: float = 1e-5
    max_route_ties: int = 10  # near-ties searched (2^n roots) when the trace itself is not given
    # Tokens accepted at a near-tie (greedy or sampled) per receipt: each is a choice the operator could have
    # made, so their number is bounded; honest runs measured 0 (benchmarks/bench_receipts.py).
    max_token_ties: int = 8


@dataclass
class Divergence:
    position: int  # fed position (0-based, prompt first)
    check: str  # "fingerprint", "routing", "token"
    detail: str
    token_index: int | None = None  # which generated token, when the position predicts one
    layer: int | None = None

    def as_dict(self) -> dict:
        return {"position": self.position, "token_index": self.token_index, "layer": self.layer,
                "check": self.check, "detail": self.detail}


@dataclass
class _Stats:
    token_ties: int = 0
    route_ties: int = 0
    fingerprint_ties: int = 0
    max_token_gap: float = 0.0  # the largest accepted relative logit gap / sampling slack
    max_fingerprint_error: float = 0.0  # relative
    min_route_gap_seen: float = float("inf")
    greedy_margins: list = field(default_factory=list)


def check_weights(receipt: Receipt, manifest: VerifiedManifest) -> None:
    """The receipt must name exactly the weights DIR's verified manifest describes."""
    head = manifest.head
    for what, claimed, ours in (("model ID", receipt.model_id, head.model_id),
                                ("manifest version", receipt.manifest_version, head.version),
                                ("Merkle root", receipt.merkle_root.hex(), head.merkle_root.hex())):
        if claimed != ours:
            raise ReceiptMismatchError(f"receipt names {what} {claimed!r}; the verified manifest here has {ours!r}")


def replay_receipt(root: Path, manifest: VerifiedManifest, receipt: Receipt, *, budget: int, readers: int = 2,
                   trace: bytes | None = None, tol: Tolerances = Tolerances(), engine: Engine | None = None,
                   stop_token_ids: Sequence[int] | None = None) -> dict:
    """Replay and compare; the verdict as a JSON-ready dict ("valid": bool, "first_divergence", the margins).

    `engine`: an idle Engine already built over `root` and `manifest` (weights it has read stay in its
    verifying cache), for checking many receipts of one model; by default one is built for this receipt and
    closed after it. The caller keeps an engine it passes: it is neither started nor closed here.

    `stop_token_ids`: the stop tokens the client's request named; by default the signed config.json's
    end-of-sequence ids, which is what verify-and-run and serve stop at.

    Raises ReceiptMismatchError when the receipt names other weights, a request no honest run could have
    served (past the signed context, other stop tokens) or cannot describe this model (no replay then), UsageError for an engine over other weights, and what a verified read raises when the
    weights themselves are bad."""
    check_weights(receipt, manifest)
    check_request(receipt, engine.config if engine is not None else verified_config(root, manifest),
                  stop_token_ids)
    started = time.perf_counter()
    own = engine is None
    if own:
        engine = replay_engine(root, manifest, receipt.positions, budget=budget, readers=readers)
    else:
        _check_engine(engine, root, manifest, receipt)
    try:
        _check_shape(receipt, engine)
        claimed_routes = decode_trace(trace, receipt) if trace is not None else None
        verdict = _compare(engine, receipt, claimed_routes, tol)
    finally:
        if own:
            engine.close()
    verdict["replay_seconds"] = time.perf_counter() - started
    return verdict


def check_request(receipt: Receipt, cfg: ModelConfig, stop_token_ids: Sequence[int] | None = None) -> None:
    """The request the receipt states must be one an honest run serves, before any replay is planned: within
    the signed context, and stopping where the request said (a stop list widened to the answer's last token
    would pass a cut-short answer off as a natural stop; one without the model's EOS would run past it)."""
    context = cfg.max_position_embeddings
    needed = len(receipt.prompt_ids) + receipt.max_new_tokens
    if context > 0 and needed > context:
        raise ReceiptMismatchError(f"the receipt's request needs {needed} tokens of context (prompt + "
                                   f"max_new_tokens); the signed config.json allows {context}")
    expected = sorted(set(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids))
    if sorted(set(receipt.stop_token_ids)) != expected:
        source = "the signed config.json's end-of-sequence ids are" if stop_token_ids is None else "--stop-ids gives"
        raise ReceiptMismatchError(f"the receipt stops at token ids {sorted(set(receipt.stop_token_ids))[:16]}; "
                                   f"{source} {expected[:16]}")


def replay_engine(root: Path, manifest: VerifiedManifest, positions: int, *, budget: int, readers: int = 2) -> Engine:
    """An engine sized for replaying receipts of up to `positions` fed positions within `budget`."""
    # tokenizer=False: the replay works on token ids only, so the tokenizer is neither read nor parsed.
    return Engine(root, manifest, budget=budget, max_batch=1, max_queue=0, max_context=positions + 1,
                  readers=readers, tokenizer=False)


def _check_engine(engine: Engine, root: Path, manifest: VerifiedManifest, receipt: Receipt) -> None:
    """A caller's engine must read the same directory under the same verified manifest head, and its memory
    plan must hold the receipt's sequence."""
    ours, theirs = manifest.head, engine.manifest.head
    if (ours.model_id, ours.version, ours.merkle_root) != (theirs.model_id, theirs.version, theirs.merkle_root):
        raise UsageError(f"the engine given for the replay serves {theirs.model_id!r} version {theirs.version} "
                         f"(Merkle root {theirs.merkle_root.hex()[:16]}…); the receipt is checked against "
                         f"{ours.model_id!r} version {ours.version} (Merkle root {ours.merkle_root.hex()[:16]}…)")
    if engine.root.resolve() != Path(root).resolve():
        raise UsageError(f"the engine given for the replay reads {engine.root}; the receipt is checked against "
                         f"{root}")
    if receipt.positions + 1 > engine.max_request_tokens:
        raise UsageError(f"the engine given for the replay holds {engine.max_request_tokens} tokens per sequence; "
                         f"this receipt needs {receipt.positions + 1}")


def _check_shape(receipt: Receipt, engine: Engine) -> None:
    cfg = engine.config
    moe = tuple(i for i, m in enumerate(cfg.moe_layers) if m)
    if receipt.moe_layers != moe or receipt.top_k != cfg.top_k:
        raise ReceiptMismatchError(f"receipt routes MoE layers {list(receipt.moe_layers)[:8]} with top-{receipt.top_k}; "
                                   f"this model has {list(moe)[:8]} with top-{cfg.top_k}")
    bad = next((t for t in receipt.prompt_ids + receipt.token_ids + receipt.stop_token_ids if t >= cfg.vocab_size),
               None)
    if bad is not None:
        raise ReceiptMismatchError(f"receipt holds token id {bad}, outside this model's vocabulary of "
                                   f"{cfg.vocab_size}")


def _compare(engine: Engine, receipt: Receipt, claimed_routes: np.ndarray | None, tol: Tolerances) -> dict:
    prompt_len = len(receipt.prompt_ids)
    fed = receipt.fed_ids()
    fp_index, fp_value = receipt.fingerprint_arrays()
    hidden_size = engine.config.hidden_size
    rng = np.random.default_rng(receipt.seed)
    stats = _Stats()
    first: Divergence | None = None
    leaves: list[bytes] = []
    ties: list[tuple[int, int, np.ndarray]] = []  # (position, layer slot, alternative [k] row)
    replay_routes = []

    def diverge(d: Divergence) -> None:
        nonlocal first
        if first is None or d.position < first.position:
            first = d

    for start, logits, trace in engine.teacher_forced(fed, logits_from=prompt_len - 1):
        t = len(trace.hidden)
        routes = np.stack(trace.routes, axis=1)  # [t, layers, k]
        replay_routes.append(routes)
        leaves.extend(routing_leaves(routes, start))
        ties += _near_ties(routes, trace, start, tol)
        for row in range(t):
            p = start + row
            d = _check_fingerprint(trace.hidden[row], int(fp_index[p]), float(fp_value[p]), hidden_size, tol, stats)
            if d is not None:
                diverge(Divergence(p, "fingerprint", d, _token_index(p, prompt_len)))
            if claimed_routes is not None:
                d = _check_routes(claimed_routes[p], routes[row], trace, row, tol, stats)
                if d is not None:
                    slot, detail = d
                    diverge(Divergence(p, "routing", detail, _token_index(p, prompt_len), receipt.moe_layers[slot]))
            if p >= prompt_len - 1:
                i = p - (prompt_len - 1)
                d = _check_token(logits[row], receipt, i, rng, tol, stats)
                if d is not None:
                    diverge(Divergence(p, "token", d, i))
        if first is not None:
            break  # the rest of the replay cannot make the receipt valid
    route_verdict = "match"
    if first is None and claimed_routes is None:
        route_verdict, first = _check_routing_root(receipt, replay_routes, leaves, ties, tol, stats)
    return _report(first, route_verdict, sum(len(r) for r in replay_routes), stats, tol)


def _near_ties(routes: np.ndarray, trace: StepTrace, start: int, tol: Tolerances) -> list[tuple[int, int, np.ndarray]]:
    """# routes [t, layers, k] -> (position, layer slot, alternative [k] row) for every choice of a segment whose
    last chosen expert beat the first left out by at most `tol.route_gap`: the routing it would have had."""
    ties = []
    for slot in range(routes.shape[1]):
        near = np.nonzero(trace.gaps[slot] <= tol.route_gap)[0]
        for row in near:
            alt = routes[row, slot].copy()
            out, into = trace.swaps[slot][row]
            alt[alt == out] = into
            ties.append((start + int(row), slot, np.sort(alt)))
    return ties


def _check_routing_root(receipt: Receipt, replay_routes: list[np.ndarray], leaves: list[bytes],
                        ties: list[tuple[int, int, np.ndarray]], tol: Tolerances, stats: _Stats
                        ) -> tuple[str, Divergence | None]:
    """(verdict, divergence) for a receipt without its trace: only the routing root to compare, with the
    near-ties' alternatives searched when the replay's own root differs."""
    if routing_root(leaves) == receipt.routing_root:
        return "match", None
    route_verdict = _search_ties(np.concatenate(replay_routes), leaves, ties, receipt.routing_root, tol)
    if route_verdict == "differs":
        return route_verdict, Divergence(-1, "routing", "the routing trace the receipt commits to is not the "
                                         f"replay's (no combination of the {len(ties)} near-tie(s) within "
                                         f"{tol.route_gap} matches); pass --trace to find the first token and layer")
    stats.route_ties += int(route_verdict.split()[0])
    return route_verdict, None


def _report(first: Divergence | None, route_verdict: str, positions: int, stats: _Stats, tol: Tolerances) -> dict:
    return {
        "valid": first is None,
        "first_divergence": first.as_dict() if first is not None else None,
        "positions_checked": positions,
        "near_ties": {"tokens": stats.token_ties, "routing": stats.route_ties, "fingerprint": stats.fingerprint_ties},
        "margins": {"max_token_deviation": stats.max_token_gap,
                    "max_fingerprint_relative_error": stats.max_fingerprint_error,
                    "min_greedy_decision_margin": min(stats.greedy_margins, default=None)},
        "routing": route_verdict if first is None or first.check != "routing" else "differs",
        "tolerances": {"logit": tol.logit, "sample_mass": tol.sample_mass, "route_gap": tol.route_gap,
                       "fingerprint": tol.fingerprint, "sample_order": tol.sample_order},
    }


def _token_index(position: int, prompt_len: int) -> int | None:
    """The generated token position `position` was fed as (None for a prompt token)."""
    return position - prompt_len if position >= prompt_len else None


def _check_fingerprint(hidden: np.ndarray, index: int, value: float, size: int, tol: Tolerances,
                       stats: _Stats) -> str | None:
    scale = float(np.max(np.abs(hidden)))
    if index >= size:
        return f"fingerprint names hidden entry {index}; the hidden state has {size}"
    replayed = float(hidden[index])
    error = abs(value - replayed) / max(scale, 1e-30)
    if not np.isfinite(value) or error > tol.fingerprint:
        return (f"last hidden state entry {index} is {replayed:.6g} in the replay; the receipt commits "
                f"{value:.6g} (relative error {error:.2e} > {tol.fingerprint:g})")
    if abs(replayed) < scale * (1 - tol.fingerprint):
        return (f"the receipt commits entry {index} as the largest of the last hidden state; the replay's largest "
                f"is entry {int(np.argmax(np.abs(hidden)))} ({scale:.6g} against {abs(replayed):.6g})")
    if index != int(np.argmax(np.abs(hidden))):
        stats.fingerprint_ties += 1
    stats.max_fingerprint_error = max(stats.max_fingerprint_error, error)
    return None


def _check_routes(claimed: np.ndarray, replayed: np.ndarray, trace, row: int, tol: Tolerances,
                  stats: _Stats) -> tuple[int, str] | None:
    """claimed, replayed: [layers, k] sorted expert ids at one position."""
    for slot in range(len(claimed)):
        if np.array_equal(claimed[slot], replayed[slot]):
            continue
        out, into = trace.swaps[slot][row]
        alt = replayed[slot].copy()
        alt[alt == out] = into
        if trace.gaps[slot][row] <= tol.route_gap and np.array_equal(np.sort(alt), claimed[slot]):
            stats.route_ties += 1
            continue
        return slot, (f"receipt routes to experts {claimed[slot].tolist()}, the replay to "
                      f"{replayed[slot].tolist()} (score gap {float(trace.gaps[slot][row]):.2e})")
    return None


def _check_token(logits: np.ndarray, receipt: Receipt, i: int, rng: np.random.Generator, tol: Tolerances,
                 stats: _Stats) -> str | None:
    token = receipt.token_ids[i]
    if not np.isfinite(logits).all():
        return "the replayed logits are not finite"
    if receipt.temperature == 0:
        top = int(np.argmax(logits))
        scale = max(float(np.max(np.abs(logits))), 1e-30)
        if token == top:
            second = np.partition(logits, -2)[-2] if len(logits) > 1 else -np.inf
            stats.greedy_margins.append(float((logits[top] - second) / scale))
            return None
        gap = float(logits[top] - logits[token]) / scale
        if gap <= tol.logit:
            return _tie(stats, tol, gap, f"greedy decoding gives token {top} here; the receipt has {token}")
        return (f"greedy decoding gives token {top} here; the receipt has {token} (logit gap {gap:.2e} of "
                f"max|logit| > {tol.logit:g})")
    u = rng.random()
    slack = sampling_slack(logits, receipt.temperature, receipt.top_p, u, token)
    if slack == 0.0:
        return None
    if slack > tol.sample_mass:  # perhaps near-equal tokens sorted the other way round in the run
        tie = tol.sample_order * max(float(np.max(np.abs(logits))), 1e-30)
        slack = min(slack, sampling_slack(logits, receipt.temperature, receipt.top_p, u, token, order_tie=tie))
    if slack <= tol.sample_mass:
        return _tie(stats, tol, slack, f"the seeded draw gives another token than the receipt's {token}")
    return (f"sampling with seed {receipt.seed} at temperature {receipt.temperature:g}, top_p {receipt.top_p:g} "
            f"does not give token {token} here (off by {slack:.2e} of probability mass)")


def _tie(stats: _Stats, tol: Tolerances, gap: float, what: str) -> str | None:
    """Accept one more near-tie token, or say that the receipt has used up its near-ties."""
    stats.token_ties += 1
    stats.max_token_gap = max(stats.max_token_gap, gap)
    if stats.token_ties > tol.max_token_ties:
        return f"{what}: a near-tie, but the receipt already used its {tol.max_token_ties} tolerated near-tie tokens"
    return None


def _search_ties(routes: np.ndarray, leaves: list[bytes], ties: list, root: bytes, tol: Tolerances) -> str:
    """Whether swapping some of the replay's near-tie experts reproduces the committed root: "<n> tie(s)" with
    the fewest swaps that do, or "differs". routes: [positions, layers, k] as replayed."""
    if len(ties) > tol.max_route_ties or len(leaves) << len(ties) > MAX_SEARCH_LEAVES:
        return "differs"
    for n in range(1, len(ties) + 1):
        for combo in itertools.combinations(ties, n):
            trial = list(leaves)
            changed = {}
            for p, slot, alt in combo:
                row = changed.setdefault(p, routes[p].copy())
                row[slot] = alt
            for p, row in changed.items():
                trial[p] = routing_leaves(row[None], p)[0]
            if routing_root(trial) == root:
                return f"{n} tie(s)"
    return "differs"
