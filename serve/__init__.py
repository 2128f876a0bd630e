"""`shardtool serve`'s HTTP layer: an OpenAI-style API over the runtime's engine, which it only feeds.

`_protocol` validates request bodies into typed requests, `_chat` renders the signed chat template, `_text`
turns token ids into text deltas and applies stop strings, `_metrics` is GET /metrics, `_receipts` signs and keeps
run receipts, `_app` the routes and responses (JSON or server-sent events), `_server` runs it under uvicorn with
timeouts and caps.
"""

from shardtool.serve._app import Access, Limits, create_app
from shardtool.serve._chat import ChatTemplate
from shardtool.serve._health import verify_all_first
from shardtool.serve._receipts import ReceiptSigner
from shardtool.serve._server import ServerSettings, Stopped, bind, run, stop_on_signals, url_of

__all__ = ["Access", "ChatTemplate", "Limits", "ReceiptSigner", "ServerSettings", "Stopped", "bind", "create_app", "run",
           "stop_on_signals", "url_of", "verify_all_first"]
