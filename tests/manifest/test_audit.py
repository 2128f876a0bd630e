"""audit_directory units: finding classes that are hard to stage through the CLI, and scale."""

from __future__ import annotations

import errno
import os
import resource
import signal

import blake3
import pytest

from shardtool.keys import generate
from shardtool.manifest import Entry, build_manifest, verify_manifest
from shardtool.manifest import _files, _workers
from shardtool.manifest.audit import audit_directory


def _verified(entries):
    key = generate()
    m = build_manifest(entries, model_id="t/audit")
    m = m.with_envelope(m.envelope.signed_by(key))
    return verify_manifest(m.to_bytes(), [key.public], 1)


def _write(root, rel, data):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return Entry(path=rel, kind="other", size=len(data), digest=blake3.blake3(data).digest())


def test_unreadable_file_is_a_finding(tmp_path, monkeypatch):
    monkeypatch.setattr(_workers, "available", lambda: False)  # the read path; the mapped path: below
    entries = [_write(tmp_path, "a.bin", b"a" * 100), _write(tmp_path, "big.bin", os.urandom(5 << 20))]
    real_readv = os.readv

    def failing_readv(fd, buffers):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_files.os, "readv", failing_readv)
    report = audit_directory(tmp_path, _verified(entries))
    monkeypatch.setattr(_files.os, "readv", real_readv)
    assert [(f.path, f.finding) for f in report.findings] == [("big.bin", "unreadable")]
    assert "Input/output error" in report.findings[0].detail


def test_file_changing_while_hashed_is_a_finding(tmp_path, monkeypatch):
    monkeypatch.setattr(_workers, "available", lambda: False)  # the read path; the mapped path: below
    data = os.urandom(6 << 20)
    entries = [_write(tmp_path, "big.bin", data)]
    real_readv = os.readv
    calls = []

    def growing_readv(fd, buffers):
        n = real_readv(fd, buffers)
        if not calls:
            with open(tmp_path / "big.bin", "ab") as fh:  # another writer appends mid-hash
                fh.write(b"more")
        calls.append(n)
        return n

    monkeypatch.setattr(_files.os, "readv", growing_readv)
    report = audit_directory(tmp_path, _verified(entries))
    assert [(f.path, f.finding) for f in report.findings] == [("big.bin", "unreadable")]
    assert "changed while" in report.findings[0].detail


def test_vanishing_file_is_missing_not_a_crash(tmp_path, monkeypatch):
    entries = [_write(tmp_path, "d/a.bin", b"a"), _write(tmp_path, "d/b.bin", b"b")]
    verified = _verified(entries)
    from shardtool import safeio

    real = safeio.open_file_at

    def vanish_then_open(dir_fd, name, relpath):
        if name == "b.bin" and (tmp_path / "d/b.bin").exists():
            os.unlink(tmp_path / "d/b.bin")
        return real(dir_fd, name, relpath)

    monkeypatch.setattr("shardtool.manifest.audit.open_file_at", vanish_then_open)
    report = audit_directory(tmp_path, verified)
    assert [(f.path, f.finding) for f in report.findings] == [("d/b.bin", "missing")]


