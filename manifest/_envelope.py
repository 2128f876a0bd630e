"""DSSE envelopes (secure-systems-lab/dsse protocol v1): signatures over PAE(payloadType, payload).

Verification order is the protocol's: signatures first (over the exact payload bytes), then the payload
type, and only then does anyone parse the payload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from shardtool.errors import ManifestFormatError, SignatureError, ThresholdError, TrustSettingsError
from shardtool.keys import SIGNATURE_SIZES, PrivateKey, PublicKey
from shardtool.manifest._canonical import take_fields

PAYLOAD_TYPE = "application/vnd.shardtool.manifest-head+msgpack"
MAX_SIGNATURES = 64
MAX_PAYLOAD = 64 * 1024
_KEYID = re.compile(r"[0-9a-f]{1,64}")


def pae(payload_type: str, payload: bytes) -> bytes:
    """Pre-Authentication Encoding: "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


@dataclass(frozen=True)
class Signature:
    keyid: str
    sig: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.keyid, str) or not _KEYID.fullmatch(self.keyid):
            raise ManifestFormatError(f"signature keyid must be 1-64 lowercase hex characters, got {self.keyid!r}")
        if not isinstance(self.sig, bytes) or len(self.sig) not in SIGNATURE_SIZES:
            raise ManifestFormatError(f"signature by {self.keyid} must be 64 bytes (Ed25519) or the size of an ML-DSA "
                                      f"signature ({', '.join(str(n) for n in sorted(SIGNATURE_SIZES) if n != 64)})")

    def to_dict(self) -> dict[str, Any]:
        return {"keyid": self.keyid, "sig": self.sig}

    @classmethod
    def from_dict(cls, raw: Any) -> "Signature":
        d = take_fields(raw, ("keyid", "sig"), "signature")
        return cls(keyid=d["keyid"], sig=d["sig"])


@dataclass(frozen=True)
class Envelope:
    payload_type: str
    payload: bytes
    signatures: tuple[Signature, ...] = ()
    # The payload cap of the document kind (a manifest head is small; a run receipt carries token ids).
    max_payload: int = field(default=MAX_PAYLOAD, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.payload_type, str) or not 0 < len(self.payload_type) <= 256:
            raise ManifestFormatError("envelope payloadType must be a string of 1-256 characters")
        if not isinstance(self.payload, bytes) or len(self.payload) > self.max_payload:
            raise ManifestFormatError(f"envelope payload must be binary, at most {self.max_payload} bytes")
        if len(self.signatures) > MAX_SIGNATURES:
            raise ManifestFormatError(f"envelope has {len(self.signatures)} signatures, at most {MAX_SIGNATURES} allowed")

    def to_dict(self) -> dict[str, Any]:
        return {"payloadType": self.payload_type, "payload": self.payload,
                "signatures": [s.to_dict() for s in self.signatures]}

    @classmethod
    def from_dict(cls, raw: Any, *, max_payload: int = MAX_PAYLOAD) -> "Envelope":
        d = take_fields(raw, ("payloadType", "payload", "signatures"), "envelope")
        sigs = d["signatures"]
        if not isinstance(sigs, list):
            raise ManifestFormatError("envelope signatures must be a list")
        if len(sigs) > MAX_SIGNATURES:
            raise ManifestFormatError(f"envelope has {len(sigs)} signatures, at most {MAX_SIGNATURES} allowed")
        return cls(payload_type=d["payloadType"], payload=d["payload"],
                   signatures=tuple(Signature.from_dict(s) for s in sigs), max_payload=max_payload)

    def signed_by(self, key: PrivateKey) -> "Envelope":
        """A copy with `key`'s signature added (replacing an earlier one by the same key)."""
        public = key.public
        sig = Signature(keyid=public.keyid, sig=key.sign(pae(self.payload_type, self.payload)))
        kept = tuple(s for s in self.signatures if not _verifies(public, s, self))
        return Envelope(self.payload_type, self.payload, kept + (sig,), self.max_payload)


def _verifies(key: PublicKey, signature: Signature, envelope: Envelope) -> bool:
    try:
        key.verify(signature.sig, pae(envelope.payload_type, envelope.payload))
    except SignatureError:
        return False
    return True


def distinct_keys(keys: Iterable[PublicKey]) -> tuple[PublicKey, ...]:
    """The trusted keys with duplicates removed by raw key bytes, never by key ID."""
    seen: dict[bytes, PublicKey] = {}
    for key in keys:
        seen.setdefault(key.raw, key)
    return tuple(seen.values())


def check_threshold(trusted: Sequence[PublicKey], threshold: int) -> tuple[PublicKey, ...]:
    keys = distinct_keys(trusted)
    if not keys:
        raise TrustSettingsError("no trusted public key given", hint="pass --trust KEY.pub")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold <= len(keys):
        raise TrustSettingsError(f"threshold must be between 1 and the number of distinct trusted keys ({len(keys)}), "
                         f"got {threshold}")
    return keys


def verify_envelope(envelope: Envelope, trusted: Sequence[PublicKey], threshold: int,
                    payload_type: str = PAYLOAD_TYPE, *, what: str = "manifest",
                    signer_hint: str = "run `shardtool sign` with a publisher key") -> tuple[bytes, tuple[PublicKey, ...]]:
    """Return (payload, keys that signed) once `threshold` distinct trusted keys have signed it.

    Each trusted key counts at most once however many signatures it made, whatever key IDs claim;
    key IDs are not consulted at all, so a forged or repeated key ID cannot inflate the count.
    """
    keys = check_threshold(trusted, threshold)
    if not envelope.signatures:
        raise SignatureError(f"{what} is not signed", hint=signer_hint)
    message = pae(envelope.payload_type, envelope.payload)
    signers = []
    for key in keys:
        for signature in envelope.signatures:
            try:
                key.verify(signature.sig, message)
            except SignatureError:
                continue
            signers.append(key)
            break
    if not signers:
        raise SignatureError(f"none of the {len(envelope.signatures)} signature(s) verifies with a trusted key",
                             hint=f"trusted key IDs: {', '.join(k.keyid for k in keys)}")
    if len(signers) < threshold:
        raise ThresholdError(f"{len(signers)} distinct trusted key(s) signed, threshold is {threshold}")
    if envelope.payload_type != payload_type:
        raise ManifestFormatError(f"payloadType is {envelope.payload_type!r}, expected {payload_type!r}")
    return envelope.payload, tuple(signers)
