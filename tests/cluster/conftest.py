"""One real Ray head (127.0.0.1, its own process group and temp dir) for all the cluster tests."""

from __future__ import annotations

import pytest

import _clusterkit as kit


@pytest.fixture(scope="session")
def head(tmp_path_factory):
    if not (kit.BIN / "ray").exists():
        pytest.fail(f"Ray's `ray` command is not installed next to {kit.BIN / 'python'}; run `make install` "
                    f"(the dev extra pulls in the cluster extra)")
    work = tmp_path_factory.mktemp("ray-head")
    h = kit.Head.start(work)
    yield h
    temp = str(h.temp)
    assert kit.processes_mentioning(temp), "the check below would see the head's processes"
    h.stop()
    assert kit.group_members(h.proc.pgid) == [], "processes of the Ray head's group survived its stop"
    assert kit.processes_mentioning(temp) == [], "processes of the Ray session survived the head's stop"
