"""`shardtool serve`'s HTTP layer: an OpenAI-style API over the runtime's engine, which it only feeds.

`_protocol` validates request bodies into typed requests, `_chat` renders the signed chat template (in the worker
processes of `_render`, each render bounded in time and memory), `_text` turns token ids into text deltas and
applies stop strings, `_metrics` is GET /metrics, `_receipts` signs and keeps run receipts, `_health` says what
GET /health reports about the weights, `_access` who may call the routes, `_app` the routes and their responses
(JSON or server-sent events), `_server` runs it under uvicorn with timeouts, caps and TLS.

The names below are loaded from their module at first use (PEP 562): a chat template worker imports `_chat`
without the runtime's numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "_access": ("Access",),
    "_app": ("Limits", "create_app"),
    "_chat": ("ChatTemplate",),
    "_receipts": ("ReceiptSigner",),
    "_server": ("ServerSettings", "Stopped", "bind", "check_tls_files", "run", "stop_on_signals", "url_of"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_HOME_OF)


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
