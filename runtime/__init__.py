"""The verifying runtime: shard store (`_store`: where every weight is verified before use), the
provider that maps the split layout onto it (`_provider`), and the numpy MoE forward pass (`_model`)."""

from shardtool.runtime._provider import VerifiedWeights
from shardtool.runtime._store import ShardFormatError, ShardStore, StoreStats

__all__ = ["ShardFormatError", "ShardStore", "StoreStats", "VerifiedWeights"]
