"""Audit a model directory against a verified manifest: every listed file present, the right size and
BLAKE3 digest, and nothing present that is not listed. Findings are data, not exceptions.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Generator, Iterable

from shardtool.safeio import open_beneath, open_dir_beneath, open_file_at
from shardtool.text import printable
from shardtool.errors import (DigestMismatchError, MissingFileError, NotARegularFileError, ShardtoolError,
                              VerificationError)
from shardtool.manifest._document import VerifiedManifest
from shardtool.manifest import _workers
from shardtool.manifest._files import CHUNK, MAP_MIN, FileDigest, check_entry, digest_fd
from shardtool.manifest._paths import MAX_SEGMENTS
from shardtool.manifest._records import Entry
from shardtool.manifest._scan import implied_directories, parent_directories, walk

FINDING_CLASSES = ("missing", "size-mismatch", "digest-mismatch", "unlisted", "symlink", "not-a-regular-file",
                   "unreadable")


@dataclass(frozen=True)
class Finding:
    path: str
    finding: str
    detail: str
    kind: str | None = None
    layer: int | None = None
    expert: int | None = None
    expected_size: int | None = None
    expected_digest: str | None = None
    found_size: int | None = None
    found_digest: str | None = None

    def line(self) -> str:
        """One terminal-safe line: the path (and a detail that may quote a name) come from disk."""
        return f"{self.finding:<18} {printable(self.path)}: {printable(self.detail, backslash=False)}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AuditReport:
    findings: list[Finding] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # --present-only: listed, not held by this node
    files_checked: int = 0
    bytes_hashed: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings

    def counts(self) -> dict[str, int]:
        out = {c: 0 for c in FINDING_CLASSES}
        for f in self.findings:
            out[f.finding] += 1
        return out


def _from_entry(entry: Entry, finding: str, detail: str, **found) -> Finding:
    return Finding(path=entry.path, finding=finding, detail=detail, kind=entry.kind, layer=entry.layer,
                   expert=entry.expert, expected_size=entry.size, expected_digest=entry.digest.hex(), **found)


def _compare(entry: Entry, result: FileDigest) -> Finding | None:
    """The finding form of the one entry check (`check_entry`): the error it raises, as a finding."""
    try:
        check_entry(entry, result)
    except DigestMismatchError as e:
        digest = result.digest.hex() if result.digest and e.finding != "unreadable" else None
        return _from_entry(entry, e.finding, e.message, found_size=result.size, found_digest=digest)
    return None


def open_finding(err: ShardtoolError, listed_in: str = "the manifest") -> tuple[str, str]:
    """(finding class, detail) of a listed file's failed open: what the tree did to us is a finding; trouble on our
    side (out of descriptors) stays an error."""
    if not isinstance(err, VerificationError):
        raise err
    if isinstance(err, MissingFileError):
        return "missing", f"listed in {listed_in}, not on disk"
    if isinstance(err, NotARegularFileError):
        return err.finding, err.message
    return "unreadable", err.message


def _open_finding(entry: Entry, err: ShardtoolError) -> Finding:
    return _from_entry(entry, *open_finding(err))


def _open_at(root: Path, entry: Entry, dir_fd: int | None) -> int | ShardtoolError:
    """The listed file's descriptor (through `dir_fd`, its directory, when given), or the error opening it raised."""
    try:
        if dir_fd is None:
            return open_beneath(root, entry.path)
        return open_file_at(dir_fd, entry.path.rpartition("/")[2], entry.path)
    except ShardtoolError as e:
        return e


