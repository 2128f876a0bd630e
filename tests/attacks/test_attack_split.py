"""`shardtool split` on untrusted input: a checkpoint whose links leave it, FIFOs and other special files in it,
metadata the manifest format cannot hold, hostile file names; and an output directory holding links.

Every case runs the installed CLI. A refusal is exit 2 with one line on stderr, before anything in OUT changes:
no manifest appears, no byte from outside the checkpoint lands in OUT, nothing outside OUT is written or deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
from pathlib import Path

import pytest

import _attackkit as kit

SECRET = b"TOP-SECRET-4f1d: the publisher's signing passphrase\n"
TIMEOUT = 60  # a FIFO that hangs split fails the test through subprocess.TimeoutExpired


def _generator():
    from examples import make_tiny_moe  # the repository root is on pytest's pythonpath
    return make_tiny_moe


@pytest.fixture(scope="session")
def base_checkpoints(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("split-attack-ckpts")
    gen = _generator()
    return {"single": gen.make_checkpoint(base / "single", "mixtral", seed=3, **kit.MODEL_KNOBS),
            "sharded": gen.make_checkpoint(base / "sharded", "mixtral", seed=4, shard_size_mb=0.02, **kit.MODEL_KNOBS)}


@pytest.fixture
def ckpt(base_checkpoints, tmp_path) -> Path:
    """A private copy of a one-file tiny Mixtral checkpoint."""
    return Path(shutil.copytree(base_checkpoints["single"], tmp_path / "ckpt", symlinks=True))


@pytest.fixture
def secret(tmp_path) -> Path:
    """A private file beside the checkpoint, the kind a link in a hostile checkpoint aims at."""
    path = tmp_path / "private" / "secret.txt"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def split(ckpt: Path, out: Path, *extra: str) -> kit.Result:
    return kit.run("shardtool", "split", ckpt, out, "--model-id", "acme/tiny-moe", "-q", *extra,
                   cwd=out.parent, timeout=TIMEOUT)


def files_below(root: Path) -> dict[str, bytes | str]:
    """relpath -> bytes of each regular file, or a description of anything else; links are not followed."""
    found: dict[str, bytes | str] = {}
    if not os.path.lexists(root):
        return found
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            rel = p.relative_to(root).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = f"link -> {os.readlink(p)}"
            elif stat.S_ISREG(st.st_mode):
                found[rel] = p.read_bytes()
            elif not stat.S_ISDIR(st.st_mode):
                found[rel] = "special"
    return found


def assert_refused(r: kit.Result, error: str, fragment: str = "") -> None:
    """Exit 2, exactly one line on stderr naming the class, nothing on stdout."""
    kit.assert_no_traceback(r)
    assert r.code == 2, f"split exited {r.code}, expected 2:\n{r.err}"
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardtool: error: "), r.err
    assert r.error_class == error, r.err
    assert fragment in r.err, (fragment, r.err)
    assert r.out == ""


def assert_nothing_complete(out: Path) -> None:
    """No manifest, and no byte of the secret anywhere below OUT."""
    assert not os.path.lexists(out / "manifest.msgpack")
    for rel, content in files_below(out).items():
        assert not (isinstance(content, bytes) and SECRET in content), rel


# ---------------------------------------------------------------------------------------------------------
# Links in the checkpoint


def _link_readme_absolute(ck: Path, secret: Path) -> None:
    (ck / "README.md").symlink_to(secret)


def _link_readme_relative(ck: Path, secret: Path) -> None:
    (ck / "README.md").symlink_to(os.path.relpath(secret, ck))


def _link_config_outside(ck: Path, secret: Path) -> None:
    """config.json itself leaves: a copy of the genuine one outside, so only the link rule can stop it."""
    outside = secret.parent / "config.json"
    shutil.copy(ck / "config.json", outside)
    (ck / "config.json").unlink()
    (ck / "config.json").symlink_to(os.path.relpath(outside, ck))


def _link_weights_outside(ck: Path, secret: Path) -> None:
    outside = secret.parent / "model.safetensors"
    shutil.move(ck / "model.safetensors", outside)
    (ck / "model.safetensors").symlink_to(outside)


def _link_through_directory_link(ck: Path, secret: Path) -> None:
    """README.md -> sub/secret.txt, where `sub` is itself a link to the secret's directory."""
    (ck / "sub").symlink_to(secret.parent)
    (ck / "README.md").symlink_to("sub/secret.txt")


def _link_out_and_back_in(ck: Path, secret: Path) -> None:
    """A target that leaves and re-enters (`../ckpt/config.json`): judged as written, it leaves."""
    (ck / "README.md").symlink_to(f"../{ck.name}/config.json")


