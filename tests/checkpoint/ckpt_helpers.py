"""Helpers shared by the checkpoint tests. Imported by module name (`from ckpt_helpers import ...`):
`from conftest import` would resolve to whichever conftest.py the whole suite imported first."""

from __future__ import annotations

from pathlib import Path

NOW = 1_800_000_000  # fixed clock: manifests are reproducible


def tensors_of(directory: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, bytes) over every safetensors file, read by the reference implementation."""
    import safetensors

    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, t in safetensors.deserialize(path.read_bytes()):
            assert name not in out
            out[name] = (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
    return out


def join_unsigned(out: Path, rebuilt: Path, **kwargs):
    """join from a split's own unsigned manifest (what `join --insecure-no-verify` does): every file is
    still checked against the entries."""
    from shardtool.checkpoint import join_checkpoint
    from shardtool.manifest import load_manifest

    return join_checkpoint(out, rebuilt, load_manifest(Path(out) / "manifest.msgpack"), **kwargs)


def serialize(tensors, metadata=None) -> bytes:
    """A whole safetensors file from (TensorSpec, bytes) pairs, in the order given: our writer's header
    encoding, for tests that compare it with the reference writer."""
    from shardtool.checkpoint import encode_header

    items = list(tensors)
    for spec, data in items:
        assert len(data) == spec.nbytes, (spec, len(data))
    return encode_header([s for s, _ in items], metadata) + b"".join(bytes(d) for _, d in items)
