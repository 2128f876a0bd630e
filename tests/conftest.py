"""Fixtures shared by the whole suite: the public test vectors, fixed Ed25519 keys, exact-class raises, tiny models
built once per session (`tiny`, from tests/_kit), and the pytest-xdist groups.

The vectors live in `tests/vectors/` (byte-exact copies; sources and licences in its README.md), resolved
from this file, never the cwd. A missing vector file fails the test: a vector test that skips proves nothing.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from _kit import xdist_group_of_item
from _kit.models import TinyModels

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTDATA_DIR = REPO_ROOT / "tests" / "vectors"


def _load_testdata(name: str) -> Any:
    return json.loads((TESTDATA_DIR / name).read_text(encoding="utf-8"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vectors(file, argname, extract): parametrize `argname` with the named cases that "
        "extract(json_of(tests/vectors/file)) returns as (id, value) pairs",
    )
    # pytest-xdist's own mark (registered here too, so a run with `-p no:xdist` does not warn about it)
    config.addinivalue_line("markers", "xdist_group(name): run on the same xdist worker as the group's other tests")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per vector, named by its id: a failing vector is reported by name, not as 'case 37'."""
    for marker in metafunc.definition.iter_markers("vectors"):
        file, argname, extract = marker.args
        cases = list(extract(_load_testdata(file)))
        metafunc.parametrize(argname, [value for _, value in cases], ids=[name for name, _ in cases])


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = xdist_group_of_item(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Generated checkpoints, keys and split+signed releases, each built once per session: `tiny.checkpoint(family,
    **knobs)`, `tiny.keypair(name)`, `tiny.release(family, model_id=..., **knobs)`. Shared: read them, or change a
    `_kit.models.fresh_copy` of them."""
    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def testdata() -> Path:
    """The folder of public vectors (`tests/vectors/`)."""
    return TESTDATA_DIR


@pytest.fixture(scope="session")
def load_testdata(testdata: Path) -> Callable[[str], Any]:
    return _load_testdata


@contextlib.contextmanager
def _raises_exactly(cls: type[BaseException], match: str | None = None) -> Iterator[pytest.ExceptionInfo]:
    with pytest.raises(cls, match=match) as info:
        yield info
    assert type(info.value) is cls, f"expected exactly {cls.__name__}, got {type(info.value).__name__}: {info.value}"


@pytest.fixture(scope="session")
def raises_exactly() -> Callable[..., contextlib.AbstractContextManager]:
    """Like pytest.raises, but a subclass is a failure: the tests pin the exact error class."""
    return _raises_exactly


@pytest.fixture(scope="session")
def ed25519_keys() -> list:
    """Five fixed Ed25519 keys (shardtool.keys.PrivateKey) from seeds 0x01.., 0x02.., ...: reproducible runs."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shardtool.keys import PrivateKey

    return [PrivateKey(Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32)) for i in range(1, 6)]


@pytest.fixture
def header_parses(monkeypatch) -> list[bytes]:
    """The safetensors headers really parsed from here on (a header memo's misses), in order."""
    import shardtool.safetensors_format as sf

    calls: list[bytes] = []
    real = sf.parse_header

    def counted(header: bytes, *, file_size: int):
        calls.append(header)
        return real(header, file_size=file_size)
    monkeypatch.setattr(sf, "parse_header", counted)
    return calls
