"""The fuzz oracle and shared strategies.

`only_our_errors(fn, *args)` calls a parser on hostile input and enforces the contract: it returns, or raises
a ShardtoolError subclass; any other exception, a call that runs for seconds (a hang), or an allocation beyond
a fixed budget (unbounded allocation: the address-space limit turns it into a MemoryError) fails the test
with the input attached.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import msgpack
from hypothesis import strategies as st

from shardtool.errors import ShardtoolError

WATCHDOG_SECONDS = 10  # no single parse of a <= 64 KiB input may take this long, however loaded the machine
# Address space one call may add: the parsers' own caps (4M-item arrays, 64 MiB bins) fit well inside it;
# an allocation sized by a length the input merely *claims* (2^32 items, a 2^62-byte header) does not.
# (RLIMIT_AS rather than tracemalloc: tracing every allocation made the suite six times slower.)
ALLOCATION_BUDGET = 512 * 1024 * 1024
_PAGE = os.sysconf("SC_PAGE_SIZE")


class Hang(BaseException):
    """Raised by the watchdog; a BaseException so no `except Exception` in the code under test swallows it."""


@contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    def fire(signum, frame):
        raise Hang(f"call still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def address_space_budget(extra: int) -> Iterator[None]:
    """Cap this process's address space at its current size + `extra` for the duration of the block."""
    with open("/proc/self/statm") as fh:
        current = int(fh.read().split()[0]) * _PAGE
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = current + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def only_our_errors(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args) -> its result, or the ShardtoolError it raised. Anything else fails the test."""
    started = time.perf_counter()
    try:
        with watchdog(WATCHDOG_SECONDS), address_space_budget(ALLOCATION_BUDGET):
            result = fn(*args, **kwargs)
    except ShardtoolError as e:
        assert str(e), "a ShardtoolError without a message"
        result = e
    except Hang as e:
        raise AssertionError(f"{fn.__name__} hung on {args!r:.300}: {e}") from None
    except MemoryError:
        raise AssertionError(f"{fn.__name__} tried to allocate more than {ALLOCATION_BUDGET} bytes on input "
                             f"{args!r:.300}") from None
    except Exception as e:  # noqa: BLE001 - this is the oracle: anything but our own errors is the bug
        raise AssertionError(f"{fn.__name__} raised {type(e).__name__}: {e} on input {args!r:.300}") from e
    assert time.perf_counter() - started < WATCHDOG_SECONDS
    return result


# --- strategies -----------------------------------------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**64 - 1)
INTERESTING_INTS = st.sampled_from([0, 1, -1, 2**31, 2**32, 2**50, 2**53, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
SCALARS = (st.none() | st.booleans() | INT64 | INTERESTING_INTS | st.floats(allow_nan=True)
           | st.text(max_size=40) | st.binary(max_size=64))


def msgpack_values(max_leaves: int = 25):
    """Any value msgpack can pack: the shapes a hostile document may take."""
    return st.recursive(
        SCALARS,
        lambda children: st.lists(children, max_size=6)
        | st.dictionaries(st.text(max_size=12) | INT64, children, max_size=6),
        max_leaves=max_leaves)


def packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@st.composite
def mutated(draw, original: bytes, max_ops: int = 4) -> bytes:
    """`original` with a few byte-level edits: flips, overwrites, insertions, deletions, truncation, splices."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "duplicate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "duplicate" and data:
            n = draw(st.integers(1, 16))
            data[pos:pos] = data[pos:pos + n]
    return bytes(data)
