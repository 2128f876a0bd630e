"""The streamed-latency arithmetic of the serving bench (benchmarks/_serve_load.py) on canned chunk timings: time
to first token from the request to the first chunk carrying text, inter-token latency as the gaps between such
chunks (a chunk carrying several tokens counted once), TPOT per token, nearest-rank percentiles, and their pooling
over windows.
"""

from __future__ import annotations

import math

import pytest

from benchmarks._serve_load import Load, percentile, stream_latencies, stream_summary, time_per_output_token

# name, sent, arrivals of the chunks carrying text, expected (TTFT, gaps)
STREAMS = [
    ("one_chunk_per_token", 10.0, (10.5, 10.6, 10.7, 10.8), (0.5, (0.1, 0.1, 0.1))),
    ("a_single_chunk", 2.0, (2.25,), (0.25, ())),
    ("uneven_gaps", 0.0, (1.0, 1.5, 4.0), (1.0, (0.5, 2.5))),
    ("two_chunks_at_once", 0.0, (0.2, 0.2, 0.7), (0.2, (0.0, 0.5))),
]


@pytest.mark.parametrize("sent, arrivals, expected", [c[1:] for c in STREAMS], ids=[c[0] for c in STREAMS])
def test_ttft_and_gaps_of_canned_streams(sent, arrivals, expected):
    ttft, gaps = stream_latencies(sent, arrivals)
    assert ttft == pytest.approx(expected[0])
    assert gaps == pytest.approx(expected[1])


BAD_STREAMS = [
    ("no_chunk_carried_text", 0.0, ()),
    ("a_chunk_before_the_request", 5.0, (4.9, 5.1)),
    ("chunks_out_of_order", 0.0, (0.3, 0.2)),
]


@pytest.mark.parametrize("sent, arrivals", [c[1:] for c in BAD_STREAMS], ids=[c[0] for c in BAD_STREAMS])
def test_impossible_streams_are_refused(sent, arrivals):
    with pytest.raises(ValueError):
        stream_latencies(sent, arrivals)


# name, samples, q, expected (nearest rank: the smallest sample with at least q % at or below it)
PERCENTILES = [
    ("median_of_odd", [3.0, 1.0, 2.0], 50, 2.0),
    ("median_of_even_is_the_lower", [4.0, 1.0, 3.0, 2.0], 50, 2.0),
    ("p99_of_100_is_the_99th", [float(i) for i in range(1, 101)], 99, 99.0),
    ("p99_of_63_gaps_is_the_largest", [0.01] * 62 + [0.5], 99, 0.5),
    ("p99_of_200_is_the_198th", [0.01] * 197 + [0.3, 0.4, 0.5], 99, 0.3),
    ("p50_of_200_is_the_100th", [float(i) for i in range(200, 0, -1)], 50, 100.0),
    ("p0_is_the_smallest", [5.0, 7.0], 0, 5.0),
    ("p100_is_the_largest", [5.0, 7.0], 100, 7.0),
]


@pytest.mark.parametrize("xs, q, expected", [c[1:] for c in PERCENTILES], ids=[c[0] for c in PERCENTILES])
def test_nearest_rank_percentile(xs, q, expected):
    assert percentile(xs, q) == expected


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))


TPOTS = [
    ("one_token_has_none", 1.0, 0.2, 1, None),
    ("two_tokens", 1.0, 0.2, 2, 0.8),
    ("per_token_whatever_the_chunking", 3.5, 0.5, 31, 0.1),
]


@pytest.mark.parametrize("seconds, ttft, tokens, expected", [c[1:] for c in TPOTS], ids=[c[0] for c in TPOTS])
def test_time_per_output_token(seconds, ttft, tokens, expected):
    assert time_per_output_token(seconds, ttft, tokens) == (None if expected is None else pytest.approx(expected))


def _window(tokens: int, sent: float, arrivals: tuple[float, ...], seconds: float) -> Load:
    ttft, gaps = stream_latencies(sent, arrivals)
    return Load(1, seconds, tokens, (seconds,), ("x",), None, (), (ttft,), gaps, len(arrivals),
                (time_per_output_token(seconds, ttft, tokens),))


def test_summary_pools_every_request_of_every_window():
    # Request A: 4 tokens in 4 chunks, gaps 0.1; request B: 6 tokens in 3 chunks (two tokens each), gaps 0.3, 0.9.
    a = _window(4, 0.0, (0.2, 0.3, 0.4, 0.5), 0.5)
    b = _window(6, 0.0, (0.6, 0.9, 1.8), 1.8)
    got = stream_summary([a, b])
    gaps = sorted((0.1, 0.1, 0.1, 0.3, 0.9))  # each chunk's gap once: B's gaps are not split per token
    assert got["itl_p50_s"] == pytest.approx(gaps[2])
    assert got["itl_p99_s"] == pytest.approx(0.9)
    assert got["ttft_p50_s"] == pytest.approx(0.2) and got["ttft_p99_s"] == pytest.approx(0.6)
    assert got["tpot_p50_s"] == pytest.approx(0.1) and got["tpot_p99_s"] == pytest.approx(1.2 / 5)
    assert got["tokens_per_chunk"] == pytest.approx(10 / 7)


def test_summary_of_no_streamed_window_is_nan():
    got = stream_summary([Load(1, 1.0, 8, (1.0,), ("x",), None, ())])
    assert all(math.isnan(v) for v in got.values())
