"""The library example of docs/library.md, run as written there (and README's copy) against a tiny signed model
from the suite's kit; and the library's own refusals, each with its exact error class."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import shardtool
from shardtool.errors import SignatureError, UsageError, VerificationError

REPO = Path(__file__).resolve().parents[1]


def code_block(path: Path, heading: str | None = None) -> str:
    """The one python block of `path` (of its section `heading`, when given)."""
    text = path.read_text(encoding="utf-8")
    if heading is not None:
        text = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, f"{path} should hold exactly one python example there"
    return blocks[0]


@pytest.fixture
def workdir(tiny, tmp_path, monkeypatch):
    """my-model (split, unsigned), publisher.key / .pub, as the example names them."""
    release = tiny.release("mixtral", model_id="lib/example", key=None, layers=2, experts=4)
    shutil.copytree(release, tmp_path / "my-model")
    key = tiny.keypair("publisher")
    for suffix in (".key", ".pub"):
        shutil.copy(key.with_suffix(suffix), tmp_path / f"publisher{suffix}")
    (tmp_path / "publisher.key").chmod(0o600)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_docs_example_runs_as_written(workdir, capsys):
    exec(compile(code_block(REPO / "docs" / "library.md"), "docs/library.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("lib/example ") and out[0].endswith(" files OK")
    assert out[-1].endswith(" tokens/s")


def test_the_readme_copy_runs_as_written(workdir, capsys):
    shardtool.sign("my-model", "publisher.key")
    exec(compile(code_block(REPO / "README.md", "## Use it from Python"), "README.md", "exec"), {})


def test_stream_gives_the_text_generate_gives(workdir):
    shardtool.sign("my-model", "publisher.key")
    with shardtool.open_model("my-model", trust=["publisher.pub"], memory_budget="1GiB") as model:
        answer = model.generate("Once upon a time", max_new_tokens=12)
        assert "".join(model.stream("Once upon a time", max_new_tokens=12)) == answer.text
        assert len(answer.ids) == model.summary()["new_tokens"]


def _unsigned(workdir):
    pass


def _tamper(workdir):
    expert = sorted((workdir / "my-model" / "experts").rglob("*.safetensors"))[0]
    data = bytearray(expert.read_bytes())
    data[-1] ^= 1
    expert.write_bytes(bytes(data))


# Each bad setup, the call, and the exact error class it raises.
REFUSED = [
    ("unsigned_manifest", _unsigned, lambda: shardtool.verify("my-model", trust=["publisher.pub"]), SignatureError),
    ("tampered_expert", _tamper, lambda: shardtool.verify("my-model", trust=["publisher.pub"]), VerificationError),
    ("no_trusted_key", None, lambda: shardtool.open_model("my-model", trust=[]), UsageError),
    ("store_without_cache_dir", None,
     lambda: shardtool.open_model("https://example.invalid/m", trust=["publisher.pub"]), UsageError),
    ("bad_budget", None, lambda: shardtool.open_model("my-model", trust=["publisher.pub"], memory_budget="lots"),
     UsageError),
    ("absent_directory", None, lambda: shardtool.open_model("nowhere", trust=["publisher.pub"]), UsageError),
]


@pytest.mark.parametrize("setup, call, error", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_the_library_refuses(workdir, raises_exactly, setup, call, error):
    if setup is not _unsigned:
        shardtool.sign("my-model", "publisher.key")
    if setup is not None:
        setup(workdir)
    with raises_exactly(error):
        call()


def test_verify_raises_where_audit_reports(workdir):
    shardtool.sign("my-model", "publisher.key")
    _tamper(workdir)
    result = shardtool.audit("my-model", trust=["publisher.pub"])
    assert not result and len(result.report.findings) == 1
    with pytest.raises(VerificationError, match="1 file"):
        shardtool.verify("my-model", trust=["publisher.pub"])
