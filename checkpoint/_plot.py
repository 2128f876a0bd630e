"""The resource contract as a picture (`inspect --plot`): seconds per token against the memory budget at one disk
speed, cold and with the cache's expected hit rate (`_contract.seconds_per_token_at`), the memory floor as a vertical
line, and measured runs (verify-and-run's --json-report) as points on the same axes. SVG written by hand: no
plotting library, and every string in it escaped (a model ID or a file name is text, not markup)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence
from xml.sax.saxutils import escape, quoteattr

from shardtool.checkpoint._contract import estimate, seconds_per_token_at
from shardtool.errors import CheckpointFormatError
from shardtool.text import format_rate, format_size, printable

WIDTH, HEIGHT = 720, 440
LEFT, RIGHT, TOP, BOTTOM = 80, 24, 44, 64  # the plot area's margins, pixels
MAX_BUDGET = 1 << 62  # bytes: a report's budget beyond this is not a budget
MIN_RATE, MAX_RATE = 1e-6, 1e9  # decoded tokens per second a run report may claim (a token in 11.6 days .. 1 ns)
GIB = 2**30


@dataclass(frozen=True)
class MeasuredPoint:
    """One run: its memory budget, its measured seconds per decoded token, and what to call it."""

    memory_bytes: int
    seconds_per_token: float
    label: str

    def __post_init__(self) -> None:
        if not 0 < self.memory_bytes <= MAX_BUDGET:
            raise ValueError(f"memory_bytes must be in 1..2^62, got {self.memory_bytes}")
        if not (math.isfinite(self.seconds_per_token) and self.seconds_per_token > 0):
            raise ValueError(f"seconds_per_token must be a positive number, got {self.seconds_per_token}")


def measured_point(report: Any, where: str) -> MeasuredPoint:
    """The point of one verify-and-run --json-report document (`where`: its file, for messages). Reads only
    `budget.total` (the run's memory budget) and `decode_tokens_per_s`; anything else in it is not looked at."""
    if not isinstance(report, Mapping):
        raise CheckpointFormatError(f"a run report is a JSON object (verify-and-run --json-report), got "
                                    f"{type(report).__name__}", path=where)
    budget = report.get("budget")
    total = budget.get("total") if isinstance(budget, Mapping) else None
    if type(total) is not int or not 0 < total <= MAX_BUDGET:
        raise CheckpointFormatError(f"budget.total must be the run's memory budget in bytes (1..2^62), got "
                                    f"{printable(repr(total)[:40])}", path=where)
    rate = report.get("decode_tokens_per_s")
    if rate is None:
        raise CheckpointFormatError("decode_tokens_per_s is null: the run decoded too few tokens to measure a rate "
                                    "(run with --max-new-tokens 2 or more)", path=where)
    # A range, not just > 0: 1 / rate of a tiny rate is inf seconds (or the axes' tenth more is), and an int past a
    # float's range does not convert (compared exactly here; NaN compares false).
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not MIN_RATE <= rate <= MAX_RATE:
        raise CheckpointFormatError(f"decode_tokens_per_s must be a number of tokens per second in "
                                    f"[{MIN_RATE:g}, {MAX_RATE:g}], got {printable(repr(rate)[:40])}", path=where)
    return MeasuredPoint(total, 1.0 / rate, where)


@dataclass(frozen=True)
class Axes:
    """Data to pixels: x is the memory budget in bytes from 0 to `x_max`, y seconds per token from 0 to `y_max`."""

    x_max: float
    y_max: float

    def x(self, memory_bytes: float) -> float:
        return LEFT + memory_bytes / self.x_max * (WIDTH - LEFT - RIGHT)

    def y(self, seconds: float) -> float:
        return HEIGHT - BOTTOM - seconds / self.y_max * (HEIGHT - TOP - BOTTOM)


def _nice_step(span: float) -> float:
    """A step of 1, 2 or 5 times a power of ten giving about five ticks over `span`."""
    raw = span / 5
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def axes_for(contract: Mapping[str, int], *, disk_gbps: float, points: Sequence[MeasuredPoint] = (),
             context_tokens: int | None = None) -> Axes:
    """Room for the whole curve (up to the budget that caches every expert), every point, and a tenth more."""
    est = estimate(contract, disk_gbps=disk_gbps, context_tokens=context_tokens)
    full = est.min_memory_bytes + contract.get("expert_bytes_total", 0)
    x_top = max([full, *(p.memory_bytes for p in points)]) * 1.1 / GIB
    y_top = max([est.seconds_per_token_cold, *(p.seconds_per_token for p in points)]) * 1.1
    x_step = _nice_step(x_top) if x_top > 0 else 1.0
    y_step = _nice_step(y_top) if y_top > 0 else 1.0
    return Axes(math.ceil(x_top / x_step) * x_step * GIB, math.ceil(y_top / y_step) * y_step)


def contract_svg(contract: Mapping[str, int], *, disk_gbps: float, points: Sequence[MeasuredPoint] = (),
                 title: str = "", context_tokens: int | None = None) -> bytes:
    """The picture, as UTF-8 SVG bytes. The element ids `floor`, `cold`, `expected` and `point-N` name its parts."""
    est = estimate(contract, disk_gbps=disk_gbps, context_tokens=context_tokens)
    ax = axes_for(contract, disk_gbps=disk_gbps, points=points, context_tokens=context_tokens)
    floor, cold = est.min_memory_bytes, est.seconds_per_token_cold
    full = floor + contract.get("expert_bytes_total", 0)
    expected = [(floor, cold), (min(full, ax.x_max), seconds_per_token_at(
        contract, min(full, int(ax.x_max)), disk_gbps=disk_gbps, context_tokens=context_tokens)), (ax.x_max, 0.0)]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>',
           f'<text x="{LEFT}" y="20" font-size="14">{escape(printable(title))}</text>',
           f'<text x="{LEFT}" y="36" fill="#555">seconds per token against memory budget, disk {disk_gbps:g} GB/s '
           f'({escape(format_rate(disk_gbps * 1e9))})</text>']
    out += _grid(ax)
    # Below the floor the runtime refuses to start: shaded.
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{max(0.0, ax.x(floor) - LEFT):.2f}" '
               f'height="{HEIGHT - TOP - BOTTOM}" fill="#eee"/>')
    out.append(f'<line id="floor" x1="{ax.x(floor):.2f}" y1="{TOP}" x2="{ax.x(floor):.2f}" y2="{HEIGHT - BOTTOM}" '
               f'stroke="#b00" stroke-dasharray="5 3"/>')
    out.append(f'<text x="{ax.x(floor) + 4:.2f}" y="{TOP + 12}" fill="#b00">floor {escape(format_size(floor))}'
               f'</text>')
    out.append(_polyline("cold", [(floor, cold), (ax.x_max, cold)], ax, "#999"))
    out.append(_polyline("expected", expected, ax, "#36c"))
    for i, p in enumerate(points):
        out.append(f'<circle id="point-{i}" cx="{ax.x(p.memory_bytes):.2f}" cy="{ax.y(p.seconds_per_token):.2f}" '
                   f'r="4" fill="#e80"><title>{escape(printable(p.label))}: {p.seconds_per_token:.4g} s/token at '
                   f'{escape(format_size(p.memory_bytes))}</title></circle>')
    legend = [("#999", "cold (every selected expert read)"), ("#36c", "expected hit rate (even routing)")]
    if points:
        legend.append(("#e80", "measured runs"))
    x = LEFT
    for colour, text in legend:
        out.append(f'<rect x="{x}" y="{HEIGHT - 23}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{x + 14}" y="{HEIGHT - 14}">{escape(text)}</text>')
        x += 14 + 7 * len(text) + 20  # about 7 pixels a character at 12 px
    out.append("</svg>\n")
    return "\n".join(out).encode("utf-8")