def check_file(root: Path, entry: Entry, buffer: bytearray | None = None, *, dir_fd: int | None = None,
               opened: int | ShardtoolError | None = None, parallel: bool = False, threads: int | None = None,
               before_map: Callable[[], None] | None = None,
               after_map: Callable[[], None] | None = None) -> Finding | None:
    """Hash one listed file and compare; return its finding or None when it matches.

    `dir_fd`: an already opened (link-free) parent directory, so a batch of files in one directory
    costs one open each rather than one per path component. `opened`: the file, already opened by `_open_at`
    (its descriptor, closed here, or the error its opening raised). `threads`, `before_map`, `after_map`: as
    `digest_fd`'s (given only in audit's supervised worker processes).
    """
    if opened is None:
        opened = _open_at(root, entry, dir_fd)
    if isinstance(opened, ShardtoolError):
        return _open_finding(entry, opened)
    fd = opened
    try:
        result = digest_fd(fd, buffer, parallel=parallel, expected_size=entry.size, threads=threads,
                           before_map=before_map, after_map=after_map)
    except OSError as e:
        return _from_entry(entry, "unreadable", f"read failed: {e.strerror}")
    finally:
        os.close(fd)
    return _compare(entry, result)


def _link_target_inside(root: Path, relpath: str) -> str | None:
    """For --follow-symlinks: the link's final target relative to `root`, or None if it leaves `root`."""
    real_root = os.path.realpath(root)
    target = os.path.realpath(os.path.join(root, relpath))
    if os.path.commonpath([real_root, target]) != real_root or target == real_root:
        return None
    return os.path.relpath(target, real_root).replace(os.sep, "/")


def _check_link(root: Path, entry: Entry) -> Finding | None:
    target = _link_target_inside(root, entry.path)
    if target is None:
        return _from_entry(entry, "symlink", "is a symlink that points outside the model directory")
    try:
        fd = open_beneath(root, target)  # the resolved path has no links left; a swapped one is refused
    except ShardtoolError as e:
        return _open_finding(entry, e)
    try:
        return _compare(entry, digest_fd(fd, expected_size=entry.size))
    except OSError as e:
        return _from_entry(entry, "unreadable", f"read failed: {e.strerror}")
    finally:
        os.close(fd)


def audit_directory(root: Path, manifest: VerifiedManifest, *, ignore: Iterable[str] = (),
                    present_only: bool = False, follow_symlinks: bool = False, workers: int | None = None,
                    progress: Callable[[int], None] | None = None) -> AuditReport:
    """Compare `root` with `manifest`. `ignore`: relative paths that are not model files (the manifest
    itself when it lives in `root`). `follow_symlinks`: a listed path that is a link to a file inside
    `root` is checked through its target; links leaving `root` stay findings. `progress(n)` is called
    with bytes hashed as they accrue."""
    listed = manifest.by_path()
    ignored = set(ignore)
    implied = implied_directories([*listed, *ignored])  # the manifest file itself may sit in a subdirectory
    report = AuditReport()
    on_disk: dict[str, str] = {}
    for item in walk(root, stat_if=lambda relpath: relpath not in listed, max_depth=MAX_SEGMENTS):
        if item.relpath in ignored:
            continue
        on_disk[item.relpath] = item.kind
        entry = listed.get(item.relpath)
        if item.kind == "too-deep":
            report.findings.append(Finding(path=item.relpath, finding="unlisted", detail=item.detail))
        elif item.kind == "unreadable":
            report.findings.append(_from_entry(entry, "unreadable", item.detail) if entry is not None
                                   else Finding(path=item.relpath, finding="unreadable", detail=item.detail))
        elif item.kind == "directory":
            if entry is not None:
                report.findings.append(_from_entry(entry, "not-a-regular-file", "is a directory"))
            elif item.relpath not in implied:
                report.findings.append(Finding(path=item.relpath, finding="unlisted",
                                               detail="a directory that no listed file lies in"))
        elif entry is None:
            finding = {"file": "unlisted", "symlink": "symlink", "special": "not-a-regular-file"}[item.kind]
            detail = {"file": f"present ({item.size} bytes) but not listed in the manifest",
                      "symlink": "a symlink not listed in the manifest",
                      "special": "a special file not listed in the manifest"}[item.kind]
            report.findings.append(Finding(path=item.relpath, finding=finding, detail=detail, found_size=item.size))
        elif item.kind == "symlink":
            if follow_symlinks:
                finding = _check_link(root, entry)
                report.files_checked += 1
                if finding is not None:
                    report.findings.append(finding)
            else:
                report.findings.append(_from_entry(entry, "symlink", "is a symlink; links are not followed"))
        elif item.kind == "special":
            report.findings.append(_from_entry(entry, "not-a-regular-file", "is a special file (FIFO, socket or device)"))
    to_hash = []
    unreadable_dirs = {path for path, kind in on_disk.items() if kind == "unreadable"}
    for path, entry in listed.items():
        kind = on_disk.get(path)
        if kind is None and unreadable_dirs and any(d in unreadable_dirs for d in parent_directories(path)):
            report.findings.append(_from_entry(entry, "unreadable", "lies in a directory that could not be walked"))
        elif kind is None:
            if present_only:
                report.absent.append(path)
            else:
                report.findings.append(_from_entry(entry, "missing", "listed in the manifest, not on disk"))
        elif kind == "file":
            to_hash.append(entry)
    report.findings.extend(_hash_all(root, to_hash, workers, progress, report))
    report.findings.sort(key=lambda f: (f.path, f.finding))
    return report


