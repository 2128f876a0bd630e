"""shardtool: signed weight supply chain and verifying runtime for Mixture-of-Experts models.

Where things are:
- `shardtool.manifest`  the signed Merkle manifest format (pure functions of bytes) and audit
- `shardtool.keys`      Ed25519 key files and key IDs
- `shardtool.runtime`   the verifying shard store and the numpy MoE forward pass
- `shardtool.checkpoint` Hugging Face checkpoints: split / join / inspect
- `shardtool.api`       the library under the commands: `open_model`, `sign`, `verify` (docs/library.md)
- `shardtool.cli`       the command-line face (`shardtool`, `verify-and-run`)

`shardtool.open_model`, `shardtool.sign`, `shardtool.verify` and `shardtool.audit` are `shardtool.api`'s, imported
on first use (PEP 562): this base floor imports nothing above it until a caller asks for them.
"""

from typing import Any

__version__ = "0.1.0"

_API = ("open_model", "sign", "verify", "audit")

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import shardtool.api  # the one upward import of the base floor (tests/test_architecture.py allows only it)

    value = getattr(shardtool.api, name)
    globals()[name] = value
    return value
