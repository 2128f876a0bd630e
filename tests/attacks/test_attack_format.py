"""Malformed input: manifests that are truncated, oversized, not msgpack, not canonical, carrying duplicate keys,
unknown fields or out-of-range integers, or whose entry list does not match the signed head; and correctly
signed files whose contents are hostile (safetensors headers with overlapping or out-of-bounds offsets,
config.json that is not JSON). Every one must end in a clean exit 1, never a traceback.
"""

from __future__ import annotations

import json
import os
import struct

import msgpack
import pytest

import _attackkit as kit
from _attackkit import EXPERT, Attack, refused

FORMAT = "ManifestFormatError"
MERKLE = "MerkleProofError"
SHARD = "ShardFormatError"
MAX_MANIFEST_BYTES = 256 * 1024 * 1024


def _raw(edit):
    """Edit the manifest file's bytes directly."""
    def tamper(model, world):
        p = model / kit.MANIFEST
        p.write_bytes(edit(p.read_bytes()))
    return tamper


def _oversized(model, world):
    """A sparse file one byte over the cap: the reader must stop at the cap, not read it all."""
    with open(model / kit.MANIFEST, "r+b") as fh:
        fh.truncate(MAX_MANIFEST_BYTES + 1)


def _doc(edit, *, sign: bool = False, reseal: bool = False):
    """Edit the taken-apart manifest; optionally recompute count+root and/or re-sign with the trusted key."""
    def tamper(model, world):
        doc = kit.Doc.read(model)
        edit(doc, world)
        if reseal:
            doc.reseal()
        if sign:
            doc.sign(world.keys.signer("A"))
        doc.write(model)
    return tamper


def pack_pairs(pairs) -> bytes:
    """A msgpack map from (key, value) pairs as given: the only way to put a key in twice."""
    return msgpack.Packer().pack_map_header(len(pairs)) + b"".join(kit.pack(k) + kit.pack(v) for k, v in pairs)


def _duplicate_top_key(model, world):
    doc = kit.Doc.read(model)
    env = {"payloadType": doc.payload_type, "payload": doc.payload_bytes(), "signatures": doc.signatures}
    fmt = "shardtool-manifest-v1"
    data = pack_pairs([("entries", doc.raw_entries()), ("envelope", env), ("format", fmt), ("format", fmt)])
    (model / kit.MANIFEST).write_bytes(data)


def _duplicate_head_key(doc, world):
    pairs = sorted(doc.head.items())
    pairs.append(("version", doc.head["version"]))
    doc.payload = pack_pairs(sorted(pairs, key=lambda kv: kv[0]))


def _duplicate_entry_key(doc, world):
    i = next(i for i, e in enumerate(doc.entries) if e["path"] == EXPERT)
    pairs = sorted(doc.entries[i].items())
    pairs.append(("size", doc.entries[i]["size"]))
    doc.entries[i] = pack_pairs(sorted(pairs, key=lambda kv: kv[0]))


def _set_entry(target, **fields):
    def edit(doc, world):
        for e in doc.entries:
            if e["path"] == target:
                e.update(fields)
    return edit


def _wide_int_version(doc, world):
    """version 2 written as a uint64 (0xcf + 8 bytes): the same number, not the canonical bytes."""
    canonical = kit.pack(doc.head)
    doc.payload = canonical.replace(b"\xa7version\x02", b"\xa7version\xcf" + (2).to_bytes(8, "big"))
    assert doc.payload != canonical


def _count_plus_one(doc, world):
    doc.head["entry_count"] += 1


def _swap_entries(doc, world):
    doc.entries[3], doc.entries[4] = doc.entries[4], doc.entries[3]


def _append_entry(doc, world):
    doc.entries.append(dict(doc.entries[-1], path="zz-extra.bin"))


# --- correctly signed, hostile contents -------------------------------------------------------------------

