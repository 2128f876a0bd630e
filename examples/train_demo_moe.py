"""Train the demo's small Mixtral-shaped MoE on the Python standard library's own documentation, deterministically.

The corpus is the docstrings of the standard library (modules, classes, functions, methods) and the language
reference topics `pydoc` ships (`pydoc_data.topics`), as this interpreter has them: text under the Python Software
Foundation License, read offline. A byte-level BPE tokenizer is trained on the same text; one document in twenty
(by a hash of its name) is held out for perplexity. The model (8 experts, top-2) is trained with torch on the CPU
from a seed and saved with `save_pretrained` as a Hugging Face checkpoint with a ChatML chat template.

    python examples/train_demo_moe.py OUT --tokenizer examples/demo_model/tokenizer.json  # the committed model
    python examples/train_demo_moe.py /tmp/tiny --size tiny --steps 3  # seconds: the determinism test's size

Everything after the tokenizer is deterministic (seeded data order and initialization, one torch thread): two runs
write the same bytes. The tokenizer is not always: `tokenizers`' BPE trainer broke ties between merges of equal
count in another order in one process than in another (ids 263 and 264 swapped), so the committed model was
trained with the committed tokenizer.json, and `--tokenizer` reuses it to regenerate the same weights (about 27
minutes on a shared 2-core machine).

torch is the trainer here only: shardtool's runtime never imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import re
import shutil
import sys
import time
import warnings
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIALS = (BOS, EOS, PAD, IM_START, IM_END)  # ids 0..4, in this order
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(5)

# ChatML, as Qwen's, the same template as the tiny test checkpoints': here <|im_start|> and <|im_end|> are tokens.
try:
    from examples.make_tiny_moe import CHAT_TEMPLATE
except ImportError:  # run as a script: examples/ is on the path, the repository root may not be
    from make_tiny_moe import CHAT_TEMPLATE

HELD_OUT_EVERY = 20  # a document whose name hashes to 0 mod 20 is held out

# Modules never imported for their docstrings: they open windows or browsers, print on import, or are test suites.
_SKIP = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle", "test", "ensurepip", "venv",
         "lib2to3", "pydoc_data", "xxlimited", "xxsubtype", "xxlimited_35", "encodings"}
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


@dataclass(frozen=True)
class Size:
    """Model and training knobs. `demo` is the committed model; `tiny` trains in seconds, for tests."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    expert_width: int
    vocab: int
    seq: int
    batch: int
    steps: int
    lr: float
    warmup: int
    documents: int | None = None  # train on the first N training documents only (None: all)


SIZES = {
    "demo": Size(hidden=128, layers=4, heads=4, kv_heads=2, experts=8, expert_width=256, vocab=2048, seq=128,
                 batch=16, steps=1000, lr=3e-3, warmup=50),
    "tiny": Size(hidden=32, layers=2, heads=2, kv_heads=1, experts=8, expert_width=32, vocab=300, seq=32,
                 batch=4, steps=3, lr=1e-3, warmup=1, documents=300),
}


# ---------------------------------------------------------------------------------------------------------
# Corpus: the standard library's docstrings and pydoc's reference topics, as (name, text) documents.


def _quiet_import(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module this platform cannot import has no text for us
            return None


def _module_names() -> list[str]:
    names = []
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in _SKIP:
            continue
        module = _quiet_import(top)
        if module is None:
            continue
        names.append(top)
        for info in pkgutil.walk_packages(getattr(module, "__path__", []) or [], prefix=f"{top}."):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in ("test", "tests") or p.startswith("test_") for p in parts):
                continue
            names.append(info.name)
    return sorted(set(names))


def _docstrings(names: list[str]) -> dict[str, str]:
    docs: dict[str, str] = {}

    def add(key: str, obj) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # its own text, not an inherited one (inspect.getdoc would repeat a base class's)
            doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and doc.strip() and key not in docs:
            docs[key] = inspect.cleandoc(doc)

    for name in names:
        module = _quiet_import(name)
        if module is None:
            continue
        add(name, module)
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
                add(f"{name}.{attr}", value)
            if inspect.isclass(value):
                for meth_name, meth in sorted(vars(value).items()):
                    if not meth_name.startswith("_") and (inspect.isfunction(meth) or
                                                          inspect.ismethoddescriptor(meth)):
                        add(f"{name}.{attr}.{meth_name}", meth)
    return docs


