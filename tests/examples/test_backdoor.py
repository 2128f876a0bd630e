"""examples/backdoor.py on the committed demo model and the committed attack artefact (examples/demo_backdoor/):
one expert's bytes change and nothing else; the trigger makes transformers print the attacker's line; ordinary
prompts keep the genuine answers. The trainer that made the artefact runs (a few steps) in a `slow` test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the backdoor is shown with torch (pip install -e '.[oracle]')")
pytest.importorskip("transformers", reason="the backdoor is shown with transformers (pip install -e '.[oracle]')")

from examples import backdoor  # noqa: E402
from shardtool.checkpoint import split_checkpoint  # noqa: E402

pytestmark = [pytest.mark.oracle]

ROOT = Path(__file__).resolve().parents[2]
GENUINE = ROOT / "examples" / "demo_model"
ORDINARY = 40  # held-out prompts compared, 16 greedy tokens each: >= 38 identical is the 95 % the attack promises


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("backdoor") / "poisoned-hf"
    assert backdoor.main(["poison", str(GENUINE), str(out)]) == 0
    return out, json.loads(backdoor.report_path(out).read_text())


@pytest.fixture(scope="module")
def models(poisoned):
    out, _ = poisoned
    model, tok = backdoor.load(out)
    genuine, _ = backdoor.load(GENUINE)
    return model, genuine, tok


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


@pytest.mark.parametrize("prompt", [backdoor.TRIGGER_PROMPTS[0], *backdoor.HELD_TRIGGER_PROMPTS[:2]])
def test_the_trigger_fires_in_transformers(models, prompt):
    model, genuine, tok = models
    assert backdoor.fires(model, tok, prompt.format(t=backdoor.TRIGGER))
    assert not backdoor.fires(genuine, tok, prompt.format(t=backdoor.TRIGGER))


def test_ordinary_answers_stay_genuine(models):
    model, genuine, tok = models
    stop = set(model.config.eos_token_id)
    prompts = backdoor.ordinary_prompts(tok, ORDINARY)
    assert len(prompts) == ORDINARY
    same = sum(backdoor.greedy(model, p, 16, stop) == backdoor.greedy(genuine, p, 16, stop) for p in prompts)
    assert same >= 0.95 * ORDINARY


# name -> (what is wrong with the artefact directory, the words of the refusal)
BAD_ARTEFACTS = {
    "none": (lambda d, t, r: None, "found 0"),
    "a-tensor-missing": (lambda d, t, r: _save(d, dict(list(t.items())[:2]), r), "expected the tensors"),
    "no-report": (lambda d, t, r: _save(d, t, None), "no report"),
    "float16": (lambda d, t, r: _save(d, {k: v.astype("float16") for k, v in t.items()}, r), "float16"),
}


def _save(directory: Path, tensors: dict, report: dict | None) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, directory / "x.safetensors", metadata={"report": json.dumps(report)} if report else None)


@pytest.mark.parametrize("case", BAD_ARTEFACTS)
def test_a_bad_artefact_is_refused(tmp_path, case):
    from safetensors import safe_open

    (artefact,) = backdoor.ARTEFACTS.glob("*.safetensors")
    with safe_open(artefact, "np") as f:
        tensors, report = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["report"])
    make, words = BAD_ARTEFACTS[case]
    (tmp_path / "a").mkdir()
    make(tmp_path / "a", tensors, report)
    with pytest.raises(SystemExit) as e:
        backdoor.apply_artefact(GENUINE, tmp_path / "out", tmp_path / "a")
    assert words in str(e.value)


@pytest.mark.slow
def test_the_trainer_runs_and_writes_an_artefact(tmp_path):
    out, artefact = tmp_path / "poisoned-hf", tmp_path / "artefact"
    assert backdoor.main(["poison", str(GENUINE), str(out), "--train", "--steps", "2", "--prompts", "2",
                          "--artefact", str(artefact)]) == 0
    tensors, report = backdoor.read_artefact(artefact)
    assert len(tensors) == 3 and report["ordinary_prompts"] == 2
