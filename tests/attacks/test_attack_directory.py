"""The model directory itself: missing and unlisted files, links, FIFOs and directories where files should be,
and manifests whose paths try to leave the directory.

The path cases are manifests crafted with msgpack by hand and signed by the trusted key, with every other entry
genuine and the hostile entry's size and digest matching the file it names: only path validation stops them.
"""

from __future__ import annotations

import os
import shutil

import pytest

import _attackkit as kit
from _attackkit import EXPERT, Attack, found, refused

SIBLING = "experts/layer-000/expert-0000.safetensors"
NOT_REGULAR = "NotARegularFileError"
FORMAT = "ManifestFormatError"


def _symlink_outside(model, world):
    """EXPERT becomes a link to a byte-identical copy outside the directory: right bytes, wrong place."""
    outside = world.tmp / "outside.safetensors"
    shutil.copy(model / EXPERT, outside)
    kit.replace_file(model / EXPERT, lambda p: p.symlink_to(outside))


def _symlink_sibling(model, world):
    kit.replace_file(model / EXPERT, lambda p: p.symlink_to(SIBLING.rsplit("/", 1)[1]))


def _symlink_parent_dir(model, world):
    """experts/layer-000 becomes a link to an outside copy of itself: every byte below it is genuine."""
    outside = world.tmp / "layer-000"
    shutil.copytree(model / "experts/layer-000", outside)
    shutil.rmtree(model / "experts/layer-000")
    (model / "experts/layer-000").symlink_to(outside)


def _unlisted(model, world):
    shutil.copy(model / EXPERT, model / "experts/layer-000/expert-0002.safetensors")


def _unlisted_bad_name(model, world):
    (model / os.fsdecode(b"trunk/\xff\xfe\nname.bin")).write_bytes(b"x")


DEEP = 1500  # deeper than Python's recursion limit


def _deep_tree(model, world):
    """An unlisted file at the bottom of a tree deeper than the interpreter's recursion limit."""
    here = os.open(model, os.O_RDONLY)
    try:
        for _ in range(DEEP):
            os.mkdir("d", dir_fd=here)
            nxt = os.open("d", os.O_RDONLY, dir_fd=here)
            os.close(here)
            here = nxt
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=here))
    finally:
        os.close(here)


LONG = "L" * 255  # the longest name a component may have
LONG_LEVELS = 20  # 20 x 256 characters: a path far beyond PATH_MAX (4096)


def _tampered_beside_tree_beyond_path_max(model, world):
    """A tampered expert, and beside it a tree whose paths are longer than PATH_MAX: the walk must not give
    up with an I/O error (exit 3) and hide the tampered shard."""
    kit.flip(model / EXPERT)
    here = os.open(model, os.O_RDONLY)
    try:
        for _ in range(LONG_LEVELS):
            os.mkdir(LONG, dir_fd=here)
            nxt = os.open(LONG, os.O_RDONLY, dir_fd=here)
            os.close(here)
            here = nxt
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=here))
    finally:
        os.close(here)


def _socket_instead_of_expert(model, world):
    """A Unix socket where a shard belongs (open() of a socket fails with ENXIO: a finding, not I/O trouble)."""
    kit.plant_socket(model / EXPERT, world.tmp)


SPARSE_SIZE = 1 << 42  # 4 TiB of holes: hours of hashing if anyone read it before comparing sizes


def _sparse_instead_of_expert(model, world):
    with open(model / EXPERT, "r+b") as fh:
        fh.truncate(SPARSE_SIZE)


def _unlisted_directories(model, world):
    """51 empty directories, one named like a trunk shard: none is implied by any listed path."""
    (model / "trunk/layer-099.safetensors").mkdir()
    for i in range(50):
        (model / f"extra-{i:02d}").mkdir()


def _manifest_as(make):
    def tamper(model, world):
        kit.replace_file(model / kit.MANIFEST, make)
    return tamper


