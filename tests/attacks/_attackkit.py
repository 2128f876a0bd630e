"""Tools for the attack suite: run the installed CLIs, and forge manifests byte by byte.

The forger deliberately does not use shardtool's own encoder, Merkle code or signer: it packs msgpack by
hand, computes the RFC 9162 root with its own few lines and signs PAE bytes with `cryptography`, so a
forged manifest is exactly what an attacker (or a careless publisher) could produce, and only the
verifier under test can stop it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import blake3
import msgpack
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from _kit import cli
from _kit.cli import BIN, REPO, Result  # noqa: F401  (the attack tests use them through this kit)

env_for = cli.user_env  # the environment a command gets: XDG state in the given directory, no passphrase

MANIFEST = "manifest.msgpack"
PAYLOAD_TYPE = "application/vnd.shardtool.manifest-head+msgpack"
PROMPT = "hello world"
NEW_TOKENS = 3
# Every expert is selected for every token (experts == experts_per_tok), so a bad expert is always
# read during prefill: the run must stop before the first generated token is printed.
MODEL_KNOBS = dict(layers=2, experts=2, experts_per_tok=2, hidden=32, moe_intermediate=16, intermediate=48,
                   vocab=300, heads=4, kv_heads=2)
EXPERT = "experts/layer-000/expert-0001.safetensors"
EXPERT_L1 = "experts/layer-001/expert-0001.safetensors"
TRUNK = "trunk/layer-001.safetensors"
EMBED = "trunk/embed.safetensors"


# ---------------------------------------------------------------------------------------------------------
# Running the CLIs


def run(program: str, *args: Any, cwd: Path | None = None, state: Path | None = None, timeout: int = 60,
        env: dict | None = None) -> Result:
    """The shared runner (its state defaults to `cwd/xdg`); every command also gets --state-dir."""
    return cli.run(program, *args, cwd=cwd, state=state, env=env, timeout=timeout)


def trust_args(keys: Sequence[Path], threshold: int) -> list[str]:
    return [a for k in keys for a in ("--trust", str(k))] + ["--threshold", str(threshold)]


def audit_cmd(model: Path, keys: Sequence[Path], threshold: int, state: Path, extra: Sequence[str] = ()) -> list:
    return ["shardtool", "audit", model, *trust_args(keys, threshold), "--state-dir", state, "--json", "-q", *extra]


def run_cmd(model: Path, keys: Sequence[Path], threshold: int, state: Path, extra: Sequence[str] = ()) -> list:
    return ["verify-and-run", model, *trust_args(keys, threshold), "--state-dir", state, "--prompt", PROMPT,
            "--max-new-tokens", str(NEW_TOKENS), "--print-ids", "-q", *extra]


def run_many(commands: Iterable[Sequence[Any]], cwd: Path, timeout: int = 60) -> list[Result]:
    """Run several CLI invocations at once (two cores: audit and verify-and-run side by side)."""
    commands = list(commands)
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(pool.map(lambda c: run(c[0], *c[1:], cwd=cwd, timeout=timeout), commands))


# ---------------------------------------------------------------------------------------------------------
# What a refusal looks like


def assert_no_traceback(r: Result) -> None:
    assert "Traceback" not in r.err, f"a crash, not a refusal:\n{r.err}"


def assert_audit_refused(r: Result, error: str, message: str = "") -> None:
    """The manifest itself was refused: exit 1, the JSON error names the class, nothing was hashed."""
    assert_no_traceback(r)
    assert r.code == 1, f"audit exited {r.code}, expected 1:\n{r.err}"
    doc = r.report
    assert doc["ok"] is False and "findings" not in doc, doc
    assert doc["error"]["class"] == error, doc["error"]
    assert message in doc["error"]["message"], (message, doc["error"]["message"])


def findings(r: Result) -> set[tuple[str, str]]:
    return {(f["path"], f["finding"]) for f in r.report["findings"]}


def assert_audit_findings(r: Result, expected: set[tuple[str, str]]) -> None:
    assert_no_traceback(r)
    assert r.code == 1, f"audit exited {r.code}, expected 1:\n{r.err}"
    assert r.report["ok"] is False
    assert findings(r) == expected


def assert_run_refused(r: Result, error: str, message: str = "") -> None:
    """verify-and-run stopped with exit 1 and one error line, having printed no token at all."""
    assert_no_traceback(r)
    assert r.code == 1, f"verify-and-run exited {r.code}, expected 1:\nstdout={r.out!r}\n{r.err}"
    assert r.out == "", f"output was produced: {r.out!r}"
    assert r.error_class == error, r.err
    assert message in r.err, (message, r.err)


def assert_run_clean(r: Result, expected_out: str) -> None:
    assert_no_traceback(r)
    assert r.code == 0, r.err
    assert r.out == expected_out


# ---------------------------------------------------------------------------------------------------------
# Files


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def remove_tree(root: Path) -> None:
    """rmtree without recursion and without long paths: shutil.rmtree (and pytest's temp cleanup) overflow
    the stack on the 1500-level tree one attack plants, and fail on paths beyond PATH_MAX. One descriptor
    at a time: go down into a subdirectory while there is one, remove files on the way, and remove each
    directory from its parent (reached through `..`) once it is empty."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fd = os.open(root, flags)
    names: list[str] = []  # the path from root down to the current directory
    try:
        while True:
            sub = None
            with os.scandir(fd) as it:
                for d in it:
                    if d.is_dir(follow_symlinks=False):
                        sub = sub or d.name
                    else:
                        os.unlink(d.name, dir_fd=fd)
            if sub is not None:
                nxt = os.open(sub, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
                names.append(sub)
                continue
            if not names:
                break
            up = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = up
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(root)


def flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def plant_socket(path: Path, scratch: Path) -> None:
    """Replace `path` by a Unix socket (bind() wants a path under 108 bytes: bind in `scratch`, then rename)."""
    import socket
    import tempfile

    short = tempfile.mkdtemp(dir=scratch)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(os.path.join(short, "s"))
    finally:
        sock.close()
    path.unlink()
    os.rename(os.path.join(short, "s"), path)


def publish_rewritten(model: Path, rel: str, rewrite, signer) -> None:
    """Rewrite file `rel`, then publish it properly: its entry updated, the root resealed, re-signed."""
    rewrite(model / rel)
    doc = Doc.read(model)
    for i, e in enumerate(doc.entries):
        if e["path"] == rel:
            doc.entries[i] = entry_for(model, rel, kind=e["kind"], layer=e["layer"], expert=e["expert"])
    doc.reseal().sign(signer).write(model)


def replace_file(path: Path, make) -> None:
    """Unlink and recreate `path` as something else (symlink, FIFO, directory)."""
    path.unlink()
    make(path)


# ---------------------------------------------------------------------------------------------------------
# Forging manifests by hand


def canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value, key=lambda k: k.encode())}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def pack(value: Any) -> bytes:
    """Canonical msgpack as the format specifies: sorted keys, shortest ints, bin for bytes."""
    return msgpack.packb(canonical(value), use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _h(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def merkle_root(raw_entries: Sequence[bytes]) -> bytes:
    """RFC 9162 §2.1.1 MTH with BLAKE3: leaf H(0||d), node H(1||l||r), split at the largest power of 2 < n."""
    def mth(items: Sequence[bytes]) -> bytes:
        if len(items) == 1:
            return _h(b"\x00" + items[0])
        k = 1 << ((len(items) - 1).bit_length() - 1)
        return _h(b"\x01" + mth(items[:k]) + mth(items[k:]))
    return mth(raw_entries) if raw_entries else _h(b"")


def load_wycheproof_ed25519() -> dict:
    """The Wycheproof EdDSA vectors kept in the repository (tests/vectors/, sources in its README)."""
    return json.loads((REPO / "tests" / "vectors" / "wycheproof_ed25519_test.json").read_text())


def pae(payload_type: str, payload: bytes) -> bytes:
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    return serialization.load_pem_private_key(Path(path).read_bytes(), password=None)


def keyid_of(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return blake3.blake3(raw).digest()[:16].hex()


@dataclass
class Doc:
    """A manifest taken apart: the head map, the entry maps (or raw entry bytes), the signatures."""

    head: dict
    entries: list  # dicts (packed canonically) or raw bytes (kept as they are)
    signatures: list
    payload_type: str = PAYLOAD_TYPE
    payload: bytes | None = None  # None: the canonical packing of `head`
    top_extra: dict | None = None

    @classmethod
    def read(cls, model: Path) -> "Doc":
        doc = unpack((model / MANIFEST).read_bytes())
        env = doc["envelope"]
        return cls(head=unpack(env["payload"]), entries=[unpack(e) for e in doc["entries"]],
                   signatures=list(env["signatures"]), payload_type=env["payloadType"])

    def raw_entries(self) -> list[bytes]:
        return [e if isinstance(e, bytes) else pack(e) for e in self.entries]

    def reseal(self) -> "Doc":
        """Recompute entry count and Merkle root over the current entries (as a publisher would)."""
        raw = self.raw_entries()
        self.head["entry_count"] = len(raw)
        self.head["merkle_root"] = merkle_root(raw)
        return self

    def payload_bytes(self) -> bytes:
        return self.payload if self.payload is not None else pack(self.head)

    def sign(self, *keys: Ed25519PrivateKey, payload_type: str | None = None, keyid: str | None = None) -> "Doc":
        """Drop old signatures and sign (PAE over `payload_type`, default the envelope's own type)."""
        self.signatures = []
        return self.add_signature(*keys, payload_type=payload_type, keyid=keyid)

    def add_signature(self, *keys: Ed25519PrivateKey, payload_type: str | None = None,
                      keyid: str | None = None) -> "Doc":
        message = pae(payload_type or self.payload_type, self.payload_bytes())
        for key in keys:
            self.signatures.append({"keyid": keyid or keyid_of(key), "sig": key.sign(message)})
        return self

    def to_bytes(self) -> bytes:
        doc = {"format": "shardtool-manifest-v1",
               "envelope": {"payloadType": self.payload_type, "payload": self.payload_bytes(),
                            "signatures": self.signatures},
               "entries": self.raw_entries(), **(self.top_extra or {})}
        return pack(doc)

    def write(self, model: Path) -> None:
        (model / MANIFEST).write_bytes(self.to_bytes())


def entry_for(model: Path, path: str, *, kind: str = "other", layer: int | None = None,
              expert: int | None = None, file: Path | None = None) -> dict:
    """A correct entry map for a file (by default `model/path`): its real size and BLAKE3."""
    data = (file or model / path).read_bytes()
    return {"digest": _h(data), "expert": expert, "kind": kind, "layer": layer, "path": path, "size": len(data)}


def sort_entries(entries: list) -> list:
    return sorted(entries, key=lambda e: (e["path"] if isinstance(e, dict) else unpack(e)["path"]).encode(
        "utf-8", "surrogatepass"))


# ---------------------------------------------------------------------------------------------------------
# One attack case: how to tamper, what audit and verify-and-run must answer


@dataclass(frozen=True)
class Expect:
    """`refused`: the manifest (or run) stops with `error` (exit `code`); `findings`: audit lists exactly
    these (path, class) pairs; `clean`: exit 0 and, for verify-and-run, the untouched model's output."""

    kind: str
    error: str = ""
    message: str = ""
    found: frozenset = frozenset()
    code: int = 1


def refused(error: str, message: str = "", code: int = 1) -> Expect:
    return Expect("refused", error, message, code=code)


def found(*pairs: tuple[str, str]) -> Expect:
    return Expect("findings", found=frozenset(pairs))


CLEAN = Expect("clean")


@dataclass(frozen=True)
class Attack:
    tamper: Any  # tamper(model: Path, world) -> None
    audit: Expect
    run: Expect
    trust: tuple[str, ...] = ("A",)
    threshold: int = 1
    audit_extra: tuple[str, ...] = ()
    run_extra: tuple[str, ...] = ()
    accept_first: str | None = None  # name of a World release ("v2") the rollback state already accepted


def _check_audit(r: Result, e: Expect) -> None:
    if e.kind == "refused":
        assert_no_traceback(r)
        assert r.code == e.code, f"audit exited {r.code}, expected {e.code}:\n{r.err}"
        doc = r.report
        assert doc["ok"] is False and doc["error"]["class"] == e.error, doc
        assert e.message in doc["error"]["message"], (e.message, doc["error"]["message"])
    elif e.kind == "findings":
        assert_audit_findings(r, set(e.found))
    else:
        assert_no_traceback(r)
        assert r.code == 0 and r.report["ok"] is True, r.err


def _check_run(r: Result, e: Expect, clean_out: str) -> None:
    if e.kind == "refused":
        assert_no_traceback(r)
        assert r.code == e.code, f"verify-and-run exited {r.code}, expected {e.code}:\nstdout={r.out!r}\n{r.err}"
        assert r.out == "", f"output was produced: {r.out!r}"
        assert r.error_class == e.error, r.err
        assert e.message in r.err, (e.message, r.err)
    else:
        assert_run_clean(r, clean_out)


def accept(state: Path, release: Path, trusted: Sequence[Path]) -> None:
    """Record `release` in the rollback state as already accepted (what an earlier audit would leave)."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import check_and_record, load_manifest

    check_and_record(state, load_manifest(release / MANIFEST).head, [load_public_key(p) for p in trusted])


def check_attack(attack: Attack, model: Path, world: Any) -> tuple[Result, Result]:
    """Tamper with `model`, run audit and verify-and-run side by side, and check both answers."""
    attack.tamper(model, world)
    keys = [world.keys.pub(k) for k in attack.trust]
    states = world.tmp / "state-audit", world.tmp / "state-run"
    if attack.accept_first is not None:
        for s in states:
            accept(s, getattr(world, attack.accept_first), keys)
    audit_r, run_r = run_many([audit_cmd(model, keys, attack.threshold, states[0], attack.audit_extra),
                               run_cmd(model, keys, attack.threshold, states[1], attack.run_extra)], cwd=world.tmp)
    _check_audit(audit_r, attack.audit)
    _check_run(run_r, attack.run, world.clean_out)
    return audit_r, run_r


# ---------------------------------------------------------------------------------------------------------
# Key files, read with their own few lines (not shardtool's encoder)


def der_items(der: bytes) -> list[tuple[int, bytes]]:
    """(tag, value) of each DER item in `der`, one level deep."""
    items, i = [], 0
    while i < len(der):
        tag, n = der[i], der[i + 1]
        i += 2
        if n & 0x80:
            width = n & 0x7F
            n, i = int.from_bytes(der[i:i + width], "big"), i + width
        items.append((tag, der[i:i + n]))
        i += n
    return items


def oid(value: bytes) -> str:
    arcs, acc = [], 0
    for b in value:
        acc = (acc << 7) | (b & 0x7F)
        if not b & 0x80:
            arcs.append(acc)
            acc = 0
    first = min(arcs[0] // 40, 2)
    return ".".join(map(str, [first, arcs[0] - 40 * first, *arcs[1:]]))


PBES2, SCRYPT, PBKDF2, AES256_CBC = ("1.2.840.113549.1.5.13", "1.3.6.1.4.1.11591.4.11", "1.2.840.113549.1.5.12",
                                     "2.16.840.1.101.3.4.1.42")


def pkcs8_encryption(pem: bytes) -> dict:
    """How an ENCRYPTED PRIVATE KEY PEM is protected: scheme, KDF and its parameters, cipher."""
    lines = pem.strip().splitlines()
    assert lines[0] == b"-----BEGIN ENCRYPTED PRIVATE KEY-----", lines[0]
    [(_, info)] = der_items(base64.b64decode(b"".join(lines[1:-1])))
    (_, algorithm), _data = der_items(info)
    (_, scheme), (_, params) = der_items(algorithm)
    out = {"scheme": oid(scheme)}
    (_, kdf), (_, cipher) = der_items(params)
    (_, kdf_oid), (_, kdf_params) = der_items(kdf)
    out["kdf"], out["cipher"] = oid(kdf_oid), oid(der_items(cipher)[0][1])
    fields = der_items(kdf_params)
    out["salt"] = fields[0][1]
    numbers = [int.from_bytes(v, "big") for tag, v in fields[1:] if tag == 0x02]
    if out["kdf"] == SCRYPT:
        out["N"], out["r"], out["p"] = numbers[:3]
    elif out["kdf"] == PBKDF2:
        out["iterations"] = numbers[0]
    return out


def legacy_encrypted_pem(key: Ed25519PrivateKey, passphrase: bytes) -> bytes:
    """A private key as shardtool wrote it before scrypt: cryptography's PKCS#8 BestAvailableEncryption."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(passphrase))
