"""The verifying runtime: shard store (`_store`: where every weight is verified before use), the
provider that maps the split layout onto it (`_provider`), and the numpy MoE forward pass (`_model`)."""

from shardtool.runtime._provider import VerifiedWeights
from shardtool.runtime._session import Session, encode_prompt, load_tokenizer
from shardtool.runtime._store import ShardFormatError, ShardStore, StoreStats

__all__ = ["Session", "ShardFormatError", "ShardStore", "StoreStats", "VerifiedWeights", "encode_prompt",
           "load_tokenizer"]
