"""The wire form of a cluster's calls and answers: msgpack maps of plain types (no ext types, size caps), arrays as
{"dtype", "shape", "data": raw bytes}. What crosses the coordinator's pipe to its cluster proxy, and what a node's
actor takes and returns for a `run` call: one bytes object each way, which Ray carries as it is (no pickled arrays
to rebuild on either side) and the proxy forwards without reading.

    a call:    {"layer", "experts", "x": array [n, H] float32, "rows": [[expert, array [t_e] int64], ...], "nonce",
                "session": the session id (`_cluster_session`) whose key authenticates the answer}
    a span call (a pipeline plan's node runs its layers): {"session": its id, "span_call": bytes, "mac": keyed
                BLAKE3 of those bytes under the session's key}, the bytes a msgpack map {"span": [first layer,
                last layer + 1], "x": array [n, H] float32, "segments": [[sequence, start, t], ...] (the rows of
                each sequence, in order), "drop": [sequence, ...] (sequences whose keys the node may forget),
                "routes": bool, "nonce", "number": the session's call number, increasing}. A span node keeps
                state (keys and values) between calls: a call someone between could forge or replay would change
                what later, authenticated answers compute on. Its answer has the reply's form, the one output
                under 0
    an answer: info(): {"body": bytes, "signature": bytes (Ed25519)}
               run():  {"body": bytes, "mac": bytes (keyed BLAKE3), "outputs": [[expert, array [t_e, H] float32], ...]}
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from shardtool.errors import UsageError
from shardtool.text import printable

from ._cluster_session import mac

MAX_FRAME = 1 << 30  # one frame: a call's hidden states or a reply's outputs; the caps below bound what it holds
MAX_ARRAY_ELEMENTS = 1 << 28  # one array of a frame (a 1 GiB float32 block)
_DTYPES = {"<f4": np.dtype("<f4"), "<i8": np.dtype("<i8")}  # the only arrays that cross the wire
# The one key of each answer form that authenticates its body: an info()'s signature, a run's MAC.
_PROOF = {frozenset({"body", "signature"}): "signature", frozenset({"body", "mac", "outputs"}): "mac"}
_CALL_KEYS = {"layer", "experts", "x", "rows", "nonce", "session"}
_SPAN_KEYS = {"session", "span_call", "mac"}
_SPAN_CALL_KEYS = {"span", "x", "segments", "drop", "routes", "nonce", "number"}
SPAN_CALL_TYPE = "application/vnd.shardtool.span-call+msgpack"  # what a span call's MAC is over (PAE)


class NodeFailed(Exception):
    """A node-level failure of one call: the node is dropped. `str()` is one line."""


class ProtocolError(Exception):
    """A frame that breaks the pipe's protocol (from a child that misbehaves: the proxy is killed)."""


def _refuse_ext(code: int, data: bytes):
    raise ProtocolError(f"msgpack extension type {code} in a frame")


def unpack(data: bytes) -> dict:
    """One frame's payload -> a map with string keys, only plain types (no ext types, no timestamps)."""
    try:
        # The frame's length is capped before it is read; unpackb caps each string, array and map by it.
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ProtocolError(f"a frame that is not msgpack: {type(e).__name__}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"a frame that is a {type(doc).__name__}, not a map")
    return doc


def pack(doc: dict) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def decode_array(obj: Any, dtype: str, ndim: int, what: str) -> np.ndarray:
    """A wire array -> a read-only ndarray of exactly `dtype` and `ndim` dimensions, its bytes matching its shape."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise ProtocolError(f"{what} is not an array (dtype, shape, data)")
    shape, data = obj["shape"], obj["data"]
    if obj["dtype"] != dtype:
        raise ProtocolError(f"{what} has dtype {printable(str(obj['dtype'])[:20])}, expected {dtype}")
    if (not isinstance(shape, list) or len(shape) != ndim
            or not all(type(n) is int and 0 <= n <= MAX_ARRAY_ELEMENTS for n in shape)):
        raise ProtocolError(f"{what} does not have a shape of {ndim} sizes in [0, {MAX_ARRAY_ELEMENTS}]")
    count = math.prod(shape)  # Python ints (each capped above): numpy's prod costs ~20 us a call, per array
    if count > MAX_ARRAY_ELEMENTS or type(data) is not bytes or len(data) != count * _DTYPES[dtype].itemsize:
        raise ProtocolError(f"{what}: {len(data) if type(data) is bytes else 'no'} data bytes for shape {shape}")
    return np.frombuffer(data, dtype=_DTYPES[dtype]).reshape(shape)


def _proof(answer: Any) -> str | None:
    """Which key authenticates `answer`'s body ("signature" or "mac"), when it has one of the two forms with bytes
    there; None otherwise."""
    if not isinstance(answer, dict):
        return None
    proof = _PROOF.get(frozenset(answer))
    return proof if proof and type(answer["body"]) is bytes and type(answer[proof]) is bytes else None


def encode_answer(answer: Any) -> dict:
    """A node's answer as Ray gave it (in the child) or as its service made it -> its wire form: the body and its
    signature or MAC as bytes, a reply's outputs as [expert, float32 array] pairs. Anything else cannot be carried:
    NodeFailed."""
    proof = _proof(answer)
    if proof is None:
        raise NodeFailed("the answer is not a signed answer (a mapping of body and signature bytes, or of body, MAC "
                         "and outputs): refused")
    wire = {"body": answer["body"], proof: answer[proof]}
    if "outputs" in answer:
        outputs = answer["outputs"]
        if not isinstance(outputs, dict) or not all(
                type(e) is int and type(y) is np.ndarray and y.dtype == np.float32 and y.ndim == 2
                for e, y in outputs.items()):
            raise NodeFailed("the reply's outputs are not a mapping of expert ids to 2-D float32 arrays")
        wire["outputs"] = [[e, encode_array(y)] for e, y in outputs.items()]
    return wire


def decode_answer(obj: Any) -> dict:
    """An answer's wire form (from the child, untrusted) -> the mapping `RemoteExperts` checks: body and signature,
    or for a reply body, MAC and {expert: [t_e, H] float32}. Only the form is checked here; every other check is the
    coordinator's."""
    proof = _proof(obj)
    if proof is None:
        raise ProtocolError("an answer that is not body and signature bytes, nor body, MAC and outputs")
    answer = {"body": obj["body"], proof: obj[proof]}
    if "outputs" in obj:
        pairs = obj["outputs"]
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int
                                                  and 0 <= p[0] < 1 << 31 for p in pairs):
            raise ProtocolError("a reply's outputs that are not [expert, array] pairs")
        outputs = {e: decode_array(y, "<f4", 2, f"expert {e}'s output") for e, y in pairs}
        if len(outputs) != len(pairs):
            raise ProtocolError("a reply's outputs name an expert twice")
        answer["outputs"] = outputs
    return answer



