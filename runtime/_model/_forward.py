"""The forward pass over a `WeightProvider`, and `Model`: prefill a prompt, then decode one token at a time."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, chain
from typing import TypeVar

import numpy as np

from shardtool import formats
from shardtool.errors import CheckpointFormatError, UsageError
from shardtool.families import MOE_MODULE_ALIASES, TEXT_MODEL_WRAPPER

from . import _decode_row
from ._activations import prefill_chunk
from ._cache import KVCache
from ._config import ModelConfig
from ._dtypes import finite, to_float32, weight_f32
from ._packed import Packed, pack
from ._llama4 import chunked_mask
from ._gpt_oss import clamped_swiglu, expert_weights
from ._layers import (ROUTER_TENSORS, Attend, ExpertFetch, ExpertOutputs, ExpertUnavailable, ObserveRoute,
                      causal_mask, decoder_layer, expert_mlp, gqa_attention, linear, matmul_t, mla_attention,
                      predict_experts, rms_norm)
from ._lookahead import LookaheadStats
from ._rope import cos_sin, inv_freq
from ._weights import WeightProvider, derived

Shapes = dict[str, tuple[int, ...]]
_T = TypeVar("_T")


def trunk_shapes(cfg: ModelConfig, layer: int) -> tuple[Shapes, Shapes]:
    """(required, optional) trunk tensors of decoder layer `layer` and their shapes."""
    h = cfg.hidden_size
    req: Shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    opt: Shapes = {}
    a = "self_attn."
    if cfg.mla is None:
        nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        req.update({a + "q_proj.weight": (nh * d, h), a + "k_proj.weight": (kvh * d, h),
                    a + "v_proj.weight": (kvh * d, h), a + "o_proj.weight": (h, nh * d)})
        opt.update({a + "q_proj.bias": (nh * d,), a + "k_proj.bias": (kvh * d,), a + "v_proj.bias": (kvh * d,),
                    a + "o_proj.bias": (h,)})
        if cfg.attention_sinks:
            req[a + "sinks"] = (nh,)
        if cfg.qk_norm == "per_head":
            req.update({a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
        elif cfg.qk_norm == "full":
            req.update({a + "q_norm.weight": (nh * d,), a + "k_norm.weight": (kvh * d,)})
    else:
        m, nh = cfg.mla, cfg.num_heads
        dq = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            req[a + "q_proj.weight"] = (nh * dq, h)
        else:
            req.update({a + "q_a_proj.weight": (m.q_lora_rank, h), a + "q_a_layernorm.weight": (m.q_lora_rank,),
                        a + "q_b_proj.weight": (nh * dq, m.q_lora_rank)})
            opt[a + "q_a_proj.bias"] = (m.q_lora_rank,)
        req.update({a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
                    a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
                    a + "kv_b_proj.weight": (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                    a + "o_proj.weight": (h, nh * m.v_head_dim)})
        opt.update({a + "kv_a_proj_with_mqa.bias": (m.kv_lora_rank + m.qk_rope_head_dim,), a + "o_proj.bias": (h,)})
    if cfg.moe_layers[layer]:
        req["mlp.gate.weight"] = (cfg.num_experts, h)
        if cfg.router == "sigmoid_group":
            req["mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
        if cfg.router_bias:
            req["mlp.gate.bias"] = (cfg.num_experts,)
        shared = {"gated": "mlp.shared_expert.", "plain": "mlp.shared_experts.",
                  "one": "mlp.shared_expert."}.get(cfg.shared_expert)
        if shared:
            req.update(_mlp_shapes(shared, cfg.shared_intermediate_size, h))
        if cfg.shared_expert == "gated":
            req["mlp.shared_expert_gate.weight"] = (1, h)
    else:
        req.update(_mlp_shapes("mlp.", cfg.intermediate_size, h))
    return req, opt


def _mlp_shapes(prefix: str, i: int, h: int) -> Shapes:
    return {prefix + "gate_proj.weight": (i, h), prefix + "up_proj.weight": (i, h), prefix + "down_proj.weight": (h, i)}


def _canonical_trunk_name(name: str) -> str:
    for old, new in MOE_MODULE_ALIASES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _block_scale_of(name: str, required: Shapes) -> bool:
    """`<proj>.weight_scale` of a required [out, in] weight `<proj>.weight`: its block-int8 scales (`pack` checks
    them with the weight)."""
    base = name.removesuffix("." + formats.INT8.scale)
    return base != name and len(required.get(base + ".weight", ())) == 2


def prepare_layer(cfg: ModelConfig, layer: int, tensors: Mapping[str, np.ndarray], *,
                  only: Sequence[str] | None = None) -> dict[str, Packed | np.ndarray]:
    """Trunk tensors of one layer under canonical names, each checked against its expected shape: the weights
    [out, in] as stored (`pack`: views, no copies), the vectors (norms, biases, sinks) as float32; with `only`,
    just those of them (the lookahead's router)."""
    by_name = {_canonical_trunk_name(n): n for n in tensors}
    required, optional = trunk_shapes(cfg, layer)
    if only is not None:
        required = {n: shape for n, shape in required.items() if n in only}
        optional = {n: shape for n, shape in optional.items() if n in only}
    unknown = [n for n in by_name if only is None and n not in required and n not in optional
               and not n.endswith("_scale_inv") and not n.endswith("rotary_emb.inv_freq")
               and not _block_scale_of(n, required)]
    if unknown:
        raise CheckpointFormatError(f"layer {layer}: unexpected tensors {sorted(unknown)} for a {cfg.model_type} "
                                    f"layer", hint="the config.json does not describe these weights")
    canonical = {name: tensors[source] for name, source in by_name.items()}
    out: dict[str, Packed | np.ndarray] = {}
    for name, shape in chain(required.items(), optional.items()):
        if name not in canonical:
            if name in required:
                raise CheckpointFormatError(f"layer {layer}: missing tensor {name}")
            continue
        if len(shape) == 2:  # a weight [out, in]
            out[name] = pack(canonical, name.removesuffix(".weight"), shape, f"layer {layer}",  # type: ignore[arg-type]
                             fp8_block=cfg.fp8_block)
            continue
        array = weight_f32(canonical, name, cfg.fp8_block)
        if array.shape != shape:
            raise CheckpointFormatError(f"layer {layer}: {name} has shape {array.shape}, expected {shape}")
        out[name] = finite(array, f"layer {layer}: {name}")
    return out


def expert_packed(cfg: ModelConfig, layer: int, expert: int,
                  t: Mapping[str, np.ndarray]) -> tuple[Packed, Packed, Packed]:
    """# an expert shard's tensors -> gate [I, H], up [I, H], down [H, I] as stored, checked; once per shard
    (`derived`)."""
    return derived(t, "expert", cfg, lambda t: _pack_expert(cfg, layer, expert, t))


def _pack_expert(cfg: ModelConfig, layer: int, expert: int,
                 t: Mapping[str, np.ndarray]) -> tuple[Packed, Packed, Packed]:
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    where = f"layer {layer} expert {expert}"
    return tuple(pack(t, name, shape, where, fp8_block=cfg.fp8_block)  # type: ignore[return-value]
                 for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))))


