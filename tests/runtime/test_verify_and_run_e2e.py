"""The installed `verify-and-run` command on a tiny generated, split and signed Mixtral: output, sampling
flags, the JSON report, and every way a run must stop (exit 1: untrustworthy; exit 2: usage)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest

from shardtool.keys import load_private_key
from shardtool.manifest import build_manifest, load_manifest, save_manifest
from shardtool.runtime import DEFAULT_CACHE_POLICY, encode_prompt

from _budgets import budget_for_top_k_plus
from _republish import republish
from _kit import cli
from _kit.cli import BIN, Result
from examples.make_tiny_moe import make_checkpoint

PROMPT = "Hi"
NEW = 24


def run(*args, program: str = "verify-and-run", cwd: Path | None = None, timeout: int = 120) -> Result:
    """`verify-and-run args...` (or `program`) through the suite's runner, XDG state in `cwd`."""
    return cli.run(program, *args, cwd=cwd, state=cwd or Path.cwd(), timeout=timeout)


def ok(*args, program: str = "verify-and-run", cwd: Path | None = None, timeout: int = 120) -> Result:
    return cli.ok(program, *args, cwd=cwd, state=cwd or Path.cwd(), timeout=timeout)


@dataclass
class Built:
    work: Path
    model: Path  # split, signed by key `a`
    first_use: dict[tuple[int, int], int]  # (layer, expert) -> tokens already printed when it is first read
    greedy: list[int]  # in-process greedy tokens for PROMPT
    num_experts: int
    num_layers: int


