"""Hypothesis profiles for the fuzz suite: "fast" by default (part of `make test`), "long" for `make fuzz`
(`pytest tests/fuzz --hypothesis-profile=long`).

The fuzz tests carry no `@settings(max_examples=...)` of their own, so the profile decides how long they run.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# No deadline: the machine is shared and timings are noisy. Hangs are caught by the per-call watchdog in
# _fuzzkit instead, which turns one call running for seconds into a failure with the input that caused it.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("fast", max_examples=100, **_COMMON)  # hypothesis' own default count
settings.register_profile("long", max_examples=6_000, **_COMMON)


def pytest_configure(config) -> None:
    # Only when no profile was asked for: `--hypothesis-profile=long` (loaded by hypothesis' own plugin) wins.
    if not config.getoption("hypothesis_profile", None):
        settings.load_profile("fast")

