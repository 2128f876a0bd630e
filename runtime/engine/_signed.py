"""The model's small signed files (config.json, tokenizer.json, tokenizer_config.json), read through
verification: the size cap first, then the bytes checked against the manifest, and only then parsed."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from shardtool.errors import CheckpointFormatError, ShardFormatError, VerificationError
from shardtool.manifest import VerifiedManifest, read_verified
from shardtool.runtime.model import ModelConfig
from shardtool.strict_json import loads_strict

MAX_CONFIG_BYTES = 1024 * 1024
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024


def signed_text(root: Path, manifest: VerifiedManifest, path: str, cap: int) -> str | None:
    """The text of signed file `path`, read through verification (size cap first); None when unlisted."""
    entry = manifest.by_path().get(path)
    if entry is None:
        return None
    if entry.size > cap:
        raise VerificationError(f"{path} is {entry.size} bytes, more than the {cap}-byte cap", path=path)
    try:
        return read_verified(root, entry).tobytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise VerificationError(f"signed {path} is not UTF-8: {e.reason}", path=path) from None


def signed_json(root: Path, manifest: VerifiedManifest, path: str) -> dict | None:
    """A signed JSON object, parsed by the one strict reader (duplicate keys, NaN, huge integers, deep nesting
    refused) only after its bytes were verified; None when the manifest lists no such file."""
    text = signed_text(root, manifest, path, MAX_CONFIG_BYTES)
    if text is None:
        return None
    try:
        value = loads_strict(text.encode("utf-8"), path)
    except CheckpointFormatError as e:
        raise VerificationError(f"signed {path} is not valid JSON: {e.message}", path=path) from None
    if not isinstance(value, dict):
        raise VerificationError(f"signed {path} is not a JSON object", path=path)
    return value


@contextlib.contextmanager
def signed_content(path: str) -> Iterator[None]:
    """Format errors about signed file `path` are about signed, verified bytes: the publisher shipped a model that
    cannot run (a config the model cannot use). That is a verification failure (exit 1), not a usage error
    (errors.py, CheckpointFormatError)."""
    try:
        yield
    except CheckpointFormatError as e:
        raise VerificationError(f"signed {path} is unusable: {e.message}", path=path, hint=e.hint) from None


def unusable_shards(error: CheckpointFormatError) -> ShardFormatError:
    """A signed shard without a tensor its signed config.json implies, or with a wrong shape: the signed model
    cannot run, a verification failure of the signed bytes (exit 1)."""
    return ShardFormatError(f"signed shards do not fit the signed config.json: {error.message}", path=error.path,
                            hint=error.hint)


def verified_config(root: Path, manifest: VerifiedManifest) -> ModelConfig:
    """The model's signed config.json as a validated, capped ModelConfig."""
    document = signed_json(root, manifest, "config.json")
    if document is None:
        raise VerificationError("the signed manifest lists no config.json")
    with signed_content("config.json"):
        return ModelConfig.from_hf_config(document)


def load_tokenizer(root: Path, manifest: VerifiedManifest):
    """The HF tokenizer from the verified tokenizer.json, or None when the model ships none."""
    text = signed_text(root, manifest, "tokenizer.json", MAX_TOKENIZER_BYTES)
    if text is None:
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception for malformed JSON
        raise VerificationError(f"signed tokenizer.json does not load: {str(e)[:200]}", path="tokenizer.json") from None