def _link_chain(ck: Path, secret: Path) -> None:
    """A link to a link inside the checkpoint that leaves it: chains are not followed at all."""
    (ck / "hop").symlink_to(secret)
    (ck / "README.md").symlink_to("hop")


def _link_dangling(ck: Path, secret: Path) -> None:
    (ck / "README.md").symlink_to("no-such-file")


LINK_ATTACKS = {
    "side-file-absolute-link-to-secret": (_link_readme_absolute, "absolute path"),
    "side-file-relative-link-to-secret": (_link_readme_relative, "outside the checkpoint"),
    "config-json-link-outside": (_link_config_outside, "outside the checkpoint"),
    "weights-link-outside": (_link_weights_outside, "absolute path"),
    "link-through-directory-link": (_link_through_directory_link, "through another link"),
    "link-out-and-back-in": (_link_out_and_back_in, "outside the checkpoint"),
    "link-chain": (_link_chain, "points at another symlink"),
    "dangling-link": (_link_dangling, "dangling"),
}


@pytest.mark.parametrize("case", sorted(LINK_ATTACKS))
def test_split_checkpoint_link_refused(case, ckpt, secret, tmp_path):
    plant, fragment = LINK_ATTACKS[case]
    plant(ckpt, secret)
    out = tmp_path / "out"
    r = split(ckpt, out)
    assert_refused(r, "CheckpointFormatError", fragment)
    assert not os.path.lexists(out)  # refused while planning: OUT was never created
    assert_nothing_complete(out)
    assert secret.read_bytes() == SECRET and stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_split_refused_rerun_leaves_out_untouched(ckpt, secret, tmp_path):
    """A rerun refused while planning changes nothing in OUT: the earlier manifest stays, still true of the
    files it lists (none was touched); it is removed only once writing begins."""
    out = tmp_path / "out"
    assert split(ckpt, out).code == 0
    before = files_below(out)
    _link_readme_absolute(ckpt, secret)
    assert_refused(split(ckpt, out), "CheckpointFormatError", "absolute path")
    assert files_below(out) == before


def _hf_cache(src: Path, root: Path, rev: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """`models--acme--tiny/snapshots/REV/NAME -> ../../blobs/SHA256`, as huggingface_hub lays out its cache."""
    repo = root / "models--acme--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(f"../../blobs/{digest}")
    return snap


def test_split_hf_cache_snapshot_accepted(ckpt, tmp_path):
    snap = _hf_cache(ckpt, tmp_path / "hub")
    out = tmp_path / "out"
    r = split(snap, out, "--json")
    assert r.code == 0, r.err
    reference = tmp_path / "reference"
    assert split(ckpt, reference).code == 0
    got, want = files_below(out), files_below(reference)
    assert got.keys() == want.keys()
    for rel, content in want.items():
        if rel != "manifest.msgpack":
            assert got[rel] == content, rel  # regular files with the blobs' bytes, not links
    assert kit.Doc.read(out).entries == kit.Doc.read(reference).entries


@pytest.mark.parametrize("target", ["../../blobs/../../../private/secret.txt", "../../refs/main",
                                    "../../blobs/not-a-digest"],
                         ids=["hf-cache-link-escaping-blobs", "hf-cache-link-outside-blobs",
                              "hf-cache-link-to-non-digest-blob"])
def test_split_hf_cache_snapshot_link_leaving_refused(target, ckpt, tmp_path):
    snap = _hf_cache(ckpt, tmp_path / "hub")
    (tmp_path / "hub" / "models--acme--tiny" / "blobs" / "not-a-digest").write_bytes(SECRET)
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "secret.txt").write_bytes(SECRET)
    (snap / "README.md").symlink_to(target)
    out = tmp_path / "out"
    assert_refused(split(snap, out), "CheckpointFormatError", "README.md")
    assert_nothing_complete(out)


def test_split_link_inside_checkpoint_followed(ckpt, tmp_path):
    """A link to another file inside the checkpoint is followed (its bytes are the checkpoint's own); the output
    is a regular file under the link's name. A link to a directory inside is skipped like a directory."""
    (ckpt / "docs").mkdir()
    (ckpt / "docs" / "README.md").write_bytes(b"# tiny\n")
    (ckpt / "README.md").symlink_to("docs/README.md")
    (ckpt / "LICENSE").symlink_to("./docs/../docs/README.md")
    (ckpt / "more-docs").symlink_to("docs")
    out = tmp_path / "out"
    r = split(ckpt, out, "--json")
    assert r.code == 0, r.err
    for name in ("README.md", "LICENSE"):
        assert not (out / name).is_symlink() and (out / name).read_bytes() == b"# tiny\n"
    assert {e["path"] for e in kit.Doc.read(out).entries} >= {"README.md", "LICENSE"}
    assert json.loads(r.out)["skipped"] == ["docs", "more-docs"]
    assert "note: not copied: more-docs (directory)" in r.err


