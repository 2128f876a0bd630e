"""Two changes to typer's private hooks, each made only where this module finds the hook it expects.

Option values of the plain types (str, int, float, bool, Path, and lists of them) converted without
pydantic. typer converts every parameter through a pydantic TypeAdapter: importing pydantic and building the
adapters cost about 0.25 CPU-seconds at every start (measured on `shardtool audit` of one file: 0.84 s of
CPU in all, 0.59 s without), a quarter of a warm audit of 2 GiB. Every other annotation, and any option
with a custom parser or clamping, still goes through typer's own conversion.

Help without a type placeholder for a flag: typer's rich help prints `<bool>` beside every flag (`--json
<bool>`, `--help <bool>`), as if the flag took a value; its plain help already leaves flags out.

`install()` is called once by `run_app`; it changes nothing if typer's hooks are not where this module expects
them (another typer version).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, get_args, get_origin

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"", "0", "off", "f", "false", "n", "no"})
_PLAIN = (str, int, float, bool)


def install() -> None:
    _install_flag_help()
    _install_plain_conversion()


def _install_flag_help() -> None:
    try:
        from typer.core import TyperOption
    except ImportError:
        return
    typer_display = getattr(TyperOption, "display_type_rich", None)
    if typer_display is None or getattr(typer_display, "_shardtool_flags", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> Any:
        if getattr(self, "is_flag", False) or getattr(self, "count", False):  # a flag takes no value to name
            return None
        return typer_display(self, ctx)

    display_type_rich._shardtool_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich


def _plain_bool(value: Any, bad: Callable[[str], Exception]) -> bool:
    """A command-line word (or a bool given in code) as a boolean; `bad(message)` is the error for anything else."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise bad(f"{value!r} is not a valid boolean")


def _plain_number(kind: type, info: Any, value: Any, bad: Callable[[str], Exception]) -> Any:
    """`value` as an int or float (`kind`) within the option's min and max; `bad(message)` is the error
    otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise bad(f"{value!r} is not a valid {kind.__name__}")
    try:
        number = kind(value.strip() if isinstance(value, str) else value)
    except (ValueError, OverflowError):
        raise bad(f"{value!r} is not a valid {kind.__name__}") from None
    if info.min is not None and number < info.min:
        raise bad(f"{number} is below the minimum {info.min}")
    if info.max is not None and number > info.max:
        raise bad(f"{number} is above the maximum {info.max}")
    return number


def _install_plain_conversion() -> None:
    try:
        import typer._coercion as coercion
        import typer.core as core
        from typer._click.exceptions import BadParameter
        from typer._param_types import coerce_cli_path
    except ImportError:
        return
    typer_build = getattr(coercion, "build_runtime_param", None)
    if typer_build is None or getattr(core, "build_runtime_param", None) is not typer_build:
        return

    @dataclass(frozen=True)
    class PlainRuntimeParam(coercion.RuntimeParam):
        kind: type = str

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            if isinstance(value, (list, tuple)):
                return [self._one(v, param, ctx) for v in value]
            return self._one(value, param, ctx)

        def _one(self, value: Any, param: Any, ctx: Any) -> Any:
            info = self.parameter_info
            if issubclass(self.kind, Path):
                path_type = info.path_type or self.kind
                if isinstance(value, str) and isinstance(path_type, type) and issubclass(path_type, Path):
                    value = path_type(value)  # what typer's adapter would make of it, without pydantic
                return coerce_cli_path(value, info, path_type=path_type, param=param, ctx=ctx)
            if isinstance(value, bytes):
                value = os.fsdecode(value)
            if self.kind is str:
                return str(value)

            def bad(message: str) -> Exception:
                return BadParameter(message, ctx=ctx, param=param)
            if self.kind is bool:
                return _plain_bool(value, bad)
            return _plain_number(self.kind, info, value, bad)

    def build_runtime_param(descriptor: Any) -> Any:
        annotation = descriptor.annotation
        inner = get_args(annotation)[0] if get_origin(annotation) is list and len(get_args(annotation)) == 1 \
            else annotation
        info = descriptor.parameter_info
        plain = inner in _PLAIN or (isinstance(inner, type) and issubclass(inner, Path))
        if (plain and descriptor.file_annotation is None and getattr(info, "parser", None) is None
                and not getattr(info, "clamp", False)):
            return PlainRuntimeParam(annotation=annotation, parameter_info=info, kind=inner)
        return typer_build(descriptor)

    coercion.build_runtime_param = build_runtime_param
    core.build_runtime_param = build_runtime_param
