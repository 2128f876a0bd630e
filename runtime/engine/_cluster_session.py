"""A cluster session: the key a coordinator and one node process share after the node's Ed25519-signed info(), so
that each run answer is authenticated by a keyed BLAKE3 (1.5 us) instead of an Ed25519 signature (44 us to sign,
138 us to verify). Signature at the handshake, MAC afterwards, as TLS 1.3 and Noise do.

The coordinator sends a fresh X25519 public key with its info() request; the node answers with its own fresh one,
both inside its signed info body, and both sides derive the key with BLAKE3's derive_key mode over the shared secret
and the handshake's transcript (both public keys, the node's name, the manifest root, the info nonce, the node's
boot id), each part length-prefixed. Whoever forwards the handshake (the cluster proxy, Ray) sees public keys only.
A MAC convinces the coordinator alone (it could have made it itself): it is not evidence for anyone else.
"""

from __future__ import annotations

import hmac
import re
import struct
import threading
from collections import OrderedDict

import blake3
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from shardtool.errors import UsageError
from shardtool.manifest import pae

CONTEXT = "shardtool cluster session v1"  # BLAKE3 derive_key context: this key is used for nothing else
PUBLIC_KEY = re.compile(r"[0-9a-f]{64}", re.ASCII)  # an X25519 public key on the wire: 32 bytes, lowercase hex
SESSION_ID = re.compile(r"[0-9a-f]{32}", re.ASCII)  # what a run call names its session by
MAX_SESSIONS = 1024  # sessions a node keeps (one per coordinator connection and readmission); the oldest go first
_LENGTH = struct.Struct(">Q")


class Handshake:
    """One side's ephemeral X25519 pair: its public half as 64 hex digits; the private half never leaves here."""

    def __init__(self):
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw).hex()

    def shared(self, peer: str) -> bytes:
        """The X25519 shared secret with `peer` (64 hex digits, checked by the caller). ValueError for a peer key
        of low order (an all-zero secret: anyone could compute it)."""
        return self._private.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(peer)))


def session_key(shared: bytes, coordinator: str, node: str, name: str, root: bytes, nonce: str, boot: str) -> bytes:
    """The session's 32-byte MAC key: BLAKE3 derive_key over the shared secret and the handshake, each part
    length-prefixed (8 bytes, big-endian) so no two transcripts encode alike."""
    h = blake3.blake3(derive_key_context=CONTEXT)
    for part in (shared, bytes.fromhex(coordinator), bytes.fromhex(node), name.encode("utf-8"), root,
                 nonce.encode("ascii"), boot.encode("ascii")):
        h.update(_LENGTH.pack(len(part)))
        h.update(part)
    return h.digest()


def session_id(coordinator: str, node: str) -> str:
    """A session's name on the wire: BLAKE3 of both public keys, 16 bytes (a replayed info request with the same
    coordinator key makes another session, never overwrites this one)."""
    return blake3.blake3(bytes.fromhex(coordinator) + bytes.fromhex(node)).digest(16).hex()


def mac(key: bytes, payload_type: str, body: bytes) -> bytes:
    """Keyed BLAKE3 over PAE(payload_type, body): what a node puts beside a run answer's body."""
    return blake3.blake3(pae(payload_type, body), key=key).digest()


def mac_matches(key: bytes, payload_type: str, body: bytes, tag) -> bool:
    """Whether `tag` (untrusted) is the MAC of `body` under `key`, compared in constant time."""
    return type(tag) is bytes and hmac.compare_digest(tag, mac(key, payload_type, body))


def unknown_session(sid: str) -> str:
    """How a node's refusal of a run call in session `sid` starts when it does not hold that session (another
    process's, or evicted): the coordinator that sent the call then shakes hands again with the same process."""
    return f"session {sid} is not one of this node process's"


def check_public_key(value, what: str) -> str:
    """An X25519 public key from the wire: exactly 64 lowercase hex digits (32 bytes); UsageError otherwise."""
    if not isinstance(value, str) or not PUBLIC_KEY.fullmatch(value):
        shown = f"{len(value)} characters" if isinstance(value, (str, bytes)) else f"a {type(value).__name__}"
        raise UsageError(f"{what} must be an X25519 public key of 64 lowercase hex digits (32 bytes), got {shown}")
    return value


class SessionTable:
    """A node's sessions, {session id: key}, bounded: the least recently used goes when MAX_SESSIONS are held (its
    coordinator's next run is refused and it shakes hands again). Thread-safe."""

    def __init__(self, cap: int = MAX_SESSIONS):
        self.cap = cap
        self._keys: OrderedDict[str, bytes] = OrderedDict()
        self._numbers: dict[str, int] = {}  # session id -> the last call number it was given (`advance`)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, sid: str, key: bytes) -> None:
        with self._lock:
            self._keys[sid] = key
            self._keys.move_to_end(sid)
            while len(self._keys) > self.cap:
                self._numbers.pop(self._keys.popitem(last=False)[0], None)

    def key(self, sid) -> bytes:
        """The key of session `sid`; UsageError when it is not one (malformed, unknown or evicted)."""
        if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid):
            raise UsageError("a run call's session must be 32 lowercase hex digits")
        with self._lock:
            key = self._keys.get(sid)
            if key is None:
                raise UsageError(f"{unknown_session(sid)} (it was restarted, or the session was evicted): ask for "
                                 f"its info() again")
            self._keys.move_to_end(sid)
            return key

    def advance(self, sid: str, number) -> None:
        """Take call `number` of session `sid` (held, its MAC checked): it must be above every number the session
        was given before, or the call is a replay (or reordered): UsageError."""
        if type(number) is not int or not 0 < number < 1 << 63:
            raise UsageError("a call's number must be an integer in [1, 2**63)")
        with self._lock:
            last = self._numbers.get(sid, 0)
            if number <= last:
                raise UsageError(f"call {number} of session {sid} comes after call {last}: a replayed or reordered "
                                 f"call: refused")
            if sid in self._keys:
                self._numbers[sid] = number
