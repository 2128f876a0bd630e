"""OpenSSF Model Signing (OMS, model_signing 1.x) signatures signed with an EC key: a Sigstore bundle (v0.3 JSON)
holding a DSSE envelope over an in-toto Statement v1 whose predicate lists every file of the model with its
digest. Pure functions of bytes and keys: `open_oms_bundle` (the bundle checked, its signature verified over
PAE, and only then the statement parsed) and `make_oms_bundle` (the bundle shardtool's export writes).

Order of a check, as for the manifest: size cap, strict JSON of the bundle, every field of the bundle validated,
the signature over PAE(payloadType, payload) (DSSE protocol v1), the payload type, then the statement's JSON and
every field of it. The bundle is untrusted until its signature verifies; what it names afterwards is still
validated (a statement may list `../x`: signed or not, it names nothing outside the model directory).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from shardtool.errors import CheckpointFormatError, ManifestFormatError, SignatureError
from shardtool.keys import EcPrivateKey, EcPublicKey
from shardtool.manifest._envelope import pae
from shardtool.manifest._paths import check_relpath
from shardtool.manifest._records import MAX_ENTRIES
from shardtool.strict_json import loads_strict

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
# What `model_signing` leaves out of a model by default besides its signature file.
GIT_PATHS = (".git", ".gitignore", ".github", ".gitattributes")
# A resource line is ~150 bytes for a typical path: 64 MiB lists ~400,000 files; base64 adds a third.
MAX_STATEMENT_BYTES = 64 * 1024 * 1024
MAX_BUNDLE_BYTES = MAX_STATEMENT_BYTES * 4 // 3 + 64 * 1024
MAX_IGNORE_PATHS = 256
MAX_NAME_CHARS = 256
MAX_TLOG_ENTRIES = 0  # a key-signed bundle has none: one with log entries was signed some other way
# hash_type -> digest length in bytes. The OMS CLI's verifier hashes with SHA-256; its library also writes BLAKE3.
DIGEST_SIZES = {"sha256": 32, "blake3": 32}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_B64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


@dataclass(frozen=True)
class OmsResource:
    name: str  # a checked relative path ('/'-separated, no `..`, not absolute)
    digest: bytes


@dataclass(frozen=True)
class OmsStatement:
    """What a verified OMS signature says: the files and digests, and how to hash them."""

    model_name: str  # informative only (the signer's directory name)
    root_digest: bytes  # subject's sha256: SHA-256 over every resource digest in listed order
    hash_type: str
    allow_symlinks: bool
    ignore_paths: tuple[str, ...]
    resources: tuple[OmsResource, ...]
    statement_sha256: bytes  # SHA-256 of the signed statement bytes: which statement a model matched
    signer: EcPublicKey

    def is_ignored(self, relpath: str) -> bool:
        """Whether `relpath` lies at or below one of the statement's ignore paths (as OMS's verifier skips them)."""
        return any(relpath == p or relpath.startswith(p + "/") for p in self.ignore_paths)


def _fail(message: str, where: str | None, hint: str | None = None) -> ManifestFormatError:
    return ManifestFormatError(message, path=where, hint=hint)


def _fields(raw: Any, required: Sequence[str], optional: Sequence[str], what: str, where: str | None) -> dict:
    """`raw` as a dict with every `required` key, and no key but those and `optional`: an unknown field is refused
    by name (a bundle or statement we do not fully understand is not one we vouch for)."""
    if not isinstance(raw, dict):
        raise _fail(f"{what} must be a JSON object, got {type(raw).__name__}", where)
    missing = [k for k in required if k not in raw]
    if missing:
        raise _fail(f"{what} lacks {', '.join(missing)}", where)
    unknown = sorted(k for k in raw if k not in required and k not in optional)
    if unknown:
        raise _fail(f"{what} has unknown field(s) {', '.join(repr(k[:40]) for k in unknown[:5])}", where)
    return raw


def _string(value: Any, what: str, where: str | None, cap: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str) or len(value) > cap:
        raise _fail(f"{what} must be a string of at most {cap} characters", where)
    return value


def _b64(value: Any, what: str, where: str | None, cap: int) -> bytes:
    if not isinstance(value, str) or len(value) > cap * 4 // 3 + 4 or not _B64.fullmatch(value):
        raise _fail(f"{what} must be standard base64 of at most {cap} bytes", where)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _fail(f"{what} is not valid base64", where) from None
    if len(data) > cap:
        raise _fail(f"{what} is larger than {cap} bytes", where)
    return data


def _json(data: bytes, what: str, where: str | None) -> Any:
    try:
        return loads_strict(data, what)
    except CheckpointFormatError as e:
        raise _fail(e.message if e.path is None else f"{e.path}: {e.message}", where) from None


def _signer(material: dict, trusted: Sequence[EcPublicKey], where: str | None) -> list[EcPublicKey]:
    """The trusted keys the bundle's key hint allows (all of them when it names none)."""
    key = _fields(material.get("publicKey"), (), ("hint",), "verificationMaterial.publicKey", where)
    hint = key.get("hint")
    if hint in (None, ""):
        return list(trusted)
    if not isinstance(hint, str) or not _HEX64.fullmatch(hint):
        raise _fail("verificationMaterial.publicKey.hint must be 64 lowercase hex characters", where)
    named = [k for k in trusted if k.hint == hint]
    if not named:
        raise SignatureError(f"signed by another key (hint {hint[:32]}), not by a trusted EC key "
                             f"({', '.join(k.keyid for k in trusted)})", path=where)
    return named


