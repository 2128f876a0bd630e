"""Signed run receipts: what a run claims (weights, request, answer, routing, activations), as bytes.

A receipt is a DSSE envelope (payloadType `RECEIPT_PAYLOAD_TYPE`, Ed25519, canonical msgpack like the
manifest) signed by the operator. Pure functions of bytes and keys: `sign_receipt` makes one,
`open_receipt` checks the operator's signature first and only then decodes the payload, field by field,
with caps; nothing in it is trusted before that. Whether the claims are *true* is the replay's question
(`shardtool.runtime.replay_receipt`). docs/receipt-format.md is the specification.

The routing trace (per fed position, per MoE layer, the chosen expert ids) is committed by a Merkle root
(RFC 9162 shape, BLAKE3, one leaf per position), so one position can be opened alone; the trace itself is a
separate, unsigned file whose root must equal the signed one (`decode_trace`).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from shardtool.errors import ManifestFormatError
from shardtool.keys import PrivateKey, PublicKey
from shardtool.manifest import _canonical
from shardtool.manifest._envelope import Envelope, verify_envelope
from shardtool.manifest._merkle import HASH_SIZE, blake3_256, leaf_hash, root_from_leaf_hashes

RECEIPT_FORMAT = "shardtool-receipt/1"
RECEIPT_PAYLOAD_TYPE = "application/vnd.shardtool.run-receipt+msgpack"
RECEIPT_TYPE = "shardtool/run-receipt"
RECEIPT_VERSION = 1
TRACE_FORMAT = "shardtool-routing-trace/1"
ROUTING_SCHEME = "route-leaf/u32le"  # leaf data: position u32 LE, then [layers, k] expert ids u32 LE, rows sorted
FINGERPRINT_SCHEME = "top1-abs/u32le-f32le"  # per fed position: index of max |h|, u32 LE; h at it, f32 LE
FINGERPRINT_BYTES = 8  # per position
FINISH_REASONS = ("length", "stop")

# Caps, all checked before the thing capped is used.
MAX_RECEIPT_BYTES = 16 * 2**20  # the file; checked against fstat before a byte is read
MAX_RECEIPT_PAYLOAD = 12 * 2**20
MAX_POSITIONS = 1 << 20  # prompt + answer tokens
MAX_TOKEN_ID = (1 << 31) - 1
MAX_NEW_TOKENS = 1 << 20
MAX_STOP_IDS = 1024
MAX_MOE_LAYERS = 1024
MAX_TOP_K = 64
MAX_EXPERT_ID = (1 << 20) - 1
MAX_SEED = 2**64 - 1
MAX_TRACE_BYTES = _canonical.MAX_BIN + 4096
_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+:@-]{0,255}")


def valid_receipt_id(receipt_id: str) -> bool:
    """A receipt ID as the payload's `id` rule allows it (an HTTP path names one before anything is looked up)."""
    return _ID.fullmatch(receipt_id) is not None


if TYPE_CHECKING:  # numpy is imported where arrays are made: the manifest commands never load it
    import numpy as np


@dataclass(frozen=True)
class Receipt:
    """A decoded receipt payload: authentic (the operator signed it), not yet known to be true."""

    id: str
    created: int
    model_id: str
    manifest_version: int
    merkle_root: bytes
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    moe_layers: tuple[int, ...]
    top_k: int
    routing_root: bytes
    fingerprint: bytes  # FINGERPRINT_BYTES per fed position

    @property
    def positions(self) -> int:
        """Fed positions: the prompt and every generated token but the last (which no step consumed)."""
        return len(self.prompt_ids) + len(self.token_ids) - 1

    def fed_ids(self) -> np.ndarray:  # [positions] int64
        import numpy as np

        return np.asarray(self.prompt_ids + self.token_ids[:-1], dtype=np.int64)

    def fingerprint_arrays(self) -> tuple[np.ndarray, np.ndarray]:  # [positions] uint32, [positions] float32
        import numpy as np

        rows = np.frombuffer(self.fingerprint, dtype=np.dtype([("i", "<u4"), ("v", "<f4")]))
        return rows["i"].astype(np.int64), rows["v"].astype(np.float32)

    def to_payload(self) -> dict[str, Any]:
        return {
            "type": RECEIPT_TYPE, "version": RECEIPT_VERSION, "id": self.id, "created": self.created,
            "model": {"model_id": self.model_id, "manifest_version": self.manifest_version,
                      "merkle_root": self.merkle_root},
            "request": {"prompt_ids": list(self.prompt_ids), "max_new_tokens": self.max_new_tokens,
                        "temperature": _f64(self.temperature), "top_p": _f64(self.top_p), "seed": self.seed,
                        "stop_token_ids": list(self.stop_token_ids)},
            "answer": {"token_ids": list(self.token_ids), "finish_reason": self.finish_reason},
            "routing": {"scheme": ROUTING_SCHEME, "moe_layers": list(self.moe_layers), "top_k": self.top_k,
                        "root": self.routing_root},
            "fingerprint": {"scheme": FINGERPRINT_SCHEME, "data": self.fingerprint},
        }


