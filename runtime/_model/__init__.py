"""The numpy forward pass of Mixture-of-Experts decoders (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3/Kimi-K2,
Llama 4 text).

Weights arrive only through a `WeightProvider`; this package never opens a file.
"""

from ._cache import KVCache, bytes_per_token
from ._config import MlaConfig, ModelConfig, RopeConfig
from ._dtypes import dequantize, quantize_fp8, to_float32
from ._forward import (Float32Weights, Model, Segment, StepTrace, forward, forward_batch, prepare_layer, run_expert,
                       trunk_shapes)
from ._layers import (ExpertFetch, ExpertOutputs, ExpertUnavailable, attention, decoder_layer, expert_mlp, gqa_attention, mla_attention, moe_layer, rms_norm,
                      route_deepseek, route_softmax_topk)
from ._rope import apply_rope, apply_rope_interleave
from ._sampling import sample_token
from ._weights import DictWeightProvider, WeightProvider

__all__ = [
    "DictWeightProvider", "ExpertFetch", "ExpertOutputs", "ExpertUnavailable", "Float32Weights", "KVCache", "MlaConfig", "Model", "ModelConfig", "RopeConfig",
    "WeightProvider", "apply_rope", "apply_rope_interleave", "attention", "bytes_per_token", "decoder_layer",
    "dequantize", "expert_mlp", "forward", "gqa_attention", "mla_attention", "moe_layer",
    "Segment", "StepTrace", "forward_batch", "prepare_layer", "quantize_fp8", "rms_norm", "route_deepseek", "route_softmax_topk", "run_expert", "sample_token",
    "to_float32", "trunk_shapes",
]
