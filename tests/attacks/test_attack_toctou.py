"""Time of check to time of use: files rewritten after they were verified, and while they are being read.

A subprocess cannot time a rewrite between the check and the use, so these run in-process: the real
`verify-and-run` entry point (or the `ShardStore` it uses) with hooks that rewrite files at exactly the
wrong moment. The invariant in every case: the output is the untouched model's output, or the run is
refused; bytes that were not verified are never used.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import blake3
import numpy as np
import pytest
from safetensors.numpy import save as st_save

import _attackkit as kit
from shardtool.errors import DigestMismatchError
from shardtool.manifest import Entry

# --- the whole run, in-process ----------------------------------------------------------------------------


def _run_in_process(monkeypatch, capsys, model: Path, world, *extra: str) -> tuple[int, str, str]:
    from shardtool.cli import run_cmd

    argv = kit.run_cmd(model, [world.keys.pub("A")], 1, world.tmp / "state", extra)
    monkeypatch.setattr(sys, "argv", [str(a) for a in argv])
    with pytest.raises(SystemExit) as info:
        run_cmd.main()
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def _rewrite_after_use(monkeypatch, model: Path) -> set[str]:
    """After each file is first handed out as verified (config and tokenizer by `_signed`, shards by the
    store), flip a byte of it on disk. Returns the set of paths rewritten so far."""
    import shardtool.runtime.engine._signed as signed_mod
    from shardtool.runtime.store._store import ShardStore

    rewritten: set[str] = set()

    def tamper(entries):
        for e in entries:
            if e.path not in rewritten:
                rewritten.add(e.path)
                kit.flip(model / e.path)

    real_read_verified = signed_mod.read_verified
    real_request, real_take_hit = ShardStore.request, ShardStore._take_hit

    def read_verified(root, entry):
        data = real_read_verified(root, entry)
        tamper([entry])
        return data

    def request(self, entries):
        """Every shard goes out through a waiter of `request` (get_many uses it) or as a cached hit (`_take_hit`,
        below): rewrite the file on disk the moment its verified arrays are handed to the forward pass."""
        def handed_out(entry, wait):
            def waiter():
                arrays = wait()
                tamper([entry])
                return arrays
            return waiter
        return [handed_out(e, w) for e, w in zip(entries, real_request(self, entries))]

    def take_hit(self, entry):  # a cached shard handed out by `get` or `cached` (a warm step's experts)
        arrays = real_take_hit(self, entry)
        if arrays is not None:
            tamper([entry])
        return arrays

    monkeypatch.setattr(signed_mod, "read_verified", read_verified)
    monkeypatch.setattr(ShardStore, "request", request)
    monkeypatch.setattr(ShardStore, "_take_hit", take_hit)
    return rewritten


def test_toctou_rewritten_after_verification_output_unchanged(monkeypatch, capsys, model, world):
    """Every file rewritten on disk right after it was verified: with the whole model cached, the run never
    reads them again and prints exactly the untouched model's tokens."""
    rewritten = _rewrite_after_use(monkeypatch, model)
    code, out, err = _run_in_process(monkeypatch, capsys, model, world)
    assert code == 0, err
    assert out == world.clean_out
    weights = {e.relative_to(model).as_posix() for e in model.rglob("*.safetensors")}
    assert {"config.json", "tokenizer.json"} | weights <= rewritten, "the hooks no longer see every file"


def test_toctou_rewritten_after_verification_then_evicted(monkeypatch, capsys, model, world):
    """The same, with a budget so small that shards are evicted and read again: the second read meets the
    rewritten bytes and the run stops; whatever it printed before is a prefix of the untouched output."""
    from shardtool.runtime.store._store import ShardStore

    _rewrite_after_use(monkeypatch, model)
    largest = max(p.stat().st_size for p in model.rglob("*.safetensors"))
    real_init = ShardStore.__init__

    def small_store(self, root, *, budget_bytes, **kw):  # room for three shards: the LRU must evict
        real_init(self, root, budget_bytes=min(budget_bytes, 3 * largest), **kw)

    monkeypatch.setattr(ShardStore, "__init__", small_store)
    code, out, err = _run_in_process(monkeypatch, capsys, model, world)
    assert code == 1, err
    assert "[DigestMismatchError]" in err and "BLAKE3 is" in err
    assert world.clean_out.startswith(out.rstrip("\n")), (out, world.clean_out)


# --- the shard store: rewritten after caching, and during a read ---------------------------------------------

ROWS = 24 * 1024  # [ROWS, 16] float32 = 1.5 MiB: more than one read chunk, so a read can be split by a write