def _f64(x: float) -> bytes:
    """A float as its IEEE 754 binary64 bytes, big-endian: exact, and one encoding per value."""
    return struct.pack(">d", float(x))


# ---------------------------------------------------------------- the routing trace and its Merkle root

def routing_leaves(routes: np.ndarray, start: int = 0) -> list[bytes]:
    """# [t, layers, k] expert ids (each row sorted ascending) -> t leaf hashes, positions start..start+t-1."""
    import numpy as np

    rows = np.ascontiguousarray(routes, dtype="<u4").reshape(len(routes), -1)
    return [leaf_hash(blake3_256, struct.pack("<I", start + i) + rows[i].tobytes()) for i in range(len(rows))]


def routing_root(leaves: Sequence[bytes]) -> bytes:
    return root_from_leaf_hashes(blake3_256, leaves)


def encode_trace(receipt_id: str, moe_layers: Sequence[int], top_k: int, routes: np.ndarray) -> bytes:
    """The routing trace file: every fed position's chosen experts, [positions, layers, k] u32 LE."""
    import numpy as np

    return _canonical.encode({"format": TRACE_FORMAT, "receipt_id": receipt_id, "moe_layers": list(moe_layers),
                              "top_k": top_k, "positions": len(routes),
                              "routes": np.ascontiguousarray(routes, dtype="<u4").tobytes()})


def decode_trace(data: bytes, receipt: Receipt) -> np.ndarray:
    """# trace bytes -> routes [positions, layers, k], once its root is the receipt's signed routing root."""
    import numpy as np

    d = _canonical.take_fields(_canonical.decode(data, max_size=MAX_TRACE_BYTES, what="routing trace"),
                               ("format", "receipt_id", "moe_layers", "top_k", "positions", "routes"),
                               "routing trace")
    if d["format"] != TRACE_FORMAT:
        raise ManifestFormatError(f"routing trace format is {d['format']!r}, expected {TRACE_FORMAT!r}")
    if d["receipt_id"] != receipt.id:
        raise ManifestFormatError(f"routing trace is for receipt {str(d['receipt_id'])[:64]!r}, not {receipt.id!r}")
    if d["moe_layers"] != list(receipt.moe_layers) or d["top_k"] != receipt.top_k \
            or d["positions"] != receipt.positions:
        raise ManifestFormatError("routing trace shape (layers, top_k, positions) differs from the receipt's")
    shape = (receipt.positions, len(receipt.moe_layers), receipt.top_k)
    raw = d["routes"]
    if not isinstance(raw, bytes) or len(raw) != 4 * shape[0] * shape[1] * shape[2]:
        raise ManifestFormatError(f"routing trace routes must be {4 * shape[0] * shape[1] * shape[2]} bytes")
    routes = np.frombuffer(raw, dtype="<u4").reshape(shape).astype(np.int64)
    if routing_root(routing_leaves(routes)) != receipt.routing_root:
        raise ManifestFormatError("routing trace does not hash to the receipt's signed routing root")
    return routes


# ---------------------------------------------------------------- signing and opening

def sign_receipt(receipt: Receipt, key: PrivateKey) -> bytes:
    """The receipt file's bytes: the canonical payload in a DSSE envelope signed by `key`."""
    payload = _canonical.encode(receipt.to_payload())
    decode_payload(payload)  # what we sign must be what a verifier accepts
    envelope = Envelope(RECEIPT_PAYLOAD_TYPE, payload, (), MAX_RECEIPT_PAYLOAD).signed_by(key)
    return _canonical.encode({"format": RECEIPT_FORMAT, "envelope": envelope.to_dict()})