def test_hundred_thousand_entries_subset(tmp_path):
    """100,000 listed shards, a node holding 1,000 of them: memory stays flat, the answer is exact."""
    present = {}
    entries = []
    for i in range(100_000):
        rel = f"experts/layer-{i // 1000:03d}/expert-{i % 1000:04d}.safetensors"
        data = i.to_bytes(4, "little")
        if i % 100 == 0:
            entries.append(_write(tmp_path, rel, data))
            present[rel] = data
        else:
            entries.append(Entry(path=rel, kind="expert", size=4, digest=blake3.blake3(data).digest(),
                                 layer=i // 1000, expert=i % 1000))
    verified = _verified(entries)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = audit_directory(tmp_path, verified, present_only=True)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert report.ok and report.files_checked == 1000 and len(report.absent) == 99_000
    assert grown_mib < 200, f"audit of 100k entries grew peak RSS by {grown_mib:.0f} MiB"
    (tmp_path / next(iter(present))).write_bytes(b"evil")
    report = audit_directory(tmp_path, verified, present_only=True)
    assert [f.finding for f in report.findings] == ["digest-mismatch"]


@pytest.mark.parametrize("workers", [1, 3])
def test_worker_count_does_not_change_the_answer(tmp_path, workers):
    entries = [_write(tmp_path, f"d{i % 3}/f{i}.bin", os.urandom(i * 997)) for i in range(40)]
    (tmp_path / "d1/f7.bin").write_bytes(b"changed")
    report = audit_directory(tmp_path, _verified(entries), workers=workers)
    assert [(f.path, f.finding) for f in report.findings] == [("d1/f7.bin", "size-mismatch")]
    assert report.files_checked == 40


def test_entry_fast_encoding_is_the_canonical_encoding():
    """entry_bytes packs Entry.to_dict() directly; that is only right while it equals the generic canonical form."""
    from shardtool.manifest import _canonical, entry_bytes

    for entry in (Entry(path="a", kind="other", size=0, digest=b"\0" * 32),
                  Entry(path="experts/layer-001/expert-0002.safetensors", kind="expert", size=2**40,
                        digest=bytes(range(32)), layer=65_535, expert=1_048_575),
                  Entry(path="trunk/layer-000.safetensors", kind="trunk", size=300, digest=b"\1" * 32, layer=0)):
        assert entry_bytes(entry) == _canonical.encode(entry.to_dict())


def test_manifest_relpath_is_lexical_never_resolved(tmp_path):
    """Which file audit skips as "the manifest" is decided from the paths as written: a link swapped in at
    the manifest's name must not turn the skipped path into some other file's."""
    from shardtool.manifest import manifest_relpath

    (tmp_path / "experts").mkdir()
    (tmp_path / "experts/e.bin").write_bytes(b"e")
    (tmp_path / "manifest.msgpack").symlink_to(tmp_path / "experts/e.bin")
    assert manifest_relpath(tmp_path, tmp_path / "manifest.msgpack") == "manifest.msgpack"
    assert manifest_relpath(tmp_path, tmp_path / "meta" / "m.msgpack") == "meta/m.msgpack"
    assert manifest_relpath(tmp_path, tmp_path.parent / "m.msgpack") is None
    assert manifest_relpath(tmp_path, tmp_path) is None


# --- the worker processes' path (manifest/_workers.py): mapped hashing, SIGBUS, the same answers -------------

def _mapping_then(monkeypatch, act):
    """Patch the mapping the audit workers hash from: `act(fd)` runs right after the file is mapped (the
    workers are forked, so they inherit the patch)."""
    real = _files.mmap.mmap

    def mapped(fd, length, **kw):
        m = real(fd, length, **kw)
        act(fd)
        return m

    monkeypatch.setattr(_files.mmap, "mmap", mapped)


def test_file_truncated_under_the_mapping_is_a_finding_not_a_crash(tmp_path, monkeypatch):
    """A file shrinking while a worker hashes it from a mapping kills that worker with SIGBUS: the file is
    reported unreadable, the other files of its batch are still checked, the audit finishes."""
    entries = [_write(tmp_path, "d/a.bin", b"a" * 100), _write(tmp_path, "d/big.bin", os.urandom(3 << 20)),
               _write(tmp_path, "d/c.bin", os.urandom(1 << 20))]
    verified = _verified(entries)

    def shrink(fd):
        if os.fstat(fd).st_size == 3 << 20:
            os.truncate(tmp_path / "d/big.bin", 4096)

    _mapping_then(monkeypatch, shrink)
    report = audit_directory(tmp_path, verified, workers=2)
    assert [(f.path, f.finding) for f in report.findings] == [("d/big.bin", "unreadable")]
    assert "SIGBUS" in report.findings[0].detail and "changed while it was being hashed" in report.findings[0].detail
    assert report.files_checked == 3 and report.bytes_hashed == sum(e.size for e in entries)


def test_file_growing_under_the_mapping_is_a_finding(tmp_path, monkeypatch):
    entries = [_write(tmp_path, "big.bin", os.urandom(2 << 20))]
    verified = _verified(entries)

    def grow(fd):
        with open(tmp_path / "big.bin", "ab") as fh:  # another writer appends mid-hash
            fh.write(b"more")

    _mapping_then(monkeypatch, grow)
    report = audit_directory(tmp_path, verified)
    assert [(f.path, f.finding) for f in report.findings] == [("big.bin", "unreadable")]
    assert "changed while" in report.findings[0].detail


def test_worker_processes_and_threads_find_the_same(tmp_path, monkeypatch):
    """Many small files and a few mapped ones, with every per-file finding class: the workers' answer is the
    thread pool's, finding for finding."""
    entries = [_write(tmp_path, f"experts/layer-{i // 300:03d}/e{i}.bin", os.urandom(16 * 1024 if i % 50 else 600_000))
               for i in range(1200)]
    (tmp_path / "experts/layer-000/e7.bin").write_bytes(b"short")  # size
    data = bytearray((tmp_path / "experts/layer-001/e350.bin").read_bytes())
    data[5] ^= 1
    (tmp_path / "experts/layer-001/e350.bin").write_bytes(bytes(data))  # digest, a mapped file
    data = bytearray((tmp_path / "experts/layer-002/e601.bin").read_bytes())
    data[-1] ^= 1
    (tmp_path / "experts/layer-002/e601.bin").write_bytes(bytes(data))  # digest, a small file
    os.unlink(tmp_path / "experts/layer-003/e999.bin")  # missing
    os.symlink("e1000.bin", tmp_path / "experts/layer-003/e1001.bin.tmp")  # unlisted link
    os.unlink(tmp_path / "experts/layer-003/e1002.bin")
    os.symlink("e1000.bin", tmp_path / "experts/layer-003/e1002.bin")  # listed path that is a link
    os.mkfifo(tmp_path / "experts/layer-003/e1003.bin.fifo")
    (tmp_path / "experts/layer-003/extra.bin").write_bytes(b"x")  # unlisted
    verified = _verified(entries)

    def answer(report):
        return [f.to_dict() for f in report.findings], report.files_checked, report.bytes_hashed

    in_processes = answer(audit_directory(tmp_path, verified, workers=2))
    monkeypatch.setattr(_workers, "available", lambda: False)
    in_threads = answer(audit_directory(tmp_path, verified, workers=2))
    assert in_processes == in_threads
    assert sorted(f["finding"] for f in in_processes[0]) == [
        "digest-mismatch", "digest-mismatch", "missing", "not-a-regular-file", "size-mismatch", "symlink",
        "symlink", "unlisted"]


def test_one_large_file_uses_worker_owned_blake3_threads_after_the_shared_pool_ran(tmp_path):
    """BLAKE3's shared thread pool does not survive a fork (a forked hasher on it waits forever). Use the
    shared pool here first, then audit one large file with two workers: it gets threads of its own."""
    _files.digest_bytes(os.urandom(_files.PARALLEL_HASH_MIN * 2))  # starts the shared pool in this process
    entries = [_write(tmp_path, "big.bin", os.urandom(9 << 20))]
    report = audit_directory(tmp_path, _verified(entries), workers=2)
    assert report.ok and report.files_checked == 1


def test_an_error_on_our_side_in_a_worker_is_raised_not_a_finding(tmp_path, monkeypatch):
    from shardtool.errors import StorageError

    entries = [_write(tmp_path, "d/a.bin", b"a")]
    verified = _verified(entries)

    def out_of_descriptors(dir_fd, name, relpath):
        raise StorageError("too many open files", path=relpath)

    monkeypatch.setattr("shardtool.manifest.audit.open_file_at", out_of_descriptors)
    with pytest.raises(StorageError, match="too many open files"):
        audit_directory(tmp_path, verified)


# --- reading ahead: small files opened and their reads started before their turn (cold disks) ---------------

def _batch_of(tmp_path, n, size=100):
    return [_write(tmp_path, f"d/f{i:03d}.bin", os.urandom(size)) for i in range(n)]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_small_files_are_read_ahead_and_large_ones_are_not(tmp_path, monkeypatch):
    from shardtool.manifest import audit

    monkeypatch.setattr(_workers, "available", lambda: False)  # advice given in this process, where it is seen
    small = _batch_of(tmp_path, 40)
    large = _write(tmp_path, "d/g-large.bin", os.urandom(_files.MAP_MIN))  # sorts after the small ones
    advised: list[int] = []
    real = os.posix_fadvise
    monkeypatch.setattr(audit.os, "posix_fadvise",
                        lambda fd, off, n, advice: (advised.append(n), real(fd, off, n, advice))[1])
    report = audit_directory(tmp_path, _verified(small + [large]), workers=1)
    assert report.ok and report.files_checked == 41
    # Each small file but the first is advised before its turn, for its whole size; the large one never is.
    assert advised == [100] * 39


def test_an_error_on_our_side_while_reading_ahead_is_tried_again_at_the_files_turn(tmp_path, monkeypatch):
    from shardtool.errors import StorageError
    from shardtool.manifest import audit

    monkeypatch.setattr(_workers, "available", lambda: False)
    entries = _batch_of(tmp_path, 10)
    real = audit.open_file_at
    refused: list[str] = []

    def out_of_descriptors_once(dir_fd, name, relpath):
        if name == "f005.bin" and not refused:  # opened ahead (while f000 is hashed) and refused
            refused.append(name)
            raise StorageError("too many open files", path=relpath)
        return real(dir_fd, name, relpath)

    monkeypatch.setattr(audit, "open_file_at", out_of_descriptors_once)
    report = audit_directory(tmp_path, _verified(entries), workers=1)
    assert refused == ["f005.bin"] and report.ok and report.files_checked == 10


def test_a_batch_that_ends_early_closes_the_files_it_opened_ahead(tmp_path, monkeypatch):
    from shardtool.errors import StorageError
    from shardtool.manifest import audit

    monkeypatch.setattr(_workers, "available", lambda: False)
    entries = _batch_of(tmp_path, 40)
    verified = _verified(entries)
    real = audit.check_file

    def failing_at_the_third(root, entry, *a, **kw):
        if entry.path.endswith("f002.bin"):
            os.close(kw["opened"])  # check_file closes what it is given
            raise StorageError("disk went away", path=entry.path)
        return real(root, entry, *a, **kw)

    monkeypatch.setattr(audit, "check_file", failing_at_the_third)
    before = _fds()
    with pytest.raises(StorageError, match="disk went away"):
        audit_directory(tmp_path, verified, workers=1)
    assert _fds() == before


# --- the workers' edges: a file shrinking before it is mapped, deaths that are not SIGBUS, signals, limits ----

def _mapping_preceded_by(monkeypatch, act):
    """Patch the mapping call itself: `act(fd, length)` runs just before the real mmap (in the workers)."""
    real = _files.mmap.mmap

    def mapping(fd, length, **kw):
        act(fd, length)
        return real(fd, length, **kw)

    monkeypatch.setattr(_files.mmap, "mmap", mapping)


def test_file_shrinking_between_fstat_and_mmap_is_a_finding_not_a_crash(tmp_path, monkeypatch):
    """mmap refuses a length past the end with ValueError: the file changed, a finding like any other."""
    entries = [_write(tmp_path, "d/big.bin", os.urandom(1 << 20)), _write(tmp_path, "d/small.bin", b"s" * 10)]
    verified = _verified(entries)

    def shrink(fd, length):
        os.truncate(tmp_path / "d/big.bin", length - 4096)

    _mapping_preceded_by(monkeypatch, shrink)
    report = audit_directory(tmp_path, verified, workers=2)
    assert [(f.path, f.finding) for f in report.findings] == [("d/big.bin", "unreadable")]
    assert report.findings[0].detail == (f"file changed while it was being hashed ({(1 << 20) - 4096} bytes, "
                                         f"manifest says {1 << 20})")
    assert report.findings[0].found_size == (1 << 20) - 4096
    assert report.files_checked == 2


def test_a_filesystem_that_cannot_map_is_read_instead(tmp_path, monkeypatch):
    entries = [_write(tmp_path, "big.bin", os.urandom(1 << 20))]
    verified = _verified(entries)

    def refuse(fd, length):
        raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))

    _mapping_preceded_by(monkeypatch, refuse)
    assert audit_directory(tmp_path, verified, workers=2).ok
    (tmp_path / "big.bin").write_bytes(os.urandom(1 << 20))
    assert [f.finding for f in audit_directory(tmp_path, verified, workers=2).findings] == ["digest-mismatch"]