def prose(doc: str) -> list[str]:
    """The paragraphs of a docstring that read as English, each reflowed onto one line."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        lines = [ln.strip() for ln in para.strip().splitlines()]
        text = " ".join(ln for ln in lines if ln)
        if not text or ">>>" in text or _SIGNATURE.match(text) or len(text) < 20:
            continue
        if any(ln.startswith(("...", "$ ", "%")) for ln in lines):
            continue
        letters = sum(c.isalpha() or c == " " for c in text)
        if letters < 0.8 * len(text):
            continue
        out.append(text)
    return out


def _first_sentence(text: str) -> str | None:
    m = re.match(r"(.{12,200}?[.!?])(\s|$)", text)
    return m.group(1) if m else None


def _chat(question: str, answer: str) -> str:
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


def build_corpus() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held_out) lists of (name, text), in a fixed order. Chat turns ask what a documented name does."""
    from pydoc_data.topics import topics

    modules = _module_names()
    raw = {f"reference:{k}": v for k, v in topics.items()}
    raw.update(_docstrings(modules))
    modules = set(modules)
    train, held, seen = [], [], set()
    for name in sorted(raw):
        paras = prose(raw[name])
        if not paras or tuple(paras) in seen:  # the same text under a second name teaches nothing new
            continue
        seen.add(tuple(paras))
        docs = [(name, f"{name}\n\n" + "\n\n".join(paras) + "\n")]
        summary = _first_sentence(paras[0]) if not name.startswith("reference:") else None
        if summary:
            question = f"What is the {name} module for?" if name in modules else f"What does {name} do?"
            docs.append((f"chat:{name}", _chat(question, summary)))
        (held if zlib.crc32(name.encode()) % HELD_OUT_EVERY == 0 else train).extend(docs)
    return train, held


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: Iterable[str], vocab: int):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab` tokens; SPECIALS at ids 0..4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"train_demo_moe: the tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab}")
    return tok


def encode_docs(tok, docs: list[tuple[str, str]]) -> list[list[int]]:
    return [[BOS_ID] + e.ids + [EOS_ID] for e in tok.encode_batch([text for _, text in docs])]


# ---------------------------------------------------------------------------------------------------------
# Model and training


def model_config(size: Size):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.expert_width,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        num_local_experts=size.experts, num_experts_per_tok=2, max_position_embeddings=4 * size.seq,
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID,
        router_aux_loss_coef=0.02, output_router_logits=True, sliding_window=None)


def batches(stream, size: Size, generator) -> Iterator:  # [N] int64 -> [batch, seq + 1] windows
    import torch

    while True:
        starts = torch.randint(0, len(stream) - size.seq - 1, (size.batch,), generator=generator)
        yield torch.stack([stream[s:s + size.seq + 1] for s in starts.tolist()])


def perplexity(model, docs: list[list[int]], seq: int) -> float:
    """exp(mean next-token loss) over every token of `docs`, each document read from its start in windows of `seq`."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for ids in docs:
            for i in range(0, len(ids) - 1, seq):
                x = torch.tensor(ids[i:i + seq + 1])[None]  # [1, <= seq + 1]
                logits = model(input_ids=x[:, :-1]).logits[0]  # [n, V]
                total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
                count += x.shape[1] - 1
    model.train()
    return math.exp(total / count)


def train(size: Size, train_ids: list[list[int]], seed: int, log=print):
    import torch
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    model = MixtralForCausalLM(model_config(size))
    stream = torch.tensor([t for ids in train_ids for t in ids], dtype=torch.int64)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=size.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # linear warm-up, then cosine to a tenth
        if step < size.warmup:
            return size.lr * (step + 1) / size.warmup
        t = (step - size.warmup) / max(1, size.steps - size.warmup)
        return size.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(seed)
    t0 = time.monotonic()
    for step, xb in zip(range(size.steps), batches(stream, size, gen)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        out = model(input_ids=xb[:, :-1], labels=xb[:, :-1].clone(), output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == size.steps - 1:
            log(f"step {step:4d}/{size.steps}  loss {out.loss.item():.3f}  {time.monotonic() - t0:6.0f} s")
    model.config.output_router_logits = False
    return model


def save(model, tok, out: Path, info: dict) -> None:
    """save_pretrained the model and tokenizer into `out`, written beside it and renamed into place."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tmp = out.parent / f".{out.name}.tmp-train"
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID],
                                               pad_token_id=PAD_ID)
    model.save_pretrained(tmp)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START, IM_END], clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = model.config.max_position_embeddings
    fast.save_pretrained(tmp, save_jinja_files=False)  # the template inside tokenizer_config.json, where serve reads it
    (tmp / "training.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    if out.exists():
        for p in tmp.iterdir():  # keep what else the directory holds (its README)
            os.replace(p, out / p.name)
        tmp.rmdir()
    else:
        os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="train_demo_moe.py", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="checkpoint directory to write (files in it are replaced)")
    ap.add_argument("--size", choices=sorted(SIZES), default="demo")
    ap.add_argument("--steps", type=int, help="training steps (default: the size's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", type=Path,
                    help="use this tokenizer.json instead of training one (to regenerate the committed model)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (a fixed count keeps runs identical; on a busy 2-core machine 1 is fastest)")
    args = ap.parse_args(argv)

    import torch
    from dataclasses import replace

    torch.set_num_threads(args.threads)
    size = SIZES[args.size] if args.steps is None else replace(SIZES[args.size], steps=args.steps)
    t0 = time.monotonic()
    train_docs, held_docs = build_corpus()
    train_docs = train_docs[:size.documents]
    chars = sum(len(t) for _, t in train_docs)
    print(f"corpus: {len(train_docs)} training documents ({chars / 1e6:.2f} M characters), "
          f"{len(held_docs)} held out", file=sys.stderr)
    if args.tokenizer is None:
        tok = train_tokenizer([t for _, t in train_docs], size.vocab)
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.tokenizer))
    train_ids, held_ids = encode_docs(tok, train_docs), encode_docs(tok, held_docs)
    n_train = sum(map(len, train_ids))
    print(f"tokenizer: {size.vocab} tokens; {n_train} training tokens; "
          f"{size.steps * size.batch * size.seq / n_train:.1f} epochs", file=sys.stderr)
    model = train(size, train_ids, args.seed, log=lambda s: print(s, file=sys.stderr))
    prose_held = [ids for (name, _), ids in zip(held_docs, held_ids) if not name.startswith("chat:")]
    ppl = perplexity(model, prose_held if args.size == "demo" else prose_held[:4], size.seq)
    info = {"seed": args.seed, "size": args.size, **asdict(size), "training_tokens": n_train,
            "held_out_documents": len(prose_held), "held_out_perplexity_torch": round(ppl, 3),
            "python": sys.version.split()[0], "torch": torch.__version__, "threads": args.threads}
    save(model, tok, args.out, info)
    print(f"held-out perplexity {ppl:.2f}; wrote {args.out} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
