"""Walking a model directory: every entry below it with its type, never following links.

Shared by `shardtool manifest` (which refuses anything but regular files) and `audit` (which reports
links and special files as findings).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from shardtool.errors import ManifestFormatError, StorageError

@dataclass(frozen=True)
class DirItem:
    relpath: str  # '/'-separated, as found on disk (may be non-canonical: that is for the caller to judge)
    kind: str  # "file", "symlink", "directory", "special", "unreadable" (a directory we could not enter),
    #            "too-deep" (a directory at max_depth, not entered)
    size: int | None = None  # lstat size, for the items the walk was asked to stat
    detail: str = ""  # "unreadable": why


def parent_directories(path: str) -> Iterator[str]:
    """The directories a '/'-separated relative path lies in, innermost first: "a/b/c" -> "a/b", "a"."""
    reldir = path.rpartition("/")[0]
    while reldir:
        yield reldir
        reldir = reldir.rpartition("/")[0]


def implied_directories(paths: Iterable[str]) -> set[str]:
    """Every directory a listed path lies in: the only directories a clean tree holds."""
    out: set[str] = set()
    for path in paths:
        for reldir in parent_directories(path):
            if reldir in out:
                break  # and so are all its parents
            out.add(reldir)
    return out


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _kind(d: os.DirEntry) -> str | None:
    try:
        if d.is_symlink():
            return "symlink"
        if d.is_dir(follow_symlinks=False):
            return "directory"
        return "file" if d.is_file(follow_symlinks=False) else "special"
    except OSError:
        return None  # vanished while we listed; the manifest comparison reports it if it mattered


def _listing(dir_fd: int) -> list[tuple[str, str]]:
    """(name, kind) of every entry of an open directory, sorted by the name's bytes. Kinds are taken now,
    while `dir_fd` is the directory listed (entries without a d_type are stat'ed relative to it)."""
    with os.scandir(dir_fd) as it:
        found = [(d.name, _kind(d)) for d in it]
    return sorted(((n, k) for n, k in found if k is not None), key=lambda nk: nk[0].encode("utf-8", "surrogateescape"))


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _lstat_size(dir_fd: int, name: str) -> int | None:
    try:
        return os.lstat(name, dir_fd=dir_fd).st_size
    except OSError:
        return None


@dataclass
class _Frame:
    entries: Iterator[tuple[str, str]]  # what is left to visit in this directory
    prefix: str  # its relative path + "/" ("" for the root)
    own: DirItem | None  # its own item, yielded after its contents
    identity: tuple[int, int]  # (st_dev, st_ino), to check the way back up


def _open_root(root: Path) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise ManifestFormatError("not a directory", path=str(root)) from None
    except OSError as e:
        raise StorageError(f"cannot open directory: {e.strerror}", path=str(root)) from e


def _enter(cur: int, name: str, relpath: str) -> tuple[int, list[tuple[str, str]]] | DirItem:
    """Directory `name` in `cur`, opened and listed: (its descriptor, its listing), or the "unreadable" item it
    is when it cannot be entered or listed."""
    try:
        child = os.open(name, _DIR_FLAGS, dir_fd=cur)
    except OSError as e:
        return DirItem(relpath, "unreadable", detail=f"cannot enter directory: {e.strerror}")
    try:
        return child, _listing(child)
    except OSError as e:
        os.close(child)
        return DirItem(relpath, "unreadable", detail=f"cannot list directory: {e.strerror}")


def walk(root: Path, *, stat_if: Callable[[str], bool] | None = None,
         max_depth: int | None = None) -> Iterator[DirItem]:
    """Every entry below `root`, sorted, each directory after its contents; symlinks are reported, never
    followed. `stat_if(relpath)`: which non-directory items get their lstat size.

    The walk holds two descriptors whatever the depth (the root's and the current directory's) and opens
    each name relative to its parent, so a hostile tree thousands of levels deep, with paths far beyond
    PATH_MAX, is walked like any other. Going back up opens `..` and checks it is the directory we came
    from. A directory that cannot be entered or listed is an "unreadable" item, and the walk goes on;
    one moved while it is walked ends the walk with an "unreadable" item (what is beyond it is unknown).
    `max_depth`: a directory at that depth (that many path segments) is not entered but reported as a
    "too-deep" item: nothing below it can be a manifest path, and a walk of a hostile tree thousands of
    levels deep would otherwise hold memory quadratic in its depth (every frame keeps its whole path).
    """
    root_fd = _open_root(root)
    cur = -1
    try:
        try:
            listing = _listing(root_fd)
        except OSError as e:
            raise StorageError(f"cannot list directory: {e.strerror}", path=str(root)) from e
        cur = os.dup(root_fd)
        frames = [_Frame(iter(listing), "", None, _identity(root_fd))]
        while frames:
            frame = frames[-1]
            for name, kind in frame.entries:
                relpath = frame.prefix + name
                if kind != "directory":
                    size = _lstat_size(cur, name) if stat_if is not None and stat_if(relpath) else None
                    yield DirItem(relpath, kind, size)
                    continue
                if max_depth is not None and len(frames) >= max_depth:
                    yield DirItem(relpath, "too-deep",
                                  detail=f"a directory {max_depth} levels deep; nothing below it can be listed, "
                                         "so it was not entered")
                    continue
                entered = _enter(cur, name, relpath)
                if isinstance(entered, DirItem):
                    yield entered
                    continue
                child, listing = entered
                os.close(cur)
                cur = child
                frames.append(_Frame(iter(listing), relpath + "/", DirItem(relpath, "directory"), _identity(child)))
                break
            else:
                frames.pop()
                if frames:
                    try:
                        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
                    except OSError as e:
                        yield DirItem(frame.prefix.rstrip("/"), "unreadable",
                                      detail=f"cannot go back up from directory: {e.strerror}; the walk stopped here")
                        return
                    os.close(cur)
                    cur = parent
                    if _identity(parent) != frames[-1].identity:
                        yield DirItem(frame.prefix.rstrip("/"), "unreadable",
                                      detail="directory moved while it was walked; the walk stopped here")
                        return
                if frame.own is not None:
                    yield frame.own
    finally:
        if cur >= 0:
            os.close(cur)
        os.close(root_fd)
