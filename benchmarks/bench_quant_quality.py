"""Quality of `split --quantize int8|int4` against the float model, per generated family.

For each family: a checkpoint from examples/make_tiny_moe.py is split four ways (float, int8, int4 experts, and
int8 experts and trunk: `--quantize int8 --quantize-trunk`), signed with
a throw-away key and opened through the verifying runtime (`Session.model`: the forward pass over the verified
store). The float model's greedy continuation of an 8-token prompt (128 tokens) is fed, teacher-forced, to each
in one prefill; per position we compare the next-token logits with the float model's:

- top-1 agreement: positions whose argmax equals the float model's (out of 128);
- logit error: |logits_q - logits_float| / max|logits_float|, max and mean over positions of each position's max.

These random models are near-flat (top logits close together), which makes top-1 agreement a harsh measure:
llama.cpp's Q8_0 agreed on 113/128 teacher-forced on the "small" Mixtral below.

    python benchmarks/bench_quant_quality.py [--size small|tiny] [--families mixtral,qwen3_moe,...] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "olmoe", "qwen2_moe", "llama4", "gpt_oss")
METHODS = ("int8", "int4", "int8-trunk")  # int8-trunk: --quantize int8 --quantize-trunk (trunk linear weights too)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# "small" is the 54 M-parameter f32 Mixtral layout of the llama.cpp comparison (issue 16); "tiny" is for tests.
SIZES = {
    "small": dict(layers=4, experts=8, hidden=512, moe_intermediate=1024, heads=8, kv_heads=2, vocab=1024,
                  dtype="f32"),
    "tiny": dict(layers=2, experts=4, hidden=64, moe_intermediate=128, heads=4, kv_heads=2, vocab=512, dtype="f32"),
}


@dataclass(frozen=True)
class Quality:
    family: str
    method: str
    agree: int | None          # positions whose top-1 equals the float model's; None: the runtime refused
    positions: int
    max_rel_err: float
    mean_rel_err: float
    note: str = ""

    def row(self) -> str:
        if self.agree is None:
            return f"{self.family:12s} {self.method:10s}  not run: {self.note}"
        return (f"{self.family:12s} {self.method:10s} {self.agree:4d}/{self.positions}  "
                f"max {self.max_rel_err:.4f}  mean {self.mean_rel_err:.4f}" + (f"  {self.note}" if self.note else ""))


def _signed_model(ck: Path, out: Path, quantize: str | None, key, state: Path):
    """(Session over the signed split, closer) for one variant of the checkpoint."""
    from shardtool.checkpoint import split_checkpoint
    from shardtool.manifest import load_manifest, load_trusted_manifest, save_manifest
    from shardtool.runtime.engine._session import Session

    method, trunk = (quantize.removesuffix("-trunk"), quantize.endswith("-trunk")) if quantize else (None, False)
    split_checkpoint(ck, out, model_id="bench/quant", quantize=method, quantize_trunk=trunk)
    m = load_manifest(out / "manifest.msgpack")
    save_manifest(out / "manifest.msgpack", m.with_envelope(m.envelope.signed_by(key)))
    verified = load_trusted_manifest(out / "manifest.msgpack", [key.public], 1, state / (quantize or "float"))
    return Session(out, verified, budget=1 << 31, max_tokens=len(PROMPT) + 256)


def _dequantized_split(quantized: Path, out: Path, key, state: Path):
    """A copy of a quantized split whose block-quantized expert projections are expanded back to float32 (the
    values the quantized model computes with), re-signed: the format's quality for a family whose runtime does
    not take block-quantized experts yet."""
    import shutil
    from dataclasses import replace

    import blake3
    from safetensors.numpy import save

    from shardtool import blockquant, formats
    from shardtool.manifest import build_manifest, load_manifest, load_trusted_manifest, save_manifest
    from shardtool.runtime.engine._session import Session

    shutil.copytree(quantized, out)
    m = load_manifest(out / "manifest.msgpack")
    entries = []
    for e in m.entries:
        if e.kind == "expert":
            t = _tensors(out / e.path)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                d = t.pop(f"{proj}.{formats.INT8.scale}", None)
                if d is None:
                    continue
                q4 = t.pop(f"{proj}.{formats.INT4.data}", None)
                t[f"{proj}.weight"] = (blockquant.dequantize_q4(q4, d) if q4 is not None
                                       else blockquant.dequantize_q8(t[f"{proj}.weight"], d))
            data = save(t)
            (out / e.path).write_bytes(data)
            e = replace(e, size=len(data), digest=blake3.blake3(data).digest())
        entries.append(e)
    new = build_manifest(entries, model_id=m.head.model_id, version=m.head.version, contract=m.head.contract)
    save_manifest(out / "manifest.msgpack", new.with_envelope(new.envelope.signed_by(key)))
    verified = load_trusted_manifest(out / "manifest.msgpack", [key.public], 1, state / out.name)
    return Session(out, verified, budget=1 << 31, max_tokens=len(PROMPT) + 256)


def _tensors(path: Path) -> dict[str, np.ndarray]:
    import safetensors

    from shardtool.safetensors_format import numpy_dtype

    return {name: np.frombuffer(t["data"], numpy_dtype(t["dtype"])).reshape(t["shape"])
            for name, t in safetensors.deserialize(path.read_bytes())}


def greedy(model, prompt: list[int], n: int) -> list[int]:
    logits = model.prefill(prompt, last_only=True)[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode(out[-1])
    return out


def teacher_forced(model, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """# -> logits [len(continuation), V]: the predictions of each continuation token, in one prefill"""
    logits = model.prefill(prompt + continuation[:-1])
    return np.asarray(logits[len(prompt) - 1:], np.float64)


