"""Quality of bf16, `split --quantize int8|int4` and llama.cpp's Q8_0 / Q4_0 against the float model.

Default: the trained demo model (examples/demo_model, examples/train_demo_moe.py). Its held-out text (the
documents it never trained on, in the trainer's windows of 128 tokens) is scored, teacher-forced, by each
variant: a bf16 copy of the checkpoint, int8 and int4 experts, int8 experts and trunk (`--quantize int8
--quantize-trunk`; the split refuses int4 for the trunk and the row says so), each split, signed with a
throw-away key and run through the verifying runtime; and llama.cpp's own converter (F32 GGUF), quantizer
(Q8_0, Q4_0: the whole model, llama.cpp's choice of which tensors to keep) and logits (benchmarks/_llamacpp.py),
where .venv-bench has it built. Per variant: held-out perplexity, and top-1 agreement with the float split
(positions whose argmax equals the float model's).

`--random`: the generated random-weight families (examples/make_tiny_moe.py), the float model's greedy
continuation of an 8-token prompt fed back teacher-forced. Their logits are near-flat, so agreement there says
which families each format runs on, not how good it is; logit error = |logits_q - logits_float| / max|logits_float|.

    python benchmarks/bench_quant_quality.py [--documents N] [--no-llamacpp] [--json]
    python benchmarks/bench_quant_quality.py --random [--size small|tiny] [--families mixtral,...] [--tokens 128]
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


# --- the trained demo model: held-out text, not a greedy continuation --------------------------------------------

DEMO_MODEL = REPO / "examples" / "demo_model"
TRAINED = ("float", "bf16", "int8", "int4", "int8-trunk", "int4-trunk")
LLAMACPP = ("Q8_0", "Q4_0")


@dataclass(frozen=True)
class HeldOut:
    variant: str
    perplexity: float | None   # None: not run
    agree: int                 # held-out positions whose top-1 equals the float model's
    positions: int
    note: str = ""

    def row(self) -> str:
        if self.perplexity is None:
            return f"{self.variant:18s} not run: {self.note}"
        return (f"{self.variant:18s} ppl {self.perplexity:7.3f}  top-1 = float {self.agree}/{self.positions} "
                f"({100 * self.agree / self.positions:.2f} %)" + (f"  {self.note}" if self.note else ""))


def heldout_windows(model_dir: Path, documents: int | None) -> list[list[int]]:
    """The first `documents` held-out documents (never trained on) as the trainer's windows of seq + 1 ids."""
    from tokenizers import Tokenizer

    from examples import train_demo_moe

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _, held = train_demo_moe.build_corpus()
    docs = [[train_demo_moe.BOS_ID] + tok.encode(t).ids + [train_demo_moe.EOS_ID]
            for name, t in held if not name.startswith("chat:")][:documents]
    seq = train_demo_moe.SIZES["demo"].seq
    return [ids[i:i + seq + 1] for ids in docs for i in range(0, len(ids) - 1, seq)]


def _bf16_checkpoint(ck: Path, out: Path) -> Path:
    """A copy of the checkpoint with every floating tensor rounded to bfloat16 (what a bf16 release ships)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(ck, out)
    for f in out.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()}, f,
                  metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _scores(model, windows: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(argmax, next-id log-probability) per window through the runtime's prefill."""
    from examples.heldout_perplexity import log_softmax

    top, logp = [], []
    for ids in windows:
        z = log_softmax(np.asarray(model.prefill(ids[:-1])))  # [n, V]
        top.append(z.argmax(axis=-1))
        logp.append(z[np.arange(len(ids) - 1), ids[1:]])
    return top, logp


def _held_out(variant: str, ref_top: np.ndarray, top: np.ndarray, logp: np.ndarray, note: str = "") -> HeldOut:
    return HeldOut(variant, float(np.exp(-logp.mean())), int((top == ref_top).sum()), len(ref_top), note)


def measure_trained(model_dir: Path, work: Path, documents: int | None, variants=TRAINED, llamacpp=LLAMACPP,
                    log=lambda row: None) -> list[HeldOut]:
    """Held-out perplexity and top-1 agreement with the float split, for each of our variants (through the
    verifying runtime) and each llama.cpp type (its converter, quantizer and logits)."""
    from shardtool.keys import generate

    key, state = generate(), work / "state"
    windows = heldout_windows(model_dir, documents)
    rows, ref_top = [], None
    for variant in variants:
        ck = model_dir
        if variant == "bf16":
            ck = _bf16_checkpoint(model_dir, work / "bf16-hf")
        try:
            s = _signed_model(ck, work / variant, None if variant in ("float", "bf16") else variant, key,
                              state / variant)
        except Exception as e:  # noqa: BLE001 - a variant split refuses (e.g. a trunk format it lacks): say so
            rows.append(HeldOut(variant, None, 0, 0, f"{type(e).__name__}: {e}"[:200]))
            log(rows[-1])
            continue
        try:
            top, logp = (np.concatenate(a) for a in _scores(s.model, windows))
        finally:
            s.close()
        if ref_top is None:
            ref_top = top
        rows.append(_held_out(variant, ref_top, top, logp))
        log(rows[-1])
    if llamacpp:
        from benchmarks import _llamacpp

        why = _llamacpp.available().reason
        if why:
            rows += [HeldOut(f"llama.cpp {t}", None, 0, 0, why) for t in llamacpp]
            return rows
        f32 = _llamacpp.convert(model_dir, "f32", work / "f32.gguf")
        for t in ("F32", *llamacpp):
            gguf = f32 if t == "F32" else _llamacpp.quantize(f32, work / f"{t}.gguf", t)
            got = _llamacpp.score(gguf, windows, work)
            top, logp = np.concatenate(got["argmax"]), np.concatenate(got["logprob"])
            rows.append(_held_out(f"llama.cpp {t}", ref_top, top, logp))
            log(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", action="store_true",
                    help="the generated random-weight families instead (a coverage check: which families each "
                         "format runs on; their agreement is not a quality figure)")
    ap.add_argument("--documents", type=int, help="only the first N held-out documents of the trained model")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    if not args.random:
        with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
            found = measure_trained(DEMO_MODEL, Path(tmp), args.documents, llamacpp=() if args.no_llamacpp else LLAMACPP,
                                    log=(lambda r: None) if args.json else (lambda r: print(r.row(), flush=True)))
        if args.json:
            print(json.dumps([r.__dict__ for r in found], indent=1))
        return 0
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
