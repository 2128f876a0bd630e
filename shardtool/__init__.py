"""shardtool: signed weight supply chain and verifying runtime for Mixture-of-Experts models.

Where things are:
- `shardtool.manifest`  the signed Merkle manifest format (pure functions of bytes) and audit
- `shardtool.keys`      Ed25519 key files and key IDs
- `shardtool.runtime`   the verifying shard store and the numpy MoE forward pass
- `shardtool.checkpoint` Hugging Face checkpoints: split / join / inspect
- `shardtool.cli`       the command-line face (`shardtool`, `verify-and-run`)
"""

__version__ = "0.1.0"
