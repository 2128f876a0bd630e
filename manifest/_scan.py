"""Walking a model directory: every entry below it with its type, never following links.

Shared by `shardtool manifest` (which refuses anything but regular files) and `audit` (which reports
links and special files as findings).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from shardtool.errors import ManifestFormatError, StorageError

_EXPERT = re.compile(r"experts/layer-(\d{3,5})/expert-(\d{4,7})\.safetensors")
_TRUNK_LAYER = re.compile(r"trunk/layer-(\d{3,5})\.safetensors")
_CONFIG = {"config.json", "generation_config.json"}
_TOKENIZER = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "tokenizer.model", "added_tokens.json", "chat_template.jinja", "tiktoken.model"}


@dataclass(frozen=True)
class DirItem:
    relpath: str  # '/'-separated, as found on disk (may be non-canonical: that is for the caller to judge)
    kind: str  # "file", "symlink", "directory", "special"
    abspath: str

    def size(self) -> int | None:
        """lstat on demand: the walk itself uses only the directory entry's type, no syscall per file."""
        try:
            return os.lstat(self.abspath).st_size
        except OSError:
            return None


def classify(relpath: str) -> tuple[str, int | None, int | None]:
    """(kind, layer, expert) for a path of the split layout (docs/shard-layout.md); `other` when unknown."""
    m = _EXPERT.fullmatch(relpath)
    if m:
        return "expert", int(m.group(1)), int(m.group(2))
    m = _TRUNK_LAYER.fullmatch(relpath)
    if m:
        return "trunk", int(m.group(1)), None
    if relpath.startswith("trunk/") and relpath.endswith(".safetensors"):
        return "trunk", None, None
    if relpath in _CONFIG:
        return "config", None, None
    if relpath in _TOKENIZER:
        return "tokenizer", None, None
    return "other", None, None


def _listing(directory: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda d: d.name.encode("utf-8", "surrogateescape"))
    except OSError as e:
        raise StorageError(f"cannot list directory: {e.strerror}", path=directory) from e


def _kind(d: os.DirEntry) -> str | None:
    try:
        if d.is_symlink():
            return "symlink"
        if d.is_dir(follow_symlinks=False):
            return "directory"
        return "file" if d.is_file(follow_symlinks=False) else "special"
    except OSError:
        return None  # vanished while we listed; the manifest comparison reports it if it mattered


def walk(root: Path) -> Iterator[DirItem]:
    """Every entry below `root`, sorted, each directory after its contents; symlinks are reported, never
    followed. Iterative, not recursive: a hostile tree thousands of levels deep must not exhaust the stack."""
    if not root.is_dir():
        raise ManifestFormatError("not a directory", path=str(root))
    # Each frame: the remaining entries of one directory, its relative prefix, and its own item (yielded last).
    stack: list[tuple[Iterator[os.DirEntry], str, DirItem | None]] = [(iter(_listing(str(root))), "", None)]
    while stack:
        entries, prefix, own = stack[-1]
        for d in entries:
            kind = _kind(d)
            if kind is None:
                continue
            item = DirItem(prefix + d.name, kind, d.path)
            if kind == "directory":
                stack.append((iter(_listing(d.path)), item.relpath + "/", item))
                break
            yield item
        else:
            stack.pop()
            if own is not None:
                yield own