BATCH_FILES = 256
BATCH_BYTES = 16 * 1024 * 1024


def _batches(entries: list[Entry]) -> list[list[Entry]]:
    """Files grouped by directory, at most BATCH_FILES or about BATCH_BYTES a batch: a task opens its
    directory once, yet large files still spread over all workers."""
    by_dir: dict[str, list[Entry]] = {}
    for e in entries:
        by_dir.setdefault(e.path.rpartition("/")[0], []).append(e)
    out: list[list[Entry]] = []
    for group in by_dir.values():
        current: list[Entry] = []
        size = 0
        for e in group:
            if current and (len(current) >= BATCH_FILES or size + e.size > BATCH_BYTES):
                out.append(current)
                current, size = [], 0
            current.append(e)
            size += e.size
        if current:
            out.append(current)
    out.sort(key=lambda b: -sum(e.size for e in b))  # largest first: no long task starts last
    return out


def _check_batch(root: Path, items: list[Entry], buf: bytearray, *, parallel: bool = False,
                 threads: int | None = None, mapping: Callable[[int | None], None] | None = None) -> list[Finding]:
    """Check a batch of listed files from one directory (opened once); their findings. `mapping(k)`: in a
    worker process, said before the k-th file is hashed from a mapping; `mapping(None)`: once it is unmapped."""
    found: list[Finding] = []
    reldir = items[0].path.rpartition("/")[0]
    try:
        dir_fd = open_dir_beneath(root, reldir)
    except ShardtoolError as e:
        return [_open_finding(entry, e) for entry in items]
    files = _opened_ahead(root, items, dir_fd)
    try:
        for k, (entry, opened) in enumerate(files):
            before_map = None if mapping is None else (lambda k=k: mapping(k))
            after_map = None if mapping is None else (lambda: mapping(None))
            finding = check_file(root, entry, buf, dir_fd=dir_fd, opened=opened, parallel=parallel, threads=threads,
                                 before_map=before_map, after_map=after_map)
            if finding is not None:
                found.append(finding)
    finally:
        files.close()  # closes the files it opened ahead, if the batch ended early
        os.close(dir_fd)
    return found


READ_AHEAD_FILES = 32
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)  # Linux and most Unix; not macOS


