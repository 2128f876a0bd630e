"""A pull killed (SIGKILL) while a throttled mirror is serving a large file, then run again: it completes, nothing
verified before the kill is asked for again, and the partial file is continued with a Range request from where it
ended (its prefix kept)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import blake3
import pytest

from shardtool.manifest import MANIFEST_NAME
from shardtool.remote._fetch import partial_name

from _remotekit import MODEL_ID, MirrorServer, build_cli, check_dest, verified_entries

PAD = "blobs/pad.bin"
PAD_SIZE = 24 * 1024 * 1024
RATE = 3 * 1024 * 1024  # bytes per second per connection on the slow mirror


@pytest.fixture(scope="module")
def big(world, tmp_path_factory):
    """The tiny model plus a 24 MiB file, hashed into a new manifest and signed by the publisher."""
    work = tmp_path_factory.mktemp("big")
    model = work / "model"
    shutil.copytree(world.model, model)
    (model / MANIFEST_NAME).unlink()
    (model / "blobs").mkdir()
    (model / PAD).write_bytes(os.urandom(PAD_SIZE))
    cli = build_cli(work)
    cli.ok("manifest", model, "--model-id", MODEL_ID)
    cli.ok("sign", model, "--key", world.work / "publisher.key")
    entries = verified_entries(model, world.pub, work / "st")
    assert entries[PAD].size == PAD_SIZE
    server = MirrorServer(model, {"slow": {"rate": RATE}}, work / "mirror")
    yield model, entries, server
    server.close()


def test_killed_pull_resumes_without_fetching_verified_files_again(cli, world, big, tmp_path):
    model, entries, server = big
    dest = tmp_path / "dest"
    partial = dest / "blobs" / partial_name("pad.bin")
    others = [p for p in entries if p != PAD]
    proc = subprocess.Popen(cli.argv("pull", server.url("slow"), dest, "--trust", world.pub, "--model-id", MODEL_ID,
                                     "-q"), cwd=cli.cwd, env=cli.env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size >= 2 * 1024 * 1024
                   and all((dest / p).exists() for p in others)):
            assert proc.poll() is None, f"pull ended before it was killed: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "the pull made no progress on the large file"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    held = partial.stat().st_size
    assert 0 < held < PAD_SIZE
    pad = (model / PAD).read_bytes()
    assert partial.read_bytes() == pad[:held]
    assert not (dest / PAD).exists() and not (dest / MANIFEST_NAME).exists()
    check_dest(dest, entries, complete=False)

    mark = server.mark()
    r = cli("pull", server.url("good"), dest, "--trust", world.pub, "--model-id", MODEL_ID, "--json", "-q")
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    assert summary["files"] == {"selected": len(entries), "kept": len(others), "downloaded": 0, "resumed": 1,
                                "failed": 0}
    assert summary["bytes"]["downloaded"] == PAD_SIZE - held
    asked = [(q["path"], q["range"]) for q in server.requests(mark)]
    assert asked == [(MANIFEST_NAME, None), (PAD, f"bytes={held}-")]
    assert blake3.blake3((dest / PAD).read_bytes()).digest() == entries[PAD].digest
    check_dest(dest, entries, complete=True)
    cli.ok("audit", dest, "--trust", world.pub, "--model-id", MODEL_ID)
