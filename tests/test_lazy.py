"""A package's lazy exports (shardtool/lazy.py): each name from its one home, loaded once; unknown names and a name
with two homes refused."""

from __future__ import annotations

import sys

import pytest

from shardtool.lazy import lazy_exports


def test_manifest_and_serve_export_exactly_their_homes() -> None:
    import shardtool.manifest as manifest
    import shardtool.serve as serve
    for package in (manifest, serve):
        assert package.__all__ == sorted(name for names in package._HOMES.values() for name in names)
        assert set(package.__all__) <= set(dir(package))


def test_a_name_is_loaded_from_its_home_once() -> None:
    namespace = {"__name__": "shardtool.manifest"}
    names, getattr_, _ = lazy_exports(namespace, {"_records": ("MAX_LAYER",)})
    from shardtool.manifest._records import MAX_LAYER
    assert names == ["MAX_LAYER"]
    assert getattr_("MAX_LAYER") == MAX_LAYER
    assert namespace["MAX_LAYER"] == MAX_LAYER  # kept: the next lookup never reaches __getattr__
    assert "shardtool.manifest._records" in sys.modules


BAD = {
    "unknown-name": ({"_records": ("MAX_LAYER",)}, "nope", AttributeError),
    "private-module-name": ({"_records": ("MAX_LAYER",)}, "_records", AttributeError),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_lookups(case: str) -> None:
    homes, name, error = BAD[case]
    _, getattr_, _ = lazy_exports({"__name__": "shardtool.manifest"}, homes)
    with pytest.raises(error, match=f"has no attribute '{name}'"):
        getattr_(name)


def test_a_name_with_two_homes_is_refused() -> None:
    with pytest.raises(ValueError, match="'Entry' is exported by both _records and _document"):
        lazy_exports({"__name__": "shardtool.manifest"}, {"_records": ("Entry",), "_document": ("Entry",)})