def open_receipt(data: bytes, operators: Sequence[PublicKey]) -> tuple[Receipt, PublicKey]:
    """Receipt file bytes -> (receipt, the operator key that signed it). Signature first (one of the operator
    keys), then the payload type, and only then is the payload decoded, with caps."""
    doc = _canonical.decode(data, max_size=MAX_RECEIPT_BYTES, what="receipt")
    d = _canonical.take_fields(doc, ("format", "envelope"), "receipt")
    if d["format"] != RECEIPT_FORMAT:
        raise ManifestFormatError(f"receipt format is {str(d['format'])[:64]!r}, expected {RECEIPT_FORMAT!r}")
    envelope = Envelope.from_dict(d["envelope"], max_payload=MAX_RECEIPT_PAYLOAD)
    payload, signers = verify_envelope(envelope, operators, 1, RECEIPT_PAYLOAD_TYPE, what="receipt",
                                       signer_hint="receipts are signed by the serving operator's key")
    return decode_payload(payload), signers[0]


def decode_payload(payload: bytes) -> Receipt:
    """Strictly decode a receipt payload: every field present, typed and capped; nothing else."""
    d = _canonical.take_fields(_canonical.decode(payload, max_size=MAX_RECEIPT_PAYLOAD, what="receipt payload"),
                               ("type", "version", "id", "created", "model", "request", "answer", "routing",
                                "fingerprint"), "receipt")
    if d["type"] != RECEIPT_TYPE or type(d["version"]) is not int or d["version"] != RECEIPT_VERSION:  # True == 1
        raise ManifestFormatError(f"receipt type/version is {str(d['type'])[:64]!r}/{str(d['version'])[:20]}, "
                                  f"expected {RECEIPT_TYPE!r}/{RECEIPT_VERSION}")
    model = _canonical.take_fields(d["model"], ("model_id", "manifest_version", "merkle_root"), "receipt.model")
    req = _canonical.take_fields(d["request"], ("prompt_ids", "max_new_tokens", "temperature", "top_p", "seed",
                                                "stop_token_ids"), "receipt.request")
    ans = _canonical.take_fields(d["answer"], ("token_ids", "finish_reason"), "receipt.answer")
    rt = _canonical.take_fields(d["routing"], ("scheme", "moe_layers", "top_k", "root"), "receipt.routing")
    fp = _canonical.take_fields(d["fingerprint"], ("scheme", "data"), "receipt.fingerprint")
    receipt = Receipt(
        id=_text(d["id"], _ID, "receipt.id"),
        created=_int(d["created"], 0, 2**40, "receipt.created"),
        model_id=_text(model["model_id"], _MODEL_ID, "receipt.model.model_id"),
        manifest_version=_int(model["manifest_version"], 1, 2**63 - 1, "receipt.model.manifest_version"),
        merkle_root=_digest(model["merkle_root"], "receipt.model.merkle_root"),
        prompt_ids=_ids(req["prompt_ids"], 1, MAX_POSITIONS, MAX_TOKEN_ID, "receipt.request.prompt_ids"),
        max_new_tokens=_int(req["max_new_tokens"], 1, MAX_NEW_TOKENS, "receipt.request.max_new_tokens"),
        temperature=_float(req["temperature"], 0.0, 1e6, "receipt.request.temperature"),
        top_p=_float(req["top_p"], 0.0, 1.0, "receipt.request.top_p"),
        seed=_int(req["seed"], 0, MAX_SEED, "receipt.request.seed"),
        stop_token_ids=_ids(req["stop_token_ids"], 0, MAX_STOP_IDS, MAX_TOKEN_ID, "receipt.request.stop_token_ids"),
        token_ids=_ids(ans["token_ids"], 1, MAX_NEW_TOKENS, MAX_TOKEN_ID, "receipt.answer.token_ids"),
        finish_reason=_choice(ans["finish_reason"], FINISH_REASONS, "receipt.answer.finish_reason"),
        moe_layers=_ids(rt["moe_layers"], 0, MAX_MOE_LAYERS, 65_535, "receipt.routing.moe_layers"),
        top_k=_int(rt["top_k"], 1, MAX_TOP_K, "receipt.routing.top_k"),
        routing_root=_digest(rt["root"], "receipt.routing.root"),
        fingerprint=fp["data"] if isinstance(fp["data"], bytes) else b"\0",  # type checked below
    )
    _choice(rt["scheme"], (ROUTING_SCHEME,), "receipt.routing.scheme")
    _choice(fp["scheme"], (FINGERPRINT_SCHEME,), "receipt.fingerprint.scheme")
    check_consistent(receipt, fp["data"])
    return receipt


