"""A shard's tensors checked against the config and packed as stored (views, no copies): a decoder layer's trunk
(`prepare_layer`) and a routed expert's projections (`expert_packed`), and one expert run on its rows (`run_expert`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

import numpy as np

from shardtool import formats
from shardtool.errors import CheckpointFormatError
from shardtool.families import MOE_MODULE_ALIASES

from ._config import ModelConfig
from ._dtypes import finite, weight_f32
from ._gpt_oss import clamped_swiglu, expert_weights
from ._layers import expert_mlp, linear
from ._packed import Packed, pack
from ._weights import derived

Shapes = dict[str, tuple[int, ...]]


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
