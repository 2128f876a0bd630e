"""The signed Merkle manifest: format, signatures, verification, audit.

Trust logic (`_canonical`, `_records`, `_merkle`, `_envelope`, `_document`) takes bytes and keys, never
paths; `_io`, `_files`, `_scan`, `_state` and `audit` are the I/O around it. Where a shard is verified:
`shardtool.manifest._files.read_verified`.
"""

from shardtool.manifest._document import (
    FORMAT,
    MAX_MANIFEST_BYTES,
    Manifest,
    VerifiedManifest,
    build_manifest,
    check_freshness,
    check_model_id,
    decode_manifest,
    describe_head,
    entry_bytes,
    verify_manifest,
)
from shardtool.manifest._envelope import PAYLOAD_TYPE, Envelope, Signature, pae, verify_envelope
from shardtool.manifest._files import (
    VerifiedBytes,
    VerifyingStream,
    open_file_matches,
    read_verified,
    read_verified_prefix,
    read_verified_timed,
    verify_entry,
    verify_file,
)
from shardtool.manifest._paths import check_relpath
from shardtool.manifest._io import (
    MANIFEST_NAME,
    default_manifest_path,
    hash_directory,
    load_manifest,
    load_trusted_manifest,
    load_trusted_proof,
    load_verified_manifest,
    manifest_relpath,
    read_manifest_bytes,
    save_manifest,
    trust_manifest_bytes,
)
from shardtool.manifest._receipt import (MAX_RECEIPT_BYTES, MAX_TRACE_BYTES, RECEIPT_FORMAT, RECEIPT_PAYLOAD_TYPE,
                                        Receipt, decode_trace, encode_trace, open_receipt, routing_leaves, routing_root,
                                        sign_receipt, valid_receipt_id)
from shardtool.manifest._proof import ProvenEntry, build_proof, verify_proof
from shardtool.manifest._records import KINDS, MAX_ENTRIES, MAX_EXPERT, MAX_LAYER, Entry, Head, check_model_id_form
from shardtool.manifest._state import check_and_record, default_state_dir

__all__ = [
    "MAX_ENTRIES", "MAX_MANIFEST_BYTES", "MAX_EXPERT", "MAX_LAYER", "VerifiedBytes", "VerifyingStream", "open_file_matches", "check_relpath", "read_verified_timed",
    "verify_entry", "verify_file", "manifest_relpath", "read_manifest_bytes", "check_model_id_form",
    "FORMAT", "KINDS", "MANIFEST_NAME", "PAYLOAD_TYPE", "Entry", "Envelope", "Head", "Manifest", "Signature",
    "ProvenEntry", "VerifiedManifest", "build_proof", "verify_proof", "build_manifest", "check_and_record", "check_freshness", "decode_manifest",
    "default_manifest_path", "default_state_dir", "describe_head", "entry_bytes", "hash_directory", "load_manifest", "load_trusted_manifest", "load_trusted_proof", "check_model_id",
    "MAX_RECEIPT_BYTES", "MAX_TRACE_BYTES", "RECEIPT_FORMAT", "RECEIPT_PAYLOAD_TYPE", "Receipt", "decode_trace",
    "encode_trace",
    "open_receipt", "routing_leaves", "routing_root", "sign_receipt", "valid_receipt_id",
    "load_verified_manifest", "pae", "read_verified", "read_verified_prefix", "save_manifest", "trust_manifest_bytes", "verify_envelope", "verify_manifest",
]
