"""The verifying runtime: shard store and the numpy MoE forward pass."""
