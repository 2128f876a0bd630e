"""`shardtool inspect DIR --plot contract.svg [--report run.json ...]`: the resource contract as a picture. The SVG
parses, its lines and points sit where the contract's arithmetic (`seconds_per_token_at`, `estimate`) puts them,
its strings are escaped, and a bad --report is one line on stderr, exit 2, and no picture."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from shardtool.checkpoint import estimate, expected_hit_rate, seconds_per_token_at
from shardtool.checkpoint._plot import Axes, axes_for, measured_point
from shardtool.manifest import load_manifest

from test_ckpt_cli import assert_one_line_error, run, src  # noqa: F401  (src: a fixture)

SVG = "{http://www.w3.org/2000/svg}"
GIB = 2**30


@pytest.fixture
def split(src: Path, tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / "out"
    assert run("split", src, out, "-q", "--model-id", "acme/plot").code == 0
    return out, dict(load_manifest(out / "manifest.msgpack").head.contract)


def _report(path: Path, budget: int, tokens_per_s, model_id: str = "acme/plot", **extra) -> Path:
    path.write_text(json.dumps({"model_id": model_id, "budget": {"total": budget, "kv_cache": 1},
                                "decode_tokens_per_s": tokens_per_s, **extra}))
    return path


def _by_id(svg: Path) -> dict[str, ET.Element]:
    root = ET.parse(svg).getroot()
    assert root.tag == SVG + "svg"
    return {e.get("id"): e for e in root.iter() if e.get("id")}


def _points(e: ET.Element) -> list[float]:
    """A polyline's points, flat: x0, y0, x1, y1, ..."""
    return [float(v) for p in e.get("points").split() for v in p.split(",")]


