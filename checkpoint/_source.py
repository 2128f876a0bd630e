"""Opening a Hugging Face checkpoint directory as untrusted input: config, index, headers, side files.

Every file is read through `_ckptdir.CheckpointDir` (no link out of the checkpoint, regular files only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from shardtool.checkpoint._ckptdir import CheckpointDir, Item
from shardtool.safetensors_format import Header, TensorInfo, read_header_fd
from shardtool.strict_json import loads_strict
from shardtool.errors import CheckpointFormatError, StorageError, VerificationError

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
    items: Mapping[str, Item]                          # every entry looked at (links described by their target)
    identity: tuple[int, int]                          # (device, inode) of the checkpoint directory
    why_skipped: Mapping[str, str]                     # skipped name -> reason, for the note split prints
    signed: SignedDigests | None = None                 # split --oms-signature: the digests every read must match
    pins: Mapping[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)  # name -> pin_of(fd)

    def open_dir(self) -> CheckpointDir:
        """The same checkpoint directory again (refused if it was replaced), for reading tensor bytes."""
        return CheckpointDir(self.root, expect=self.identity)

    def expected(self, name: str) -> tuple[int, int, int]:
        """(device, inode, size) a file had when it was planned; it must still be that file when copied."""
        return self.items[name].identity


@dataclass(frozen=True)
class SignedDigests:
    """The digest a signed statement (OMS) gives each file, which every byte split parses or copies must match."""

    hash_type: str                     # "sha256" or "blake3"
    digests: Mapping[str, bytes]       # relative path -> digest
    where: str                         # the signature file, for error lines

    def check(self, root: Path, name: str, found: bytes) -> None:
        """Raises VerificationError unless `found` is the signed digest of `name`."""
        expected = self.digests.get(name)
        if expected is None:
            raise VerificationError(f"split reads this file but it is not listed in the OMS statement of "
                                    f"{self.where} (its bytes are not signed)", path=str(root / name),
                                    hint="sign the checkpoint again without --ignore-paths over the files split uses")
        if found != expected:
            raise VerificationError(f"does not match its OMS signature: {self.hash_type} {expected.hex()} signed "
                                    f"in {self.where}, {found.hex()} read by split",
                                    path=str(root / name))

    def hasher(self) -> Any:
        if self.hash_type == "sha256":
            return hashlib.sha256()
        import blake3

        return blake3.blake3()


def pin_of(fd: int) -> tuple[int, int, int]:
    """(size, mtime, ctime) of an open file: any write to it moves its ctime, which no unprivileged user can set
    back, so an unchanged pin means the bytes read through the fd are the bytes hashed through it."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def hash_fd(signed: SignedDigests, root: Path, name: str, fd: int) -> tuple[int, int, int]:
    """Hash the open file `name` from its first byte to its end, check it against the signed digest (raises), and
    return its pin, taken before the first byte was read: a write while it was hashed moves the pin."""
    pin = pin_of(fd)
    h = signed.hasher()
    buf = bytearray(8 * 1024 * 1024)
    offset = 0
    while True:
        try:
            n = os.preadv(fd, [buf], offset)
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror}", path=str(root / name)) from e
        if n == 0:
            break
        h.update(memoryview(buf)[:n])
        offset += n
    if offset != pin[0] or pin_of(fd) != pin:
        raise VerificationError("changed while split hashed it against the OMS statement", path=str(root / name))
    signed.check(root, name, h.digest())
    return pin


def _manifest_safe(name: str) -> bool:
    """Whether a file name can be a manifest path (NFC, no control characters, ...); others are not copied."""
    from shardtool.errors import ManifestFormatError
    from shardtool.manifest import check_relpath

    try:
        check_relpath(name)
    except ManifestFormatError:
        return False
    return True


def parse_json(data: bytes, where: str) -> Any:
    """Untrusted JSON bytes: UTF-8, duplicate keys and NaN rejected (the one strict reader)."""
    return loads_strict(data, where)


def load_json(path: Path) -> Any:
    """A small JSON file the user named (`inspect --config`), read by the one safe-open: a regular file (a FIFO
    or device is refused, not waited on), at most MAX_JSON_BYTES. The user's own input: a usage-class error."""
    from shardtool.safeio import read_regular

    try:
        data = read_regular(path, MAX_JSON_BYTES, what="JSON file", too_large=CheckpointFormatError)
    except VerificationError as e:
        raise CheckpointFormatError(e.message, path=str(path)) from None
    return parse_json(data, str(path))


def _plain_name(name: Any, what: str) -> str:
    """A weight file name: one plain segment that could also be a manifest path (its name travels into the
    shards' `shardtool.source` record, from which join recreates the file)."""
    if not isinstance(name, str) or "/" in name or name.startswith(".") or not _manifest_safe(name):
        raise CheckpointFormatError(f"{what} {name!r} is not a plain file name in the checkpoint directory",
                                    path=INDEX_NAME)
    return name


def _regular(d: CheckpointDir, items: Mapping[str, Item], name: str) -> Item:
    """The entry `name`, which split must read: it has to be a regular file (or a permitted link to one)."""
    item = items.get(name)
    if item is None:
        raise CheckpointFormatError(f"{name!r} not found", path=str(d.root))
    if item.kind != "file":
        raise CheckpointFormatError(f"{name!r} is a {item.what}, expected a regular file", path=str(d.root))
    return item


