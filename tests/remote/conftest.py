"""Fixtures for the pull/push tests: a split, signed tiny model, a real S3 endpoint (moto's server on 127.0.0.1, read
through s3fs) and the hostile HTTP mirror (`hostile_mirror.py`), each started once per session as a subprocess in
its own process group and ended by that group at teardown.

moto, s3fs and boto3 are imported at the top: where they are missing the whole directory errors at collection
instead of skipping (`make install` puts them in through the dev extra).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import boto3
import moto  # noqa: F401 - fail loudly at collection when the S3 test stack is missing
import pytest
import s3fs  # noqa: F401
from _remotekit import (FAULTS, MODEL_ID, S3_ENV, Cli, MirrorServer, World, build_cli, free_port, stop,
                        target_file, verified_entries, wait_port)

from examples.make_tiny_moe import make_checkpoint
from shardtool.manifest import MANIFEST_NAME


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> World:
    work = tmp_path_factory.mktemp("remote-world")
    cli = build_cli(work)
    cli.ok("keygen", "--out", "publisher", "--no-passphrase")
    make_checkpoint(work / "ck", "mixtral", experts=4, layers=3, vocab=300, dtype="f32")
    cli.ok("split", "-q", "ck", "model", "--model-id", MODEL_ID)
    cli.ok("sign", "model", "--key", "publisher.key")
    shutil.copytree(work / "model", work / "unsigned")
    (work / "unsigned" / MANIFEST_NAME).unlink()
    cli.ok("manifest", "unsigned", "--model-id", MODEL_ID)
    entries = verified_entries(work / "model", work / "publisher.pub", work / "st")
    return World(work, work / "model", work / "unsigned", work / "publisher.pub", entries)


@pytest.fixture
def cli(tmp_path) -> Cli:
    return build_cli(tmp_path)


@pytest.fixture(scope="session")
def http_mirrors(world, tmp_path_factory):
    target = target_file(world)
    config = {fault: {"fault": fault, "path": target} for fault in FAULTS}
    config.update({"huge": {"fault": "huge", "path": MANIFEST_NAME},
                   "huge_chunked": {"fault": "huge_chunked", "path": MANIFEST_NAME},
                   "listing": {"fault": "listing", "path": "*"},
                   "norange": {"range": False}})
    server = MirrorServer(world.model, config, tmp_path_factory.mktemp("mirror"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 and the environment a client needs for it; one bucket `models`."""
    port = free_port()
    tmp = tmp_path_factory.mktemp("moto")
    env = {**os.environ, **S3_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "moto.err", "w"), env=env, cwd=tmp)
    try:
        wait_port(port, proc, "moto.server")
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket="models")
        yield {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
    finally:
        stop(proc)
