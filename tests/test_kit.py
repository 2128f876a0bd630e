"""The shared test kit (tests/_kit) holds what the suite relies on: the xdist groups name real folders, a Result
reads both ways, and a session-built model is built once per argument set."""

from __future__ import annotations

import pytest

from _kit import XDIST_GROUPS, xdist_group_of
from _kit.cli import REPO, Result, ok, run


@pytest.mark.parametrize("folder", sorted(XDIST_GROUPS))
def test_each_xdist_group_names_a_folder_of_tests(folder):
    assert sorted((REPO / "tests" / folder).glob("test_*.py")), f"tests/{folder} holds no tests to keep together"


@pytest.mark.parametrize("rel, group", [
    ("cluster/test_cluster_e2e.py", "ray"),
    ("cluster/test_cluster_units.py", "ray"),
    ("remote/test_s3_e2e.py", "remote"),
    ("attacks/test_attack_format.py", None),
    ("runtime/test_cluster_plan.py", None),  # "cluster" in the name, not the folder
    ("test_kit.py", None),
], ids=lambda v: str(v))
def test_a_test_file_is_grouped_by_its_folder(rel, group):
    assert xdist_group_of(REPO / "tests" / rel) == group


def test_this_session_marked_every_grouped_folder(request):
    for item in request.session.items:
        group = xdist_group_of(item.path)
        if group is not None:
            assert [m.args for m in item.iter_markers("xdist_group")] == [(group,)], item.nodeid


@pytest.fixture(scope="module")
def built_once_per_module() -> object:
    return object()


def test_a_test_with_a_module_fixture_stays_with_its_file(request, built_once_per_module):
    assert [m.args for m in request.node.iter_markers("xdist_group")] == [("tests/test_kit.py",)]


def test_a_test_with_function_and_session_fixtures_goes_to_any_worker(request, tmp_path, tiny):
    assert list(request.node.iter_markers("xdist_group")) == []


def test_result_reads_as_code_out_err_and_as_a_completed_process():
    r = Result(1, "", "verify-and-run: error: shard digest mismatch [DigestMismatchError]\n")
    assert (r.code, r.out, r.err) == (r.returncode, r.stdout, r.stderr) == (1, "", r.err)
    assert r.error_class == "DigestMismatchError" and r.one_line().endswith("[DigestMismatchError]")


def test_run_gives_the_exit_code_and_ok_refuses_a_failure(tmp_path):
    r = run("shardtool", "no-such-command", cwd=tmp_path)
    assert r.code == 2 and "Traceback" not in r.err, r.err
    with pytest.raises(AssertionError, match="no-such-command exited 2"):
        ok("shardtool", "no-such-command", cwd=tmp_path)


def test_tiny_builds_each_model_once_per_argument_set(tiny):
    a = tiny.checkpoint("mixtral", layers=1, experts=2)
    assert tiny.checkpoint("mixtral", experts=2, layers=1) == a  # keyword order does not matter
    assert tiny.checkpoint("mixtral", layers=1, experts=3) != a
    release = tiny.release("mixtral", model_id="kit/once", layers=1, experts=2)
    assert tiny.release("mixtral", model_id="kit/once", experts=2, layers=1) == release
    assert (release / "manifest.msgpack").is_file() and tiny.keypair().with_suffix(".pub").is_file()


def test_the_installed_pytest_and_xdist_keep_a_group_on_one_worker(tmp_path):
    """The marks above are only half of it: xdist must honour them. pytest 9.2 changed what a node id is made of and
    xdist 3.8's `--dist loadgroup` then spread every group over both workers, silently (each module's model built
    twice; a Ray test that restarts the node another test killed ran where nobody had killed it)."""
    import subprocess
    import sys
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n"
        "@pytest.mark.xdist_group('g')\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_one(i):\n"
        "    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                        "-p", "no:randomly", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:]
    workers = {line.split("]", 1)[0] for line in r.stdout.splitlines() if line.startswith("[gw") and "PASSED" in line}
    assert len(workers) == 1, r.stdout[-2000:]
