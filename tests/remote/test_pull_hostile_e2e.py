"""`shardtool pull` end to end against mirrors that misbehave (tests/remote/hostile_mirror.py): each fault on one
shard either fails over to a good `--mirror` (exit 0, the fault reported against that mirror and file) or, with no
good mirror, exits 1 with one stderr line naming the file and the mirror. In every case DEST holds nothing
unverified under a final name and no more than the signed total plus one read chunk."""

from __future__ import annotations

import json

import pytest

from shardtool.manifest import MANIFEST_NAME

from _remotekit import FAULTS, MODEL_ID, check_dest, target_file


def _pull(cli, world, url, dest, *mirrors, quiet=False, timeout="2"):
    args = ["pull", url, dest, "--trust", world.pub, "--model-id", MODEL_ID, "--timeout", timeout, "--json"]
    for m in mirrors:
        args += ["--mirror", m]
    if quiet:
        args.append("-q")
    return cli(*args)


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_fails_over_to_a_good_mirror(cli, world, http_mirrors, tmp_path, fault):
    dest = tmp_path / "dest"
    bad, good = http_mirrors.url(fault), http_mirrors.url("good")
    r = _pull(cli, world, bad, dest, good)
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    target = target_file(world)
    assert summary["complete"] and summary["manifest_written"]
    faults = summary["mirrors"][bad.rstrip("/") + "/"]["faults"]
    assert [f["path"] for f in faults] == [target], faults
    assert summary["mirrors"][good]["files_served"] >= 1
    assert all(not m["faults"] for url, m in summary["mirrors"].items() if url != bad)
    check_dest(dest, world.entries, complete=True)
    assert (dest / MANIFEST_NAME).read_bytes() == (world.model / MANIFEST_NAME).read_bytes()
    assert f"mirror fault: {target}: {bad}" in r.err
    if fault == "endless":  # the files were hashed above; once, the user's own check of DEST as well
        cli.ok("audit", dest, "--trust", world.pub, "--model-id", MODEL_ID)


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_with_no_good_mirror_exits_1_in_one_line(cli, world, http_mirrors, tmp_path, fault):
    dest = tmp_path / "dest"
    bad = http_mirrors.url(fault)
    r = _pull(cli, world, bad, dest, quiet=True)
    assert r.code == 1, r.err
    line = r.one_line()
    target = target_file(world)
    assert target in line and bad in line, line
    check_dest(dest, world.entries, complete=False)
    # Every other file was still fetched and verified; the target is not under its final name.
    assert not (dest / target).exists()
    assert all((dest / p).is_file() for p in world.entries if p != target)


def test_stall_keeps_the_prefix_and_the_next_mirror_resumes_it(cli, world, http_mirrors, tmp_path):
    dest = tmp_path / "dest"
    mark = http_mirrors.mark()
    r = _pull(cli, world, http_mirrors.url("stall"), dest, http_mirrors.url("good"))
    assert r.code == 0, r.err
    target = target_file(world)
    size = world.entries[target].size
    asks = [q for q in http_mirrors.requests(mark) if q["path"] == target]
    assert [(q["mirror"], q["range"]) for q in asks] == [("stall", None), ("good", f"bytes={size // 2}-")]


def test_short_mirror_then_no_range_mirror_restarts_from_zero(cli, world, http_mirrors, tmp_path):
    target = target_file(world)
    size = world.entries[target].size
    got = {}
    for good in ("good", "norange"):
        mark = http_mirrors.mark()
        r = _pull(cli, world, http_mirrors.url("short"), tmp_path / good, http_mirrors.url(good))
        assert r.code == 0, r.err
        check_dest(tmp_path / good, world.entries, complete=True)
        asks = [q for q in http_mirrors.requests(mark) if q["path"] == target]
        # Both are asked to continue after the short mirror's size - 1 bytes
        assert [(q["mirror"], q["range"]) for q in asks] == [("short", None), (good, f"bytes={size - 1}-")]
        got[good] = json.loads(r.out)["bytes"]["downloaded"]
    # ... but the one that ignores Range sends the whole file, and what was held is dropped for it.
    assert got["norange"] - got["good"] == size - 1


@pytest.mark.parametrize("fault", ["huge", "huge_chunked"])
def test_a_1_gib_manifest_is_refused_and_the_next_mirror_asked(cli, world, http_mirrors, tmp_path, fault):
    dest = tmp_path / "dest"
    r = _pull(cli, world, http_mirrors.url(fault), dest, http_mirrors.url("good"), timeout="30")
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    assert summary["manifest_mirror"] == http_mirrors.url("good")
    faults = summary["mirrors"][http_mirrors.url(fault)]["faults"]
    assert [f["path"] for f in faults] == [MANIFEST_NAME] and "cap" in faults[0]["reason"]
    assert f"mirror fault: {MANIFEST_NAME}: {http_mirrors.url(fault)}" in r.err
    check_dest(dest, world.entries, complete=True)

    if fault == "huge_chunked":
        return  # alone, it fails like `huge` (which reads nothing); this one would read the 256 MiB cap again
    alone = _pull(cli, world, http_mirrors.url(fault), tmp_path / "alone", quiet=True, timeout="30")
    assert alone.code == 1
    line = alone.one_line()
    assert MANIFEST_NAME in line and http_mirrors.url(fault) in line, line
    assert not (tmp_path / "alone").exists() or not any((tmp_path / "alone").rglob("*"))


def test_a_listing_that_names_etc_passwd_is_never_asked_for(cli, world, http_mirrors, tmp_path):
    dest = tmp_path / "sub" / "dest"
    mark = http_mirrors.mark()
    r = _pull(cli, world, http_mirrors.url("listing"), dest)
    assert r.code == 0, r.err
    check_dest(dest, world.entries, complete=True)
    asked = {q["path"] for q in http_mirrors.requests(mark)}
    assert asked == set(world.entries) | {MANIFEST_NAME}
    assert not any(p.name == "passwd" for p in tmp_path.rglob("*"))
    assert {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} == asked


def test_redirect_to_another_host_is_not_followed(cli, world, http_mirrors, tmp_path):
    """The redirect's target (127.0.0.2, same port) serves the right bytes: only a client that refuses it fails."""
    mark = http_mirrors.mark()
    r = _pull(cli, world, http_mirrors.url("redirect"), tmp_path / "dest", quiet=True)
    assert r.code == 1
    assert "another origin" in r.one_line()
    assert all(q["host"] == "127.0.0.1" for q in http_mirrors.requests(mark))