def check_consistent(r: Receipt, fingerprint: Any = None) -> None:
    """The rules any honest receipt keeps whatever the model: sizes agree, the top_p is usable, and the
    answer ends exactly as its finish reason says (no stop token before the end, none missing at it)."""
    fingerprint = r.fingerprint if fingerprint is None else fingerprint
    if r.top_p <= 0:
        raise ManifestFormatError(f"receipt.request.top_p must be in (0, 1], got {r.top_p}")
    if r.positions > MAX_POSITIONS:
        raise ManifestFormatError(f"receipt covers {r.positions} positions, more than {MAX_POSITIONS}")
    if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES * r.positions:
        raise ManifestFormatError(f"receipt.fingerprint.data must be {FINGERPRINT_BYTES * r.positions} bytes "
                                  f"({FINGERPRINT_BYTES} per fed position)")
    if list(r.stop_token_ids) != sorted(set(r.stop_token_ids)):
        raise ManifestFormatError("receipt.request.stop_token_ids must be sorted and distinct")
    if list(r.moe_layers) != sorted(set(r.moe_layers)) or not r.moe_layers:
        raise ManifestFormatError("receipt.routing.moe_layers must be a non-empty, sorted list of distinct layers")
    if len(r.token_ids) > r.max_new_tokens:
        raise ManifestFormatError(f"receipt answer has {len(r.token_ids)} tokens, more than max_new_tokens "
                                  f"{r.max_new_tokens}")
    stops = set(r.stop_token_ids)
    early = next((i for i, t in enumerate(r.token_ids[:-1]) if t in stops), None)
    if early is not None:
        raise ManifestFormatError(f"receipt answer continues past stop token {r.token_ids[early]} at new token "
                                  f"{early}")
    if r.finish_reason == "stop" and r.token_ids[-1] not in stops:
        raise ManifestFormatError("receipt says the answer ended on a stop token, and its last token is none")
    if r.finish_reason == "length" and (r.token_ids[-1] in stops or len(r.token_ids) != r.max_new_tokens):
        raise ManifestFormatError(f"receipt says the answer reached max_new_tokens ({r.max_new_tokens}) and it "
                                  f"has {len(r.token_ids)} tokens" + (", the last a stop token"
                                                                     if r.token_ids[-1] in stops else ""))


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ManifestFormatError(f"{what} must be an integer in [{lo}, {hi}], got {str(v)[:40]}")
    return v


def _text(v: Any, pattern: re.Pattern, what: str) -> str:
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise ManifestFormatError(f"{what} is not a valid identifier: {str(v)[:64]!r}")
    return v


def _digest(v: Any, what: str) -> bytes:
    if not isinstance(v, bytes) or len(v) != HASH_SIZE:
        raise ManifestFormatError(f"{what} must be {HASH_SIZE} bytes")
    return v


def _float(v: Any, lo: float, hi: float, what: str) -> float:
    if not isinstance(v, bytes) or len(v) != 8:
        raise ManifestFormatError(f"{what} must be 8 bytes (IEEE 754 binary64, big-endian)")
    x = struct.unpack(">d", v)[0]
    if not lo <= x <= hi:  # also refuses NaN
        raise ManifestFormatError(f"{what} must be in [{lo}, {hi}], got {x}")
    return x


def _choice(v: Any, allowed: tuple[str, ...], what: str) -> str:
    if v not in allowed:
        raise ManifestFormatError(f"{what} is {str(v)[:40]!r}, expected one of {', '.join(allowed)}")
    return v


def _ids(v: Any, min_len: int, max_len: int, hi: int, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not min_len <= len(v) <= max_len:
        raise ManifestFormatError(f"{what} must be a list of {min_len} to {max_len} integers")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= hi:
            raise ManifestFormatError(f"{what} holds {str(x)[:40]}, not an integer in [0, {hi}]")
    return tuple(v)
