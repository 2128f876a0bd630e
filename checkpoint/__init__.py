"""Hugging Face MoE checkpoints in and out of the split layout (docs/shard-layout.md), and their resource contract.

`split_checkpoint` streams a checkpoint into per-expert and trunk shards with an unsigned manifest;
`join_checkpoint` rebuilds it from verified shards; `parse_safetensors` parses verified shard bytes.
"""

from shardtool.checkpoint._contract import (
    DEFAULT_CONTEXT_TOKENS,
    KEYS as CONTRACT_KEYS,
    check_contract_keys,
    Estimate,
    ModelShape,
    contract_from_config,
    estimate,
    expected_hit_rate,
    model_shape,
    seconds_per_token_at,
)
from shardtool.checkpoint._plot import MeasuredPoint, contract_svg, measured_point
from shardtool.families import SUPPORTED_FAMILIES, detect_family
from shardtool.checkpoint._join import JoinResult, join_checkpoint
from shardtool.checkpoint._source import load_json
from shardtool.checkpoint._writer import TensorSpec, encode_header
from shardtool.safetensors_format import (
    DTYPE_SIZES,
    Header,
    TensorInfo,
    numpy_dtype,
    parse_header,
    parse_safetensors,
    read_header,
)
from shardtool.checkpoint._split import (OMS_RECORD_NAME, SplitJob, SplitResult, default_model_id, prepare_split,
                                         run_split, split_checkpoint, with_oms_record)

__all__ = [
    "check_contract_keys", "default_model_id", "load_json",
    "CONTRACT_KEYS", "DEFAULT_CONTEXT_TOKENS", "DTYPE_SIZES", "Estimate", "Header", "JoinResult", "ModelShape",
    "SUPPORTED_FAMILIES", "SplitJob", "SplitResult", "TensorInfo", "TensorSpec", "contract_from_config",
    "detect_family", "encode_header", "estimate", "expected_hit_rate", "seconds_per_token_at", "MeasuredPoint",
    "contract_svg", "measured_point", "join_checkpoint", "model_shape", "numpy_dtype", "parse_header",
    "parse_safetensors", "prepare_split", "read_header", "run_split", "split_checkpoint", "OMS_RECORD_NAME",
    "with_oms_record",
]
