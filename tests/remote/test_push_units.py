"""Units of `push`: through a recording fsspec filesystem (a local filesystem under its own protocol that notes every
committed upload), the manifest is committed last, after every shard it lists is already in the store; a shard
upload that fails leaves no manifest in the store."""

from __future__ import annotations

import os
import shutil
import threading

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from shardtool.errors import DigestMismatchError, StorageError, UsageError
from shardtool.manifest import MANIFEST_NAME
from shardtool.remote import _push, push


class RecordingFS(LocalFileSystem):
    """`recordfs:///abs/path`: local files, with each committed upload's path (and what the store held at that
    moment) appended to `commits`; `fail` names a path whose commit raises."""

    protocol = ("recordfs",)
    commits: list[tuple[str, set[str]]] = []
    fail: str | None = None
    store: str = ""
    lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("recordfs://"):
            path = path[len("recordfs://"):]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if "w" in mode:  # like an object store: a key needs no directory made first
            self.makedirs(self._parent(path), exist_ok=True)
        f = super()._open(path, mode, block_size=block_size, autocommit=autocommit, cache_options=cache_options,
                          **kwargs)
        if "w" in mode:
            commit = f.commit
            rel = self._strip_protocol(path)[len(RecordingFS.store) + 1:]

            def recording_commit():
                if rel == RecordingFS.fail:
                    raise OSError(5, "injected commit failure")
                with RecordingFS.lock:
                    held = {p[len(RecordingFS.store) + 1:] for p in self.find(RecordingFS.store)}
                    RecordingFS.commits.append((rel, held))
                commit()
            f.commit = recording_commit
        return f


@pytest.fixture
def recordfs(tmp_path):
    fsspec.register_implementation("recordfs", RecordingFS, clobber=True)
    RecordingFS.commits, RecordingFS.fail = [], None
    RecordingFS.store = str(tmp_path / "store")
    return RecordingFS


def test_manifest_is_committed_last_after_every_shard(world, recordfs):
    data = (world.model / MANIFEST_NAME).read_bytes()
    report = push(world.model, data, f"recordfs://{recordfs.store}", jobs=4)
    order = [rel for rel, _ in recordfs.commits]
    assert sorted(order[:-1]) == sorted(world.entries) and order[-1] == MANIFEST_NAME
    assert recordfs.commits[-1][1] == set(world.entries)  # the store held every shard when the manifest went up
    assert report.uploaded[-1] == MANIFEST_NAME and not report.skipped

    recordfs.commits.clear()
    again = push(world.model, data, f"recordfs://{recordfs.store}", jobs=4)
    assert [rel for rel, _ in recordfs.commits] == [MANIFEST_NAME]
    assert sorted(again.skipped) == sorted(world.entries)


def test_a_failed_shard_upload_leaves_no_manifest(world, recordfs, tmp_path):
    recordfs.fail = sorted(world.entries)[0]
    data = (world.model / MANIFEST_NAME).read_bytes()
    with pytest.raises(StorageError, match="injected commit failure"):
        push(world.model, data, f"recordfs://{recordfs.store}", jobs=4)
    assert MANIFEST_NAME not in {rel for rel, _ in recordfs.commits}
    assert not (tmp_path / "store" / MANIFEST_NAME).exists()
    assert not (tmp_path / "store" / recordfs.fail).exists()


def test_a_directory_target_is_written_through_no_link(world, tmp_path):
    """A link planted in the target directory (a subdirectory to elsewhere, a file name to a victim, a FIFO at a
    file name) never sends a byte outside it nor hangs the push: links on the way are refused, links and FIFOs at a
    file name are replaced by a rename of a fresh file."""
    data = (world.model / MANIFEST_NAME).read_bytes()
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "experts").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UsageError, match="symlink inside the output directory"):
        push(world.model, data, str(linked), jobs=2)
    assert list(outside.iterdir()) == [] and not (linked / MANIFEST_NAME).exists()

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").symlink_to(victim)
    os.mkfifo(target / "tokenizer.json")
    report = push(world.model, data, str(target), jobs=2, timeout=2)
    assert victim.read_bytes() == b"keep me" and not (target / "config.json").is_symlink()
    assert (target / "config.json").read_bytes() == (world.model / "config.json").read_bytes()
    assert (target / "tokenizer.json").is_file() and report.uploaded[-1] == MANIFEST_NAME


def test_a_store_copy_of_the_right_size_but_other_bytes_is_uploaded_again(world, tmp_path):
    data = (world.model / MANIFEST_NAME).read_bytes()
    target = tmp_path / "target"
    push(world.model, data, str(target), jobs=2)
    victim = sorted(world.entries)[0]
    right = (target / victim).read_bytes()
    (target / victim).write_bytes(bytes([right[0] ^ 1]) + right[1:])
    again = push(world.model, data, str(target), jobs=2)
    assert sorted(again.skipped) == sorted(set(world.entries) - {victim})
    assert victim in again.uploaded and (target / victim).read_bytes() == right


def test_a_file_growing_while_it_is_uploaded_is_refused_one_byte_past_its_size(world, tmp_path, monkeypatch,
                                                                               raises_exactly):
    """Another writer appends 8 MiB right after the size check: push reads one byte past the signed size, the
    entry check refuses the upload before its commit, and no manifest goes up."""
    model = tmp_path / "model"
    shutil.copytree(world.model, model)
    victim = sorted(world.entries)[0]
    real = _push.check_size

    def then_grow(entry, size, where=None):
        real(entry, size, where)
        if entry.path == victim:
            with open(model / victim, "ab") as fh:
                fh.write(b"\0" * (8 << 20))

    monkeypatch.setattr(_push, "check_size", then_grow)
    with raises_exactly(DigestMismatchError) as info:
        push(model, (model / MANIFEST_NAME).read_bytes(), str(tmp_path / "target"), jobs=1)
    size = world.entries[victim].size
    assert (info.value.expected, info.value.actual) == (str(size), str(size + 1))
    assert info.value.path == str(model / victim)
    assert not (tmp_path / "target" / victim).exists() and not (tmp_path / "target" / MANIFEST_NAME).exists()
