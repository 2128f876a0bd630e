"""The model floor of the runtime: the numpy (and native) forward pass of Mixture-of-Experts decoders (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V3/Kimi-K2, Llama 4 text, gpt-oss): config, stored formats and packing, numerics and
kernels.

Weights arrive only through a `WeightProvider`, and the lookahead's guesses leave only through a `Prefetcher`: this
package never opens a file and imports nothing of the store or the engine above it.
"""

from ._activations import prefill_chunk, step_bytes, step_rows
from ._cache import KVCache, bytes_per_token
from ._config import MlaConfig, ModelConfig, RopeConfig
from ._dtypes import dequantize, to_float32
from ._forward import Layers, Model, forward, forward_batch, run_layers, step_attends
from ._layers import (ExpertFetch, ExpertOutputs, ExpertUnavailable, attention, decoder_layer, expert_mlp, gqa_attention,
                      mla_attention, moe_layer, rms_norm, route_deepseek, route_softmax_topk)
from ._packed import MAX_THREADS, kernels, set_threads
from ._prepare import prepare_expert, prepare_layer, run_expert, trunk_shapes
from ._rope import apply_rope, apply_rope_interleave, inv_freq
from ._segment import Segment, StepTrace
from ._view import PackedWeights
from ._weights import DictWeightProvider, Prefetcher, Tensors, WeightProvider

__all__ = [
    "DictWeightProvider", "ExpertFetch", "ExpertOutputs", "ExpertUnavailable", "KVCache", "MAX_THREADS",
    "MlaConfig", "Model", "ModelConfig", "PackedWeights", "Prefetcher", "RopeConfig", "Tensors",
    "WeightProvider", "apply_rope", "apply_rope_interleave", "attention", "bytes_per_token", "decoder_layer",
    "dequantize", "expert_mlp", "forward", "gqa_attention", "inv_freq", "kernels", "mla_attention", "moe_layer",
    "Layers", "Segment", "StepTrace", "forward_batch", "run_layers", "step_attends", "prefill_chunk", "prepare_expert", "prepare_layer",
    "rms_norm", "route_deepseek", "route_softmax_topk", "run_expert", "set_threads", "step_bytes", "step_rows",
    "to_float32", "trunk_shapes",
]
