"""Unit tests for split's handling of untrusted input: the checkpoint's one safe open (`_ckptdir`), the output
directory (`_outdir`), planning-time refusals and the terminal escaping of names. End to end: tests/attacks/
test_attack_split.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from shardtool.checkpoint import prepare_split, run_split
from shardtool.checkpoint._ckptdir import CheckpointDir
from shardtool.outdir import OutDir
from shardtool.text import printable
from shardtool.errors import CheckpointFormatError, UsageError

from ckpt_helpers import NOW

HEX = "ab" * 32


@pytest.fixture
def src(make_tiny, tmp_path: Path) -> Path:
    return Path(shutil.copytree(make_tiny("mixtral"), tmp_path / "ckpt"))


def _tree(tmp_path: Path) -> Path:
    """root/{a.txt, sub/b.txt, sub/deeper/c.txt}, plus outside.txt beside root."""
    root = tmp_path / "root"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"a")
    (root / "sub" / "b.txt").write_bytes(b"b")
    (root / "sub" / "deeper" / "c.txt").write_bytes(b"c")
    (tmp_path / "outside.txt").write_bytes(b"secret")
    return root


FOLLOWED = {"plain": "a.txt", "into-subdirectory": "sub/b.txt", "dot-segments": "./sub/./deeper/../b.txt",
            "double-slash": "sub//deeper/c.txt"}
REFUSED = {"absolute": None, "parent": "../outside.txt", "parent-after-descent": "sub/../../outside.txt",
           "through-link": "linkdir/b.txt", "to-link": "hop", "dangling": "nope.txt", "empty-after-dots": "./."}


@pytest.mark.parametrize("case", sorted(FOLLOWED))
def test_link_inside_is_followed(case: str, tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "link").symlink_to(FOLLOWED[case])
    with CheckpointDir(root) as d:
        item = d.lookup("link")
        assert item.kind == "file" and item.link
        fd, _ = d.open("link", expect=item.identity)
        try:
            assert os.read(fd, 10) in (b"a", b"b", b"c")
        finally:
            os.close(fd)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_link_leaving_or_odd_is_refused(case: str, tmp_path: Path, raises_exactly) -> None:
    root = _tree(tmp_path)
    (root / "linkdir").symlink_to("sub")
    (root / "hop").symlink_to("a.txt")
    target = REFUSED[case] if REFUSED[case] is not None else str(tmp_path / "outside.txt")
    (root / "link").symlink_to(target)
    with CheckpointDir(root) as d, raises_exactly(CheckpointFormatError) as info:
        d.lookup("link")
    assert "'link'" in info.value.one_line()
    with CheckpointDir(root) as d, raises_exactly(CheckpointFormatError):
        d.open("link")


def test_hf_blob_rule_needs_the_cache_layout(tmp_path: Path, raises_exactly) -> None:
    """`../../blobs/HEX` is followed only from REPO/snapshots/REV; the same link elsewhere leaves the checkpoint."""
    repo = tmp_path / "models--a--b"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / HEX).write_bytes(b"{}")
    snap = repo / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to(f"../../blobs/{HEX}")
    with CheckpointDir(snap) as d:
        assert d.lookup("config.json").kind == "file"
    other = repo / "not-snapshots" / "rev"
    other.mkdir(parents=True)
    (other / "config.json").symlink_to(f"../../blobs/{HEX}")
    with CheckpointDir(other) as d, raises_exactly(CheckpointFormatError):
        d.lookup("config.json")
    (repo / "blobs" / HEX).unlink()
    (repo / "blobs" / HEX).symlink_to(tmp_path / "elsewhere")  # a blob that is itself a link: not followed
    with CheckpointDir(snap) as d, raises_exactly(CheckpointFormatError):
        d.lookup("config.json")


def test_file_swapped_after_planning_is_refused(src: Path, tmp_path: Path, raises_exactly) -> None:
    job = prepare_split(src)
    weights = src / "model.safetensors"
    shutil.copy(weights, tmp_path / "copy")
    os.replace(tmp_path / "copy", weights)  # same bytes, another inode
    with raises_exactly(CheckpointFormatError, match="changed during split"):
        run_split(job, tmp_path / "out", model_id="t", now=NOW)
    assert not (tmp_path / "out" / "manifest.msgpack").exists()


def test_checkpoint_directory_replaced_after_planning_is_refused(src: Path, tmp_path: Path, raises_exactly) -> None:
    job = prepare_split(src)
    shutil.move(src, tmp_path / "moved")
    shutil.copytree(tmp_path / "moved", src)
    with raises_exactly(CheckpointFormatError, match="replaced during split"):
        run_split(job, tmp_path / "out", model_id="t", now=NOW)


def test_side_file_named_like_a_layout_directory_is_refused(src: Path, raises_exactly) -> None:
    (src / "trunk").write_bytes(b"x")
    with raises_exactly(CheckpointFormatError, match="both a file to copy and a directory"):
        prepare_split(src)


def test_huge_source_metadata_is_refused(src: Path, raises_exactly) -> None:
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(src / "model.safetensors")
    safetensors.numpy.save_file(tensors, src / "model.safetensors", metadata={"x": "y" * 100_000})
    with raises_exactly(CheckpointFormatError, match="__metadata__"):
        prepare_split(src)


def test_expert_pattern_matching_non_digits_is_a_usage_error(src: Path, raises_exactly) -> None:
    pattern = r"model\.layers\.(?P<layer>\w+)\.block_sparse_moe\.experts\.(?P<expert>\w+)\."
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                 "model_type": "acme", "architectures": ["Acme"]}))
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(src / "model.safetensors")
    name = next(n for n in tensors if ".experts.0.w1" in n)
    tensors[name.replace(".experts.0.", ".experts.zero.")] = tensors.pop(name)
    safetensors.numpy.save_file(tensors, src / "model.safetensors")
    with raises_exactly(UsageError, match="must match digits"):
        prepare_split(src, expert_pattern=pattern)


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**12), ("head_dim", "7"), ("num_attention_heads", 0),
                                         ("hidden_size", 2**41)],
                         ids=["layers-huge", "head-dim-string", "no-heads", "hidden-huge"])
def test_config_values_are_capped(field: str, value, src: Path, raises_exactly) -> None:
    config = json.loads((src / "config.json").read_text())
    config[field] = value
    (src / "config.json").write_text(json.dumps(config))
    with raises_exactly(CheckpointFormatError, match=field):
        prepare_split(src)


def test_contract_beyond_63_bits_is_a_usage_error_before_out_exists(src: Path, tmp_path: Path,
                                                                    raises_exactly) -> None:
    """Values within the config caps whose products outgrow the manifest's contract: refused by the manifest dry
    run (a usage error), not after the shards are written."""
    config = json.loads((src / "config.json").read_text())
    # KV cache bytes per token alone pass 2^63 (sizes the expert tensors do not carry: split checks those against
    # config.json before the contract)
    config.update(head_dim=2**40, num_key_value_heads=2**20)
    (src / "config.json").write_text(json.dumps(config))
    job = prepare_split(src)
    with raises_exactly(UsageError, match="contract"):
        run_split(job, tmp_path / "out", model_id="t", now=NOW)
    assert not (tmp_path / "out").exists()


def test_outdir_refuses_links_and_cleans_without_following(tmp_path: Path, raises_exactly) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".x.tmp").write_bytes(b"keep")
    (out / "trunk").mkdir(parents=True)
    (out / "trunk" / ".y.tmp").write_bytes(b"drop")
    (out / "trunk" / ".link.tmp").symlink_to(elsewhere / ".x.tmp")
    (out / "experts").symlink_to(elsewhere)
    with OutDir(out, checkpoint=(0, 0)) as od:
        od.remove_temp_files()
        assert od.stale_files(set()) == ()  # the experts link is not walked
        with raises_exactly(UsageError, match="symlink inside the output directory"):
            od.dir("experts/layer-000")
    assert (elsewhere / ".x.tmp").read_bytes() == b"keep"
    assert not os.path.lexists(out / "trunk" / ".y.tmp") and not os.path.lexists(out / "trunk" / ".link.tmp")


@pytest.mark.parametrize("text,shown", [("plain name.md", "plain name.md"), ("a\rb", "a\\x0db"),
                                        ("x\x1b[31m", "x\\x1b[31m"), ("c1\x9b2J", "c1\\x9b2J"),
                                        ("bidi\u202etxt.md", "bidi\\u202etxt.md"), ("bad\udcff", "bad\\udcff"),
                                        ("back\\slash", "back\\\\slash")],
                         ids=["plain", "cr", "ansi", "c1-csi", "bidi-override", "undecodable-byte", "backslash"])
def test_printable_escapes_what_split_prints(text: str, shown: str) -> None:
    """The escaping split's notes use (`shardtool.text.printable`): visible, unambiguous, one line."""
    assert printable(text) == shown and shown.isprintable()
