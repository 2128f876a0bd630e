"""An output directory (split's OUT, pull's DEST): every write, rename and unlink happens relative to a directory
descriptor opened from OUT down with O_DIRECTORY | O_NOFOLLOW, so a link planted in OUT cannot send a byte, or a
deletion, anywhere else (docs/shard-layout.md, "What split reads and writes").

* OUT itself: its last component must not be a symlink (refused; pass the directory it points to). The
  components above it are the user's own path and are resolved as typed.
* Where split needs a directory (`trunk`, `experts`, `experts/layer-LLL`), a symlink or anything but a
  directory is refused; all of them are opened before the first byte is written.
* Where split writes a file, whatever is there (a link included) is replaced by a rename, never written
  through; a file is reused only if it is a regular file, opened with O_NOFOLLOW (see `_reuse`).
* Clean-up unlinks only `.*.tmp` entries that are not directories (unlinking a link removes the link, not
  its target) and never descends through a link.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path
from typing import Iterator

from shardtool.errors import StorageError, UsageError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SCANNED = ("trunk", "experts")  # the trees split writes shards into; stale files are looked for there only


class OutDir:
    """OUT, opened (and created if absent). Use as a context manager."""

    def __init__(self, out: Path, *, checkpoint: tuple[int, int] | None = None):
        """`checkpoint`: (st_dev, st_ino) of a directory OUT and its subdirectories must not be (split's input)."""
        self.path = Path(out)
        self._checkpoint = checkpoint
        try:
            if self.path.parent != self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(self.path)
            except FileExistsError:
                pass
            fd = os.open(self.path, _DIR_FLAGS)
        except OSError as e:
            self._refuse_not_dir(e, None, self.path)
            raise StorageError(f"cannot create output directory: {e.strerror}", path=str(self.path)) from e
        self._dirs: dict[str, int] = {"": fd}
        self._lock = threading.RLock()  # pull's jobs and a store's readers open directories at once
        self._check_not_checkpoint(fd, self.path)

    @property
    def fd(self) -> int:
        return self._dirs[""]

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def __enter__(self) -> "OutDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- directories --------------------------------------------------------------------------------------------

    def dir(self, reldir: str) -> int:
        """Descriptor of OUT/reldir, created if absent; a symlink or non-directory on the way is refused."""
        with self._lock:
            return self._dir(reldir)

    def _dir(self, reldir: str) -> int:
        if reldir in self._dirs:
            return self._dirs[reldir]
        parent_rel, _, part = reldir.rpartition("/")
        parent = self._dir(parent_rel)
        where = self.path / reldir
        try:
            os.mkdir(part, dir_fd=parent)
        except FileExistsError:
            pass
        except OSError as e:
            raise StorageError(f"cannot create directory: {e.strerror}", path=str(where)) from e
        try:
            fd = os.open(part, _DIR_FLAGS, dir_fd=parent)
        except OSError as e:
            self._refuse_not_dir(e, parent, where, part)
            raise StorageError(f"cannot open directory: {e.strerror}", path=str(where)) from e
        self._dirs[reldir] = fd
        self._check_not_checkpoint(fd, where)
        return fd

    def _refuse_not_dir(self, e: OSError, parent: int | None, where: Path, name: str | None = None) -> None:
        """Turn 'a link or a file where a directory must be' into a usage error naming it; return otherwise."""
        if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
            return
        try:
            st = os.stat(name if parent is not None else where, dir_fd=parent, follow_symlinks=False)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode):
            if parent is None:
                raise UsageError("the output directory is a symlink; shardtool never writes through links",
                                 path=str(where), hint="pass the directory it points to") from None
            raise UsageError("is a symlink inside the output directory; shardtool never writes through links",
                             path=str(where), hint="remove the link") from None
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError("exists and is not a directory", path=str(where)) from None

    def _check_not_checkpoint(self, fd: int, where: Path) -> None:
        st = os.fstat(fd)
        if self._checkpoint is not None and (st.st_dev, st.st_ino) == self._checkpoint:
            raise UsageError("output directory is the checkpoint itself", path=str(where))

    # -- files --------------------------------------------------------------------------------------------------

    def locate(self, relpath: str) -> tuple[int, str]:
        """(descriptor of the directory, name) for a file split writes."""
        reldir, _, name = relpath.rpartition("/")
        return self.dir(reldir), name

    def unlink(self, relpath: str) -> None:
        """Remove a file (or a link: the link itself) if present; a directory there is left for the writer to
        report."""
        dir_fd, name = self.locate(relpath)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except (FileNotFoundError, IsADirectoryError):
            pass
        except OSError as e:
            if e.errno != errno.EPERM:  # Linux reports unlink() of a directory as EISDIR, POSIX allows EPERM
                raise StorageError(f"cannot remove: {e.strerror}", path=str(self.path / relpath)) from e

    def is_directory(self, relpath: str) -> bool:
        dir_fd, name = self.locate(relpath)
        try:
            return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StorageError(f"cannot stat: {e.strerror}", path=str(self.path / relpath)) from e

    # -- walking what is already there --------------------------------------------------------------------------

    def _walk(self) -> Iterator[tuple[int, str, str, bool]]:
        """(directory fd, its relpath, entry name, is a real directory) for everything below trunk/ and experts/;
        links are entries, never followed. Iterative: a deep hostile tree cannot exhaust the stack."""
        stack: list[tuple[int, str, bool]] = []  # (fd, relpath, fd is ours to close)
        for top in _SCANNED:
            try:
                fd = os.open(top, _DIR_FLAGS, dir_fd=self.fd)
            except OSError:
                continue  # absent, or not a directory (a link is refused before we get here)
            stack.append((fd, top, True))
        while stack:
            fd, rel, owned = stack.pop()
            try:
                with os.scandir(fd) as it:
                    entries = [(d.name, d.is_dir(follow_symlinks=False)) for d in it]
                for name, is_dir in sorted(entries):
                    if is_dir:
                        try:
                            stack.append((os.open(name, _DIR_FLAGS, dir_fd=fd), f"{rel}/{name}", True))
                        except OSError:
                            pass  # replaced meanwhile: not ours to chase
                    yield fd, rel, name, is_dir
            except OSError as e:
                raise StorageError(f"cannot list directory: {e.strerror}", path=str(self.path / rel)) from e
            finally:
                if owned:
                    os.close(fd)

    def remove_temp_files(self) -> None:
        """Temp files of an interrupted atomic write (`.NAME.XXXX.tmp`), in OUT and below trunk/ and experts/."""
        def drop(dir_fd: int, rel: str, name: str) -> None:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StorageError(f"cannot remove a leftover temp file: {e.strerror}",
                                   path=str(self.path / rel / name)) from e

        with os.scandir(self.fd) as it:
            top = [d.name for d in it if _is_temp(d.name) and not d.is_dir(follow_symlinks=False)]
        for name in top:
            drop(self.fd, "", name)
        for dir_fd, rel, name, is_dir in self._walk():
            if not is_dir and _is_temp(name):
                drop(dir_fd, rel, name)

    def stale_files(self, expected: set[str]) -> tuple[str, ...]:
        """Entries below trunk/ and experts/ that this split did not write (left by a split of another
        checkpoint, or put there by someone else); links and special files included."""
        found = {f"{rel}/{name}" for _, rel, name, is_dir in self._walk() if not is_dir}
        return tuple(sorted(found - expected))


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")