def _add_entry(path: str, *, file_bytes: bytes | None = None, outside: bool = False, twice: bool = False):
    """Sign (with the trusted key A) a manifest with one more entry, `path`, whose size and BLAKE3 match a
    real file: at `path` itself inside the model when it can exist, else outside the model."""
    def tamper(model, world):
        data = file_bytes if file_bytes is not None else (model / EXPERT).read_bytes()
        where = path.replace("{tmp}", str(world.tmp))
        target = world.tmp / "outside.bin" if outside else None
        if target is not None:
            target.write_bytes(data)
        elif "\x00" not in where:
            (model / where).parent.mkdir(parents=True, exist_ok=True)
            (model / where).write_bytes(data)
        doc = kit.Doc.read(model)
        entry = {"digest": kit._h(data), "expert": None, "kind": "other", "layer": None, "path": where,
                 "size": len(data)}
        doc.entries = kit.sort_entries(doc.entries + [entry] * (2 if twice else 1))
        doc.reseal().sign(world.keys.signer("A")).write(model)
    return tamper


def _path_case(tamper, message):
    return Attack(tamper, refused(FORMAT, message), refused(FORMAT, message))


CASES = {
    "missing-expert": Attack(lambda m, w: (m / EXPERT).unlink(), found((EXPERT, "missing")),
                             refused("MissingFileError", f"{EXPERT}: file is missing")),
    "missing-config-json": Attack(lambda m, w: (m / "config.json").unlink(), found(("config.json", "missing")),
                                  refused("MissingFileError", "config.json: file is missing")),
    "missing-layer-directory": Attack(lambda m, w: shutil.rmtree(m / "experts/layer-000"),
                                      found((EXPERT, "missing"), (SIBLING, "missing")),
                                      refused("MissingFileError", "file is missing")),
    "unlisted-file": Attack(_unlisted, found(("experts/layer-000/expert-0002.safetensors", "unlisted")), kit.CLEAN),
    "unlisted-file-undecodable-name": Attack(
        _unlisted_bad_name, found((os.fsdecode(b"trunk/\xff\xfe\nname.bin"), "unlisted")), kit.CLEAN),
    "symlink-outside": Attack(_symlink_outside, found((EXPERT, "symlink")), refused(NOT_REGULAR, "is a symlink")),
    "symlink-outside-follow-symlinks": Attack(_symlink_outside, found((EXPERT, "symlink")),
                                              refused(NOT_REGULAR, "is a symlink"),
                                              audit_extra=("--follow-symlinks",)),
    "symlink-to-listed-shard": Attack(_symlink_sibling, found((EXPERT, "symlink")),
                                      refused(NOT_REGULAR, f"{EXPERT}: is a symlink")),
    "symlink-to-listed-shard-follow-symlinks": Attack(_symlink_sibling, found((EXPERT, "digest-mismatch")),
                                                      refused(NOT_REGULAR, f"{EXPERT}: is a symlink"),
                                                      audit_extra=("--follow-symlinks",)),
    "symlinked-parent-directory": Attack(_symlink_parent_dir,
                                         found(("experts/layer-000", "symlink"), (EXPERT, "missing"),
                                               (SIBLING, "missing")),
                                         refused(NOT_REGULAR, "is a symlink (at 'layer-000')")),
    "fifo-instead-of-expert": Attack(lambda m, w: kit.replace_file(m / EXPERT, os.mkfifo),
                                     found((EXPERT, "not-a-regular-file")),
                                     refused(NOT_REGULAR, f"{EXPERT}: is a FIFO, expected a regular file")),
    "directory-instead-of-expert": Attack(lambda m, w: kit.replace_file(m / EXPERT, os.mkdir),
                                          found((EXPERT, "not-a-regular-file")),
                                          refused(NOT_REGULAR, f"{EXPERT}: is a directory")),
    # Directories 1..32 levels deep are reported; the one 32 levels deep is not entered (no manifest path
    # has more than 32 segments), which keeps the walk's memory bounded however deep the tree.
    "unlisted-file-in-very-deep-tree": Attack(
        _deep_tree, found(*(("/".join("d" * (i + 1)), "unlisted") for i in range(32))), kit.CLEAN),
    "tampered-expert-beside-tree-beyond-path-max": Attack(
        _tampered_beside_tree_beyond_path_max,
        found((EXPERT, "digest-mismatch"), ("/".join([LONG] * LONG_LEVELS + ["f"]), "unlisted"),
              *(("/".join([LONG] * (i + 1)), "unlisted") for i in range(LONG_LEVELS))),
        refused("DigestMismatchError", f"{EXPERT}: BLAKE3 is")),
    "socket-instead-of-expert": Attack(_socket_instead_of_expert, found((EXPERT, "not-a-regular-file")),
                                       refused(NOT_REGULAR, f"{EXPERT}: is a socket")),
    "socket-instead-of-expert-verify-all-first": Attack(
        _socket_instead_of_expert, found((EXPERT, "not-a-regular-file")),
        refused(NOT_REGULAR, f"{EXPERT}: is a socket"), run_extra=("--verify-all-first",)),
    "sparse-4tib-instead-of-expert": Attack(_sparse_instead_of_expert, found((EXPERT, "size-mismatch")),
                                            refused("DigestMismatchError", f"size is {SPARSE_SIZE} bytes")),
    "sparse-4tib-instead-of-expert-verify-all-first": Attack(
        _sparse_instead_of_expert, found((EXPERT, "size-mismatch")),
        refused("DigestMismatchError", f"size is {SPARSE_SIZE} bytes"), run_extra=("--verify-all-first",)),
    "unlisted-directories": Attack(_unlisted_directories,
                                   found(("trunk/layer-099.safetensors", "unlisted"),
                                         *((f"extra-{i:02d}", "unlisted") for i in range(50))), kit.CLEAN),
    "manifest-missing": Attack(lambda m, w: (m / kit.MANIFEST).unlink(),
                               refused("VerificationError", "no manifest here"),
                               refused("VerificationError", "no manifest here")),
    "manifest-is-a-fifo": Attack(_manifest_as(os.mkfifo),
                                 refused("VerificationError", "manifest is not a regular file"),
                                 refused("VerificationError", "manifest is not a regular file")),
    "manifest-is-a-directory": Attack(_manifest_as(os.mkdir),
                                      refused("VerificationError", "manifest path is a directory"),
                                      refused("VerificationError", "manifest path is a directory")),
    # Signed manifests whose only flaw is a path.
    "manifest-path-dotdot": _path_case(_add_entry("../outside.bin", outside=True), "has a '..' segment"),
    "manifest-path-dotdot-inner": _path_case(_add_entry("experts/../../outside.bin", outside=True),
                                             "has a '..' segment"),
    "manifest-path-absolute": _path_case(_add_entry("{tmp}/outside.bin", outside=True), "is absolute"),
    "manifest-path-backslash": _path_case(_add_entry("experts\\layer-000\\extra.bin"), "contains a backslash"),
    "manifest-path-nul": _path_case(_add_entry("trunk/extra.bin\x00.safetensors"), "contains NUL"),
    "manifest-path-duplicate": _path_case(_add_entry("trunk/extra.bin", twice=True),
                                          "duplicate path 'trunk/extra.bin'"),
    "manifest-path-empty-segment": _path_case(_add_entry("trunk//extra.bin"), "has an empty segment"),
    "manifest-path-control-character": _path_case(_add_entry("trunk/extra\x1b[2J.bin"), "contains a control character"),
    "manifest-path-not-nfc": _path_case(_add_entry("trunk/cafe\u0301.bin"), "is not in Unicode NFC form"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_directory(case, model, world):
    try:
        kit.check_attack(CASES[case], model, world)
    finally:
        if case in ("unlisted-file-in-very-deep-tree", "tampered-expert-beside-tree-beyond-path-max"):
            kit.remove_tree(model)


# --- found by an attack review of the hardening ------------------------------------------------------------


def test_directory_manifest_is_a_symlink(model, world):
    """DIR/manifest.msgpack replaced by a link to a genuine copy: the manifest sits where others write, so its
    name is opened without following links (a link there once let audit skip another file, and let
    `/proc/kmsg` be read as a manifest)."""
    genuine = world.tmp / "genuine.msgpack"
    (model / kit.MANIFEST).rename(genuine)
    (model / kit.MANIFEST).symlink_to(genuine)
    states = world.tmp / "s1", world.tmp / "s2"
    audit_r, run_r = kit.run_many([kit.audit_cmd(model, [world.keys.pub("A")], 1, states[0]),
                                   kit.run_cmd(model, [world.keys.pub("A")], 1, states[1])], cwd=world.tmp)
    kit.assert_audit_refused(audit_r, "VerificationError", "manifest is not a regular file (is a symlink")
    kit.assert_run_refused(run_r, "VerificationError", "manifest is not a regular file (is a symlink")


def test_directory_manifest_in_a_subdirectory_is_not_a_finding(model, world):
    """`--manifest DIR/meta/manifest.msgpack`: the directory holding the manifest is implied too."""
    (model / "meta").mkdir()
    (model / kit.MANIFEST).rename(model / "meta" / kit.MANIFEST)
    r = kit.run(*kit.audit_cmd(model, [world.keys.pub("A")], 1, world.tmp / "s",
                               ["--manifest", model / "meta" / kit.MANIFEST]), cwd=world.tmp)
    assert r.code == 0 and r.report["ok"], r.err


def test_directory_deep_tree_of_long_names_in_bounded_memory(model, world):
    """2,000 levels of 250-character names: the walk stops 32 levels down (no manifest path is deeper), so
    audit runs in bounded memory. Before, each frame held its whole path: 1 GB here, MemoryError under a
    limit. The child runs with a 1 GiB address-space limit: any quadratic growth crashes it (exit 70)."""
    import resource
    import subprocess

    name = "n" * 250
    here = os.open(model, os.O_RDONLY)
    try:
        for _ in range(2000):
            os.mkdir(name, dir_fd=here)
            nxt = os.open(name, os.O_RDONLY, dir_fd=here)
            os.close(here)
            here = nxt
    finally:
        os.close(here)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    try:
        cmd = [str(a) for a in kit.audit_cmd(model, [world.keys.pub("A")], 1, world.tmp / "s")]
        proc = subprocess.run([str(kit.BIN / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=120,
                              preexec_fn=limit, env=kit.env_for(world.tmp / "xdg"), stdin=subprocess.DEVNULL)
        r = kit.Result(proc.returncode, proc.stdout, proc.stderr)
        kit.assert_audit_findings(r, {("/".join([name] * (i + 1)), "unlisted") for i in range(32)})
        deepest = [f for f in r.report["findings"] if f["path"].count("/") == 31]
        assert "not entered" in deepest[0]["detail"]
    finally:
        kit.remove_tree(model)


def test_directory_leased_file_is_a_finding_not_io_trouble(model, world):
    """Whoever owns a listed file can take a write lease on it: our non-blocking open then fails with
    EWOULDBLOCK. That is the tree's doing (exit 1, reported in --json), not our I/O trouble (exit 3)."""
    import fcntl
    import signal

    old = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease break signal would end this process
    fd = os.open(model / EXPERT, os.O_RDWR)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        states = world.tmp / "s1", world.tmp / "s2"
        audit_r, run_r = kit.run_many([kit.audit_cmd(model, [world.keys.pub("A")], 1, states[0]),
                                       kit.run_cmd(model, [world.keys.pub("A")], 1, states[1])], cwd=world.tmp)
        kit.assert_audit_findings(audit_r, {(EXPERT, "unreadable")})
        kit.assert_run_refused(run_r, "UnreadableFileError", EXPERT)
    finally:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        os.close(fd)
        signal.signal(signal.SIGIO, old)


def test_directory_special_files_are_never_opened(tmp_path, monkeypatch):
    """The type is checked before the open: a device node is never opened (opening one can have side
    effects: a tape rewinds, a tty becomes the controlling terminal)."""
    from shardtool import safeio
    from shardtool.errors import NotARegularFileError

    os.mkfifo(tmp_path / "fifo")
    opened = []
    real_open = os.open

    def spy(path, flags, *a, **k):
        opened.append(path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(safeio.os, "open", spy)
    dir_fd = real_open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(NotARegularFileError, match="is a FIFO"):
            safeio.open_file_at(dir_fd, "fifo", "fifo")
        with pytest.raises(NotARegularFileError, match="is a FIFO"):
            safeio.open_regular(tmp_path / "fifo")
    finally:
        os.close(dir_fd)
    assert "fifo" not in [os.path.basename(str(p)) for p in opened]
