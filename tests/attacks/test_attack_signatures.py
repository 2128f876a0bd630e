"""Signature attacks on the manifest envelope: unsigned, untrusted, corrupted, under threshold, one key counted
twice, non-canonical Ed25519 encodings from Wycheproof, and a valid signature over another payload type.
"""

from __future__ import annotations

import re
import shutil

import pytest

import _attackkit as kit
from _attackkit import Attack, refused

SIG = "SignatureError"
THRESHOLD = "ThresholdError"
OTHER_TYPE = "application/vnd.in-toto+json"
L = 2**252 + 27742317777372353535851937790883648493  # order of the Ed25519 base point (RFC 8032)
P = 2**255 - 19


def _resign(*names, **kw):
    def tamper(model, world):
        kit.Doc.read(model).sign(*(world.keys.signer(n) for n in names), **kw).write(model)
    return tamper


def _unsigned(model, world):
    doc = kit.Doc.read(model)
    doc.signatures = []
    doc.write(model)


def _corrupt(index: int):
    def edit(sig: bytes) -> bytes:
        return sig[:index] + bytes([sig[index] ^ 0x01]) + sig[index + 1:]
    return edit


def _edit_signature(edit, *names):
    """Sign with `names`, then replace the LAST signature's bytes by edit(sig)."""
    def tamper(model, world):
        doc = kit.Doc.read(model).sign(*(world.keys.signer(n) for n in names))
        doc.signatures[-1]["sig"] = edit(doc.signatures[-1]["sig"])
        doc.write(model)
    return tamper


def _same_key_two_keyids(model, world):
    """A's one signature listed twice: once under A's key ID, once under B's."""
    a, b = world.keys.signer("A"), world.keys.signer("B")
    doc = kit.Doc.read(model).sign(a)
    doc.signatures.append({"keyid": kit.keyid_of(b), "sig": doc.signatures[0]["sig"]})
    doc.write(model)


def _same_key_trusted_twice(model, world):
    shutil.copy(world.keys.pub("A"), world.keys.dir / "A-again.pub")


def _other_payload_type(model, world):
    doc = kit.Doc.read(model)
    doc.payload_type = OTHER_TYPE
    doc.sign(world.keys.signer("A")).write(model)


# --- Wycheproof's non-canonical encodings, applied to a real signature over this manifest --------------------

def _s_plus(delta: int):
    def edit(sig: bytes) -> bytes:
        s = (int.from_bytes(sig[32:], "little") + delta) % 2**256
        return sig[:32] + s.to_bytes(32, "little")
    return edit


