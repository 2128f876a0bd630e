"""`shardtool serve`'s HTTP layer: an OpenAI-style API over the runtime's engine, which it only feeds.

`_protocol` validates request bodies into typed requests, `_chat` renders the signed chat template (in the worker
processes of `_render`, each render bounded in time and memory), `_text` turns token ids into text deltas and
applies stop strings, `_scores` shows token scores (logprobs) in OpenAI's shapes, `_handoff` carries a request's engine events to the event loop (waking it only when the
reader can use them), `_metrics` is GET /metrics, `_receipts` signs and keeps run receipts, `_health` says what
GET /health reports about the weights, `_access` who may call the routes, `_app` the routes and their responses
(JSON or server-sent events), `_server` runs it under uvicorn with timeouts, caps and TLS.

The names below are loaded from their module at first use (PEP 562): a chat template worker imports `_chat`
without the runtime's numpy.
"""

from __future__ import annotations

from shardtool.lazy import lazy_exports

_HOMES = {
    "_access": ("Access",),
    "_app": ("Limits", "create_app"),
    "_chat": ("ChatTemplate",),
    "_receipts": ("ReceiptSigner",),
    "_server": ("ServerSettings", "Stopped", "bind", "check_tls_files", "run", "stop_on_signals", "url_of"),
}

__all__, __getattr__, __dir__ = lazy_exports(globals(), _HOMES)
