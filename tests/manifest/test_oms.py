"""The OMS bundle decoder (`open_oms_bundle`) as a table of named bad bundles, each asserting the exact error class,
and the encoder's round trip. The end-to-end cases with the real model_signing: tests/attacks/test_attack_oms.py and
tests/cli/test_oms_export_e2e.py."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from shardtool.errors import ManifestFormatError, SignatureError
from shardtool.keys import EcPrivateKey
from shardtool.manifest import OmsResource, make_oms_bundle, open_oms_bundle
from shardtool.manifest._envelope import pae
from shardtool.manifest._oms import MAX_BUNDLE_BYTES, PAYLOAD_TYPE

KEY = EcPrivateKey(ec.derive_private_key(1234567, ec.SECP256R1()))
OTHER = EcPrivateKey(ec.derive_private_key(7654321, ec.SECP256R1()))
RESOURCES = [OmsResource("b/x.bin", b"\x02" * 32), OmsResource("a.json", b"\x01" * 32)]
GENUINE = make_oms_bundle("acme/moe", RESOURCES, ["model.sig"], KEY)


def _bundle() -> dict:
    return json.loads(GENUINE)


def _statement() -> dict:
    return json.loads(base64.b64decode(_bundle()["dsseEnvelope"]["payload"]))


def _resign(statement: dict, key: EcPrivateKey = KEY, payload_type: str = PAYLOAD_TYPE) -> bytes:
    payload = json.dumps(statement).encode()
    bundle = _bundle()
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(payload).decode()
    bundle["dsseEnvelope"]["payloadType"] = payload_type
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(key.sign(pae(payload_type, payload))).decode()
    return json.dumps(bundle).encode()


def _edit_bundle(fn):
    b = _bundle()
    fn(b)
    return json.dumps(b).encode()


def _edit_statement(fn):
    s = _statement()
    fn(s)
    return _resign(s)


def test_the_encoder_round_trips_sorted_with_the_subject_over_the_digests():
    st = open_oms_bundle(GENUINE, [OTHER.public, KEY.public])
    assert [r.name for r in st.resources] == ["a.json", "b/x.bin"]
    assert st.root_digest == hashlib.sha256(b"\x01" * 32 + b"\x02" * 32).digest()
    assert st.signer == KEY.public and st.model_name == "acme/moe" and st.ignore_paths == ("model.sig",)
    assert st.statement_sha256 == hashlib.sha256(base64.b64decode(_bundle()["dsseEnvelope"]["payload"])).digest()


BAD = {
    "not-json": (b"{", ManifestFormatError),
    "not-utf8": (b"\xff\xfe", ManifestFormatError),
    "array": (b"[]", ManifestFormatError),
    "nan": (GENUINE.replace(b'"tlogEntries": []', b'"tlogEntries": NaN'), ManifestFormatError),
    "unknown-bundle-field": (_edit_bundle(lambda b: b.update(extra=1)), ManifestFormatError),
    "other-media-type": (_edit_bundle(lambda b: b.update(mediaType="application/json")), ManifestFormatError),
    "tlog-entries": (_edit_bundle(lambda b: b["verificationMaterial"].update(tlogEntries=[{}])), ManifestFormatError),
    "certificate": (_edit_bundle(lambda b: b["verificationMaterial"].update(certificate={"rawBytes": "AA=="})),
                    ManifestFormatError),
    "bad-hint": (_edit_bundle(lambda b: b["verificationMaterial"]["publicKey"].update(hint="XYZ")),
                 ManifestFormatError),
    "hint-of-another-key": (_edit_bundle(lambda b: b["verificationMaterial"]["publicKey"].update(hint=OTHER.public.hint)),
                            SignatureError),
    "two-signatures": (_edit_bundle(lambda b: b["dsseEnvelope"]["signatures"].append({"sig": "AA=="})),
                       ManifestFormatError),
    "no-signature": (_edit_bundle(lambda b: b["dsseEnvelope"].update(signatures=[])), ManifestFormatError),
    "sig-not-base64": (_edit_bundle(lambda b: b["dsseEnvelope"]["signatures"][0].update(sig="!!")),
                       ManifestFormatError),
    "payload-not-base64": (_edit_bundle(lambda b: b["dsseEnvelope"].update(payload="%%")), ManifestFormatError),
    "signed-by-another-key": (_resign(_statement(), OTHER), SignatureError),
    "payload-edited": (_edit_bundle(lambda b: b["dsseEnvelope"].update(
        payload=base64.b64encode(base64.b64decode(b["dsseEnvelope"]["payload"]) + b" ").decode())), SignatureError),
    "payload-type-signed-but-wrong": (_resign(_statement(), payload_type="application/json"), ManifestFormatError),
    "statement-type": (_edit_statement(lambda s: s.update(_type="https://in-toto.io/Statement/v0.1")),
                       ManifestFormatError),
    "predicate-v0.1": (_edit_statement(lambda s: s.update(predicateType="https://model_signing/Digests/v0.1")),
                       ManifestFormatError),
    "two-subjects": (_edit_statement(lambda s: s["subject"].append(s["subject"][0])), ManifestFormatError),
    "subject-digest-wrong": (_edit_statement(lambda s: s["subject"][0]["digest"].update(sha256="0" * 64)),
                             ManifestFormatError),
    "unknown-predicate-field": (_edit_statement(lambda s: s["predicate"].update(extra=[])), ManifestFormatError),
    "shards": (_edit_statement(lambda s: s["predicate"]["serialization"].update(method="shards")),
               ManifestFormatError),
    "hash-md5": (_edit_statement(lambda s: s["predicate"]["serialization"].update(hash_type="md5")),
                 ManifestFormatError),
    "allow-symlinks-string": (_edit_statement(lambda s: s["predicate"]["serialization"].update(allow_symlinks="no")),
                              ManifestFormatError),
    "ignore-absolute": (_edit_statement(lambda s: s["predicate"]["serialization"].update(ignore_paths=["/etc"])),
                        ManifestFormatError),
    "name-dotdot": (_edit_statement(lambda s: s["predicate"]["resources"][0].update(name="../a.json")),
                    ManifestFormatError),
    "name-absolute": (_edit_statement(lambda s: s["predicate"]["resources"][0].update(name="/a.json")),
                      ManifestFormatError),
    "name-twice": (_edit_statement(lambda s: s["predicate"]["resources"].append(s["predicate"]["resources"][0])),
                   ManifestFormatError),
    "algorithm-differs": (_edit_statement(lambda s: s["predicate"]["resources"][0].update(algorithm="blake3")),
                          ManifestFormatError),
    "digest-short": (_edit_statement(lambda s: s["predicate"]["resources"][0].update(digest="ab")),
                     ManifestFormatError),
    "digest-uppercase": (_edit_statement(lambda s: s["predicate"]["resources"][0].update(digest="AB" * 32)),
                         ManifestFormatError),
    "oversized": (b" " * (MAX_BUNDLE_BYTES + 1), ManifestFormatError),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_bundle_raises_its_exact_class_naming_the_file(name):
    data, error = BAD[name]
    with pytest.raises(error) as info:
        open_oms_bundle(data, [KEY.public], where="model.sig")
    assert type(info.value) is error  # not a subclass: the table names the class
    assert str(info.value).startswith("model.sig: ")
