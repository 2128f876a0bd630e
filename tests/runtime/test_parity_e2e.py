"""transformers is the reference for the whole verified path: a tiny random model of each family is saved
with `save_pretrained`, split, signed, and run by the installed `verify-and-run`; its 16 greedy tokens must
equal `generate(do_sample=False)` and its logits (read through the verifying store) match float32 torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="parity oracle needs torch (pip install -e '.[oracle]')")
pytest.importorskip("transformers", reason="parity oracle needs transformers (pip install -e '.[oracle]')")

import _hf_oracle as oracle  # noqa: E402  (tests/runtime is on sys.path: pytest's prepend import mode)
from _kit.cli import ok as cli  # noqa: E402  (every command here must succeed)

pytestmark = pytest.mark.oracle

PROMPT = [3, 17, 200, 45, 9, 128, 77, 5]
NEW = 16
REL_TOL = 1e-4  # max |verify-and-run - torch| <= REL_TOL * max |torch|


@dataclass(frozen=True)
class Case:
    family: str  # an oracle.FAMILY_CASES name
    # float32 | bfloat16 (save_pretrained in bf16) | float8 (DeepSeek-style block FP8) | mxfp4 (gpt-oss's experts)
    stored: str = "float32"
    block: tuple[int, int] = (128, 128)


CASES = {
    "mixtral": Case("mixtral"),
    "qwen2_moe": Case("qwen2_moe"),
    "qwen3_moe": Case("qwen3_moe"),
    "olmoe": Case("olmoe"),
    "deepseek_v3": Case("deepseek_v3"),
    "deepseek_v3_yarn": Case("deepseek_v3_yarn"),
    "mixtral-bf16": Case("mixtral", "bfloat16"),
    "deepseek_v3-bf16": Case("deepseek_v3", "bfloat16"),
    "deepseek_v3-fp8-16x16": Case("deepseek_v3", "float8", (16, 16)),
    "deepseek_v3_yarn-fp8-128x128": Case("deepseek_v3_yarn", "float8", (128, 128)),
    # The 8-token prompt spans two attention chunks of 5; layer 2 is a NoPE layer.
    "llama4": Case("llama4"),
    "llama4_llama3": Case("llama4_llama3"),
    "llama4-bf16": Case("llama4", "bfloat16"),
    "gpt_oss": Case("gpt_oss"),
    "gpt_oss-bf16": Case("gpt_oss", "bfloat16"),
    "gpt_oss-mxfp4": Case("gpt_oss", "mxfp4"),
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("keys")
    cli("shardtool", "keygen", "--out", "k", "--no-passphrase", cwd=work)
    return work


def write_checkpoint(case: Case, ck: Path, ref_dir: Path):
    """The checkpoint as a publisher would ship it, and the float32 torch model its stored values mean."""
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    hf = oracle.build(case.family)
    if case.stored == "float32":
        hf.save_pretrained(ck)
        return hf
    if case.stored == "mxfp4":  # as gpt-oss ships: U8 expert blocks + scales; transformers reads them itself
        oracle.write_mxfp4(hf, ck)
        return oracle.load_mxfp4(ck)
    if case.stored == "bfloat16":
        hf.to(torch.bfloat16).save_pretrained(ck)
        ref = AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager", dtype=torch.float32).eval()
        ref.generation_config.eos_token_id = None
        ref.generation_config.pad_token_id = 0
        return ref
    # FP8: transformers cannot write DeepSeek's block-FP8 format on a CPU, so its save_pretrained output is
    # quantized the way DeepSeek-V3 ships (F8_E4M3 projections + float32 weight_scale_inv per block).
    stored, exact = oracle.lower_precision(oracle.saved_state(hf, ck), "float8", case.block)
    for f in ck.glob("*.safetensors*"):
        f.unlink()
    save_file({k: np.ascontiguousarray(v) for k, v in stored.items()}, ck / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((ck / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(case.block)}
    (ck / "config.json").write_text(json.dumps(config, indent=2))
    return oracle.load_weights(hf, ref_dir, exact)


def stored_dtypes(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    out = set()
    for f in model_dir.rglob("*.safetensors"):
        with safe_open(f, "np") as fh:
            out.update(str(fh.get_slice(k).get_dtype()) for k in fh.keys())
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_and_run_matches_transformers(name, keys, tmp_path):
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime.engine._session import Session

    case = CASES[name]
    ref = write_checkpoint(case, tmp_path / "ck", tmp_path / "ref")
    cli("shardtool", "split", "-q", tmp_path / "ck", tmp_path / "model", cwd=tmp_path)
    cli("shardtool", "sign", tmp_path / "model", "--key", keys / "k.key", cwd=tmp_path)
    dtypes = stored_dtypes(tmp_path / "model")
    want = {"float32": "F32", "bfloat16": "BF16", "float8": "F8_E4M3", "mxfp4": "U8"}[case.stored]
    assert want in dtypes, f"split output holds {dtypes}, expected {want} shards"

    report = tmp_path / "report.json"
    r = cli("verify-and-run", tmp_path / "model", "--trust", keys / "k.pub", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--print-ids", "--temperature", "0", "--max-new-tokens", NEW, "--json-report", report,
            "--state-dir", tmp_path / "state", "-q", cwd=tmp_path)
    tokens = [int(x) for x in r.stdout.split()]
    assert tokens == oracle.greedy(ref, PROMPT, NEW)
    summary = json.loads(report.read_text())
    assert summary["generated_ids"] == tokens and summary["cache"]["misses"] > 0

    # Logits through the same verified path: trusted manifest -> session -> verifying shard store.
    verified = load_trusted_manifest(tmp_path / "model" / "manifest.msgpack", [load_public_key(keys / "k.pub")], 1,
                                     tmp_path / "state-logits")
    session = Session(tmp_path / "model", verified, budget=1 << 30, max_tokens=len(PROMPT))
    try:
        got = session.model.prefill(PROMPT)
        if case.family.startswith("deepseek"):
            # The correction bias must really be in the signed shards, non-zero, or selection is not under test.
            bias = session.weights.layer(1)["mlp.gate.e_score_correction_bias"]
            assert np.abs(bias.astype(np.float32)).max() > 0.01
    finally:
        session.close()
    want_logits = oracle.logits(ref, PROMPT)
    assert got.shape == want_logits.shape
    assert np.abs(got - want_logits).max() <= REL_TOL * np.abs(want_logits).max()


def test_make_tiny_moe_llama4_runs_as_transformers_does(keys, tmp_path):
    """examples/make_tiny_moe.py's Llama 4 (bf16, one dense layer then MoE, NoPE every 2nd layer, chunks of 4 so
    the 8-token prompt spans two): verify-and-run's 16 greedy tokens equal transformers' on the same files."""
    import torch
    from transformers import AutoModelForCausalLM

    from examples.make_tiny_moe import make_checkpoint

    ck = make_checkpoint(tmp_path / "ck", "llama4", layers=4, dense_layers=1, attention_chunk_size=4,
                         nope_interval=2, vocab=300, max_position_embeddings=64)
    config = json.loads((ck / "config.json").read_text())
    assert config["no_rope_layers"] == [1, 0, 1, 0] and config["attention_chunk_size"] == 4
    ref = AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager", dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    cli("shardtool", "split", "-q", ck, tmp_path / "model", cwd=tmp_path)
    cli("shardtool", "sign", tmp_path / "model", "--key", keys / "k.key", cwd=tmp_path)
    r = cli("verify-and-run", tmp_path / "model", "--trust", keys / "k.pub", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--print-ids", "--temperature", "0", "--max-new-tokens", NEW, "--state-dir", tmp_path / "state", "-q",
            cwd=tmp_path)
    assert [int(x) for x in r.stdout.split()] == oracle.greedy(ref, PROMPT, NEW)


def test_llama4_multimodal_checkpoint_runs_its_language_model(keys, tmp_path):
    """A checkpoint in the published Llama4ForConditionalGeneration layout (config under text_config, tensors under
    language_model., a vision tower beside them), made from the text model's own weights: verify-and-run generates
    the text model's greedy tokens."""
    from safetensors.numpy import load_file, save_file

    ref = write_checkpoint(CASES["llama4"], tmp_path / "text", tmp_path / "ref")
    state = {}
    for f in (tmp_path / "text").glob("*.safetensors"):
        state.update(load_file(f))
    wrapped = {f"language_model.{k}": v for k, v in state.items()}
    wrapped["vision_model.patch_embedding.linear.weight"] = np.ones((8, 12), np.float32)
    wrapped["multi_modal_projector.linear_1.weight"] = np.ones((64, 8), np.float32)
    (tmp_path / "ck").mkdir()
    save_file(wrapped, tmp_path / "ck" / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps(
        {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": text,
         "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 8}, "tie_word_embeddings": False}))
    cli("shardtool", "split", "-q", tmp_path / "ck", tmp_path / "model", cwd=tmp_path)
    cli("shardtool", "sign", tmp_path / "model", "--key", keys / "k.key", cwd=tmp_path)
    assert (tmp_path / "model" / "trunk" / "extra.safetensors").exists()  # the vision tower, never read
    r = cli("verify-and-run", tmp_path / "model", "--trust", keys / "k.pub", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--print-ids", "--temperature", "0", "--max-new-tokens", NEW, "--state-dir", tmp_path / "state", "-q",
            cwd=tmp_path)
    assert [int(x) for x in r.stdout.split()] == oracle.greedy(ref, PROMPT, NEW)


def test_text_prompt_through_the_verified_tokenizer(keys, tmp_path):
    """--prompt with the model's tokenizer.json: same ids as the transformers tokenizer, same text out."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = oracle.build("qwen3_moe")
    hf.save_pretrained(tmp_path / "ck")
    vocab = {f"w{i}": i for i in range(hf.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "ck" / "tokenizer.json"))
    cli("shardtool", "split", "-q", tmp_path / "ck", tmp_path / "model", cwd=tmp_path)
    cli("shardtool", "sign", tmp_path / "model", "--key", keys / "k.key", cwd=tmp_path)

    prompt = "w3 w17 w200 w45 w9"
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "model" / "tokenizer.json"))
    ids = hf_tok(prompt)["input_ids"]
    assert ids == [3, 17, 200, 45, 9]
    r = cli("verify-and-run", tmp_path / "model", "--trust", keys / "k.pub", "--prompt", prompt,
            "--max-new-tokens", NEW, "--state-dir", tmp_path / "state", "-q", cwd=tmp_path)
    assert r.stdout == hf_tok.decode(oracle.greedy(hf, ids, NEW)) + "\n"


BATCH_PROMPTS = [PROMPT, [11, 4], [250, 31, 7, 90, 64, 12, 8, 3, 99, 101, 42, 17, 5], [60]]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3", "llama4", "gpt_oss-mxfp4"])
def test_requests_served_in_one_batch_each_match_transformers(name, keys, tmp_path):
    """Continuous batching (the engine `serve` runs): four prompts of different lengths prefilled and decoded
    in shared steps; each one's greedy tokens equal transformers' for that prompt alone."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import Engine, SamplingParams, TokenEvent

    ref = write_checkpoint(CASES[name], tmp_path / "ck", tmp_path / "ref")
    cli("shardtool", "split", "-q", tmp_path / "ck", tmp_path / "model", cwd=tmp_path)
    cli("shardtool", "sign", tmp_path / "model", "--key", keys / "k.key", cwd=tmp_path)
    verified = load_trusted_manifest(tmp_path / "model" / "manifest.msgpack", [load_public_key(keys / "k.pub")], 1,
                                     tmp_path / "state")
    engine = Engine(tmp_path / "model", verified, budget=1 << 30, max_batch=4, max_context=64)
    got: list[list[int]] = [[] for _ in BATCH_PROMPTS]
    try:
        tickets = [engine.submit(p, SamplingParams(NEW, stop_token_ids=()),
                                 lambda e, out=out: out.append(e.token) if isinstance(e, TokenEvent) else None)
                   for p, out in zip(BATCH_PROMPTS, got)]
        while not all(t.done for t in tickets):
            engine.step()
        assert engine.metrics()["step_sequences_total"] > engine.metrics()["steps_total"]
    finally:
        engine.close()
    for prompt, tokens in zip(BATCH_PROMPTS, got):
        assert tokens == oracle.greedy(ref, prompt, NEW), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_make_tiny_moe_gpt_oss_runs_like_transformers(mxfp4, keys, tmp_path):
    """examples/make_tiny_moe.py's gpt-oss (BF16, and with MXFP4 experts as released) as transformers loads it:
    split, signed and run by verify-and-run, its greedy tokens are transformers' (up to the config's EOS)."""
    import torch
    from transformers import AutoModelForCausalLM

    from examples import make_tiny_moe as mtm

    ck = mtm.make_checkpoint(tmp_path / "ck", "gpt_oss", layers=2, moe_intermediate=32, mxfp4=mxfp4)
    if mxfp4:
        ref = oracle.load_mxfp4(ck)
    else:
        ref = AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager", dtype=torch.float32).eval()
    cli("shardtool", "split", "-q", ck, tmp_path / "model", cwd=tmp_path)
    cli("shardtool", "sign", tmp_path / "model", "--key", keys / "k.key", cwd=tmp_path)
    assert ("U8" in stored_dtypes(tmp_path / "model")) == mxfp4
    r = cli("verify-and-run", tmp_path / "model", "--trust", keys / "k.pub", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--print-ids", "--max-new-tokens", NEW, "--state-dir", tmp_path / "state", "-q", cwd=tmp_path)
    want = oracle.greedy(ref, PROMPT, NEW)
    if mtm.EOS_ID in want:  # verify-and-run stops after the config's eos_token_id
        want = want[:want.index(mtm.EOS_ID) + 1]
    assert [int(x) for x in r.stdout.split()] == want