def _rewrite_header(path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    new = edit(header, body)
    if isinstance(new, bytes):  # a raw header (not even JSON)
        raw = new
    else:
        raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _signed_file(rel: str, rewrite):
    """Rewrite file `rel`, then publish it properly: entry size and digest updated, root resealed, re-signed."""
    def tamper(model, world):
        kit.publish_rewritten(model, rel, rewrite, world.keys.signer("A"))
    return tamper


def _tensors(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _overlap(header, body):
    first, second = _tensors(header)[:2]
    a, b = header[second]["data_offsets"]
    header[second]["data_offsets"] = [a - 2, b - 2]


def _out_of_bounds(header, body):
    """The last tensor claims twice its rows: shape and offsets agree, the end lies past the file."""
    last = _tensors(header)[-1]
    a, b = header[last]["data_offsets"]
    header[last]["shape"][0] *= 2
    header[last]["data_offsets"] = [a, a + 2 * (b - a)]


def _zero_size_huge_shape(header, body):
    header["extra.weight"] = {"dtype": "F32", "shape": [2**62, 0], "data_offsets": [0, 0]}


def _rename_tensor(header, body):
    name = _tensors(header)[0]
    header["renamed." + name] = header.pop(name)


def _transpose(header, body):
    name = _tensors(header)[0]
    header[name]["shape"] = header[name]["shape"][::-1]


def _nan_at(suffix: str, flat: int):
    """Element `flat` (row-major) of the file's tensor named `...suffix` made NaN (the bytes then signed by the
    publisher)."""
    def rewrite(path) -> None:
        data = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        spec = header[next(k for k in header if k.endswith(suffix))]
        nan = {"F32": b"\x00\x00\xc0\x7f", "BF16": b"\xc0\x7f", "F16": b"\x00\x7e"}[spec["dtype"]]
        at = 8 + n + spec["data_offsets"][0] + flat * len(nan)
        data[at:at + len(nan)] = nan
        path.write_bytes(bytes(data))
    return rewrite


_nan_weight = _nan_at("gate_proj.weight", kit.MODEL_KNOBS["hidden"] + 2)  # [1, 2] of gate_proj [I, H]


def _shard_case(rewrite, message, rel=EXPERT):
    # The bytes are exactly what the publisher signed, so audit (a byte-level check) passes; the runtime parses
    # them and must refuse cleanly.
    return Attack(_signed_file(rel, lambda p: _rewrite_header(p, rewrite)), kit.CLEAN, refused(SHARD, message))


def _both(error, message):
    return dict(audit=refused(error, message), run=refused(error, message))


CASES = {
    "manifest-truncated": Attack(_raw(lambda b: b[: len(b) // 2]), **_both(FORMAT, "not valid msgpack")),
    "manifest-empty": Attack(_raw(lambda b: b""), **_both(FORMAT, "manifest is empty")),
    "manifest-oversized": Attack(_oversized, **_both(FORMAT, "larger than 268435456 bytes")),
    "manifest-malformed-msgpack": Attack(_raw(lambda b: b"\xc1" + b[1:]), **_both(FORMAT, "not valid msgpack")),
    "manifest-trailing-bytes": Attack(_raw(lambda b: b + b"\x00"), **_both(FORMAT, "not valid msgpack")),
    "manifest-random-bytes": Attack(_raw(lambda b: os.urandom(len(b))), **_both(FORMAT, "")),
    "duplicate-key-top-level": Attack(_duplicate_top_key, **_both(FORMAT, "duplicate map key 'format'")),
    "duplicate-key-in-signed-head": Attack(_doc(_duplicate_head_key, sign=True),
                                           **_both(FORMAT, "duplicate map key 'version'")),
    "duplicate-key-in-signed-entry": Attack(_doc(_duplicate_entry_key, reseal=True, sign=True),
                                            **_both(FORMAT, "duplicate map key 'size'")),
    "unknown-field-top-level": Attack(_doc(lambda d, w: setattr(d, "top_extra", {"zz": 1})),
                                      **_both(FORMAT, "manifest has unknown field(s) zz")),
    "unknown-field-in-signed-head": Attack(_doc(lambda d, w: d.head.update(mirror="https://evil"), sign=True),
                                           **_both(FORMAT, "head has unknown field(s) mirror")),
    "unknown-field-in-signed-entry": Attack(_doc(_set_entry(EXPERT, url="https://evil"), reseal=True, sign=True),
                                            **_both(FORMAT, "entry has unknown field(s) url")),
    "version-beyond-int64": Attack(_doc(lambda d, w: d.head.update(version=2**64 - 1), sign=True),
                                   **_both(FORMAT, "head.version must be in")),
    "version-as-float": Attack(_doc(lambda d, w: d.head.update(version=2.0), sign=True),
                               **_both(FORMAT, "float has no canonical encoding")),
    "version-non-canonical-width": Attack(_doc(_wide_int_version, sign=True),
                                          **_both(FORMAT, "head is not in canonical msgpack form")),
    "created-beyond-range": Attack(_doc(lambda d, w: d.head.update(created=2**41, expires=2**41 + 1), sign=True),
                                   **_both(FORMAT, "head.created must be in")),
    "entry-size-negative": Attack(_doc(_set_entry(EXPERT, size=-1), reseal=True, sign=True),
                                  **_both(FORMAT, "size must be an integer in [0, 2^50], got -1")),
    "entry-layer-beyond-range": Attack(_doc(_set_entry(EXPERT, layer=70_000), reseal=True, sign=True),
                                       **_both(FORMAT, "layer must be an integer in [0, 65535], got 70000")),
    "entry-digest-short": Attack(_doc(_set_entry(EXPERT, digest=b"\x00" * 31), reseal=True, sign=True),
                                 **_both(FORMAT, "digest must be 32 bytes")),
    "signed-payload-oversized": Attack(_doc(lambda d, w: d.head.update(model_id="a" * 70_000), sign=True),
                                       **_both(FORMAT, "payload must be binary, at most 65536 bytes")),
    "entry-oversized": Attack(_doc(_set_entry(EXPERT, path="x/" + "a" * 3000), reseal=True, sign=True),
                              **_both(FORMAT, "must be binary of at most 2048 bytes")),
    "entry-count-mismatch-in-signed-head": Attack(_doc(_count_plus_one, sign=True),
                                                  **_both(MERKLE, "the signed head says")),
    "entry-appended": Attack(_doc(_append_entry), **_both(MERKLE, "the signed head says")),
    "entry-removed": Attack(_doc(lambda d, w: d.entries.pop(3)), **_both(MERKLE, "the signed head says")),
    "entry-modified": Attack(_doc(_set_entry(EXPERT, size=1)), **_both(MERKLE, "entry list hashes to root")),
    "entries-reordered": Attack(_doc(_swap_entries), **_both(MERKLE, "entry list hashes to root")),
    "entries-unsorted-but-signed": Attack(_doc(_swap_entries, reseal=True, sign=True),
                                          **_both(FORMAT, "entries are not sorted by path")),
    "root-replaced-unsigned": Attack(_doc(lambda d, w: d.head.update(merkle_root=b"\x00" * 32)),
                                     **_both("SignatureError", "none of the 1 signature(s) verifies")),
    # Correctly signed files with hostile contents.
    "signed-shard-overlapping-offsets": _shard_case(_overlap, "overlaps the previous tensor"),
    "signed-shard-out-of-bounds-offsets": _shard_case(_out_of_bounds, "beyond the end of the"),
    "signed-shard-header-not-json": _shard_case(lambda h, b: b"{not json", "header is not JSON"),
    "signed-shard-huge-header-length": Attack(
        _signed_file(EXPERT, lambda p: p.write_bytes(struct.pack("<Q", 2**62) + p.read_bytes()[8:])), kit.CLEAN,
        refused(SHARD, "exceeds the 104857600-byte limit")),
    "signed-shard-zero-size-huge-shape": _shard_case(_zero_size_huge_shape, "invalid shape"),
    "signed-shard-missing-tensor": _shard_case(_rename_tensor, "missing tensor gate_proj.weight"),
    "signed-shard-wrong-shape": _shard_case(_transpose, "gate_proj.weight has shape (32, 16), expected (16, 32)"),
    "signed-shard-nan-weight": Attack(_signed_file(EXPERT, _nan_weight), kit.CLEAN,
                                      refused(SHARD, "gate_proj.weight: a NaN or infinite value at [1, 2]")),
    "signed-shard-nan-norm-weight": Attack(_signed_file(kit.TRUNK, _nan_at("post_attention_layernorm.weight", 3)),
                                           kit.CLEAN, refused(SHARD, "layer 1: post_attention_layernorm.weight: a "
                                                                     "NaN or infinite value")),
    "signed-shard-nan-embedding": Attack(_signed_file(kit.EMBED, _nan_at("embed_tokens.weight", 5)), kit.CLEAN,
                                         refused(SHARD, "embed_tokens.weight: a NaN or infinite value at [0, 5]")),
    "signed-config-json-not-json": Attack(_signed_file("config.json", lambda p: p.write_bytes(b"{nope")), kit.CLEAN,
                                          refused("VerificationError", "signed config.json is not valid JSON")),
    "signed-config-json-not-an-object": Attack(_signed_file("config.json", lambda p: p.write_bytes(b"[1, 2]")),
                                               kit.CLEAN,
                                               refused("VerificationError", "signed config.json is not a JSON object")),
    "signed-config-json-invalid-value": Attack(
        _signed_file("config.json", lambda p: p.write_text(json.dumps({**json.loads(p.read_text()),
                                                                       "num_hidden_layers": -1}))),
        kit.CLEAN,
        refused("VerificationError", "signed config.json is unusable: config.json: num_hidden_layers must be")),
    "signed-tokenizer-json-garbage": Attack(_signed_file("tokenizer.json", lambda p: p.write_bytes(b'{"a": 1}')),
                                            kit.CLEAN,
                                            refused("VerificationError", "signed tokenizer.json does not load")),
}
XFAIL: dict[str, str] = {}  # attacks not yet refused, each with the reason (none at present)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=XFAIL[c]))
                                  if c in XFAIL else c for c in CASES])
def test_format(case, model, world):
    kit.check_attack(CASES[case], model, world)