def encode_call(layer: int, expert_ids, x: np.ndarray, rows, nonce: str, session: str) -> bytes:
    """One `run` call's arguments as the bytes a node's actor takes (`decode_any_call`)."""
    return pack({"layer": int(layer), "experts": [int(e) for e in expert_ids], "x": encode_array(x),
                 "rows": [[int(e), encode_array(r)] for e, r in rows.items()], "nonce": nonce, "session": session})


def encode_span_call(span: tuple[int, int], x: np.ndarray, segments, drop, routes: bool, nonce: str, number: int,
                     session: tuple[str, bytes]) -> bytes:
    """One span call's arguments as the bytes a pipeline node's actor takes (`decode_any_call`), authenticated by
    `session`'s (id, key) as call `number` of that session."""
    sid, key = session
    call = pack({"span": [int(span[0]), int(span[1])], "x": encode_array(x),
                 "segments": [[int(q), int(start), int(t)] for q, start, t in segments],
                 "drop": [int(q) for q in drop], "routes": bool(routes), "nonce": nonce, "number": int(number)})
    return pack({"session": sid, "span_call": call, "mac": mac(key, SPAN_CALL_TYPE, call)})


def decode_any_call(call: Any) -> tuple[str, tuple]:
    """A call's bytes (at a node, from the wire) -> ("run", `_run_call`'s tuple) or ("span", (session id, the
    span call's bytes, their MAC)), the form checked here (a UsageError naming what is wrong); a span call's bytes
    are read (`decode_span_call`) only once their MAC is checked, the values are the node's to check."""
    doc = _unpack_call(call)
    if set(doc) != _SPAN_KEYS:
        return "run", _run_call(doc)
    if type(doc["span_call"]) is not bytes or type(doc["mac"]) is not bytes:
        raise UsageError("a span call must carry its call and its MAC as bytes")
    return "span", (doc["session"], doc["span_call"], doc["mac"])


def decode_span_call(call: bytes) -> tuple[Any, np.ndarray, Any, Any, Any, Any, Any]:
    """A span call's authenticated bytes -> (span, x [n, H] float32, segments, drop, routes, nonce, number), the
    form checked here (a UsageError naming what is wrong)."""
    try:
        doc = unpack(call)
        if set(doc) != _SPAN_CALL_KEYS:
            raise ProtocolError(f"a span call must have exactly the keys {sorted(_SPAN_CALL_KEYS)}")
        x = decode_array(doc["x"], "<f4", 2, "the hidden states")
    except ProtocolError as e:
        raise UsageError(str(e)) from None
    return doc["span"], x, doc["segments"], doc["drop"], doc["routes"], doc["nonce"], doc["number"]


def _unpack_call(call: Any) -> dict:
    if type(call) is not bytes or len(call) > MAX_FRAME:
        raise UsageError(f"a call must be at most {MAX_FRAME} bytes of msgpack, got a {type(call).__name__}")
    try:
        return unpack(call)
    except ProtocolError as e:
        raise UsageError(str(e)) from None


def _run_call(doc: dict) -> tuple[Any, Any, np.ndarray, dict[int, np.ndarray], Any, Any]:
    """A run call's map -> (layer, expert ids, x [n, H] float32, {expert: rows int64}, nonce, session id), their
    form checked here (a UsageError naming what is wrong); their values are NodeService.run's to check."""
    try:
        if set(doc) != _CALL_KEYS:
            raise ProtocolError(f"a call must have exactly the keys {sorted(_CALL_KEYS)}")
        pairs = doc["rows"]
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int
                                                  for p in pairs):
            raise ProtocolError("a call's rows are not [expert, array] pairs")
        rows = {e: decode_array(r, "<i8", 1, f"rows of expert {e}") for e, r in pairs}
        if len(rows) != len(pairs):
            raise ProtocolError("a call's rows name an expert twice")
        x = decode_array(doc["x"], "<f4", 2, "the hidden states")
    except ProtocolError as e:
        raise UsageError(str(e)) from None
    return doc["layer"], doc["experts"], x, rows, doc["nonce"], doc["session"]
