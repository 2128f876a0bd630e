"""EleutherAI's lm-evaluation-harness, unchanged, against the real `shardtool serve` (`--model local-completions`,
the tokenizer from the model's signed directory) on a task whose data is a local file
(examples/lm_eval/tiny_cloze.yaml): the same accuracy and the same log-likelihoods (within 1e-4) as
`--model hf` on the same checkpoint. Both runs are the `lm_eval` command line, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_serve_e2e import MODEL_ID, Server, built  # noqa: F401  (the module fixture, reused)

pytestmark = pytest.mark.oracle
pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness (make oracle, or pip install -e '.[oracle,eval]')")
pytest.importorskip("torch", reason="lm_eval --model hf needs torch (pip install -e '.[oracle]')")
pytest.importorskip("transformers", reason="lm_eval --model hf needs transformers (pip install -e '.[oracle]')")

ROOT = Path(__file__).resolve().parents[2]
TASK = "shardtool_tiny_cloze"
LOGLIKELIHOOD_TOL = 1e-4


def lm_eval(out: Path, *args) -> dict:
    """`lm_eval ... --tasks TASK` from the repository root (the task names its data file from there), offline; the
    run's results and its samples."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(out / "hf-home"), "TOKENIZERS_PARALLELISM": "false"}
    command = [str(Path(sys.executable).parent / "lm_eval"), *args, "--tasks", TASK, "--include_path",
               "examples/lm_eval", "--batch_size", "1", "--output_path", str(out), "--log_samples"]
    r = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"lm_eval exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    samples = [json.loads(line) for p in out.rglob(f"samples_{TASK}_*.jsonl") for line in p.read_text().splitlines()]
    assert len(results) == 1 and samples, list(out.rglob("*"))
    return {"acc": results[0]["results"][TASK]["acc,none"],
            "loglikelihoods": {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}}


def test_lm_eval_against_serve_equals_lm_eval_on_the_checkpoint(built, tmp_path):  # noqa: F811
    server = Server(built, built.model, "--model-id", MODEL_ID, "--no-access-log", state="state-lm-eval")
    try:
        server.wait_listening()
        served = lm_eval(tmp_path / "served", "--model", "local-completions", "--model_args",
                         f"model={MODEL_ID},base_url={server.url}/v1/completions,tokenizer={built.model},"
                         f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=128")
    finally:
        assert server.stop() == 0, server.stderr()
    reference = lm_eval(tmp_path / "hf", "--model", "hf", "--model_args",
                        f"pretrained={built.work / 'model-hf'},dtype=float32", "--device", "cpu")
    assert served["acc"] == reference["acc"]
    assert served["loglikelihoods"].keys() == reference["loglikelihoods"].keys()
    assert len(served["loglikelihoods"]) == 16
    for doc, expected in reference["loglikelihoods"].items():
        got = served["loglikelihoods"][doc]
        assert len(got) == len(expected) == 4
        assert all(abs(g - e) <= LOGLIKELIHOOD_TOL for g, e in zip(got, expected)), (doc, got, expected)