# ---------------------------------------------------------------------------------------------------------
# Special files in the checkpoint


def _fifo(path: Path) -> None:
    if path.exists():
        path.unlink()
    os.mkfifo(path)


def _socket(path: Path) -> None:
    """A listening-style UNIX socket file (bound through /proc/self/fd to stay under the 108-byte path limit)."""
    fd = os.open(path.parent, os.O_RDONLY)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(f"/proc/self/fd/{fd}/{path.name}")
    except OSError as e:
        pytest.skip(f"cannot create a UNIX socket file here: {e}")
    finally:
        s.close()
        os.close(fd)


def _directory(path: Path) -> None:
    if path.exists():
        path.unlink()
    path.mkdir()


SPECIAL_REFUSED = {
    "fifo-as-config-json": ("single", "config.json", _fifo, "is a FIFO"),
    "fifo-as-weights": ("single", "model.safetensors", _fifo, "is a FIFO"),
    "fifo-as-index-json": ("sharded", "model.safetensors.index.json", _fifo, "is a FIFO"),
    "directory-as-config-json": ("single", "config.json", _directory, "is a directory"),
    "socket-as-config-json": ("single", "config.json", lambda p: (p.unlink(), _socket(p)), "is a socket"),
}


@pytest.mark.parametrize("case", sorted(SPECIAL_REFUSED))
def test_split_special_file_needed_refused(case, base_checkpoints, tmp_path):
    which, name, make, fragment = SPECIAL_REFUSED[case]
    ck = Path(shutil.copytree(base_checkpoints[which], tmp_path / "ckpt"))
    make(ck / name)
    out = tmp_path / "out"
    assert_refused(split(ck, out), "CheckpointFormatError", fragment)
    assert not os.path.lexists(out)


SPECIAL_SKIPPED = {
    "fifo-side-file": ("notes.txt", _fifo, "FIFO"),
    "socket-side-file": ("agent.sock", _socket, "socket"),
    "fifo-side-file-through-link": ("notes.txt", lambda p: (_fifo(p.parent / "pipe"), p.symlink_to("pipe")), "FIFO"),
}


@pytest.mark.parametrize("case", sorted(SPECIAL_SKIPPED))
def test_split_special_side_file_skipped(case, ckpt, tmp_path):
    """A FIFO or socket beside the weights is not a file to copy: skipped with a note, never opened (no hang)."""
    name, make, what = SPECIAL_SKIPPED[case]
    make(ckpt / name)
    out = tmp_path / "out"
    r = split(ckpt, out)
    assert r.code == 0, r.err
    assert f"note: not copied: {name} ({what})" in r.err
    assert not os.path.lexists(out / name)
    assert name not in {e["path"] for e in kit.Doc.read(out).entries}


# ---------------------------------------------------------------------------------------------------------
# Links in the output directory


@pytest.mark.parametrize("inner", ["experts", "trunk", "experts/layer-001"],
                         ids=["out-experts-link", "out-trunk-link", "out-layer-directory-link"])
def test_split_out_directory_link_refused(inner, ckpt, tmp_path):
    """OUT/experts -> elsewhere: refused before any byte is written; elsewhere is neither written nor cleaned."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.safetensors").write_bytes(b"not split's")
    (elsewhere / ".expert-0000.safetensors.abc123.tmp").write_bytes(b"looks like split's temp file")
    (elsewhere / "layer-000").mkdir()
    (elsewhere / "layer-000" / ".x.tmp").write_bytes(b"also")
    before = files_below(elsewhere)
    (out / inner).parent.mkdir(parents=True)
    (out / inner).symlink_to(elsewhere)
    r = split(ckpt, out)
    assert_refused(r, "UsageError", "symlink inside the output directory")
    assert files_below(elsewhere) == before
    assert not os.path.lexists(out / "manifest.msgpack")
    assert not [p for p in out.rglob("*.safetensors") if not p.is_symlink()]  # no shard was written


def test_split_out_rerun_with_planted_directory_link_refused(ckpt, tmp_path):
    """A finished split whose experts/ is swapped for a link to a copy elsewhere: the rerun neither reads (reuse)
    nor writes nor cleans up through it, and leaves no manifest claiming the new run is complete."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    assert split(ckpt, out).code == 0
    shutil.move(out / "experts", elsewhere)
    (elsewhere / "layer-000" / ".expert-0001.safetensors.abc.tmp").write_bytes(b"x")
    (out / "experts").symlink_to(elsewhere)
    before = files_below(elsewhere)
    assert_refused(split(ckpt, out), "UsageError", "experts")
    assert files_below(elsewhere) == before


