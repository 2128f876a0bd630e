"""Run receipts in `shardtool serve`: the operator's key signs each finished answer's record, and the signed
receipts are kept in a bounded LRU store for `GET /v1/receipts/{id}` (and its routing trace).

Signing (canonical encoding, the routing trace's Merkle root, Ed25519) runs on a worker thread, never on the
event loop or on the engine's thread. The store holds at most `capacity` receipts and `max_bytes` of receipt
and trace bytes (it lives outside the engine's memory budget); the least recently stored or fetched one is
evicted first, and evictions are counted for /metrics.
"""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict

from shardtool.manifest import RECEIPT_FORMAT
from shardtool.runtime import RunRecord, SignedReceipt, make_receipt

MAX_RECEIPTS = 1 << 20  # the largest --max-receipts: each entry holds a receipt and its trace in memory

# Why a response carries "receipt": null (the "receipt_unavailable" field names one of these).
STOP_STRING = ("stop_string", "a stop string ended the answer: the engine stopped it between two tokens, which "
                              "no receipt's finish_reason (stop: a stop token; length: max_tokens reached) can "
                              "state; ask without `stop` (and cut the text yourself) to get a receipt")
NO_NEW_TOKENS = ("no_new_tokens", "max_tokens 0 scored the prompt and generated nothing: a receipt binds the tokens "
                                  "an answer generated, and there are none (the scores came from the same verified "
                                  "weights; ask for at least one token to get a receipt)")

RECEIPT_HELP = {
    "receipts_signed_total": "Run receipts signed (one per finished completion).",
    "receipts_evicted_total": "Run receipts evicted from the in-memory store (--max-receipts).",
    "receipts_unavailable_total": "Finished completions that got no receipt (a stop string ended them, or max_tokens 0 generated nothing).",
    "receipts_stored": "Run receipts held in the in-memory store.",
    "receipts_stored_bytes": "Receipt and routing-trace bytes held in the in-memory store (--max-receipt-bytes).",
}


class ReceiptStore:
    """Thread-safe bounded LRU of signed receipts by id."""

    def __init__(self, capacity: int, max_bytes: int = 256 * 2**20):
        if not 1 <= capacity <= MAX_RECEIPTS or max_bytes < 1:
            raise ValueError(f"receipt store capacity {capacity} (1..{MAX_RECEIPTS}) or max_bytes {max_bytes} (>= 1)")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, SignedReceipt] = OrderedDict()
        self._lock = threading.Lock()
        self.signed = 0
        self.evicted = 0
        self.unavailable = 0

    def put(self, signed: SignedReceipt) -> None:
        with self._lock:
            old = self._items.pop(signed.id, None)  # ids are random: a repeat is a replacement, not a second entry
            if old is not None:
                self.bytes -= _size(old)
            self._items[signed.id] = signed
            self.bytes += _size(signed)
            self.signed += 1
            # The newest stays even alone over max_bytes: the response that names it must be able to serve it.
            while len(self._items) > self.capacity or (self.bytes > self.max_bytes and len(self._items) > 1):
                _, gone = self._items.popitem(last=False)
                self.bytes -= _size(gone)
                self.evicted += 1

    def get(self, receipt_id: str) -> SignedReceipt | None:
        with self._lock:
            signed = self._items.get(receipt_id)
            if signed is not None:
                self._items.move_to_end(receipt_id)
            return signed

    def count_unavailable(self) -> None:
        with self._lock:
            self.unavailable += 1

    def metrics(self) -> dict[str, int]:
        with self._lock:
            return {"receipts_signed_total": self.signed, "receipts_evicted_total": self.evicted,
                    "receipts_unavailable_total": self.unavailable, "receipts_stored": len(self._items),
                    "receipts_stored_bytes": self.bytes}


def _size(signed: SignedReceipt) -> int:
    return len(signed.data) + len(signed.trace)


class ReceiptSigner:
    """Signs a finished request's RunRecord with the operator key over the served manifest's weights."""

    def __init__(self, key, manifest, config, capacity: int, max_bytes: int):
        self.key, self.manifest, self.config = key, manifest, config
        self.store = ReceiptStore(capacity, max_bytes)

    def sign(self, record: RunRecord) -> dict:
        """Blocking (call it on a worker thread): the receipt object a response carries."""
        signed = make_receipt(record, self.manifest, self.config, self.key)
        self.store.put(signed)
        return response_object(signed)


def response_object(signed: SignedReceipt) -> dict:
    return {"id": signed.id, "format": RECEIPT_FORMAT, "data": base64.b64encode(signed.data).decode("ascii"),
            "trace_url": f"/v1/receipts/{signed.id}/trace"}
