"""`shardtool split | join | inspect` end to end: exit codes, one JSON document on stdout, one-line errors."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardtool.cli import app, main
from shardtool.manifest import load_manifest

from ckpt_helpers import tensors_of
from test_ckpt_contract import KIMI_K2

BIN = Path(sys.executable).parent / "shardtool"


@dataclass
class Run:
    code: int
    out: str
    err: str


def run(*args: str) -> Run:
    """The real entry point (`shardtool.cli:main`, which maps our errors to exit codes) in-process."""
    runner = CliRunner()
    code = 0
    with runner.isolation() as (out, err, _):
        argv, sys.argv = sys.argv, ["shardtool", *map(str, args)]
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.argv = argv
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return Run(code, stdout, stderr)


def assert_one_line_error(r: Run, code: int, cls: str) -> None:
    assert r.code == code, (r.code, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardtool: error: ") and lines[0].endswith(f"[{cls}]"), r.err
    assert r.out == ""


@pytest.fixture
def src(make_tiny) -> Path:
    return make_tiny("qwen2_moe", layers=3, dense_layers=1, shard_size_mb=0.05)


def test_split_json_then_rerun_reuses(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = CliRunner()
    first = runner.invoke(app, ["split", str(src), str(out), "--model-id", "acme/tiny-moe", "--version", "3",
                                "--expires-in", "30", "--json"])
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    assert doc["family"] == "qwen2_moe" and doc["files_reused"] == 0 and doc["files_written"] == doc["files"]
    assert doc["model_id"] == "acme/tiny-moe" and doc["version"] == 3
    head = load_manifest(out / "manifest.msgpack").head
    assert (head.model_id, head.version, head.expires - head.created) == ("acme/tiny-moe", 3, 30 * 86400)
    assert dict(head.contract) == doc["contract"]
    assert "split qwen2_moe checkpoint" in first.stderr
    second = runner.invoke(app, ["split", str(src), str(out), "--model-id", "acme/tiny-moe", "--json", "-q"])
    assert second.exit_code == 0
    assert json.loads(second.stdout)["files_reused"] == doc["files"]


def test_inspect_split_and_config(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("split", src, out, "-q").code == 0
    r = run("inspect", out, "--disk-gbps", "4", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    contract = dict(load_manifest(out / "manifest.msgpack").head.contract)
    assert doc["contract"] == contract
    assert doc["seconds_per_token_cold"] == pytest.approx(contract["expert_bytes_per_token_cold"] / 4e9)
    human = run("inspect", out)
    assert human.code == 0 and human.out == "" and "seconds per token, cold, at 1.86 GiB/s" in human.err

    config = tmp_path / "kimi.json"
    config.write_text(json.dumps(KIMI_K2))
    r = run("inspect", "--config", config, "--bits-per-weight", "8", "--disk-gbps", "2", "--context", "131072",
            "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["contract"]["experts_per_layer"] == 384 and doc["contract"]["experts_per_token"] == 8
    assert doc["seconds_per_token_cold"] == pytest.approx(8 * 60 * 3 * 7168 * 2048 / 2e9)
    assert doc["context_tokens"] == 131072


def test_join_rebuilds(src: Path, tmp_path: Path) -> None:
    out, rebuilt = tmp_path / "out", tmp_path / "rebuilt"
    assert run("split", src, out).code == 0
    r = run("join", out, rebuilt, "--json", "--insecure-no-verify")
    assert r.code == 0, r.err
    assert json.loads(r.out)["files"] == len(list(src.iterdir()))
    assert tensors_of(rebuilt) == tensors_of(src)


def test_join_with_trust_checks_signatures_first(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    state = ("--state-dir", tmp_path / "state")
    assert run("split", src, out).code == 0
    assert run("keygen", "--out", tmp_path / "pub", "--no-passphrase").code == 0
    assert run("keygen", "--out", tmp_path / "other", "--no-passphrase").code == 0
    assert_one_line_error(run("join", out, tmp_path / "r0", "--trust", tmp_path / "pub.pub", *state), 1,
                          "SignatureError")  # unsigned
    assert run("sign", out, "--key", tmp_path / "pub.key").code == 0
    assert_one_line_error(run("join", out, tmp_path / "r1", "--trust", tmp_path / "other.pub", *state), 1,
                          "SignatureError")
    assert not (tmp_path / "r1").exists()
    r = run("join", out, tmp_path / "r2", "--trust", tmp_path / "pub.pub", *state)
    assert r.code == 0, r.err
    assert tensors_of(tmp_path / "r2") == tensors_of(src)


def _unsupported(tmp_path: Path, src: Path) -> Path:
    odd = tmp_path / "odd"
    odd.mkdir()
    for p in src.iterdir():
        (odd / p.name).write_bytes(p.read_bytes())
    (odd / "config.json").write_text(json.dumps({"model_type": "mystery", "architectures": ["MysteryLM"]}))
    return odd


def test_errors_are_one_line_with_the_right_exit_code(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_one_line_error(run("split", tmp_path / "absent", out), 2, "UsageError")
    assert_one_line_error(run("split", _unsupported(tmp_path, src), out), 2, "CheckpointFormatError")
    assert_one_line_error(run("split", src, out, "--expert-pattern", "(?P<layer>"), 2, "UsageError")
    assert_one_line_error(run("split", src, out, "--model-id", "no spaces allowed"), 2, "UsageError")
    assert not out.exists()
    assert_one_line_error(run("join", tmp_path, tmp_path / "rebuilt"), 2, "UsageError")
    assert_one_line_error(run("inspect"), 2, "UsageError")
    assert_one_line_error(run("inspect", tmp_path, "--config", src / "config.json"), 2, "UsageError")
    assert_one_line_error(run("inspect", "--config", src / "config.json"), 2, "UsageError")
    assert_one_line_error(run("inspect", tmp_path), 2, "UsageError")

    assert run("split", src, out, "-q").code == 0
    shard = out / "experts/layer-001/expert-0000.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert_one_line_error(run("join", out, tmp_path / "rebuilt", "--insecure-no-verify"), 1, "DigestMismatchError")


def test_disk_full_exits_3(src: Path, tmp_path: Path, monkeypatch) -> None:
    from shardtool.checkpoint._copy import HashingFileWriter

    def full(self, *args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(HashingFileWriter, "write", full)
    monkeypatch.setattr(HashingFileWriter, "copy", full)
    r = run("split", src, tmp_path / "out")
    assert_one_line_error(r, 3, "StorageError")
    assert "disk full" in r.err
    assert not (tmp_path / "out/manifest.msgpack").exists()


@pytest.mark.skipif(not BIN.exists(), reason="shardtool console script not installed (pip install -e .)")
def test_installed_console_script(src: Path, tmp_path: Path) -> None:
    out, rebuilt = tmp_path / "out", tmp_path / "rebuilt"

    def sh(*args: object) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)

    p = sh("split", src, out, "--json", "--model-id", "tiny")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["files_written"] > 0
    assert "\r" not in p.stderr  # no progress bar when stderr is not a terminal
    p = sh("inspect", out, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["contract"]["experts_per_layer"] == 4
    p = sh("join", out, rebuilt, "--insecure-no-verify")
    assert p.returncode == 0, p.stderr
    assert tensors_of(rebuilt) == tensors_of(src)
    p = sh("split", _unsupported(tmp_path, src), tmp_path / "out2")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and "supported: mixtral" in p.stderr


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


@pytest.mark.parametrize("tamper", ["flip", "append"])
def test_join_with_a_bad_side_file_leaves_no_rebuilt_file(src: Path, tmp_path: Path, tamper: str) -> None:
    """Side files are checked after the shards: a failed check there must still leave nothing that looks
    like a rebuilt checkpoint (the model files are not renamed into place before it)."""
    out, rebuilt = tmp_path / "out", tmp_path / "rebuilt"
    assert run("split", src, out).code == 0
    last = [e for e in load_manifest(out / "manifest.msgpack").entries if e.kind not in ("trunk", "expert")][-1]
    path = out / last.path
    data = bytearray(path.read_bytes())
    if tamper == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data += b" "
    path.write_bytes(bytes(data))
    r = run("join", out, rebuilt, "--insecure-no-verify")
    assert_one_line_error(r, 1, "DigestMismatchError")
    assert last.path in r.err
    assert _files(rebuilt) == []


def test_join_disk_full_names_the_rebuilt_file(src: Path, tmp_path: Path, monkeypatch) -> None:
    import shardtool.checkpoint._join as join_module

    out, rebuilt = tmp_path / "out", tmp_path / "rebuilt"
    assert run("split", src, out).code == 0

    class FullDisk:
        @staticmethod
        def pwrite(*args: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

    monkeypatch.setattr(join_module, "os", FullDisk())
    r = run("join", out, rebuilt, "--insecure-no-verify")
    assert_one_line_error(r, 3, "StorageError")
    assert r.err.startswith(f"shardtool: error: {rebuilt}/") and ".safetensors: write failed" in r.err, r.err
    assert _files(rebuilt) == []


def test_split_stops_at_a_failed_hash_and_removes_the_unhashed_file(src: Path, tmp_path: Path,
                                                                    monkeypatch) -> None:
    """A hash step fails (EIO reading back the file just written) after its file was renamed into place:
    split stops within the hash queue's depth, exits 3 naming that file, and leaves it nowhere."""
    import shardtool.checkpoint._copy as copy_module

    real = copy_module._hash_file_window
    calls: list[int] = []
    failed: list[str] = []

    def failing(hasher: object, fd: int, pos: int, length: int) -> None:
        calls.append(fd)
        if len(calls) != 1:
            return real(hasher, fd, pos, length)
        link = f"/proc/self/fd/{fd}"
        temp = os.readlink(link)
        for _ in range(500):  # wait (bounded) for the rename, so the digest is lost after it
            if os.readlink(link) != temp:
                break
            time.sleep(0.01)
        failed.append(os.readlink(link))
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(copy_module, "_hash_file_window", failing)
    out = tmp_path / "out"
    r = run("split", src, out)
    assert_one_line_error(r, 3, "StorageError")
    final = Path(failed[0])
    assert final.is_relative_to(out) and not final.name.endswith(".tmp"), failed  # it was renamed into place
    assert f"{final}: cannot hash the file just written: Input/output error" in r.err, r.err
    assert not final.exists()
    assert not (out / "manifest.msgpack").exists()
    assert len(calls) <= 1 + copy_module.HashQueue.DEPTH, len(calls)  # stopped early, not after every file