def test_the_picture_is_where_the_arithmetic_says(split, tmp_path: Path) -> None:
    out, contract = split
    floor = estimate(contract, disk_gbps=0.85).min_memory_bytes
    full = floor + contract["expert_bytes_total"]
    reports = [_report(tmp_path / "a.json", floor + contract["expert_bytes_total"] // 4, 50.0),
               _report(tmp_path / "b.json", 2 * full, 80.0)]
    svg = tmp_path / "contract.svg"
    r = run("inspect", out, "--disk-gbps", "0.85", "--plot", svg, "--report", reports[0], "--report", reports[1])
    assert r.code == 0, r.err
    parts = _by_id(svg)
    cold = contract["expert_bytes_per_token_cold"] / 0.85e9
    ax = axes_for(contract, disk_gbps=0.85, points=[measured_point(json.loads(p.read_text()), "") for p in reports])
    assert ax.x_max >= 2 * full * 1.1 and ax.y_max >= cold * 1.1  # room for every point and the whole curve
    assert float(parts["floor"].get("x1")) == pytest.approx(ax.x(floor), abs=0.01)
    assert _points(parts["cold"]) == pytest.approx([ax.x(floor), ax.y(cold), ax.x(ax.x_max), ax.y(cold)], abs=0.01)
    # the expected curve: cold at the floor, 0 once every expert fits
    assert _points(parts["expected"])[:4] == pytest.approx([ax.x(floor), ax.y(cold), ax.x(full), ax.y(0)], abs=0.01)
    for i, (budget, rate) in enumerate([(floor + contract["expert_bytes_total"] // 4, 50.0), (2 * full, 80.0)]):
        point = parts[f"point-{i}"]
        assert (float(point.get("cx")), float(point.get("cy"))) == pytest.approx((ax.x(budget), ax.y(1 / rate)),
                                                                                  abs=0.01)
    # pixels: x grows with memory, y falls with seconds; the plot area is inside the picture
    assert Axes(10 * GIB, 2.0).x(0) < Axes(10 * GIB, 2.0).x(GIB) and Axes(10 * GIB, 2.0).y(0) > Axes(10 * GIB, 2.0).y(1)


def test_a_config_picture_escapes_its_title(src: Path, tmp_path: Path) -> None:
    odd = tmp_path / 'a<b>&"c'
    odd.mkdir()
    config = odd / "config.json"
    config.write_bytes((src / "config.json").read_bytes())
    svg = tmp_path / "c.svg"
    r = run("inspect", "--config", config, "--bits-per-weight", "4", "--plot", svg)
    assert r.code == 0, r.err
    root = ET.parse(svg).getroot()
    assert any(str(config) in (t.text or "") for t in root.iter(SVG + "text"))
    assert "point-0" not in _by_id(svg)


def test_a_picture_of_names_with_control_characters_is_still_xml(src: Path, tmp_path: Path) -> None:
    """A control character is not allowed in XML 1.0 even escaped as markup: a directory or report named with one
    made a picture no SVG reader opens. They are written as escapes, as on the terminal."""
    odd = tmp_path / "a\x1bb"
    odd.mkdir()
    config = odd / "config.json"
    config.write_bytes((src / "config.json").read_bytes())
    svg = tmp_path / "c.svg"
    assert run("inspect", "--config", config, "--bits-per-weight", "4", "--plot", svg).code == 0
    assert any("a\\x1bb" in (t.text or "") for t in ET.parse(svg).getroot().iter(SVG + "text"))


def test_a_report_named_with_a_control_character_is_still_xml(split, tmp_path: Path) -> None:
    out, _ = split
    report = _report(tmp_path / "run\x01.json", GIB, 3.0)
    svg = tmp_path / "contract.svg"
    assert run("inspect", out, "--plot", svg, "--report", report).code == 0
    assert "run\\x01.json" in "".join(_by_id(svg)["point-0"].itertext())


@pytest.mark.parametrize("memory_over_floor, expected", [
    pytest.param(-1, 0.0, id="below-the-floor"),
    pytest.param(0, 0.0, id="at-the-floor"),
    pytest.param(0.5, 0.5, id="half-the-experts"),
    pytest.param(1, 1.0, id="every-expert"),
    pytest.param(3, 1.0, id="more-than-every-expert"),
])
def test_expected_hit_rate(memory_over_floor, expected) -> None:
    contract = {"min_memory_bytes": 1000, "expert_bytes_total": 4000, "expert_bytes_per_token_cold": 100,
                "kv_cache_bytes_per_token": 2, "context_tokens": 10}
    memory = 1000 + int(memory_over_floor * 4000)
    assert expected_hit_rate(contract, memory) == expected
    assert seconds_per_token_at(contract, memory, disk_gbps=1e-7) == pytest.approx(100 / 100 * (1 - expected))
    # a longer context raises the floor: the same budget caches less
    assert expected_hit_rate(contract, 3000, context_tokens=510) == pytest.approx((3000 - 2000) / 4000)


BAD_REPORTS = [
    pytest.param(lambda p: p.write_text("{not json"), "CheckpointFormatError", id="not-json"),
    pytest.param(lambda p: p.write_text("[1, 2]"), "CheckpointFormatError", id="an-array"),
    pytest.param(lambda p: p.write_text('{"decode_tokens_per_s": 3.0}'), "CheckpointFormatError", id="no-budget"),
    pytest.param(lambda p: _report(p, "8GiB", 3.0), "CheckpointFormatError", id="budget-a-string"),
    pytest.param(lambda p: _report(p, 0, 3.0), "CheckpointFormatError", id="budget-zero"),
    pytest.param(lambda p: _report(p, True, 3.0), "CheckpointFormatError", id="budget-true"),
    pytest.param(lambda p: _report(p, GIB, None), "CheckpointFormatError", id="no-decode-rate"),
    pytest.param(lambda p: _report(p, GIB, 0), "CheckpointFormatError", id="rate-zero"),
    pytest.param(lambda p: _report(p, GIB, "fast"), "CheckpointFormatError", id="rate-a-string"),
    # 1 / rate past a float's range (inf seconds: a ValueError), or the axes' tenth more past it; an int too large
    # for a float
    pytest.param(lambda p: _report(p, GIB, 5e-324), "CheckpointFormatError", id="rate-denormal"),
    pytest.param(lambda p: _report(p, GIB, 6e-309), "CheckpointFormatError", id="rate-tiny"),
    pytest.param(lambda p: _report(p, GIB, 10**400), "CheckpointFormatError", id="rate-huge-int"),
    pytest.param(lambda p: _report(p, GIB, 3.0, model_id="other/model"), "CheckpointFormatError",
                 id="another-model"),
    pytest.param(lambda p: p.mkdir(), "CheckpointFormatError", id="a-directory"),
]


@pytest.mark.parametrize("make, cls", BAD_REPORTS)
def test_a_bad_report_is_one_line_exit_2_and_no_picture(split, tmp_path: Path, make, cls) -> None:
    out, _ = split
    report = tmp_path / "run.json"
    make(report)
    svg = tmp_path / "contract.svg"
    r = run("inspect", out, "--plot", svg, "--report", report)
    assert_one_line_error(r, 2, cls)
    assert str(report) in r.err and not svg.exists()


def test_a_report_without_a_plot_is_a_usage_error(split, tmp_path: Path) -> None:
    out, _ = split
    assert_one_line_error(run("inspect", out, "--report", _report(tmp_path / "r.json", GIB, 3.0)), 2, "UsageError")