def _killed_in_worker(monkeypatch, path, *, mapped, once=None):
    """The out-of-memory killer, placed: a worker SIGKILLs itself while checking `path` (while it is mapped
    when `mapped`); with `once` (a marker file) only the first time."""
    from shardtool.manifest import audit

    real = audit.check_file
    parent = os.getpid()

    def check_file(root, entry, *a, **kw):
        if os.getpid() != parent and entry.path == path and not (once and once.exists()):
            if once:
                once.touch()
            if not mapped:
                os.kill(os.getpid(), signal.SIGKILL)
            inner = kw["before_map"]

            def before_map():
                inner()
                os.kill(os.getpid(), signal.SIGKILL)
            kw["before_map"] = before_map
        return real(root, entry, *a, **kw)

    monkeypatch.setattr(audit, "check_file", check_file)


def test_a_worker_killed_after_a_mapped_file_blames_no_file(tmp_path, monkeypatch):
    """The mapped file was hashed and unmapped; a kill during a later small file of the same batch is no
    verdict on the mapped one (nor on any file): the audit ends with a StorageError."""
    from shardtool.errors import StorageError

    entries = [_write(tmp_path, "big.bin", os.urandom(1 << 20))] + [
        _write(tmp_path, f"small{i}.bin", os.urandom(1000)) for i in range(5)]
    verified = _verified(entries)
    _killed_in_worker(monkeypatch, "small3.bin", mapped=False, once=tmp_path.parent / f"{tmp_path.name}.killed")
    with pytest.raises(StorageError, match="SIGKILL"):
        audit_directory(tmp_path, verified, workers=1)