def _envelope(raw: dict, where: str | None) -> tuple[str, bytes, bytes]:
    """(payloadType, payload, signature) of the bundle's DSSE envelope, validated, not yet verified."""
    env = _fields(raw, ("payload", "payloadType", "signatures"), (), "dsseEnvelope", where)
    payload_type = _string(env["payloadType"], "dsseEnvelope.payloadType", where)
    payload = _b64(env["payload"], "dsseEnvelope.payload", where, MAX_STATEMENT_BYTES)
    sigs = env["signatures"]
    if not isinstance(sigs, list) or len(sigs) != 1:
        raise _fail("dsseEnvelope.signatures must hold exactly one signature (an OMS key signature)", where)
    sig = _fields(sigs[0], ("sig",), ("keyid",), "dsseEnvelope.signatures[0]", where)
    _string(sig.get("keyid", ""), "dsseEnvelope.signatures[0].keyid", where)
    return payload_type, payload, _b64(sig["sig"], "dsseEnvelope.signatures[0].sig", where, 160)


def open_oms_bundle(data: bytes, trusted: Sequence[EcPublicKey], *, where: str | None = None) -> OmsStatement:
    """The statement of an OMS bundle signed by one of `trusted`; raises ManifestFormatError for a malformed bundle
    or statement, SignatureError for one no trusted key signed. Nothing inside the payload is parsed before its
    signature verifies."""
    if len(data) > MAX_BUNDLE_BYTES:
        raise _fail(f"OMS bundle is larger than {MAX_BUNDLE_BYTES} bytes ({len(data)} bytes)", where)
    bundle = _fields(_json(data, "bundle", where), ("mediaType", "verificationMaterial", "dsseEnvelope"), (),
                     "bundle", where)
    if bundle["mediaType"] != BUNDLE_MEDIA_TYPE:
        raise _fail(f"bundle mediaType must be {BUNDLE_MEDIA_TYPE!r}, got {str(bundle['mediaType'])[:80]!r}", where)
    material = _fields(bundle["verificationMaterial"], ("publicKey",), ("tlogEntries",), "verificationMaterial",
                       where)
    tlog = material.get("tlogEntries", [])
    if not isinstance(tlog, list) or len(tlog) > MAX_TLOG_ENTRIES:
        raise _fail("verificationMaterial.tlogEntries must be empty in a key-signed bundle", where,
                    hint="shardtool checks OMS signatures made with an EC key (`model_signing sign key`)")
    candidates = _signer(material, trusted, where)
    payload_type, payload, sig = _envelope(bundle["dsseEnvelope"], where)
    signed = pae(payload_type, payload)
    signer = None
    for key in candidates:
        try:
            key.verify(sig, signed)
        except SignatureError:
            continue
        signer = key
        break
    if signer is None:
        raise SignatureError("OMS signature does not verify with the trusted EC key(s) "
                             f"({', '.join(k.keyid for k in trusted)})", path=where)
    if payload_type != PAYLOAD_TYPE:
        raise _fail(f"payloadType must be {PAYLOAD_TYPE!r}, got {payload_type[:80]!r}", where)
    return decode_statement(payload, signer, where=where)


