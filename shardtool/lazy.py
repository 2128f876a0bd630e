"""A package's public names loaded from their home module at first use (PEP 562), so importing the package runs
none of its modules and a command loads only the ones it needs."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(namespace: dict[str, Any], homes: Mapping[str, tuple[str, ...]]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """(`__all__`, `__getattr__`, `__dir__`) for the package whose globals are `namespace`; `homes` maps each of its private
    modules to the names it exports. A name is looked up once, then kept in the package's globals."""
    package = namespace["__name__"]
    home_of: dict[str, str] = {}
    for module, names in homes.items():
        for name in names:
            if name in home_of:  # one home each: a second would shadow the first without a word
                raise ValueError(f"{package}: {name!r} is exported by both {home_of[name]} and {module}")
            home_of[name] = module

    def __getattr__(name: str) -> Any:
        module = home_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *home_of})

    return sorted(home_of), __getattr__, __dir__
