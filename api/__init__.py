"""The library under the commands, in three calls: `open_model` (a verified model to generate with: what
`verify-and-run` and `serve` do), `sign` (a publisher's signature on a split model's manifest: `shardtool sign`) and
`verify` / `audit` (a directory checked against trusted keys: `shardtool audit`, raising or reporting).
`import shardtool; shardtool.open_model(...)` reaches them through the package's face; docs/library.md shows how.

The runtime's names are imported on first use (PEP 562): `sign` and `audit` do not load numpy."""

from typing import Any

from shardtool.api._oms import OmsAudit, OmsExport, audit_oms, export_oms, trusted_oms
from shardtool.api._publish import Audit, Signed, audit, audit_files, sign, trusted_manifest, verify

_RUNTIME = ("Generation", "VerifiedModel", "open_model")

__all__ = ["Audit", "OmsAudit", "OmsExport", "Signed", "audit", "audit_files", "audit_oms", "export_oms", "sign",
           "trusted_manifest", "trusted_oms", "verify", *_RUNTIME]


def __getattr__(name: str) -> Any:
    if name not in _RUNTIME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import shardtool.runtime

    value = getattr(shardtool.runtime, name)
    globals()[name] = value
    return value