def _read_json(d: CheckpointDir, items: Mapping[str, Item], name: str, signed: SignedDigests | None) -> Any:
    data = d.read(name, MAX_JSON_BYTES, expect=_regular(d, items, name).identity)
    if signed is not None:  # the very bytes parsed below
        h = signed.hasher()
        h.update(data)
        signed.check(d.root, name, h.digest())
    return parse_json(data, name)


def _weight_files(d: CheckpointDir, items: Mapping[str, Item],
                  signed: SignedDigests | None) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read and, with an index, its weight_map (tensor -> file)."""
    if INDEX_NAME in items:
        index = _read_json(d, items, INDEX_NAME, signed)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointFormatError("must be a JSON object with a 'weight_map' object", path=INDEX_NAME)
        weight_map = {str(k): _plain_name(v, "weight_map file") for k, v in index["weight_map"].items()}
        if not weight_map:
            raise CheckpointFormatError("weight_map is empty", path=INDEX_NAME)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if f not in items]
        if missing:
            raise CheckpointFormatError(
                f"index names {len(missing)} file(s) that are not in the checkpoint: "
                + ", ".join(repr(f) for f in missing[:8]) + (" ..." if len(missing) > 8 else ""), path=INDEX_NAME)
        for f in files:
            _regular(d, items, f)
        return files, weight_map
    regular = [n for n, i in items.items() if i.kind == "file"]
    if "model.safetensors" in items:
        _regular(d, items, "model.safetensors")
        return ["model.safetensors"], None
    found = sorted(n for n in regular if n.endswith(".safetensors"))
    if len(found) == 1:
        return [_plain_name(found[0], "weight file")], None
    if not found:
        raise CheckpointFormatError("no safetensors weights found", path=str(d.root),
                                    hint="expected model.safetensors or model-*.safetensors with an index")
    raise CheckpointFormatError(f"{len(found)} safetensors files but no {INDEX_NAME}", path=str(d.root))


def _read_header(d: CheckpointDir, items: Mapping[str, Item], name: str, signed: SignedDigests | None,
                 pins: dict[str, tuple[int, int, int]]) -> Header:
    """The file's validated header; with `signed`, the whole file is hashed and checked first, through the same
    fd, and pinned: split later reads its tensors only while the file still has this pin (`_stream.Sources`)."""
    fd, _ = d.open(name, expect=_regular(d, items, name).identity)
    try:
        if signed is not None:
            pins[name] = hash_fd(signed, d.root, name, fd)
        header = read_header_fd(fd, name)
        if signed is not None and pin_of(fd) != pins[name]:
            raise VerificationError("changed after split hashed it against the OMS statement",
                                    path=str(d.root / name))
        return header
    finally:
        os.close(fd)


def _skip_reason(name: str, item: Item) -> str | None:
    """Why a side file is not copied, or None when it is."""
    if item.kind != "file":
        return item.what
    if name.endswith(_WEIGHT_SUFFIXES):
        return "another weight format"
    if item.size > MAX_SIDE_FILE_BYTES:
        return f"larger than {MAX_SIDE_FILE_BYTES} bytes"
    if not _manifest_safe(name):
        return "its name cannot be a manifest path"
    return None


def open_checkpoint(root: Path, *, signed: SignedDigests | None = None) -> Checkpoint:
    """Read and validate everything but the tensor bytes, every file through the checkpoint's safe open. With
    `signed`, every file is checked against its signed digest before a byte of it is parsed."""
    with CheckpointDir(Path(root)) as d:
        items = d.scan()
        if "config.json" not in items:
            raise CheckpointFormatError("config.json not found", path=str(d.root))
        config = _read_json(d, items, "config.json", signed)
        if not isinstance(config, dict):
            raise CheckpointFormatError("must be a JSON object", path="config.json")

        files, weight_map = _weight_files(d, items, signed)
        pins: dict[str, tuple[int, int, int]] = {}
        headers = {f: _read_header(d, items, f, signed, pins) for f in files}
        tensors: dict[str, tuple[TensorInfo, str]] = {}
        for f, header in headers.items():
            for t in header.tensors:
                if t.name in tensors:
                    raise CheckpointFormatError(f"tensor {t.name!r} is in both {tensors[t.name][1]!r} and {f!r}")
                tensors[t.name] = (t, f)
        if weight_map is not None:
            wrong = sorted(n for n, f in weight_map.items() if n not in tensors or tensors[n][1] != f)
            if wrong:
                n = wrong[0]
                where = f"is in {tensors[n][1]!r}" if n in tensors else "is in no file"
                raise CheckpointFormatError(f"index maps {len(wrong)} tensor(s) wrongly: {n!r} -> {weight_map[n]!r} "
                                            f"but {where}", path=INDEX_NAME)
            unlisted = sorted(set(tensors) - set(weight_map))
            if unlisted:
                raise CheckpointFormatError(f"{len(unlisted)} tensor(s) are in the files but not in the index, "
                                            f"e.g. {unlisted[0]!r}", path=INDEX_NAME)

        side, skipped = [], {}
        for name, item in items.items():
            if name in headers:
                continue
            reason = _skip_reason(name, item)
            if reason is None:
                side.append(name)
            else:
                skipped[name] = reason
        return Checkpoint(d.root, config, headers, tensors, tuple(side), tuple(skipped), items, d.identity, skipped,
                          signed, pins)
