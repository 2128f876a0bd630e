"""The split layout (docs/shard-layout.md): where each shard of a model lives, and what a path in it is.

The one home of this knowledge: split writes these paths, the manifest classifies them, the runtime asks
for them.

    trunk/embed.safetensors                      token embedding
    trunk/layer-LLL.safetensors                  one decoder layer without its routed experts
    trunk/head.safetensors                       final norm + lm_head
    trunk/extra.safetensors                      anything else outside the layers
    experts/layer-LLL/expert-EEEE.safetensors    one routed expert of one layer
"""

from __future__ import annotations

import re
from pathlib import Path

EMBED = "trunk/embed.safetensors"
HEAD = "trunk/head.safetensors"
EXTRA = "trunk/extra.safetensors"

_EXPERT = re.compile(r"experts/layer-(\d{3,5})/expert-(\d{4,7})\.safetensors")
_TRUNK_LAYER = re.compile(r"trunk/layer-(\d{3,5})\.safetensors")
CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                             "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                             "tiktoken.model"})


def trunk_path(layer: int) -> str:
    return f"trunk/layer-{layer:03d}.safetensors"


def expert_path(layer: int, expert: int) -> str:
    return f"experts/layer-{layer:03d}/expert-{expert:04d}.safetensors"


def classify(relpath: str) -> tuple[str, int | None, int | None]:
    """(kind, layer, expert) for a path of the split layout; `other` when it is none of the layout's."""
    m = _EXPERT.fullmatch(relpath)
    if m:
        return "expert", int(m.group(1)), int(m.group(2))
    m = _TRUNK_LAYER.fullmatch(relpath)
    if m:
        return "trunk", int(m.group(1)), None
    if relpath.startswith("trunk/") and relpath.endswith(".safetensors"):
        return "trunk", None, None
    if relpath in CONFIG_FILES:
        return "config", None, None
    if relpath in TOKENIZER_FILES:
        return "tokenizer", None, None
    return "other", None, None


def model_dir(path: Path) -> Path:
    """A model directory given by a user: it must exist and be a directory (named before anything is read)."""
    from shardtool.errors import UsageError

    if not path.exists():
        raise UsageError("directory does not exist", path=str(path))
    if not path.is_dir():
        raise UsageError("not a directory", path=str(path))
    return path