def measure(family: str, knobs: dict, work: Path, tokens: int = 128,
            methods: tuple[str, ...] = METHODS, simulate: bool = True) -> list[Quality]:
    """Quality of each method against the float model. `simulate`: where the runtime refuses the quantized split,
    measure its experts expanded back to float32 instead (said in the row's note); else report it not run."""
    from examples import make_tiny_moe
    from shardtool.keys import generate

    key = generate()
    ck = make_tiny_moe.make_checkpoint(work / f"{family}-hf", family, **knobs)
    state = work / f"{family}-state"
    sessions = []
    try:
        ref = _signed_model(ck, work / f"{family}-float", None, key, state)
        sessions.append(ref)
        continuation = greedy(ref.model, PROMPT, tokens)
        want = teacher_forced(ref.model, PROMPT, continuation)
        top = want.argmax(axis=-1)
        scale = np.abs(want).max(axis=-1)
        results = []
        for method in methods:
            note = ""
            s = _signed_model(ck, work / f"{family}-{method}", method, key, state)
            sessions.append(s)
            try:
                got = teacher_forced(s.model, PROMPT, continuation)
            except Exception as e:  # noqa: BLE001 - the runtime refuses: measure the format itself instead
                if not simulate:
                    results.append(Quality(family, method, None, tokens, float("nan"), float("nan"),
                                           f"{type(e).__name__}: {e}"[:160]))
                    continue
                note = f"simulated (expanded to float32; the runtime refused: {type(e).__name__})"
                s = _dequantized_split(work / f"{family}-{method}", work / f"{family}-{method}-f32", key, state)
                sessions.append(s)
                got = teacher_forced(s.model, PROMPT, continuation)
            err = np.abs(got - want).max(axis=-1) / scale
            results.append(Quality(family, method, int((got.argmax(axis=-1) == top).sum()), tokens,
                                   float(err.max()), float(err.mean()), note))
        return results
    finally:
        for s in sessions:
            s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}")
    rows: list[Quality] = []
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        for family in families:
            found = measure(family, SIZES[args.size], Path(tmp), args.tokens)
            rows += found
            if not args.json:
                for q in found:
                    print(q.row(), flush=True)
    if args.json:
        print(json.dumps([q.__dict__ for q in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
