"""Held-out perplexity of a split demo model, computed by shardtool's verifying runtime (no torch).

The held-out documents are the ones `train_demo_moe.py` never trained on (one in twenty, by a hash of the name),
rebuilt from this interpreter's standard library; each is read from its start in windows of the trainer's
length, as the trainer measured it.

    python examples/heldout_perplexity.py demo/model --trust demo/publisher.pub --model-id demo/pydoc-moe
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository root

from examples import train_demo_moe  # noqa: E402


def log_softmax(logits: np.ndarray) -> np.ndarray:  # [T, V] -> [T, V]
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def heldout_ids(model, documents: int | None) -> list[list[int]]:
    _, held = train_demo_moe.build_corpus()
    texts = [t for name, t in held if not name.startswith("chat:")][:documents]
    bos, eos = train_demo_moe.BOS_ID, train_demo_moe.EOS_ID
    return [[bos] + model.encode(t) + [eos] for t in texts]


def perplexity(model, docs: list[list[int]], window: int) -> tuple[float, int]:
    """(exp of the mean next-token loss, tokens scored) through the runtime's prefill."""
    session = model.prepare(window + 1)
    total, count = 0.0, 0
    for ids in docs:
        for i in range(0, len(ids) - 1, window):
            chunk = ids[i:i + window + 1]
            logp = log_softmax(np.asarray(session.model.prefill(chunk[:-1])))  # [n, V]
            total -= float(logp[np.arange(len(chunk) - 1), chunk[1:]].sum())
            count += len(chunk) - 1
    return math.exp(total / count), count


def main(argv: list[str] | None = None) -> int:
    import shardtool

    ap = argparse.ArgumentParser(prog="heldout_perplexity.py", description=__doc__.splitlines()[0])
    ap.add_argument("directory", type=Path, help="the split, signed model")
    ap.add_argument("--trust", type=Path, required=True)
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--state-dir", type=Path)
    ap.add_argument("--documents", type=int, help="only the first N held-out documents (default: all)")
    args = ap.parse_args(argv)
    window = train_demo_moe.SIZES["demo"].seq
    with shardtool.open_model(args.directory, trust=[args.trust], model_id=args.model_id, state_dir=args.state_dir,
                              memory_budget="256MiB") as model:
        docs = heldout_ids(model, args.documents)
        ppl, n = perplexity(model, docs, window)
    print(f"held-out perplexity {ppl:.2f} over {n} tokens of {len(docs)} documents the model never trained on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
