"""TEMPORARY until the engine lands on main: stand-ins for the runtime's engine types (same fields)."""

from __future__ import annotations

from dataclasses import dataclass

import shardtool.runtime as _rt

if not hasattr(_rt, "TokenEvent"):
    @dataclass(frozen=True)
    class SamplingParams:
        max_new_tokens: int
        temperature: float = 0.0
        top_p: float = 1.0
        seed: int | None = None
        stop_token_ids: tuple[int, ...] | None = None

    @dataclass(frozen=True)
    class TokenEvent:
        token: int

    @dataclass(frozen=True)
    class FinishEvent:
        reason: str

    @dataclass(frozen=True)
    class ErrorEvent:
        status: int
        message: str
        error: BaseException

    _rt.SamplingParams, _rt.TokenEvent, _rt.FinishEvent, _rt.ErrorEvent = SamplingParams, TokenEvent, FinishEvent, ErrorEvent
