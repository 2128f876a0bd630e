"""The signed Merkle manifest: format, signatures, verification, audit.

Trust logic (`_canonical`, `_records`, `_merkle`, `_envelope`, `_document`) takes bytes and keys, never
paths; `_io`, `_files`, `_scan`, `_state` and `audit` are the I/O around it. Where a shard is verified:
`shardtool.manifest._files.read_verified`; the one entry check (size, then BLAKE3), which every reader of a
listed file calls: `check_entry`.

The names below are loaded from their module at first use (PEP 562), so a command imports only the
modules it needs (audit never loads the receipt format).
"""

from __future__ import annotations

from shardtool.lazy import lazy_exports

_HOMES = {
    "_document": ("FORMAT", "MAX_MANIFEST_BYTES", "Manifest", "VerifiedManifest", "build_manifest",
        "check_freshness", "check_model_id", "decode_manifest", "describe_head", "entry_bytes",
        "verify_manifest"),
    "_envelope": ("PAYLOAD_TYPE", "Envelope", "Signature", "pae", "verify_envelope"),
    "_files": ("FileDigest", "VerifiedBytes", "VerifyingStream", "check_entry", "check_size", "read_verified",
        "read_verified_prefix", "read_verified_timed", "PAGE_CACHE_CHOICES", "PAGE_CACHE_MODES", "verify_entry", "verify_file", "verify_open_file"),
    "_paths": ("check_relpath",),
    "_oms": ("OmsResource", "OmsStatement", "make_oms_bundle", "open_oms_bundle"),
    "_oms_files": ("audit_oms", "export_oms", "read_oms_bundle"),
    "_io": ("MANIFEST_NAME", "SIGNATURE_NAME", "default_manifest_path", "hash_directory", "load_manifest", "load_trusted_manifest",
        "load_trusted_proof", "load_verified_manifest", "manifest_relpath", "read_manifest_bytes",
        "save_manifest", "trust_manifest_bytes"),
    "_receipt": ("MAX_RECEIPT_BYTES", "MAX_TRACE_BYTES", "RECEIPT_FORMAT", "RECEIPT_PAYLOAD_TYPE", "Receipt",
        "decode_trace", "encode_trace", "open_receipt", "routing_leaves", "routing_root", "sign_receipt",
        "valid_receipt_id"),
    "_proof": ("ProvenEntry", "build_proof", "verify_proof"),
    "_records": ("KINDS", "MAX_ENTRIES", "MAX_EXPERT", "MAX_LAYER", "Entry", "Head", "check_model_id_form"),
    "_state": ("check_and_record", "default_state_dir"),
}

__all__, __getattr__, __dir__ = lazy_exports(globals(), _HOMES)
