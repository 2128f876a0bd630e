"""`shardtool push` to a real S3 endpoint (moto's server on 127.0.0.1, through s3fs) and `shardtool pull` back from
it: byte-identical and audited; a second push skips every shard; an unsigned manifest is refused; a tampered or
truncated object on one S3 mirror fails over to the next."""

from __future__ import annotations

import json

import boto3
import pytest

from shardtool.manifest import MANIFEST_NAME

from _remotekit import MODEL_ID, build_cli, check_dest, target_file


@pytest.fixture
def s3cli(cli, s3):
    cli.env.update(s3)
    return cli


def _bucket(s3):
    return boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def _keys(s3, prefix: str) -> set[str]:
    pages = _bucket(s3).get_paginator("list_objects_v2").paginate(Bucket="models", Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", [])}


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def pushed(world, s3, tmp_path_factory):
    """The model pushed once with the CLI to s3://models/base: (url, the push's JSON summary)."""
    cli = build_cli(tmp_path_factory.mktemp("push"))
    cli.env.update(s3)
    r = cli("push", world.model, "s3://models/base", "--json")
    assert r.code == 0, r.err
    return "s3://models/base", json.loads(r.out)


def test_push_then_pull_back_is_byte_identical(s3cli, s3, world, pushed, tmp_path):
    url, summary = pushed
    n = len(world.entries)
    assert summary["files"] == {"uploaded": n + 1, "already_present": 0}
    assert summary["bytes_uploaded"] == world.total + (world.model / MANIFEST_NAME).stat().st_size
    assert _keys(s3, "base") == set(world.entries) | {MANIFEST_NAME}

    dest = tmp_path / "dest"
    r = s3cli("pull", url, dest, "--trust", world.pub, "--model-id", MODEL_ID, "--json")
    assert r.code == 0, r.err
    pulled = json.loads(r.out)
    assert pulled["complete"] and pulled["files"]["downloaded"] == n
    assert pulled["mirrors"][url] == {"files_served": n, "faults": []}
    assert _files(dest) == _files(world.model)
    s3cli.ok("audit", dest, "--trust", world.pub, "--model-id", MODEL_ID)

    again = s3cli("push", world.model, url, "--json")
    assert again.code == 0, again.err
    second = json.loads(again.out)
    assert second["files"] == {"uploaded": 1, "already_present": n}  # only the manifest goes up again
    assert second["bytes_uploaded"] == (world.model / MANIFEST_NAME).stat().st_size


def test_push_refuses_an_unsigned_manifest(s3cli, s3, world):
    r = s3cli("push", world.unsigned, "s3://models/unsigned")
    assert r.code == 2, r.err
    assert "not signed" in r.one_line()
    assert _keys(s3, "unsigned") == set()


def test_push_refuses_an_http_target(s3cli, world):
    r = s3cli("push", world.model, "http://127.0.0.1:9/models")
    assert r.code == 2 and "read-only" in r.one_line()


@pytest.mark.parametrize("damage", ["flip", "short", "long"])
def test_a_damaged_object_fails_over_to_the_next_s3_mirror(s3cli, s3, world, pushed, tmp_path, damage):
    good, bad = pushed[0], f"s3://models/bad-{damage}"
    client = _bucket(s3)
    for key in _keys(s3, "base"):
        client.copy_object(Bucket="models", Key=f"bad-{damage}/{key}", CopySource={"Bucket": "models",
                                                                                   "Key": f"base/{key}"})
    target = target_file(world)
    data = (world.model / target).read_bytes()
    wrong = {"flip": bytes([data[0] ^ 1]) + data[1:], "short": data[:-1], "long": data + b"\0"}[damage]
    client.put_object(Bucket="models", Key=f"bad-{damage}/{target}", Body=wrong)

    dest = tmp_path / "dest"
    r = s3cli("pull", bad, dest, "--mirror", good, "--trust", world.pub, "--model-id", MODEL_ID, "--json")
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    assert [f["path"] for f in summary["mirrors"][bad]["faults"]] == [target]
    assert summary["mirrors"][good]["files_served"] == 1
    size = world.entries[target].size
    # flip: all of it again from the good mirror; short: its last byte (a range request); long: the bad answer's
    # first `size` bytes are the right ones, cut there and verified, so nothing more is asked.
    assert summary["bytes"]["downloaded"] == world.total + {"flip": size, "short": 0, "long": 0}[damage]
    check_dest(dest, world.entries, complete=True)

    if damage != "short":
        return  # alone: once is enough (the short object also takes the resume path on the good mirror above)
    alone = s3cli("pull", bad, tmp_path / "alone", "--trust", world.pub, "--model-id", MODEL_ID, "-q")
    assert alone.code == 1
    line = alone.one_line()
    assert target in line and bad in line
    check_dest(tmp_path / "alone", world.entries, complete=False)
    assert not (tmp_path / "alone" / target).exists()
