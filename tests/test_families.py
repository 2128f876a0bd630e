"""Model-family knowledge has one home, the family table (shardtool/families.py): no other source module names
a family, a model_type or an architecture, so adding a family is adding a row. Read from the source text with
`ast` (string literals, docstrings included), nothing is imported from the scanned modules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _kit.source import constants
from shardtool.errors import CheckpointFormatError
from shardtool.families import BY_NAME, TABLE, detect_family, find_family, moe_layers
from shardtool.hf_config import CONTRACT_INT_CAPS, INT_CAPS, ConfigReader

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("shardtool", "keys", "manifest", "checkpoint", "runtime", "cli")  # not examples/, tests/
TABLE_MODULE = Path("shardtool/families.py")


def _names() -> set[str]:
    return {n for f in TABLE for n in (f.name, *f.model_types, *f.architectures)}


def _mentions(root: Path) -> list[str]:
    """`path:line: 'literal'` for every string literal outside the table naming a family."""
    rx = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, sorted(_names(), key=len, reverse=True)))
                    + r")(?![A-Za-z0-9_])")
    return [f"{rel}:{line}: {rx.search(value)[0]!r}" for rel, line, value in constants(root, SOURCE_DIRS, TABLE_MODULE)
            if isinstance(value, str) and rx.search(value)]


def test_family_names_appear_only_in_the_table():
    assert _mentions(REPO) == []


def test_the_check_sees_a_family_name_outside_the_table(tmp_path):
    """The test above can fail: a planted `family == "qwen2_moe"` and an architecture name are reported."""
    for folder in SOURCE_DIRS:
        (tmp_path / folder).mkdir()
    (tmp_path / "runtime" / "bad.py").write_text('x = family == "qwen2_moe"\ny = {"MixtralForCausalLM": 1}\n')
    (tmp_path / "shardtool" / "families.py").write_text('ROWS = ("qwen2_moe",)\n')  # the table itself may
    assert _mentions(tmp_path) == ["runtime/bad.py:1: 'qwen2_moe'", "runtime/bad.py:2: 'MixtralForCausalLM'"]


def test_rows_do_not_overlap():
    model_types = [mt for f in TABLE for mt in f.model_types]
    archs = [a for f in TABLE for a in f.architectures]
    assert len(model_types) == len(set(model_types)) and len(archs) == len(set(archs))
    for f in TABLE:
        assert find_family({"model_type": f.model_types[0]}) is f
        assert all(detect_family({"architectures": [a]}) == f.name for a in f.architectures)


def test_every_key_a_row_names_has_a_cap():
    """A row cannot name a config key the reader cannot read (ConfigReader.int looks caps up by name)."""
    for f in TABLE:
        for key in (*f.expert_count_keys, *f.experts_per_token_keys, f.expert_size_key, f.dense_size_key,
                    *f.mtp_keys):
            assert key in INT_CAPS and key in CONTRACT_INT_CAPS, (f.name, key)


@pytest.mark.parametrize("name,config,expected", [
    ("mixtral", {}, (True, True, True, True)),
    ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3]}, (False, True, False, False)),
    ("deepseek_v3", {"first_k_dense_replace": 1}, (False, True, True, True)),
    ("llama4", {"moe_layers": [0, 2]}, (True, False, True, False)),
    ("llama4", {"interleave_moe_layer_step": 2}, (False, True, False, True)),
])
def test_moe_layer_rules(name, config, expected):
    assert moe_layers(BY_NAME[name], ConfigReader(config, BY_NAME[name].defaults), 4) == expected


def test_a_field_without_a_cap_cannot_be_read(raises_exactly):
    with pytest.raises(KeyError):
        ConfigReader({"no_such_field": 3}).int("no_such_field")
    with raises_exactly(CheckpointFormatError, match="num_hidden_layers is 4097, above the cap of 4096"):
        ConfigReader({"num_hidden_layers": 4097}).int("num_hidden_layers")
