"""ML-DSA (FIPS 204) signatures on shardtool's own manifest, where the installed cryptography offers them: the same
envelope, the same threshold rules (distinct trusted keys, Ed25519 and ML-DSA alike), key files through keygen."""

from __future__ import annotations

import pytest

from shardtool.errors import ManifestFormatError, SignatureError, ThresholdError, TrustSettingsError
from shardtool.keys import ALGORITHMS, PrivateKey, generate, load_private_key, load_public_key, mldsa_available
from shardtool.manifest import Envelope, Signature, pae, verify_envelope
from shardtool.manifest._envelope import PAYLOAD_TYPE

pytestmark = pytest.mark.skipif(not mldsa_available(), reason="this cryptography/OpenSSL has no ML-DSA")


@pytest.fixture(scope="module")
def pq() -> list[PrivateKey]:
    return [generate("ml-dsa-65"), generate("ml-dsa-44"), generate("ml-dsa-87")]


def _signed(keys, payload=b"head"):
    env = Envelope(PAYLOAD_TYPE, payload)
    for k in keys:
        env = env.signed_by(k)
    return env


def test_each_ml_dsa_size_signs_and_verifies_over_pae(pq):
    for key in pq:
        sig = key.sign(pae(PAYLOAD_TYPE, b"head"))
        assert (len(key.public.raw), len(sig)) == ALGORITHMS[key.public.algorithm]
        key.public.verify(sig, pae(PAYLOAD_TYPE, b"head"))
        with pytest.raises(SignatureError):
            key.public.verify(sig, pae(PAYLOAD_TYPE, b"head!"))


def test_ed25519_and_ml_dsa_keys_count_alike_toward_a_threshold(pq, ed25519_keys):
    ed, mldsa = ed25519_keys[0], pq[0]
    env = _signed([ed, mldsa])
    _, signers = verify_envelope(env, [ed.public, mldsa.public], 2)
    assert set(signers) == {ed.public, mldsa.public}


THRESHOLD_CASES = {
    # Only the ML-DSA key signed; two keys asked.
    "one-of-two-signed": (lambda ed, q: (_signed([q]), [ed.public, q.public], 2), ThresholdError),
    # The same ML-DSA key trusted twice is one key: a threshold of two cannot be met, and saying so is a settings error.
    "same-key-trusted-twice": (lambda ed, q: (_signed([q]), [q.public, q.public], 2), TrustSettingsError),
    # A corrupted ML-DSA signature counts for nothing.
    "corrupted-ml-dsa-signature": (lambda ed, q: (Envelope(PAYLOAD_TYPE, b"head", (Signature(
        q.public.keyid, bytes([_signed([q]).signatures[0].sig[0] ^ 1]) + _signed([q]).signatures[0].sig[1:]),)),
        [q.public], 1), SignatureError),
    # An Ed25519 signature presented under an ML-DSA key's ID: wrong size for that key, not counted.
    "ed25519-signature-for-an-ml-dsa-key": (lambda ed, q: (Envelope(PAYLOAD_TYPE, b"head", (Signature(
        q.public.keyid, _signed([ed]).signatures[0].sig),)), [q.public], 1), SignatureError),
}


@pytest.mark.parametrize("case", THRESHOLD_CASES)
def test_threshold_rules_hold_for_ml_dsa(case, pq, ed25519_keys, raises_exactly):
    build, error = THRESHOLD_CASES[case]
    env, trusted, threshold = build(ed25519_keys[0], pq[0])
    with raises_exactly(error):
        verify_envelope(env, trusted, threshold)


@pytest.mark.parametrize("size", [63, 65, 2419, 3310, 4628])
def test_a_signature_of_no_algorithms_size_is_refused(size, raises_exactly):
    with raises_exactly(ManifestFormatError):
        Signature("abcd", b"\x01" * size)


def test_a_cluster_node_key_must_stay_ed25519(pq, raises_exactly):
    """A node signs its info() with Ed25519 and a plan names 32 raw bytes: an ML-DSA node key is refused when the
    plan is made, not by the node that later cannot read the plan."""
    from shardtool.errors import UsageError
    from shardtool.runtime.engine._cluster_plan import make_plan

    with raises_exactly(UsageError):
        make_plan(None, [("a", 1 << 30, None)], 1, keys={"a": pq[0].public})
