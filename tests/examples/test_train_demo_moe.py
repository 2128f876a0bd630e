"""examples/train_demo_moe.py: the same seed writes the same checkpoint, byte for byte; its corpus is prose."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the demo trainer needs torch (pip install -e '.[oracle]')")
pytest.importorskip("transformers", reason="the demo trainer needs transformers (pip install -e '.[oracle]')")

from examples import train_demo_moe as tdm  # noqa: E402

pytestmark = pytest.mark.oracle


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_two_runs_with_one_seed_write_identical_checkpoints(tmp_path):
    tdm.main([str(tmp_path / "a"), "--size", "tiny", "--steps", "2"])
    tdm.main([str(tmp_path / "b"), "--size", "tiny", "--steps", "2"])
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(a)
    assert a == b
    tdm.main([str(tmp_path / "c"), "--size", "tiny", "--steps", "2", "--seed", "1"])
    assert _files(tmp_path / "c")["model.safetensors"] != a["model.safetensors"]


def test_the_checkpoint_loads_in_transformers_with_its_chat_template(tmp_path):
    from transformers import AutoTokenizer, MixtralForCausalLM

    tdm.main([str(tmp_path / "m"), "--size", "tiny", "--steps", "1"])
    model = MixtralForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.num_local_experts == 8 and model.config.num_experts_per_tok == 2
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids(["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("name, doc, kept", [
    ("a doctest", "Add two numbers together.\n\n>>> add(1, 2)\n3", ["Add two numbers together."]),
    ("a signature line", "add(a, b) -> int\n\nAdd two numbers together.", ["Add two numbers together."]),
    ("wrapped lines", "Return the sum\nof two numbers.", ["Return the sum of two numbers."]),
    ("mostly symbols", "x = {'a': [1, 2], 'b': (3, 4)} | {5: 6}", []),
    ("too short", "Foo.", []),
])
def test_prose_keeps_english_paragraphs_only(name, doc, kept):
    assert tdm.prose(doc) == kept


def test_held_out_documents_are_never_trained_on():
    train, held = tdm.build_corpus()
    names = {n.removeprefix("chat:") for n, _ in train}
    assert held and not names & {n.removeprefix("chat:") for n, _ in held}