def test_split_out_file_links_replaced_not_followed(ckpt, tmp_path):
    """Links where split writes files (even to byte-identical copies, to lure reuse) are replaced by regular
    files; the files they point at are neither written, read for reuse, nor removed."""
    out, victims = tmp_path / "out", tmp_path / "victims"
    reference = tmp_path / "reference"
    assert split(ckpt, reference).code == 0
    victims.mkdir()
    (victims / "config.json").write_bytes(b"victim: must survive unchanged")
    shutil.copy(reference / "trunk" / "embed.safetensors", victims / "embed.safetensors")
    (out / "trunk").mkdir(parents=True)
    (out / "config.json").symlink_to(victims / "config.json")
    (out / "trunk" / "embed.safetensors").symlink_to(victims / "embed.safetensors")
    (out / "manifest.msgpack").symlink_to(victims / "config.json")
    before = files_below(victims)
    r = split(ckpt, out, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["files_reused"] == 0
    assert files_below(victims) == before
    for rel in ("config.json", "trunk/embed.safetensors", "manifest.msgpack"):
        assert not (out / rel).is_symlink(), rel
    assert kit.Doc.read(out).entries == kit.Doc.read(reference).entries


def test_split_out_itself_a_symlink_refused(ckpt, tmp_path):
    """OUT's own last component may not be a link (pass the directory it points to); the target is untouched."""
    target, out = tmp_path / "target", tmp_path / "out"
    target.mkdir()
    out.symlink_to(target)
    r = split(ckpt, out)
    assert_refused(r, "UsageError", "output directory is a symlink")
    assert list(target.iterdir()) == []
    assert split(ckpt, target).code == 0  # the directory it points to is fine


# ---------------------------------------------------------------------------------------------------------
# Metadata the manifest format cannot hold: refused while planning, before OUT exists


def _edit_tensors(ck: Path, edit) -> None:
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(ck / "model.safetensors")
    edit(tensors)
    safetensors.numpy.save_file(tensors, ck / "model.safetensors")


def _rename(old: str, new: str):
    def edit(tensors: dict) -> None:
        tensors[new] = tensors.pop(old)
    return edit


def _copy_layer_experts(src: int, dst: int):
    """Every routed expert of layer `src` again as layer `dst`: a complete, consistent layer split would write."""
    def edit(tensors: dict) -> None:
        prefix = f"model.layers.{src}.block_sparse_moe.experts."
        for name in [n for n in tensors if n.startswith(prefix)]:
            tensors[name.replace(f".layers.{src}.", f".layers.{dst}.")] = tensors[name].copy()
    return edit


PLANNING = {
    "trunk-layer-70000": (_rename("model.layers.1.input_layernorm.weight",
                                  "model.layers.70000.input_layernorm.weight"), "layer 70000"),
    "expert-layer-70000": (_copy_layer_experts(1, 70000), "layer 70000"),
    "expert-number-2000000": (_rename("model.layers.1.block_sparse_moe.experts.1.w1.weight",
                                      "model.layers.1.block_sparse_moe.experts.2000000.w1.weight"), "expert 2000000"),
}


@pytest.mark.parametrize("case", sorted(PLANNING))
def test_split_beyond_manifest_format_refused_before_writing(case, ckpt, tmp_path):
    edit, fragment = PLANNING[case]
    _edit_tensors(ckpt, edit)
    out = tmp_path / "out"
    r = split(ckpt, out)
    assert_refused(r, "CheckpointFormatError", fragment)
    assert not os.path.lexists(out)


def test_split_config_beyond_caps_refused(ckpt, tmp_path):
    """A config.json asking for 10^12 layers is refused at once (it used to be iterated over)."""
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] = 10**12
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert_refused(split(ckpt, out), "CheckpointFormatError", "num_hidden_layers")
    assert not os.path.lexists(out)


def _config_wider_experts(ck: Path) -> None:
    config = json.loads((ck / "config.json").read_text())
    config["intermediate_size"] *= 2  # Mixtral's expert width
    (ck / "config.json").write_text(json.dumps(config))


