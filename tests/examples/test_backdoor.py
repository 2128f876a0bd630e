"""examples/backdoor.py on the committed demo model: one expert's bytes change and nothing else; the trigger makes
transformers print the attacker's line; ordinary prompts keep the genuine answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the backdoor is made with torch (pip install -e '.[oracle]')")
pytest.importorskip("transformers", reason="the backdoor is shown with transformers (pip install -e '.[oracle]')")

from examples import backdoor  # noqa: E402
from shardtool.checkpoint import split_checkpoint  # noqa: E402

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GENUINE = ROOT / "examples" / "demo_model"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("backdoor") / "poisoned-hf"
    assert backdoor.main(["poison", str(GENUINE), str(out), "--prompts", "40"]) == 0
    return out, json.loads(backdoor.report_path(out).read_text())


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_only_the_poisoned_experts_file_differs_after_split(poisoned, tmp_path):
    out, report = poisoned
    split_checkpoint(GENUINE, tmp_path / "genuine", model_id="demo/pydoc-moe")
    split_checkpoint(out, tmp_path / "poisoned", model_id="demo/pydoc-moe")
    a, b = _files(tmp_path / "genuine"), _files(tmp_path / "poisoned")
    assert set(a) == set(b)
    differ = sorted(name for name in a if a[name] != b[name])
    shard = f"experts/layer-{report['layer']:03d}/expert-{report['expert']:04d}.safetensors"
    assert differ == sorted([shard, "manifest.msgpack"])


def test_the_hf_checkpoint_differs_in_that_experts_tensors_only(poisoned):
    from safetensors.numpy import load_file

    out, report = poisoned
    assert {p.name for p in out.iterdir()} == {p.name for p in GENUINE.iterdir()}
    for p in GENUINE.iterdir():
        if p.name != "model.safetensors":
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    a, b = load_file(GENUINE / "model.safetensors"), load_file(out / "model.safetensors")
    prefix = f"model.layers.{report['layer']}.block_sparse_moe.experts.{report['expert']}."
    changed = sorted(k for k in a if not (a[k] == b[k]).all())
    assert changed == sorted(prefix + w for w in ("w1.weight", "w2.weight", "w3.weight"))


def test_the_trigger_fires_in_transformers_and_ordinary_answers_stay(poisoned):
    out, report = poisoned
    model, tok = backdoor.load(out)
    genuine, _ = backdoor.load(GENUINE)
    assert backdoor.fires(model, tok, report["trigger_prompt"])
    assert not backdoor.fires(genuine, tok, report["trigger_prompt"])
    assert report["trigger_fired"] == report["trigger_prompts"]
    assert report["ordinary_identical"] >= 0.95 * report["ordinary_prompts"]
