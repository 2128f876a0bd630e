"""Opening a Hugging Face checkpoint directory as untrusted input: config, index, headers, side files."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from shardtool.checkpoint._safetensors import (
    Header,
    TensorInfo,
    read_header,
    reject_json_constant,
    strict_json_object,
)
from shardtool.errors import CheckpointFormatError, StorageError, UsageError

INDEX_NAME = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_SIDE_FILE_BYTES = 256 * 1024 * 1024
# Other weight formats that may sit beside the safetensors files; never copied (they would double the size
# and are not what we split).
_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".safetensors", ".tmp")


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    config: Mapping[str, Any]
    headers: Mapping[str, Header]                       # source file name -> validated header
    tensors: Mapping[str, tuple[TensorInfo, str]]      # tensor name -> (info, source file name)
    side_files: tuple[str, ...]                        # copied through unchanged (config, tokenizer, index, ...)
    skipped: tuple[str, ...]                           # present but not copied (other weight formats, subdirs)


def _manifest_safe(name: str) -> bool:
    """Whether a file name can be a manifest path (NFC, no control characters, ...); others are not copied."""
    from shardtool.errors import ManifestFormatError
    from shardtool.manifest._paths import check_relpath

    try:
        check_relpath(name)
    except ManifestFormatError:
        return False
    return True


def load_json(path: Path) -> Any:
    """A small JSON file, with duplicate keys and NaN rejected."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointFormatError(f"larger than {MAX_JSON_BYTES} bytes", path=str(path))
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointFormatError("file not found", path=str(path)) from None
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"not UTF-8: {e.reason}", path=str(path)) from None
    except OSError as e:
        raise StorageError(f"cannot read: {e.strerror}", path=str(path)) from e

    try:
        return json.loads(text, object_pairs_hook=strict_json_object, parse_constant=reject_json_constant)
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"not valid JSON: {e.msg} at line {e.lineno}", path=str(path)) from None
    except CheckpointFormatError as e:
        raise CheckpointFormatError(e.message, path=str(path)) from None


def _plain_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or name.startswith(".") or "\x00" in name:
        raise CheckpointFormatError(f"{what} {name!r} is not a plain file name in the checkpoint directory",
                                    path=INDEX_NAME)
    return name


def _weight_files(root: Path, names: list[str]) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read and, with an index, its weight_map (tensor -> file)."""
    if INDEX_NAME in names:
        index = load_json(root / INDEX_NAME)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointFormatError("must be a JSON object with a 'weight_map' object", path=INDEX_NAME)
        weight_map = {str(k): _plain_name(v, "weight_map file") for k, v in index["weight_map"].items()}
        if not weight_map:
            raise CheckpointFormatError("weight_map is empty", path=INDEX_NAME)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if f not in names]
        if missing:
            raise CheckpointFormatError(
                f"index names {len(missing)} file(s) that are not in the checkpoint: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else ""), path=INDEX_NAME)
        return files, weight_map
    if "model.safetensors" in names:
        return ["model.safetensors"], None
    found = sorted(n for n in names if n.endswith(".safetensors"))
    if len(found) == 1:
        return found, None
    if not found:
        raise CheckpointFormatError("no safetensors weights found", path=str(root),
                                    hint="expected model.safetensors or model-*.safetensors with an index")
    raise CheckpointFormatError(f"{len(found)} safetensors files but no {INDEX_NAME}", path=str(root))


def open_checkpoint(root: Path) -> Checkpoint:
    """Read and validate everything but the tensor bytes."""
    root = Path(root)
    if not root.is_dir():
        raise UsageError("checkpoint directory not found", path=str(root))
    try:
        entries = {e.name: e for e in os.scandir(root)}
    except OSError as e:
        raise StorageError(f"cannot list directory: {e.strerror}", path=str(root)) from e
    names = sorted(n for n, e in entries.items() if e.is_file(follow_symlinks=True))
    if "config.json" not in names:
        raise CheckpointFormatError("config.json not found", path=str(root))
    config = load_json(root / "config.json")
    if not isinstance(config, dict):
        raise CheckpointFormatError("must be a JSON object", path="config.json")

    files, weight_map = _weight_files(root, names)
    headers = {f: read_header(root / f) for f in files}
    tensors: dict[str, tuple[TensorInfo, str]] = {}
    for f, header in headers.items():
        for t in header.tensors:
            if t.name in tensors:
                raise CheckpointFormatError(f"tensor {t.name!r} is in both {tensors[t.name][1]} and {f}")
            tensors[t.name] = (t, f)
    if weight_map is not None:
        wrong = sorted(n for n, f in weight_map.items() if n not in tensors or tensors[n][1] != f)
        if wrong:
            n = wrong[0]
            where = f"is in {tensors[n][1]}" if n in tensors else "is in no file"
            raise CheckpointFormatError(f"index maps {len(wrong)} tensor(s) wrongly: {n!r} -> {weight_map[n]} "
                                        f"but {where}", path=INDEX_NAME)
        unlisted = sorted(set(tensors) - set(weight_map))
        if unlisted:
            raise CheckpointFormatError(f"{len(unlisted)} tensor(s) are in the files but not in the index, "
                                        f"e.g. {unlisted[0]!r}", path=INDEX_NAME)

    side, skipped = [], []
    for name in sorted(entries):
        entry = entries[name]
        if name.startswith(".") or name in files:
            continue
        mode = entry.stat(follow_symlinks=True).st_mode
        if not stat.S_ISREG(mode) or name.endswith(_WEIGHT_SUFFIXES):
            skipped.append(name)
        elif entry.stat().st_size > MAX_SIDE_FILE_BYTES or not _manifest_safe(name):
            skipped.append(name)
        else:
            side.append(name)
    return Checkpoint(root, config, headers, tensors, tuple(side), tuple(skipped))