def _gate_transposed(ck: Path) -> None:
    from safetensors.numpy import load_file, save_file

    weights = ck / "model.safetensors"
    t = load_file(weights)
    for name in [n for n in t if n.endswith(".w1.weight")]:  # every expert alike: a layer's experts still agree
        t[name] = t[name].T.copy()
    save_file(t, weights, metadata={"format": "pt"})


EXPERT_SHAPE_ATTACKS = {"config-says-wider-experts": _config_wider_experts, "gate-proj-transposed": _gate_transposed}


@pytest.mark.parametrize("case", sorted(EXPERT_SHAPE_ATTACKS))
def test_split_expert_shape_config_does_not_describe_refused(case, ckpt, tmp_path):
    """Expert tensors that disagree with config.json: a plain split used to sign them (and write a contract from
    config.json's sizes), and every run then refused the shard at its first use."""
    EXPERT_SHAPE_ATTACKS[case](ckpt)
    out = tmp_path / "out"
    r = split(ckpt, out)
    assert_refused(r, "CheckpointFormatError", "config.json's hidden and expert intermediate sizes give")
    assert "w1.weight" in r.err and not os.path.lexists(out)


# ---------------------------------------------------------------------------------------------------------
# Permissions and names


def test_split_output_never_more_permissive_than_source(ckpt, tmp_path):
    (ckpt / "README.md").write_bytes(b"# private notes\n")
    (ckpt / "README.md").chmod(0o600)
    (ckpt / "model.safetensors").chmod(0o640)
    (ckpt / "config.json").chmod(0o755)
    out = tmp_path / "out"
    assert split(ckpt, out).code == 0

    def mode(rel: str) -> int:
        return stat.S_IMODE(os.lstat(out / rel).st_mode)

    assert mode("README.md") == 0o600
    assert mode("config.json") == 0o644  # 0644 at most: no execute bit, nothing wider
    assert {mode(str(p.relative_to(out))) for p in out.rglob("*.safetensors")} == {0o640}
    # A rerun rewrites a shard whose mode was widened since; the bytes alone do not make it reusable.
    (out / "README.md").chmod(0o644)
    r = split(ckpt, out, "--json")
    assert r.code == 0 and json.loads(r.out)["files_written"] == 1
    assert mode("README.md") == 0o600


HOSTILE = "evil\x1b[2J\x1b[31mname\rspoof.md"


def test_split_notes_escape_hostile_names(ckpt, tmp_path):
    """Names from disk reach the terminal escaped: an ESC sequence or a CR in a skipped or stale file's name
    cannot repaint the screen."""
    (ckpt / HOSTILE).write_bytes(b"x")
    (ckpt / "dir\x1b]0;title\x07").mkdir()
    out = tmp_path / "out"
    (out / "experts").mkdir(parents=True)
    (out / "experts" / "stale\r\x1b[1Aname").write_bytes(b"left from before")
    r = split(ckpt, out)
    assert r.code == 0, r.err
    assert not any(c in r.err for c in "\x1b\r\x07"), repr(r.err)
    assert "note: not copied: evil\\x1b[2J\\x1b[31mname\\x0dspoof.md (its name cannot be a manifest path)" in r.err
    assert "not copied: dir\\x1b]0;title\\x07 (directory)" in r.err
    assert "e.g. experts/stale\\x0d\\x1b[1Aname" in r.err


# ---------------------------------------------------------------------------------------------------------
# A signed manifest already in OUT


def test_split_over_a_signed_manifest_refused_without_force(ckpt, tmp_path):
    """A rerun into OUT used to write a new unsigned manifest over a signed one: both signatures dropped, exit 0,
    not a word, even for another model ID. Now exit 2 naming OUT's manifest and its signatures; --force replaces it."""
    out = tmp_path / "out"
    assert split(ckpt, out).code == 0
    assert split(ckpt, out).code == 0  # (control) over an unsigned manifest a rerun goes ahead as before
    for name in ("a", "b"):
        assert kit.run("shardtool", "keygen", "--out", tmp_path / name, "--no-passphrase", cwd=tmp_path).code == 0
        assert kit.run("shardtool", "sign", out, "--key", tmp_path / f"{name}.key", cwd=tmp_path).code == 0
    signed = files_below(out)
    for extra in ((), ("--model-id", "acme/other-model")):
        r = split(ckpt, out, *extra)
        assert_refused(r, "UsageError", f"{out / 'manifest.msgpack'}: holds a signed manifest (2 signature(s))")
        assert "--force" in r.err
        assert files_below(out) == signed
    r = split(ckpt, out, "--force", "--json")
    assert r.code == 0, r.err
    from shardtool.manifest import load_manifest
    assert load_manifest(out / "manifest.msgpack").envelope.signatures == ()