def prepare_expert(cfg: ModelConfig, layer: int, expert: int, t: Mapping[str, np.ndarray]) -> None:
    """An expert shard's tensors checked against the config and packed as `run_expert` will use them, kept on the
    shard (`derived`): what a store's reader thread does as the shard loads, so the forward pass finds it done."""
    if cfg.expert_act == "clamped_swiglu":
        derived(t, "expert", cfg, lambda t: expert_weights(cfg, layer, expert, t))
    else:
        expert_packed(cfg, layer, expert, t)


def run_expert(cfg: ModelConfig, layer: int, expert: int, t: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """# the expert's stored tensors, x [m, H] float32 -> its unweighted output [m, H]: what the local forward pass
    and a cluster node both compute for an expert (the coordinator weights and sums them, `moe_experts`)."""
    if cfg.expert_act == "clamped_swiglu":  # gpt-oss: biased projections around the clamped SwiGLU
        w = derived(t, "expert", cfg, lambda t: expert_weights(cfg, layer, expert, t))
        hidden = clamped_swiglu(linear(x, w.gate, w.gate_bias), linear(x, w.up, w.up_bias), cfg.swiglu_alpha,
                                cfg.swiglu_limit)
        return linear(hidden, w.down, w.down_bias)
    return expert_mlp(x, *expert_packed(cfg, layer, expert, t))


class Float32Weights:
    """The model's view of the provider: each shard's tensors checked against the config and its weights packed as
    stored, once per shard the provider hands out (`derived`); float32 is what the products return, never a
    whole weight's copy.

    `remote(layer)`, when given, computes the routed experts instead of the provider (a cluster's nodes); the
    provider then serves only the trunk.

    Lookahead: when the provider has `prefetch_experts(layer, ids)` and its `lookahead` is true, `lookahead(l, x)`
    applies layer l's router to a hidden state that has not reached layer l and hands the predicted experts to the
    provider, which starts reading and verifying them while the layers before l still compute. The layer itself
    routes on its real input: a wrong guess costs a read, never a different result."""

    def __init__(self, cfg: ModelConfig, provider: WeightProvider,
                 remote: Callable[[int], ExpertFetch] | None = None):
        self.cfg = cfg
        self.provider = provider
        self.remote = remote
        self.lookahead_stats = LookaheadStats()
        self._predicted: dict[int, np.ndarray] = {}  # layer -> [T, k] ids predicted for this step's rows
        self._lm_shape = (cfg.vocab_size, cfg.hidden_size)

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:  # [T] -> [T, H]
        table = derived(self.provider.embed(), "embed", self.cfg, self._embed_table)
        return to_float32(table[ids], "model.embed_tokens.weight")  # only the rows used

    def _embed_table(self, embed: Mapping[str, np.ndarray]) -> np.ndarray:  # -> [V, H] as stored
        table = _unwrapped(embed).get("model.embed_tokens.weight")
        if table is None:
            raise CheckpointFormatError("missing tensor model.embed_tokens.weight")
        if table.shape != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise CheckpointFormatError(f"model.embed_tokens.weight has shape {table.shape}, expected "
                                        f"{(self.cfg.vocab_size, self.cfg.hidden_size)}")
        # its dtype checked and every value finite, once per load of its shard (rows are converted as they are used)
        pack({"embed_tokens.weight": table}, "embed_tokens", self._lm_shape, "model")
        return table

    def head(self) -> tuple[np.ndarray, Packed]:  # norm [H] float32, lm_head [V, H] as stored
        norm, lm = derived(self.provider.head(), "head", self.cfg, self._head)
        if lm is None:  # tied: the embedding table, packed once and kept with it (its shard, not the head's)
            lm = derived(self.provider.embed(), "tied_head", self.cfg, lambda t: pack(
                {"embed_tokens.weight": self._embed_table(t)}, "embed_tokens", self._lm_shape, "model"))
        return norm, lm

    def _head(self, head: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Packed | None]:  # None: tied
        t = _unwrapped(head)
        if "model.norm.weight" not in t:
            raise CheckpointFormatError("missing tensor model.norm.weight")
        norm = finite(weight_f32(t, "model.norm.weight"), "model.norm.weight")
        if norm.shape != (self.cfg.hidden_size,):
            raise CheckpointFormatError(f"model.norm.weight has shape {norm.shape}, expected "
                                        f"{(self.cfg.hidden_size,)}")
        if self.cfg.tie_word_embeddings:
            return norm, None
        if "lm_head.weight" not in t:
            raise CheckpointFormatError("missing tensor lm_head.weight", hint="tie_word_embeddings is false")
        return norm, pack(t, "lm_head", self._lm_shape, "model", fp8_block=self.cfg.fp8_block)

    def layer(self, layer: int) -> dict[str, Packed | np.ndarray]:
        return self._trunk(layer, self.provider.layer(layer))

    def _trunk(self, layer: int, tensors: Mapping[str, np.ndarray]) -> dict[str, Packed | np.ndarray]:
        """# a trunk shard's tensors -> the layer's weights, checked and packed once per shard (`prepare_layer`)"""
        return derived(tensors, "trunk", self.cfg, lambda t: prepare_layer(self.cfg, layer, t))

    def layer_derived(self, layer: int, key: str, make: Callable[[dict[str, Packed | np.ndarray]], _T]) -> _T:
        """`make(self.layer(layer))`, computed once per trunk shard the provider hands out and config (`derived`,
        under `key`; at every call for a provider that hands out plain mappings) and found again with one request to
        the provider: what a decode step works out of a layer's weights."""
        return derived(self.provider.layer(layer), key, self.cfg, lambda t: make(self._trunk(layer, t)))

    @property
    def lookahead_on(self) -> bool:
        return (self.remote is None and bool(getattr(self.provider, "lookahead", False))
                and hasattr(self.provider, "prefetch_experts"))

    def lookahead(self, layer: int, hidden: np.ndarray) -> None:
        """# layer l, a hidden state [T, H] on its way to layer l -> its experts predicted and their loads started.
        Nothing for a dense layer, past the last layer, or without a provider that prefetches."""
        self._predicted.pop(layer, None)
        if layer >= self.cfg.num_layers or not self.cfg.moe_layers[layer] or not self.lookahead_on:
            return
        router = derived(self.provider.layer(layer), "router", self.cfg,
                         lambda t: prepare_layer(self.cfg, layer, t, only=ROUTER_TENSORS))
        predicted = predict_experts(hidden, router, self.cfg)  # [T, k]
        self._predicted[layer] = predicted
        if len(predicted) == 1:  # a decode row: its k ids (distinct: every router's top-k), np.unique's order
            self.provider.prefetch_experts(layer, sorted(predicted[0].tolist()))
            return
        ids, rows = np.unique(predicted, return_counts=True)  # most rows first, ties by id
        self.provider.prefetch_experts(layer, [int(e) for e in ids[np.argsort(-rows, kind="stable")]])

    def observer(self, layer: int, observe: ObserveRoute | None) -> ObserveRoute | None:
        """`observe` for layer `layer`'s routing, first scoring it against what the lookahead predicted."""
        predicted = self._predicted.pop(layer, None)
        if predicted is None:
            return observe

        def scored(idx: np.ndarray, scores: np.ndarray) -> None:
            if len(predicted) == len(idx):  # (always, unless a failed step left a guess for other rows)
                self.lookahead_stats.add(predicted, idx)
            if observe is not None:
                observe(idx, scores)
        return scored

    def expert_fetch(self, layer: int) -> ExpertFetch:
        if self.remote is not None:
            return self.remote(layer)

        def fetch(x: np.ndarray, rows: Mapping[int, np.ndarray]) -> ExpertOutputs:
            return _LocalExperts(self.cfg, layer, self.experts(layer, list(rows)), x, rows)
        return fetch

    def expert_projections(self, layer: int, expert: int,
                           t: Mapping[str, np.ndarray]) -> tuple[Packed, Packed, Packed]:
        """# an expert shard's tensors -> gate [I, H], up [I, H], down [H, I] as stored (`expert_packed`)"""
        return expert_packed(self.cfg, layer, expert, t)

    def experts(self, layer: int, ids: list[int]) -> Mapping[int, Mapping[str, np.ndarray]]:
        """The provider's experts `ids` of `layer` (their loads started), each a shard's tensors when it is reached."""
        got = self.provider.experts(layer, ids)
        missing = [e for e in ids if e not in got]
        if missing:
            raise CheckpointFormatError(f"layer {layer}: provider returned no tensors for experts {missing}")
        return got


def _unwrapped(tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """Embed/head tensors under their text-model names: a multimodal checkpoint's wrapper prefix removed."""
    if not any(n.startswith(TEXT_MODEL_WRAPPER) for n in tensors):
        return tensors
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        plain = name.removeprefix(TEXT_MODEL_WRAPPER)
        if plain in out:
            raise CheckpointFormatError(f"tensors {plain!r} and {TEXT_MODEL_WRAPPER + plain!r} are both present")
        out[plain] = array
    return out


class _LocalExperts(Mapping):
    """expert id -> a thunk that takes the expert from the provider and runs it on its rows (packed as stored,
    `expert_packed`), only when the MoE loop reaches it: with a streaming provider, expert e computes while the next one is
    still being read and verified."""

    def __init__(self, cfg: ModelConfig, layer: int, got: Mapping[int, Mapping[str, np.ndarray]], x: np.ndarray,
                 rows: Mapping[int, np.ndarray]):
        self.cfg, self.layer, self.got, self.x, self.rows = cfg, layer, got, x, rows

    def __getitem__(self, expert: int) -> Callable[[], np.ndarray]:
        rows, x = self.rows[expert], self.x
        if len(x) > 1:  # (one row: it is the expert's only row, x itself)
            x = x[rows]
        return lambda: run_expert(self.cfg, self.layer, expert, self.got[expert], x)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class StepTrace:
    """What one forward step saw of one segment's rows, for run receipts: per MoE layer the chosen experts,
    and the last hidden state (after the final norm). With `alternatives` (a receipt's replay), also per MoE
    layer each row's gap between its k-th and (k+1)-th selection score and the two experts on either side of
    it, so a near-tie can be told from a divergence."""

    alternatives: bool = False
    routes: list[np.ndarray] = field(default_factory=list)  # per MoE layer: [t, k] expert ids, rows sorted
    gaps: list[np.ndarray] = field(default_factory=list)  # per MoE layer: [t] float32 (inf when k = E)
    swaps: list[np.ndarray] = field(default_factory=list)  # per MoE layer: [t, 2] (k-th chosen, (k+1)-th best)
    hidden: np.ndarray | None = None  # [t, H] float32

    def observe(self, idx: np.ndarray, scores: np.ndarray) -> None:  # [t, k], [t, E]
        self.routes.append(np.sort(idx, axis=1))
        if not self.alternatives:
            return
        k = idx.shape[1]
        if k >= scores.shape[1]:
            self.gaps.append(np.full(len(idx), np.inf, np.float32))
            self.swaps.append(np.zeros((len(idx), 2), np.int64))
            return
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k + 1]  # [t, k+1]
        best = np.take_along_axis(scores, order, axis=1)
        self.gaps.append((best[:, k - 1] - best[:, k]).astype(np.float32))
        self.swaps.append(order[:, k - 1:k + 1].astype(np.int64))


@dataclass
class Segment:
    """One sequence's rows in a forward step: its new token ids, its own KV cache, and which logits it wants
    ("last": its last row's, "all": every row's, "none"); with a `trace`, what the step saw of its rows."""

    ids: np.ndarray  # [t] int64, t >= 1
    cache: KVCache
    logits: str = "last"
    trace: StepTrace | None = None


def forward_batch(cfg: ModelConfig, weights: Float32Weights, rope: tuple[np.ndarray, float],
                  segments: Sequence[Segment]) -> np.ndarray | None:
    """# segments of t_i token ids -> logits [n, V] for the rows the segments ask for, in segment order
    (None when none asks).

    The rows of every segment go through each layer together: attention runs each segment against its own
    cache and positions, the MLP and the experts run on all rows at once, so an expert chosen by several
    sequences is fetched once per step. Each segment's keys and values are appended to its cache, and every
    cache commits only after the last layer and the head succeeded: a step that fails leaves all as they were.
    """
    if _decode_row.applies(cfg, segments):  # one sequence's decode row: the same result with less Python
        return _decode_row.step(cfg, weights, rope, segments[0])
    for seg in segments:
        seg.cache.check_room(len(seg.ids))
    bounds = list(accumulate([len(seg.ids) for seg in segments], initial=0))  # segment i: rows bounds[i]:bounds[i+1]
    attends = _attends(cfg, rope, segments, bounds)
    traced = [(seg.trace, lo, hi) for seg, lo, hi in zip(segments, bounds, bounds[1:]) if seg.trace is not None]
    observe = None
    if traced:
        def observe(idx: np.ndarray, scores: np.ndarray) -> None:  # [sum t, k], [sum t, E]
            for trace, lo, hi in traced:
                trace.observe(idx[lo:hi], scores[lo:hi])
    ids = segments[0].ids if len(segments) == 1 else np.concatenate([seg.ids for seg in segments])
    x = weights.embed_rows(ids)  # [sum t, H]
    for layer, attend in enumerate(attends):
        x = decoder_layer(x, weights.layer(layer), cfg, layer, attend, weights.expert_fetch(layer),
                          weights.observer(layer, observe))
        weights.lookahead(layer + 1, x)  # layer + 1's experts start loading while its attention computes
    if traced:
        norm, _ = weights.head()
        for trace, lo, hi in traced:
            trace.hidden = rms_norm(x[lo:hi], norm, cfg.rms_norm_eps)
    rows = list(chain.from_iterable(
        range(lo, hi) if seg.logits == "all" else [hi - 1] if seg.logits == "last" else []
        for seg, lo, hi in zip(segments, bounds, bounds[1:])))
    logits = None
    if rows:
        norm, lm_head = weights.head()
        picked = x if len(rows) == len(x) else x[rows]
        logits = matmul_t(rms_norm(picked, norm, cfg.rms_norm_eps), lm_head)
    for seg in segments:
        seg.cache.commit(len(seg.ids))
    return logits


def _attends(cfg: ModelConfig, rope: tuple[np.ndarray, float], segments: Sequence[Segment],
             bounds: Sequence[int]) -> list[Attend]:
    """Per layer, the step's `Attend`: each segment's rows against its own cache, at its own positions, under the
    layer's mask (sliding window, attention chunk), appending the segment's keys and values for that layer. The
    positions' cos/sin and each kind of mask are built once per segment for the whole step."""
    chunks = cfg.attention_chunks or (None,) * cfg.num_layers
    spans = list(zip(cfg.sliding_windows, chunks))  # (sliding window, attention chunk) per layer
    kinds = set(spans)
    rotary = cfg.rope_layers or (True,) * cfg.num_layers  # False: a NoPE layer, given no cos/sin
    where = []  # per segment: cos [t, d], sin [t, d], {span: mask [t, S] or None}
    for seg in segments:
        q_pos = seg.cache.length + np.arange(len(seg.ids))
        cos, sin = cos_sin(rope[0], rope[1], q_pos)
        kv_len = seg.cache.length + len(seg.ids)
        where.append((cos, sin, {(w, c): causal_mask(q_pos, kv_len, w) if c is None else chunked_mask(q_pos, kv_len, c)
                                 for w, c in kinds}))
    attention = mla_attention if cfg.mla is not None else gqa_attention
    attends = []
    for layer, (span, rotated) in enumerate(zip(spans, rotary)):
        # per segment: its rows, and attention's arguments after (x, w, cfg): cos, sin, mask, append_kv
        parts = [(lo, hi, (cos, sin) if rotated else (None, None), masks[span], partial(seg.cache.append, layer))
                 for seg, (cos, sin, masks), lo, hi in zip(segments, where, bounds, bounds[1:])]
        attends.append(_attend(attention, cfg, parts))
    return attends


def _attend(attention: Callable, cfg: ModelConfig, parts: list[tuple]) -> Attend:
    """One layer's `Attend` over the segments' (rows lo:hi, attention's arguments after x, w and cfg)."""
    if len(parts) == 1:  # one sequence: all the rows, no slicing and no concatenation
        (_, _, (cos, sin), mask, append_kv), = parts
        return lambda xn, w: attention(xn, w, cfg, cos, sin, mask, append_kv)

    def attend(xn: np.ndarray, w: Mapping[str, np.ndarray]) -> np.ndarray:  # [sum t, H] -> [sum t, H]
        return np.concatenate([attention(xn[lo:hi], w, cfg, cos, sin, mask, append_kv)
                               for lo, hi, (cos, sin), mask, append_kv in parts])
    return attend


def forward(cfg: ModelConfig, weights: Float32Weights, rope: tuple[np.ndarray, float], ids: np.ndarray,
            cache: KVCache, *, last_only: bool = False, logits: bool = True) -> np.ndarray | None:
    """# [T] token ids -> logits [T, V] ([1, V] with last_only; None without `logits`), appending T positions
    to `cache`: one sequence's step (`forward_batch` with one segment)."""
    want = "none" if not logits else "last" if last_only else "all"
    try:
        return forward_batch(cfg, weights, rope, [Segment(ids, cache, want)])
    except ExpertUnavailable as e:  # one sequence: it needed the expert, so the error is simply its own
        raise e.cause from None


class Model:
    """A decoder over a `WeightProvider`, with its own KV cache.

    `prefill(ids)` starts a new sequence; `decode(id)` extends it by one token. Both return float32 logits.
    """

    def __init__(self, config: ModelConfig, provider: WeightProvider, *, max_tokens: int | None = None,
                 activation_reserve: int | None = None):
        """`activation_reserve`: bytes a forward step's temporaries may take; prefill then runs in chunks
        that fit (`prefill_chunk`). None: the whole prompt in one step."""
        if not isinstance(provider, WeightProvider):
            raise UsageError(f"provider {type(provider).__name__} does not implement WeightProvider")
        self.config = config
        self.provider = provider
        self.activation_reserve = activation_reserve
        self.cache = KVCache(config, max_tokens=max_tokens)
        self._weights = Float32Weights(config, provider)
        self._rope = inv_freq(config.rope)

    def prefill(self, ids: Sequence[int], *, last_only: bool = False, chunk: int | None = None) -> np.ndarray:
        """# [T] -> logits [T, V] ([1, V] with last_only); resets the cache first.

        `chunk`: at most this many tokens per forward step (default: as many as fit the activation reserve,
        `prefill_chunk`), so attention scores are [heads, chunk, T] rather than [heads, T, T]. Each chunk
        attends to the cached keys of the ones before it: the same sums as one step, up to float32 rounding
        in the matmuls.
        """
        tokens = self._check_ids(ids)
        if chunk is None and self.activation_reserve is not None:
            chunk = prefill_chunk(self.config, self.activation_reserve, len(tokens))
        if chunk is not None and chunk < 1:
            raise UsageError(f"prefill chunk must be >= 1 token, got {chunk}")
        self.cache.reset()
        step = len(tokens) if chunk is None else chunk
        outs = []
        for start in range(0, len(tokens), step):
            last = start + step >= len(tokens)
            # Only the final chunk's last row matters with last_only: the others skip the lm_head.
            logits = forward(self.config, self._weights, self._rope, tokens[start:start + step], self.cache,
                             last_only=last_only, logits=last or not last_only)
            if logits is not None:
                outs.append(logits)
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def decode(self, token_id: int) -> np.ndarray:
        """# id -> logits [V] for the next position, after everything prefilled or decoded so far."""
        if self.cache.length == 0:
            raise UsageError("decode() needs a prefilled prompt; call prefill() first")
        tokens = self._check_ids([token_id])
        return forward(self.config, self._weights, self._rope, tokens, self.cache, last_only=True)[0]

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        tokens = np.asarray(ids)
        if tokens.ndim != 1 or len(tokens) == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise UsageError(f"token ids must be a non-empty 1-D sequence of integers, got an array of "
                             f"shape {tokens.shape} and dtype {tokens.dtype}")
        bad = tokens[(tokens < 0) | (tokens >= self.config.vocab_size)]
        if len(bad):
            raise UsageError(f"token id {int(bad[0])} is outside the vocabulary of {self.config.vocab_size}")
        return tokens.astype(np.int64)