def _trace(model: Path, pub: Path, state: Path) -> tuple[dict, list[int], int, int]:
    """Run the same Session in-process and note when each expert is first read (tokens printed by then)."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime.engine._session import Session

    verified = load_trusted_manifest(model / "manifest.msgpack", [load_public_key(pub)], 1, state)
    session = Session(model, verified, budget=1 << 30, max_tokens=64)
    printed: list[int] = []
    first: dict[tuple[int, int], int] = {}
    real = session.weights.experts

    def experts(layer, ids):
        for e in ids:
            first.setdefault((layer, e), len(printed))
        return real(layer, ids)

    session.weights.experts = experts
    try:
        session.generate(encode_prompt(session.tokenizer, PROMPT), NEW, temperature=0.0, top_p=1.0, seed=None, on_token=printed.append)
    finally:
        session.close()
    return first, printed, session.config.num_experts, session.config.num_layers


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    if not (BIN / "verify-and-run").exists():
        pytest.fail(f"the verify-and-run console script is not installed next to {sys.executable}; run `make install`")
    work = tmp_path_factory.mktemp("var")
    make_checkpoint(work / "ck", "mixtral", experts=16, layers=2)
    ok("split", "-q", work / "ck", work / "model", "--model-id", "test/tiny-mixtral", "--version", "3",
       program="shardtool", cwd=work)
    for name in ("a", "b"):
        ok("keygen", "--out", name, "--no-passphrase", program="shardtool", cwd=work)
    ok("sign", work / "model", "--key", "a.key", program="shardtool", cwd=work)
    first, greedy, experts, layers = _trace(work / "model", work / "a.pub", work / "trace-state")
    return Built(work, work / "model", first, greedy, experts, layers)


@pytest.fixture
def copy(built, tmp_path) -> Path:
    """A private copy of the signed model, for tests that change it."""
    return Path(shutil.copytree(built.model, tmp_path / "model"))


def var(built, model: Path, *args, state: Path | None = None, trust=("a",)) -> Result:
    keys = [x for k in trust for x in ("--trust", built.work / f"{k}.pub")]
    return run(model, *keys, "--state-dir", state or model.parent / "state", *args, cwd=model.parent)


def expert_rel(layer: int, expert: int) -> str:
    return f"experts/layer-{layer:03d}/expert-{expert:04d}.safetensors"


def flip(path: Path, offset: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def one_error_line(r: Result) -> str:
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{r.err}"
    assert "Traceback" not in r.err
    return lines[0]


# --- normal runs ---------------------------------------------------------------------------------------

def test_text_streams_to_stdout_and_report_to_stderr(built, tmp_path):
    from tokenizers import Tokenizer

    r = var(built, built.model, "--prompt", PROMPT, "--max-new-tokens", NEW, state=tmp_path)
    assert r.code == 0, r.err
    tok = Tokenizer.from_file(str(built.model / "tokenizer.json"))
    assert r.out == tok.decode(built.greedy, skip_special_tokens=True) + "\n"
    assert "verify-and-run: test/tiny-mixtral v3" in r.err and f"cache ({DEFAULT_CACHE_POLICY}): " in r.err and "peak RSS" in r.err


def test_greedy_print_ids_is_deterministic(built, tmp_path):
    args = ("--prompt", PROMPT, "--max-new-tokens", NEW, "--print-ids", "--temperature", "0", "-q")
    first, second = (var(built, built.model, *args, state=tmp_path) for _ in range(2))
    assert first.code == second.code == 0 and first.err == second.err == ""
    assert first.out == second.out == " ".join(map(str, built.greedy)) + "\n"
    assert len(built.greedy) == NEW  # no early EOS: the tampering tests below rely on a full run


def test_seeded_sampling_is_reproducible(built, tmp_path):
    def sample(seed):
        r = var(built, built.model, "--prompt", PROMPT, "--max-new-tokens", NEW, "--print-ids", "--temperature", "1.0",
                "--top-p", "0.95", "--seed", seed, "-q", state=tmp_path)
        assert r.code == 0, r.err
        return r.ids

    a, again, other = sample(7), sample(7), sample(8)
    assert a == again
    assert a != other and a != built.greedy


def test_json_report_has_the_documented_fields(built, tmp_path):
    report = tmp_path / "report.json"
    r = var(built, built.model, "--prompt", PROMPT, "--max-new-tokens", NEW, "--print-ids", "--json-report", report,
            state=tmp_path)
    assert r.code == 0, r.err
    s = json.loads(report.read_text())
    assert s["generated_ids"] == r.ids == built.greedy
    head = (s["model_id"], s["manifest_version"], s["prompt_tokens"], s["new_tokens"])
    assert head == ("test/tiny-mixtral", 3, 2, NEW)
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "bytes_read_per_token", "peak_rss_bytes",
                "decode_expert_bytes_per_token", "contract_expert_bytes_per_token_cold", "verify_share_of_time"):
        assert isinstance(s[key], (int, float)) and s[key] > 0, key
    assert set(s["per_token_seconds"]) == {"read", "verify", "compute", "waiting_for_shards"}
    assert {"read_thread", "verify_thread", "read_thread_cpu", "verify_thread_cpu"} <= set(s["seconds"])
    assert all(v >= 0 for v in s["per_token_seconds"].values())
    assert {"hits", "misses", "evictions"} <= set(s["cache"])
    # Big budget: every file the run touched was read exactly once.
    model_bytes = {p.relative_to(built.model).as_posix(): p.stat().st_size for p in built.model.rglob("*.safetensors")}
    used = len({k for k in built.first_use}) + sum(1 for p in model_bytes if p.startswith("trunk/"))
    assert s["lookahead"]["enabled"] is False and s["lookahead"]["prefetched"] == 0  # off unless --lookahead
    assert s["cache"]["misses"] == used and s["cache"]["evictions"] == 0
    assert s["bytes_read"] <= sum(model_bytes.values())
    assert s["peak_rss_bytes"] < 1 << 30


def _budget_for_top_k_plus(built, extra: int) -> int:
    return budget_for_top_k_plus(built.model, built.work / "a.pub", 2 + NEW, extra)


def test_budget_hint_is_enough_and_a_minimal_budget_evicts_yet_gives_the_same_tokens(built, tmp_path):
    args = ("--prompt", PROMPT, "--max-new-tokens", NEW, "--print-ids", "-q")
    too_small = var(built, built.model, *args, "--memory-budget", "1MiB", state=tmp_path)
    assert too_small.code == 2
    mib = int(re.search(r"raise --memory-budget to at least (\d+)MiB", too_small.err)[1])
    assert var(built, built.model, *args, "--memory-budget", f"{mib}MiB", state=tmp_path).code == 0

    # The smallest budget the plan accepts leaves the shard cache room for top-k + 1 shards only.
    budget = _budget_for_top_k_plus(built, 1)
    report = tmp_path / "report.json"
    r = var(built, built.model, *args, "--memory-budget", budget, "--json-report", report, state=tmp_path)
    assert r.code == 0, r.err
    assert r.ids == built.greedy
    s = json.loads(report.read_text())
    assert s["budget"]["total"] == budget and s["cache"]["evictions"] > 0
    assert s["cache"]["peak_cached_bytes"] <= s["budget"]["shard_cache"]


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-da"])
def test_cache_policy_option_under_a_budget_that_evicts(built, tmp_path, policy):
    budget = _budget_for_top_k_plus(built, 3)
    report = tmp_path / "report.json"
    r = var(built, built.model, "--prompt", PROMPT, "--max-new-tokens", NEW, "--print-ids", "--memory-budget", budget,
            "--cache-policy", policy, "--json-report", report, state=tmp_path)
    assert r.code == 0, r.err
    assert r.ids == built.greedy  # the policy changes what is read again, never what is computed
    assert f"cache ({policy}): " in r.err
    s = json.loads(report.read_text())
    assert s["cache"]["policy"] == policy and s["cache"]["evictions"] > 0
    assert s["cache"]["peak_cached_bytes"] <= s["budget"]["shard_cache"]


@pytest.mark.parametrize("mode, streamed, expected", [("auto", False, "keep"), ("auto", True, "drop"),
                                                     ("keep", True, "keep"), ("drop", False, "drop"),
                                                     ("direct", True, "direct")])
def test_page_cache_option_and_its_automatic_choice(built, tmp_path, mode, streamed, expected):
    """auto keeps the pages of a model the shard cache holds whole and drops those of a model it streams; the other
    modes are taken as given; none changes a token."""
    budget = _budget_for_top_k_plus(built, 1) if streamed else "1GiB"
    report = tmp_path / "report.json"
    r = var(built, built.model, "--prompt", PROMPT, "--max-new-tokens", NEW, "--print-ids", "--memory-budget", budget,
            "--page-cache", mode, "--json-report", report, state=tmp_path)
    assert r.code == 0, r.err
    assert r.ids == built.greedy
    s = json.loads(report.read_text())
    assert s["cache"]["page_cache"] == expected
    assert (s["cache"]["evictions"] > 0) == streamed


# --- a tampered shard stops the run at once, and nothing computed from it is printed ---------------------

def _latest_first_use(built) -> tuple[tuple[int, int], int]:
    (layer, expert), printed = max(built.first_use.items(), key=lambda kv: kv[1])
    assert printed >= 2, "the prompt should bring in a new expert only after some tokens were printed"
    return (layer, expert), printed


@pytest.mark.parametrize("mode", ["ids", "text"])
def test_tampered_expert_in_use_stops_the_run_before_its_token(built, copy, mode):
    (layer, expert), printed = _latest_first_use(built)
    rel = expert_rel(layer, expert)
    expected = next(e for e in load_manifest(copy / "manifest.msgpack").entries if e.path == rel).digest.hex()
    flip(copy / rel)
    actual = blake3.blake3((copy / rel).read_bytes()).hexdigest()
    r = var(built, copy, "--prompt", PROMPT, "--max-new-tokens", NEW, "-q", *(["--print-ids"] if mode == "ids" else []))
    assert r.code == 1
    line = one_error_line(r)
    assert rel in line and expected in line and actual in line and "DigestMismatchError" in line
    # The tokens computed before the expert was needed stream out; the token that needed it never does.
    if mode == "ids":
        assert r.out == " ".join(map(str, built.greedy[:printed]))
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(copy / "tokenizer.json"))
        before = tok.decode(built.greedy[:printed], skip_special_tokens=True)
        # Text is held back only while it ends inside a UTF-8 character.
        assert r.out == before if not before.endswith("\ufffd") else before.startswith(r.out)


def test_truncated_expert_names_sizes(built, copy):
    (layer, expert), _ = _latest_first_use(built)
    rel = expert_rel(layer, expert)
    size = (copy / rel).stat().st_size
    (copy / rel).write_bytes((copy / rel).read_bytes()[:-10])
    r = var(built, copy, "--prompt", PROMPT, "--max-new-tokens", NEW, "-q")
    assert r.code == 1
    line = one_error_line(r)
    assert rel in line and str(size) in line and str(size - 10) in line


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_tampered_config_or_tokenizer_stops_before_any_output(built, copy, name):
    data = (copy / name).read_text()
    (copy / name).write_text(data.replace('"', "'", 1) if name == "tokenizer.json" else data.replace("64", "65", 1))
    for prompt in (("--prompt", PROMPT), ("--prompt-ids", "5,6,7")):
        r = var(built, copy, *prompt, "--max-new-tokens", 4)
        assert r.code == 1 and r.out == ""
        line = one_error_line(r)
        assert name in line and "DigestMismatchError" in line


def test_verify_all_first_catches_an_expert_the_prompt_never_uses(built, copy):
    unused = [(layer, e) for layer in range(built.num_layers) for e in range(built.num_experts)
              if (layer, e) not in built.first_use]
    assert unused
    rel = expert_rel(*unused[0])
    flip(copy / rel)
    lazy = var(built, copy, "--prompt", PROMPT, "--max-new-tokens", NEW, "--print-ids", "-q")
    assert lazy.code == 0 and lazy.ids == built.greedy  # never read, so never noticed
    eager = var(built, copy, "--prompt", PROMPT, "--max-new-tokens", NEW, "--print-ids", "-q", "--verify-all-first")
    assert eager.code == 1 and eager.out == ""
    assert rel in one_error_line(eager)


def _rename_gate(data: bytes) -> bytes:
    return data.replace(b'"gate_proj.weight"', b'"gate_proj.weighx"', 1)  # same length: offsets unchanged


def _unknown_family(data: bytes) -> bytes:
    return data.replace(b'"mixtral"', b'"mixtralx"', 1)


SIGNED_BUT_UNUSABLE = {  # name: (file (None: an expert the prompt uses), rewrite, error class, message)
    "expert lacks a tensor": (None, _rename_gate, "ShardFormatError", "missing tensor gate_proj.weight"),
    "config names an unknown family": ("config.json", _unknown_family, "VerificationError", "signed config.json"),
}


@pytest.mark.parametrize("case", sorted(SIGNED_BUT_UNUSABLE))
def test_signed_but_unusable_model_is_refused_with_exit_1(built, copy, case):
    # The publisher really signed these bytes, so they verify; the runtime must still refuse them as a
    # verification failure (the signed model is unusable), not as a usage error.
    rel, rewrite, error, message = SIGNED_BUT_UNUSABLE[case]
    if rel is None:
        rel = expert_rel(*min(key for key, printed in built.first_use.items() if printed == 0))
    republish(copy, rel, rewrite((copy / rel).read_bytes()), built.work / "a.key")
    r = var(built, copy, "--prompt", PROMPT, "--max-new-tokens", 4)
    assert r.code == 1 and r.out == ""
    line = one_error_line(r)
    assert f"[{error}]" in line and message in line


# --- the manifest itself: trust, signatures, freshness, rollback ----------------------------------------

def _resign(built, model: Path, *, version: int, now: int | None = None, expires_in_days: int = 365) -> None:
    current = load_manifest(model / "manifest.msgpack")
    new = build_manifest(current.entries, model_id=current.head.model_id, version=version,
                         expires_in_days=expires_in_days, now=now, contract=current.head.contract)
    key = load_private_key(built.work / "a.key", None)
    save_manifest(model / "manifest.msgpack", new.with_envelope(new.envelope.signed_by(key)))


def _unsigned(built, model):
    ok("split", "-q", built.work / "ck", model, "--model-id", "test/tiny-mixtral", program="shardtool")


MANIFEST_CASES = {  # name: (change to the model copy, extra args, trusted keys, error class)
    "untrusted key": (None, (), ("b",), "SignatureError"),
    "threshold not met": (None, ("--threshold", "2"), ("a", "b"), "ThresholdError"),
    "unsigned": (lambda built, m: (shutil.rmtree(m), _unsigned(built, m)), (), ("a",), "SignatureError"),
    "expired": (lambda built, m: _resign(built, m, version=3, now=1_000_000_000, expires_in_days=1), (), ("a",),
                "ExpiredError"),
    "manifest corrupted": (lambda built, m: (m / "manifest.msgpack").write_bytes(
        (m / "manifest.msgpack").read_bytes()[:-5]), (), ("a",), "ManifestFormatError"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_untrusted_manifest_is_refused_before_any_output(built, copy, case):
    change, extra, trust, error = MANIFEST_CASES[case]
    if change:
        change(built, copy)
    r = var(built, copy, "--prompt", PROMPT, "--max-new-tokens", 4, *extra, trust=trust)
    assert r.code == 1 and r.out == ""
    assert error in one_error_line(r)


def test_model_id_pin(built, tmp_path):
    ok_run = var(built, built.model, "--prompt-ids", "5", "--max-new-tokens", 1, "-q",
                 "--model-id", "test/tiny-mixtral", state=tmp_path)
    assert ok_run.code == 0, ok_run.err
    r = var(built, built.model, "--prompt-ids", "5", "--max-new-tokens", 1, "--model-id", "test/other", state=tmp_path)
    assert r.code == 1 and r.out == ""
    assert "manifest is for model 'test/tiny-mixtral', expected 'test/other'" in one_error_line(r)


def test_rollback_to_a_lower_version_is_refused(built, copy, tmp_path):
    state = tmp_path / "rollback-state"
    assert var(built, copy, "--prompt-ids", "5", "--max-new-tokens", 1, "-q", state=state).code == 0  # floor: v3
    _resign(built, copy, version=2)
    r = var(built, copy, "--prompt-ids", "5", "--max-new-tokens", 1, state=state)
    assert r.code == 1 and r.out == ""
    line = one_error_line(r)
    assert "RollbackError" in line and "version 2" in line


# --- usage errors: exit 2, nothing on stdout ------------------------------------------------------------

OUR_USAGE = {  # name: args after the model directory; these are our UsageErrors, one line each
    "both prompt options": ("--prompt", "x", "--prompt-ids", "1"),
    "neither prompt option": (),
    "budget too small": ("--prompt", "x", "--memory-budget", "1MiB"),
    "budget not a size": ("--prompt", "x", "--memory-budget", "lots"),
    "unknown cache policy": ("--prompt", "x", "--cache-policy", "mru"),
    "unknown page-cache mode": ("--prompt", "x", "--page-cache", "mmap"),
    "prompt ids not integers": ("--prompt-ids", "1,x"),
    "prompt id outside vocabulary": ("--prompt-ids", "1,99999"),
}
TYPER_USAGE = {  # rejected by the option parser itself
    "unknown flag": ("--prompt", "x", "--bogus"),
    "negative temperature": ("--prompt", "x", "--temperature", "-1"),
    "top-p above one": ("--prompt", "x", "--top-p", "1.5"),
    "negative max tokens": ("--prompt", "x", "--max-new-tokens", "-1"),
    "negative threads": ("--prompt", "x", "--threads", "-1"),
}


@pytest.mark.parametrize("case", sorted(OUR_USAGE))
def test_usage_errors_exit_2_with_one_line(built, case, tmp_path):
    r = var(built, built.model, *OUR_USAGE[case], state=tmp_path)
    assert r.code == 2 and r.out == ""
    assert "UsageError" in one_error_line(r)


@pytest.mark.parametrize("case", sorted(TYPER_USAGE))
def test_bad_flags_exit_2(built, case, tmp_path):
    r = var(built, built.model, *TYPER_USAGE[case], state=tmp_path)
    assert r.code == 2 and r.out == "" and "Traceback" not in r.err


def test_missing_directory_and_missing_key_exit_2(built, tmp_path):
    r = var(built, tmp_path / "nope", "--prompt", "x", state=tmp_path)
    assert r.code == 2 and "does not exist" in one_error_line(r)
    r = run(built.model, "--trust", tmp_path / "missing.pub", "--prompt", "x", "--state-dir", tmp_path, cwd=tmp_path)
    assert r.code == 2 and r.out == ""
    one_error_line(r)