def _r_bit(bit: int):
    def edit(sig: bytes) -> bytes:
        r = bytearray(sig[:32])
        r[bit // 8] ^= 1 << (bit % 8)
        return bytes(r) + sig[32:]
    return edit


def wycheproof_edit(comment: str):
    """The transformation a Wycheproof EdDSA vector's comment describes, or None for ones not expressible
    as an edit of someone else's signature (garbage, truncation, wrong message...)."""
    if m := re.match(r"modified bit (\d+) in R\b", comment):
        return _r_bit(int(m.group(1)))
    if m := re.match(r"the encoded s was replaced by s \+ (\d*)L", comment):
        return _s_plus(int(m.group(1) or 1) * L)
    if m := re.match(r"the encoded s was replaced by s \+ 2\^(\d+)", comment):
        return _s_plus(2 ** int(m.group(1)))
    if comment.startswith("the encoded s was replaced by s + p"):
        return _s_plus(P)
    if comment == "R==0":
        return lambda sig: bytes(32) + sig[32:]
    if comment == "all bits flipped in R":
        return lambda sig: bytes(b ^ 0xFF for b in sig[:32]) + sig[32:]
    if comment.startswith("R encodes y = 1 with the sign bit of x set"):
        return lambda sig: (1).to_bytes(32, "little")[:31] + b"\x80" + sig[32:]
    return None


def _wycheproof_cases():
    data = kit.load_wycheproof_ed25519()
    cases = []
    for group in data["testGroups"]:
        for t in group["tests"]:
            if t["result"] == "invalid" and wycheproof_edit(t["comment"]) is not None:
                cases.append(pytest.param(t["comment"], id=f"tc{t['tcId']}"))
    return cases


CASES = {
    "unsigned": Attack(_unsigned, refused(SIG, "manifest is not signed"), refused(SIG, "manifest is not signed")),
    "untrusted-key": Attack(_resign("C"), refused(SIG, "none of the 1 signature(s) verifies"),
                            refused(SIG, "none of the 1 signature(s) verifies")),
    "corrupted-signature": Attack(_edit_signature(_corrupt(40), "A"), refused(SIG, "none of the 1"),
                                  refused(SIG, "none of the 1")),
    "one-of-two-signatures-corrupted": Attack(_edit_signature(_corrupt(3), "A", "B"),
                                              refused(THRESHOLD, "1 distinct trusted key(s) signed, threshold is 2"),
                                              refused(THRESHOLD, "1 distinct trusted key(s) signed, threshold is 2"),
                                              trust=("A", "B"), threshold=2),
    "under-threshold": Attack(_resign("A"), refused(THRESHOLD, "threshold is 2"), refused(THRESHOLD, "threshold is 2"),
                              trust=("A", "B"), threshold=2),
    "under-threshold-with-untrusted-signer": Attack(_resign("A", "C"), refused(THRESHOLD, "threshold is 2"),
                                                    refused(THRESHOLD, "threshold is 2"), trust=("A", "B"),
                                                    threshold=2),
    "same-key-under-two-keyids": Attack(_same_key_two_keyids,
                                        refused(THRESHOLD, "1 distinct trusted key(s) signed, threshold is 2"),
                                        refused(THRESHOLD, "1 distinct trusted key(s) signed, threshold is 2"),
                                        trust=("A", "B"), threshold=2),
    "same-key-trusted-twice": Attack(_same_key_trusted_twice,
                                     refused("TrustSettingsError", "number of distinct trusted keys (1)", code=2),
                                     refused("TrustSettingsError", "number of distinct trusted keys (1)", code=2),
                                     trust=("A", "A-again"), threshold=2),
    "wycheproof-s-plus-L": Attack(_edit_signature(_s_plus(L), "A"), refused(SIG, "none of the 1"),
                                  refused(SIG, "none of the 1")),
    "wycheproof-r-sign-bit": Attack(_edit_signature(_r_bit(255), "A"), refused(SIG, "none of the 1"),
                                    refused(SIG, "none of the 1")),
    "signature-wrong-length": Attack(_edit_signature(lambda s: s[:63], "A"), refused("ManifestFormatError", "64 bytes"),
                                     refused("ManifestFormatError", "64 bytes")),
    "valid-signature-other-payload-type": Attack(_other_payload_type, refused("ManifestFormatError", "payloadType"),
                                                 refused("ManifestFormatError", "payloadType")),
    "signature-over-other-payload-type": Attack(_resign("A", payload_type=OTHER_TYPE), refused(SIG, "none of the 1"),
                                                refused(SIG, "none of the 1")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_signatures(case, model, world):
    kit.check_attack(CASES[case], model, world)


def test_signatures_two_of_two_pass(model, world):
    """The control for the threshold cases: A and B both sign, threshold 2 holds."""
    kit.check_attack(Attack(_resign("A", "B"), kit.CLEAN, kit.CLEAN, trust=("A", "B"), threshold=2), model, world)


@pytest.mark.parametrize("comment", _wycheproof_cases())
def test_signatures_wycheproof_noncanonical(comment, model, world):
    """Every Wycheproof non-canonical-encoding class, applied to a genuine signature over this manifest and
    injected into its envelope, is refused by the verifier both CLIs use (in-process: 30 cases)."""
    from shardtool.errors import SignatureError
    from shardtool.keys import load_public_key
    from shardtool.manifest import verify_manifest

    tamper = _edit_signature(wycheproof_edit(comment), "A")
    tamper(model, world)
    data = (model / kit.MANIFEST).read_bytes()
    with pytest.raises(SignatureError) as info:
        verify_manifest(data, [load_public_key(world.keys.pub("A"))], 1)
    assert type(info.value) is SignatureError
    # ...and the same forged signature beside a genuine one still counts once, not twice.
    doc = kit.Doc.read(model)
    doc.signatures.insert(0, {"keyid": kit.keyid_of(world.keys.signer("A")),
                              "sig": world.keys.signer("A").sign(kit.pae(doc.payload_type, doc.payload_bytes()))})
    verified = verify_manifest(doc.to_bytes(), [load_public_key(world.keys.pub("A"))], 1)
    assert len(verified.signers) == 1