def _resources(raw: Any, hash_type: str, where: str | None) -> tuple[OmsResource, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise _fail(f"predicate.resources must be a list of at most {MAX_ENTRIES} files", where)
    out, seen = [], set()
    size = DIGEST_SIZES[hash_type]
    for i, item in enumerate(raw):
        r = _fields(item, ("name", "algorithm", "digest"), (), f"resources[{i}]", where)
        try:
            name = check_relpath(r["name"])
        except ManifestFormatError as e:
            raise _fail(f"resources[{i}].name: {e.message}", where) from None
        if r["algorithm"] != hash_type:
            raise _fail(f"resources[{i}].algorithm must be the serialization's {hash_type!r}, got "
                        f"{str(r['algorithm'])[:40]!r}", where)
        digest = r["digest"]
        if not isinstance(digest, str) or len(digest) != 2 * size or not _HEX64.fullmatch(digest):
            raise _fail(f"resources[{i}].digest must be {2 * size} lowercase hex characters", where)
        if name in seen:
            raise _fail(f"resources list {name!r} twice", where)
        seen.add(name)
        out.append(OmsResource(name, bytes.fromhex(digest)))
    return tuple(out)


def _serialization(raw: Any, where: str | None) -> tuple[str, bool, tuple[str, ...]]:
    ser = _fields(raw, ("method", "hash_type", "allow_symlinks"), ("ignore_paths",), "predicate.serialization", where)
    if ser["method"] != "files":
        raise _fail(f"serialization method {str(ser['method'])[:40]!r} is not supported", where,
                    hint="shardtool checks OMS signatures made per file (method 'files', the default)")
    if not isinstance(ser["hash_type"], str) or ser["hash_type"] not in DIGEST_SIZES:
        raise _fail(f"hash_type {str(ser['hash_type'])[:40]!r} is not supported (expected "
                    f"{' or '.join(DIGEST_SIZES)})", where)
    if not isinstance(ser["allow_symlinks"], bool):
        raise _fail("serialization.allow_symlinks must be true or false", where)
    ignore = ser.get("ignore_paths", [])
    if not isinstance(ignore, list) or len(ignore) > MAX_IGNORE_PATHS:
        raise _fail(f"serialization.ignore_paths must be a list of at most {MAX_IGNORE_PATHS} paths", where)
    try:
        paths = tuple(check_relpath(p) for p in ignore)
    except ManifestFormatError as e:
        raise _fail(f"serialization.ignore_paths: {e.message}", where) from None
    return ser["hash_type"], ser["allow_symlinks"], paths


def decode_statement(payload: bytes, signer: EcPublicKey, *, where: str | None = None) -> OmsStatement:
    """The in-toto statement of a verified envelope, every field checked (the subject digest recomputed)."""
    st = _fields(_json(payload, "statement", where), ("_type", "subject", "predicateType", "predicate"), (),
                 "statement", where)
    if st["_type"] != STATEMENT_TYPE:
        raise _fail(f"statement _type must be {STATEMENT_TYPE!r}", where)
    if st["predicateType"] != PREDICATE_TYPE:
        raise _fail(f"predicateType must be {PREDICATE_TYPE!r}, got {str(st['predicateType'])[:80]!r}", where,
                    hint="the model_signing 0.x format lists no serialization and cannot say what is missing")
    subjects = st["subject"]
    if not isinstance(subjects, list) or len(subjects) != 1:
        raise _fail("statement must have exactly one subject", where)
    subject = _fields(subjects[0], ("name", "digest"), (), "subject", where)
    name = _string(subject["name"], "subject.name", where)
    digest = _fields(subject["digest"], ("sha256",), (), "subject.digest", where)["sha256"]
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise _fail("subject.digest.sha256 must be 64 lowercase hex characters", where)
    predicate = _fields(st["predicate"], ("serialization", "resources"), (), "predicate", where)
    hash_type, allow_symlinks, ignore = _serialization(predicate["serialization"], where)
    resources = _resources(predicate["resources"], hash_type, where)
    root = root_digest(resources)
    if root.hex() != digest:
        raise _fail(f"subject digest {digest[:16]}... is not the SHA-256 of the listed digests ({root.hex()[:16]}...)",
                    where)
    return OmsStatement(name, root, hash_type, allow_symlinks, ignore, resources, hashlib.sha256(payload).digest(),
                        signer)


def root_digest(resources: Sequence[OmsResource]) -> bytes:
    """The subject's digest: SHA-256 over every resource's digest, in listed order."""
    h = hashlib.sha256()
    for r in resources:
        h.update(r.digest)
    return h.digest()


def make_oms_bundle(model_name: str, resources: Sequence[OmsResource], ignore_paths: Sequence[str],
                    key: EcPrivateKey, hash_type: str = "sha256") -> bytes:
    """An OMS bundle over `resources` (sorted by name, as OMS's verifier compares them), signed by `key`: the bytes of
    the signature file `model_signing verify key` checks."""
    ordered = sorted(resources, key=lambda r: r.name)
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": root_digest(ordered).hex()}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "resources": [{"name": r.name, "digest": r.digest.hex(), "algorithm": hash_type} for r in ordered],
            "serialization": {"ignore_paths": list(ignore_paths), "hash_type": hash_type, "allow_symlinks": False,
                              "method": "files"},
        },
    }
    payload = json.dumps(statement, indent=2, ensure_ascii=False).encode("utf-8")
    sig = key.sign(pae(PAYLOAD_TYPE, payload))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key.public.hint}, "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode("ascii"), "payloadType": PAYLOAD_TYPE,
                         "signatures": [{"sig": base64.b64encode(sig).decode("ascii"), "keyid": ""}]},
    }
    return json.dumps(bundle, indent=2).encode("utf-8")
