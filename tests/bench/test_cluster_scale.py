"""bench_cluster_scale's arithmetic (node caps from M and a plan's summary, rates and per-token figures after a
warm-up, layouts) and _machine.holding, which moves a running process into a capped machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _machine
from benchmarks import bench_cluster_scale as scale

MIB = 2**20
NODES = [{"bytes_on_disk": 1000 * MIB, "memory_floor": 200 * MIB},
         {"bytes_on_disk": 1100 * MIB, "memory_floor": 250 * MIB}]
OVERHEAD = 100 * MIB  # largest need: 1100 + 250 + 100 = 1450 MiB


@pytest.mark.parametrize("memory, expected", [
    pytest.param(None, 1472 * MIB, id="no-M-rounds-the-largest-need-up-to-64MiB"),
    pytest.param(1450 * MIB, 1450 * MIB, id="M-exactly-the-need"),
    pytest.param(2048 * MIB, 2048 * MIB, id="M-above-the-need-is-M"),
])
def test_node_cap(memory, expected):
    assert scale.node_cap(NODES, memory=memory, overhead=OVERHEAD) == expected


@pytest.mark.parametrize("memory", [
    pytest.param(1449 * MIB, id="one-MiB-short"),
    pytest.param(1100 * MIB, id="the-experts-alone"),
])
def test_node_cap_refuses_an_M_that_cannot_hold_a_share(memory):
    with pytest.raises(ValueError, match="cannot hold its experts"):
        scale.node_cap(NODES, memory=memory, overhead=OVERHEAD)


def test_rate_and_per_token_after_warmup():
    stamps = [0.0, 5.0, 9.0, 10.0, 10.5, 11.0, 11.5]  # slow first tokens, then 2 tokens/s
    assert scale.rate_after(stamps, 3) == pytest.approx(3 / 1.5)
    reads = [0, 500, 900, 1000, 1010, 1020, 1030]
    assert scale.per_token_after(reads, 3) == pytest.approx(10)


@pytest.mark.parametrize("fn", [scale.rate_after, scale.per_token_after], ids=["rate", "per-token"])
@pytest.mark.parametrize("values, warmup", [
    pytest.param([0.0, 1.0], 1, id="no-interval-left"),
    pytest.param([0.0, 1.0, 2.0], 4, id="warm-up-longer-than-the-run"),
])
def test_too_few_tokens_after_warmup(fn, values, warmup):
    with pytest.raises(ValueError, match="no interval"):
        fn(values, warmup)


@pytest.mark.parametrize("text, nodes, replicas, names", [
    pytest.param("2x1", 2, 1, ("n1", "n2"), id="two-nodes-one-copy"),
    pytest.param("3x2", 3, 2, ("n1", "n2", "n3"), id="three-nodes-two-copies"),
    pytest.param("2", 2, 1, ("n1", "n2"), id="replicas-default-to-one"),
])
def test_layout(text, nodes, replicas, names):
    layout = scale.Layout.parse(text)
    assert (layout.nodes, layout.replicas, layout.names) == (nodes, replicas, names)
    assert not layout.pipeline and layout.key == f"{nodes}x{replicas}"


def test_a_pipeline_layout_has_its_own_key_and_label():
    layout = scale.Layout.parse("2x1p")
    assert (layout.nodes, layout.replicas, layout.pipeline) == (2, 1, True)
    assert (layout.key, layout.label) == ("2x1p", "2 nodes, pipeline")
    with pytest.raises(ValueError, match="one copy of each span"):
        scale.Layout.parse("3x2p")


@pytest.mark.parametrize("text", [pytest.param("2x3", id="more-copies-than-nodes"),
                                  pytest.param("2x0", id="no-copy")])
def test_layout_refused(text):
    with pytest.raises(ValueError, match="replicas must be"):
        scale.Layout.parse(text)


def test_holding_lowers_the_cap_by_what_an_adopted_process_already_holds(tmp_path):
    """The memory a process charged before it moved in stays charged where it was: the machine's cap is lowered by
    its resident size, and its peak counts it, so the machine still holds all of it within M."""
    machine = _machine.Machine(memory_bytes=256 * MIB, read_bps=10**9)
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(40 << 20); time.sleep(60)"],
                             start_new_session=True)
    try:
        try:
            with _machine.holding(machine, data_dir=Path(__file__).parent) as held:
                for _ in range(100):  # until the child has touched its 40 MiB
                    if _machine._vm(child.pid, "VmRSS:") > 40 * MIB:
                        break
                    subprocess.run(["sleep", "0.05"])
                rss = _machine._vm(child.pid, "VmRSS:")
                held.adopt(child.pid)
                assert child.pid in [int(p) for p in Path(held.group.procs_files[0]).read_text().split()]
                limit_file = "memory.limit_in_bytes" if held.group.version == 1 else "memory.max"
                limit = int((held.group.dirs[0] / limit_file).read_text())
                assert rss > 40 * MIB and abs(limit - (machine.memory_bytes - rss)) < 4 * MIB
                assert held.readings()[0] >= rss
        except _machine.MachineUnavailableError as e:
            pytest.skip(f"no emulated machine here: {e}")
        assert child.wait(timeout=10) != 0  # leaving the machine killed what was left in it
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("written, ids, positions", [
    pytest.param(b"5 17 300\n", ["5", "17", "300"], [1, 3, 6], id="each-id-at-its-first-digit-not-at-the-newline"),
    pytest.param(b"42\n", ["42"], [1], id="one-token"),
    pytest.param(b"", [], [], id="no-output"),
])
def test_stamped_ids_stamp_each_token_when_it_begins(written, ids, positions):
    """One stamp per token id, taken as its first character arrives (the closing newline is no token)."""
    import io

    from benchmarks import bench_cluster

    stream = io.BytesIO(written)
    got, stamps, probes = bench_cluster.stamped_ids(stream, stream.tell)
    assert got == ids and len(stamps) == len(ids) and probes == positions


def test_median_row_is_the_round_with_the_median_rate():
    rows = [{"tokens_per_s": 3.0, "n": "a"}, {"tokens_per_s": 1.0, "n": "b"}, {"tokens_per_s": 2.0, "n": "c"}]
    assert scale.median_row(rows)["n"] == "c"
    assert scale.median_row(rows[:2])["n"] == "b"  # an even count: the lower of the two middle rounds


def test_cluster_rtt_times_the_scale_models_moe_layers_only(tmp_path):
    from benchmarks import _cluster_rtt as rtt

    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "config.json").write_text(json.dumps(
        {"first_k_dense_replace": 1, "num_hidden_layers": 5, "n_routed_experts": 120, "num_experts_per_tok": 8,
         "hidden_size": 2048}))
    model = rtt.scale_model(tmp_path)
    assert model.moe_layers == (1, 2, 3, 4) and (model.experts, model.top_k, model.hidden) == (120, 8, 2048)
    assert model.manifest == "coordinator/manifest.msgpack"
    assert rtt.LOOP.moe_layers == (0, 1, 2, 3) and rtt.LOOP.warmup == 20