def _grid(ax: Axes) -> list[str]:
    """The axes, their ticks (GiB across, seconds up) and their names."""
    base = HEIGHT - BOTTOM
    out = [f'<line x1="{LEFT}" y1="{base}" x2="{WIDTH - RIGHT}" y2="{base}" stroke="#333"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base}" stroke="#333"/>']
    x_step = _nice_step(ax.x_max / GIB) * GIB
    for i in range(int(round(ax.x_max / x_step)) + 1):
        x = ax.x(i * x_step)
        out.append(f'<line x1="{x:.2f}" y1="{base}" x2="{x:.2f}" y2="{base + 5}" stroke="#333"/>'
                   f'<text x="{x:.2f}" y="{base + 18}" text-anchor="middle">{i * x_step / GIB:g}</text>')
    y_step = _nice_step(ax.y_max)
    for i in range(int(round(ax.y_max / y_step)) + 1):
        y = ax.y(i * y_step)
        out.append(f'<line x1="{LEFT - 5}" y1="{y:.2f}" x2="{WIDTH - RIGHT}" y2="{y:.2f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 8}" y="{y + 4:.2f}" text-anchor="end">{i * y_step:g}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{base + 34}" text-anchor="middle">memory budget (GiB)'
               f'</text>')
    out.append(f'<text transform="rotate(-90)" x="{-(TOP + base) / 2}" y="20" text-anchor="middle">seconds per '
               f'token</text>')
    return out


def _polyline(ident: str, data: Sequence[tuple[float, float]], ax: Axes, colour: str) -> str:
    points = " ".join(f"{ax.x(m):.2f},{ax.y(s):.2f}" for m, s in data)
    return (f'<polyline id={quoteattr(ident)} points="{points}" fill="none" stroke="{colour}" '
            f'stroke-width="2"/>')