def _opened_ahead(root: Path, items: list[Entry], dir_fd: int) -> Generator[tuple[Entry, int | ShardtoolError], None, None]:
    """Each file of a batch with its descriptor (or the error opening it raised), in order, for `check_file`.

    Small files (below MAP_MIN, read in one call) are opened up to READ_AHEAD_FILES ahead of the one being
    hashed and their reads started (POSIX_FADV_WILLNEED), so on a cold disk many reads are in flight while
    one file is hashed: read one at a time, each small file waits its whole latency (20,000 small files took
    1.24 x b3sum's time, cold). Large files are hashed from mappings that read ahead sequentially; each is
    opened when its turn comes. A file opened ahead is checked as the file that open found (no link, a regular
    file; renamed or replaced later, it is still that file that is hashed, its size compared first): audit
    reports a state of the directory. Opening ahead stops for the rest of the batch at the first error on our
    side (out of descriptors); the file is then opened at its turn, so a low descriptor limit costs speed only.
    """
    ahead = READ_AHEAD_FILES if _WILLNEED is not None else 0
    waiting: deque[int | ShardtoolError] = deque()
    following = 0  # index of the next file to open
    try:
        for k, entry in enumerate(items):
            while following < len(items) and following <= k + ahead and (
                    following == k or items[following].size < MAP_MIN):
                opened = _open_at(root, items[following], dir_fd)
                if following > k and isinstance(opened, ShardtoolError) and not isinstance(opened, VerificationError):
                    ahead = 0  # trouble on our side (no descriptor left): no more reading ahead in this batch, and
                    break  # this file is opened at its turn, once the files opened ahead of it are closed
                if isinstance(opened, int) and following > k:  # opened ahead: a small file (the loop's condition)
                    try:
                        os.posix_fadvise(opened, 0, items[following].size, _WILLNEED)
                    except OSError:
                        pass  # advice only
                waiting.append(opened)
                following += 1
            yield entry, waiting.popleft()
    finally:
        for opened in waiting:
            if isinstance(opened, int):
                os.close(opened)


def _hash_all(root: Path, entries: list[Entry], workers: int | None, progress, report: AuditReport) -> list[Finding]:
    """Hash every entry: in forked worker processes where the system has fork (`_workers.py`: every core
    runs the per-file Python, large files are hashed from mappings with no copy), else in a thread pool.

    Each task is a batch of files from one directory. With fewer large files than workers, each file
    also gets BLAKE3's own threads so that one huge shard still uses every core.
    """
    workers = workers or (os.cpu_count() or 2)
    if not entries:
        return []
    if _workers.available():
        return _hash_in_processes(root, entries, workers, progress, report)
    return _hash_in_threads(root, entries, workers, progress, report)


def _few_large(entries: list[Entry], workers: int) -> bool:
    return sum(1 for e in entries if e.size >= CHUNK) < workers


def _hash_in_processes(root: Path, entries: list[Entry], workers: int, progress, report: AuditReport
                       ) -> list[Finding]:
    threads = workers if _few_large(entries, workers) else 1
    index = {id(e): i for i, e in enumerate(entries)}
    tasks = [[index[id(e)] for e in batch] for batch in _batches(entries)]
    buf = bytearray(CHUNK)  # each worker's own copy (forked)
    found: list[Finding] = []

    def run(indices: list[int], mapping: Callable[[int | None], None]) -> list[Finding]:
        return _check_batch(root, [entries[i] for i in indices], buf, threads=threads, mapping=mapping)

    def done(task: list[int], findings: list[Finding]) -> None:
        found.extend(findings)
        size = sum(entries[i].size for i in task)
        report.files_checked += len(task)
        report.bytes_hashed += size
        if progress:
            progress(size)

    def died_mapping(i: int, detail: str) -> Finding:
        return _from_entry(entries[i], "unreadable", detail)

    _workers.run_batches(tasks, workers, run, done, died_mapping)
    return found


def _hash_in_threads(root: Path, entries: list[Entry], workers: int, progress, report: AuditReport
                     ) -> list[Finding]:
    """Hash in a thread pool: reads and BLAKE3 release the GIL, so threads keep disk and cores busy."""
    from concurrent.futures import ThreadPoolExecutor  # here: only where there is no fork (it loads logging too)

    local = threading.local()
    lock = threading.Lock()
    parallel = _few_large(entries, workers)

    def batch(items: list[Entry]) -> list[Finding]:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(CHUNK)
        found = _check_batch(root, items, buf, parallel=parallel)
        if progress:
            progress(sum(e.size for e in items))
        with lock:
            report.files_checked += len(items)
            report.bytes_hashed += sum(e.size for e in items)
        return found

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [f for found in pool.map(batch, _batches(entries)) for f in found]