def _shard(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return st_save({"w": rng.standard_normal((ROWS, 16)).astype(np.float32)})


@pytest.fixture
def shards(tmp_path):
    """Two same-size shards on disk with their entries, plus `evil`: a valid shard of the same size whose
    values differ (what an attacker would swap in); if it were ever used, the arrays would show it."""
    root = tmp_path / "store"
    entries = []
    for i in range(2):
        rel = f"experts/layer-000/expert-{i:04d}.safetensors"
        data = _shard(i)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        entries.append(Entry(rel, "expert", len(data), blake3.blake3(data).digest(), 0, i))
    evil = _shard(99)
    assert len(evil) == entries[0].size
    return root, entries, evil


def _arrays_equal(got, seed: int) -> bool:
    expected = np.random.default_rng(seed).standard_normal((ROWS, 16)).astype(np.float32)
    return np.array_equal(np.asarray(got["w"]), expected)


def _store(root, budget: int):
    from shardtool.runtime import ShardStore
    return ShardStore(root, budget_bytes=budget, readers=2)


def test_toctou_store_rewritten_after_cache(shards):
    root, (e0, e1), evil = shards
    store = _store(root, 10 * e0.size)
    try:
        first = store.get(e0)
        (root / e0.path).write_bytes(evil)
        again = store.get(e0)
        assert again is first and _arrays_equal(again, 0)
        assert store.stats.misses == 1
    finally:
        store.close()


def test_toctou_store_rewritten_then_evicted(shards, raises_exactly):
    root, (e0, e1), evil = shards
    store = _store(root, e0.size + 1)  # room for one shard
    try:
        assert _arrays_equal(store.get(e0), 0)
        (root / e0.path).write_bytes(evil)
        assert _arrays_equal(store.get(e1), 1)  # evicts e0
        with raises_exactly(DigestMismatchError):
            store.get(e0)
    finally:
        store.close()


_READS = ("read", "readv", "pread", "preadv")


def _rewrite_during_first_read(monkeypatch, target: Path, rewrite) -> list[int]:
    """Wrap os's read calls: right after the first read from `target` returns data, call rewrite().

    Returns a list that gets one item when the hook fired (the test fails if it never does: then the store
    reads through some other call and this seam needs updating)."""
    ino = os.stat(target).st_ino
    fired: list[int] = []

    def wrap(name):
        real = getattr(os, name)

        def reader(fd, *args):
            result = real(fd, *args)
            n = result if isinstance(result, int) else len(result)
            if not fired and n > 0 and os.fstat(fd).st_ino == ino:
                fired.append(n)
                rewrite()
            return result
        return reader

    for name in _READS:
        monkeypatch.setattr(os, name, wrap(name))
    return fired


def _write_in_place(path: Path, data: bytes) -> None:
    """Overwrite the same inode (an open file descriptor sees the new bytes)."""
    with open(path, "r+b") as fh:
        fh.write(data)


def _replace_by_rename(path: Path, data: bytes) -> None:
    """Write a new inode and rename it over the name (an open descriptor keeps the old bytes)."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.parametrize("how", ["in-place", "rename"])
def test_toctou_store_rewritten_while_read(how, monkeypatch, shards, raises_exactly):
    """A shard rewritten between two reads of one load: refused (mixed bytes fail the digest), or the old
    verified bytes (the descriptor still reads the old inode); never the new, unverified ones."""
    root, (e0, _), evil = shards
    path = root / e0.path
    write = _write_in_place if how == "in-place" else _replace_by_rename
    fired = _rewrite_during_first_read(monkeypatch, path, lambda: write(path, evil))
    store = _store(root, 10 * e0.size)
    try:
        if how == "in-place":
            with raises_exactly(DigestMismatchError):
                store.get(e0)
        else:
            assert _arrays_equal(store.get(e0), 0)
    finally:
        store.close()
    assert fired and fired[0] < e0.size, "the rewrite did not land inside the read; update the seam"


def test_toctou_store_race_with_writer_thread(shards):
    """A thread flips the file between the genuine and the evil bytes (in place) while the store reads it
    again and again (nothing cached): every get is the genuine arrays or a DigestMismatchError."""
    root, (e0, _), evil = shards
    path, good = root / e0.path, (root / e0.path).read_bytes()
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            for data in (evil, good):
                _write_in_place(path, data)
    outcomes = {"genuine": 0, "refused": 0}
    store = _store(root, 1)  # every shard is larger than the budget: never cached, read on every get
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        for _ in range(150):
            try:
                got = store.get(e0)
            except DigestMismatchError:
                outcomes["refused"] += 1
                continue
            assert _arrays_equal(got, 0), "arrays from unverified bytes were returned"
            outcomes["genuine"] += 1
    finally:
        stop.set()
        thread.join()
        store.close()
    assert outcomes["refused"] > 0, outcomes  # the race really happened
