"""The checkpoint directory as untrusted input: every file split reads from it is opened here, and only here.

A checkpoint is whatever a stranger handed us, so (docs/shard-layout.md, "What split reads"):

* Only the directory's own entries are read, each opened by the one safe-open (`shardtool.safeio`)
  relative to a descriptor of the directory (O_NOFOLLOW | O_NONBLOCK, then `fstat` must say regular file):
  a FIFO cannot hang us, a device or socket is never read, a directory is never taken for a file. Its
  errors are verdicts about a signed tree; here the tree is a producer's input, so they become
  CheckpointFormatError (exit 2).
* A symbolic link is followed only when its target, taken as written and walked one component at a time
  without following any further link, names a file inside the checkpoint directory; or, when the
  checkpoint is a Hugging Face cache snapshot (`models--ORG--NAME/snapshots/REV/`), when the target is
  exactly `../../blobs/HEX` (a 40- or 64-digit hex digest) in that same repository's `blobs/`. Every other
  link (absolute, leaving the checkpoint, pointing through or at another link, dangling) is refused.
* A file keeps the identity (device, inode, size) it had when split planned the job; when it is opened
  again to be copied it must still be that file.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from shardtool.safeio import describe_mode, open_file_at
from shardtool.errors import CheckpointFormatError, NotARegularFileError, StorageError, UsageError, VerificationError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_HF_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # git blob SHA-1 or LFS SHA-256, as the HF cache names them


@dataclass(frozen=True)
class Item:
    """One entry of the checkpoint directory, as split will treat it (a link is described by its target)."""

    name: str
    kind: str        # "file", "directory" or "special"
    what: str        # for messages: "regular file", "directory", "FIFO", "socket", "character device", ...
    dev: int
    ino: int
    size: int
    mode: int        # permission bits (st_mode & 0o7777) of the file itself, the link's target for a link
    link: bool       # reached through a symbolic link

    @property
    def identity(self) -> tuple[int, int, int]:
        return self.dev, self.ino, self.size


def _kind(mode: int) -> str:
    return "file" if stat.S_ISREG(mode) else "directory" if stat.S_ISDIR(mode) else "special"


class CheckpointDir:
    """An open checkpoint directory. Use as a context manager; `reopen()` for a later pass over the same one."""

    def __init__(self, root: Path, *, expect: tuple[int, int] | None = None):
        self.root = Path(root)
        try:
            # The checkpoint path itself is the user's own argument and is resolved like any path they type;
            # everything below it is untrusted.
            self._fd = os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            raise UsageError("checkpoint directory not found", path=str(self.root)) from None
        except NotADirectoryError:
            raise UsageError("checkpoint is not a directory", path=str(self.root)) from None
        except OSError as e:
            raise StorageError(f"cannot open checkpoint directory: {e.strerror}", path=str(self.root)) from e
        st = os.fstat(self._fd)
        self.identity = (st.st_dev, st.st_ino)
        if expect is not None and self.identity != expect:
            os.close(self._fd)
            raise CheckpointFormatError("checkpoint directory was replaced during split", path=str(self.root))
        self._blobs_fd = _hf_blobs(self._fd)

    def reopen(self) -> "CheckpointDir":
        return CheckpointDir(self.root, expect=self.identity)

    def close(self) -> None:
        for fd in (self._fd, self._blobs_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._blobs_fd = -1, None

    def __enter__(self) -> "CheckpointDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, cls: type, name: str, message: str) -> Exception:
        """One-line error about entry `name`: the untrusted name goes in as repr() (control characters escaped)."""
        return cls(f"{name!r} {message}", path=str(self.root))

    # -- listing ------------------------------------------------------------------------------------------------

    def scan(self) -> dict[str, Item]:
        """Every entry whose name does not start with '.', described (links by their target, or refused)."""
        try:
            with os.scandir(self._fd) as it:
                names = sorted(d.name for d in it if not d.name.startswith("."))
        except OSError as e:
            raise StorageError(f"cannot list directory: {e.strerror}", path=str(self.root)) from e
        items = {}
        for name in names:
            item = self.lookup(name)
            if item is not None:
                items[name] = item
        return items

    def lookup(self, name: str) -> Item | None:
        """The entry `name` (None if it vanished), without opening it; a link is resolved by the rules."""
        try:
            st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error(StorageError, name, f"cannot stat: {e.strerror}") from e
        link = stat.S_ISLNK(st.st_mode)
        if link:
            dir_fd, final = self._resolve_link(name)
            try:
                st = os.stat(final, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise self._error(CheckpointFormatError, name, "is a dangling symlink") from None
            except OSError as e:
                raise self._error(StorageError, name, f"cannot stat link target: {e.strerror}") from e
            finally:
                os.close(dir_fd)
            if stat.S_ISLNK(st.st_mode):
                raise self._link_error(name, "points at another symlink; chains of links are not followed")
        return Item(name, _kind(st.st_mode), describe_mode(st.st_mode), st.st_dev, st.st_ino, st.st_size,
                    stat.S_IMODE(st.st_mode), link)

    # -- opening ------------------------------------------------------------------------------------------------

    def open(self, name: str, *, expect: tuple[int, int, int] | None = None) -> tuple[int, os.stat_result]:
        """(fd, fstat) of the regular file `name`; with `expect`, it must still be that (dev, inode, size)."""
        try:
            st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            raise self._error(CheckpointFormatError, name, "not found") from None
        except OSError as e:
            raise self._error(StorageError, name, f"cannot stat: {e.strerror}") from e
        if stat.S_ISLNK(st.st_mode):
            dir_fd, final = self._resolve_link(name)
        else:
            dir_fd, final = os.dup(self._fd), name
        try:
            if not stat.S_ISLNK(st.st_mode) and not stat.S_ISREG(st.st_mode):
                raise self._not_regular(name, st.st_mode)
            try:
                fd = open_file_at(dir_fd, final, name)
            except NotARegularFileError as e:
                if e.finding == "symlink":  # the entry was swapped for a link, or a link points at a link
                    raise self._link_error(name, "is a symlink where a file was, or points at another link") \
                        from None
                raise self._error(CheckpointFormatError, name, e.message) from None
            except VerificationError as e:  # missing (a dangling link), unreadable: the checkpoint's own state
                raise self._error(CheckpointFormatError, name, e.message) from None
        finally:
            os.close(dir_fd)
        st = os.fstat(fd)
        if expect is not None and (st.st_dev, st.st_ino, st.st_size) != expect:
            os.close(fd)
            raise self._error(CheckpointFormatError, name,
                              f"changed during split (was {expect[2]} bytes, inode {expect[1]}; now {st.st_size} "
                              f"bytes, inode {st.st_ino})")
        return fd, st

    def read(self, name: str, cap: int, *, expect: tuple[int, int, int] | None = None) -> bytes:
        """The whole of a small regular file, refused above `cap` bytes."""
        fd, st = self.open(name, expect=expect)
        try:
            if st.st_size > cap:
                raise self._error(CheckpointFormatError, name,
                                  f"is {st.st_size} bytes, larger than the {cap}-byte limit")
            chunks, total = [], 0
            while total <= cap:
                chunk = os.read(fd, min(1 << 20, cap + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        except OSError as e:
            raise self._error(StorageError, name, f"cannot read: {e.strerror}") from e
        finally:
            os.close(fd)
        if total > cap:
            raise self._error(CheckpointFormatError, name, f"grew past the {cap}-byte limit while read")
        return b"".join(chunks)

    # -- links --------------------------------------------------------------------------------------------------

    def _link_error(self, name: str, why: str) -> CheckpointFormatError:
        return self._error(CheckpointFormatError, name, f"{why}; split follows a link only to a file inside the "
                           "checkpoint, or from a Hugging Face cache snapshot into its own blobs/")

    def _not_regular(self, name: str, mode: int) -> CheckpointFormatError:
        return self._error(CheckpointFormatError, name, f"is a {describe_mode(mode)}, expected a regular file")

    def _resolve_link(self, name: str) -> tuple[int, str]:
        """(directory fd, final name) that the link `name` designates under the rules; the caller closes the fd.

        The target is walked as written: '..' steps back along the directories we opened (never past the
        checkpoint), and every directory is opened with O_NOFOLLOW, so no other link is ever taken on the way.
        """
        try:
            target = os.readlink(name, dir_fd=self._fd)
        except OSError as e:
            raise self._error(StorageError, name, f"cannot read link: {e.strerror}") from e
        shown = repr(target[:200])
        if target.startswith("/"):
            raise self._link_error(name, f"is a symlink to the absolute path {shown}")
        parts = [p for p in target.split("/") if p not in ("", ".")]
        if not parts:
            raise self._link_error(name, f"is a symlink to {shown}")
        if self._blobs_fd is not None and len(parts) == 4 and parts[:3] == ["..", "..", "blobs"] \
                and _HF_BLOB.fullmatch(parts[3]):
            return os.dup(self._blobs_fd), parts[3]
        stack = [os.dup(self._fd)]
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                if part == "..":
                    if len(stack) == 1:
                        raise self._link_error(name, f"is a symlink to {shown}, outside the checkpoint")
                    os.close(stack.pop())
                    if last:
                        return os.dup(stack[-1]), "."
                elif last:
                    return os.dup(stack[-1]), part
                else:
                    try:
                        stack.append(os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=stack[-1]))
                    except OSError as e:
                        if e.errno in (errno.ELOOP, errno.ENOTDIR):
                            raise self._link_error(name, f"is a symlink to {shown}, through another link or a "
                                                         "non-directory") from None
                        if e.errno == errno.ENOENT:
                            raise self._error(CheckpointFormatError, name,
                                              f"is a dangling symlink to {shown}") from None
                        raise self._error(StorageError, name,
                                          f"cannot follow link to {shown}: {e.strerror}") from e
            raise AssertionError("unreachable: the loop returns at the last component")
        finally:
            for fd in stack:
                os.close(fd)


def _hf_blobs(root_fd: int) -> int | None:
    """A descriptor of `../../blobs` when the checkpoint is `REPO/snapshots/REV` of a Hugging Face cache, else None.

    Decided on the directories themselves (REV's real parent is REPO's `snapshots`, REPO has a real `blobs`
    directory), not on the path the user typed.
    """
    fds: list[int] = []
    try:
        parent = os.open("..", _DIR_FLAGS, dir_fd=root_fd)
        fds.append(parent)
        repo = os.open("..", _DIR_FLAGS, dir_fd=parent)
        fds.append(repo)
        snapshots = os.stat("snapshots", dir_fd=repo, follow_symlinks=False)
        pst = os.fstat(parent)
        if not stat.S_ISDIR(snapshots.st_mode) or (snapshots.st_dev, snapshots.st_ino) != (pst.st_dev, pst.st_ino):
            return None
        return os.open("blobs", _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=repo)
    except OSError:
        return None
    finally:
        for fd in fds:
            os.close(fd)