def test_a_worker_killed_while_mapping_is_no_verdict(tmp_path, monkeypatch):
    """Only SIGBUS under a mapping says something about the file; a SIGKILL there is the system's doing."""
    from shardtool.errors import StorageError

    entries = [_write(tmp_path, "big.bin", os.urandom(1 << 20))]
    verified = _verified(entries)
    _killed_in_worker(monkeypatch, "big.bin", mapped=True)
    with pytest.raises(StorageError, match="SIGKILL"):
        audit_directory(tmp_path, verified, workers=1)


def test_workers_ignore_sigint(tmp_path, monkeypatch):
    """Ctrl-C to the process group while the parent ignores SIGINT (a background job) must not kill the
    workers: here each worker gets a SIGINT while it has its file mapped; the audit still finds nothing."""
    entries = [_write(tmp_path, f"d{i}/big.bin", os.urandom(1 << 20)) for i in range(3)]
    verified = _verified(entries)
    _mapping_then(monkeypatch, lambda fd: os.kill(os.getpid(), signal.SIGINT))
    report = audit_directory(tmp_path, verified, workers=2)
    assert report.ok and report.files_checked == 3


def test_worker_count_is_capped_by_the_descriptor_limit(monkeypatch):
    """64 workers under a 40-descriptor limit: fewer workers, every task still run."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setattr(_workers.resource, "getrlimit", lambda which: (40, hard) if which == resource.RLIMIT_NOFILE
                        else resource.getrlimit(which))
    seen = []
    _workers.run_batches([[i] for i in range(100)], 64, lambda indices, mapping: [os.getpid()],
                         lambda task, found: seen.append((task[0], found[0])), lambda i, d: None)
    assert sorted(i for i, _ in seen) == list(range(100))
    assert len({pid for _, pid in seen}) <= (40 - 16) // 3


_ORPHAN_SCRIPT = """
import os, sys, time
from shardtool.manifest import _workers
out = int(sys.argv[1])

def run(indices, mapping):
    os.write(out, b"%d\\n" % os.getpid())
    time.sleep(600)
    return []

_workers.run_batches([[0], [1]], 2, run, lambda task, found: None, lambda i, d: None)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_end_with_their_parent(sig):
    import subprocess
    import sys
    import time

    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(w)], pass_fds=[w], start_new_session=True)
    os.close(w)
    try:
        with os.fdopen(r) as fh:
            pids = [int(fh.readline()), int(fh.readline())]
            p.send_signal(sig)
            assert p.wait(timeout=60) == -sig
            deadline = time.monotonic() + 60  # a bound on waiting, not a measurement
            while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(_gone(pid) for pid in pids), f"workers {pids} outlived their parent ({sig.name})"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the session this test started: whatever is left of it
        except ProcessLookupError:
            pass
        p.wait()
