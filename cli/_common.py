"""Shared CLI plumbing: error-to-exit-code mapping, stderr messages, JSON output."""

from __future__ import annotations

import contextvars
import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from shardtool.text import printable, printable_lines
from shardtool.errors import EXIT_CRASH, EXIT_IO, EXIT_USAGE, ShardtoolError, UsageError, VerificationError
from shardtool.layout import model_dir  # noqa: F401 - the commands check DIR with it
from shardtool.sizes import MAX_MEMORY_BUDGET, parse_size  # noqa: F401 - the commands' sizes


MANIFEST_HELP = "Manifest file (default: DIR/manifest.msgpack)."

DISK_GBPS_HELP = "Disk read bandwidth in GB/s (10^9 bytes a second; reports print it in GiB/s)."


def disk_rate(gbps: float) -> str:
    """--disk-gbps (typed in GB/s, 10^9 bytes a second) as reports print rates."""
    from shardtool.text import format_rate
    return format_rate(gbps * 1e9)


# The role of the command running: a verifier's verdict on bad input is "untrustworthy" (exit 1); for a
# producer (keygen, split, manifest, sign, prove, inspect) the same errors mean "malformed input" (exit 2).
_ROLE: contextvars.ContextVar[str] = contextvars.ContextVar("shardtool_command_role", default="verifier")


def producer(command: Callable) -> Callable:
    """Mark a command as a producer: the one place where its errors get their producer's exit codes."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        _ROLE.set("producer")
        return command(*args, **kwargs)
    return run


def exit_code(err: ShardtoolError) -> int:
    """The exit code of an error, by the role of the command that met it."""
    if _ROLE.get() == "producer" and isinstance(err, VerificationError):
        return EXIT_USAGE
    return err.exit_code


def manifest_path(directory: Path, override: Optional[Path]) -> Path:
    from shardtool.manifest import default_manifest_path
    return override if override is not None else default_manifest_path(directory)


def relative_inside(directory: Path, path: Path) -> list[str]:
    """The manifest file's own path relative to DIR, when it lives there (it is not a model file)."""
    from shardtool.manifest import manifest_relpath

    rel = manifest_relpath(directory, path)
    return [rel] if rel is not None else []


def load_trusted(paths: list[Path]) -> list:
    from shardtool.keys import load_public_key
    if not paths:
        raise UsageError("no trusted public key given", hint="pass --trust KEY.pub (repeatable)")
    return [load_public_key(p) for p in paths]


PLAN_TRUST_HELP = "Operator public key the cluster plan's signature (PLAN.sig) must verify with (repeatable)."
CLUSTER_GRAPH_HELP = ("Each MoE layer's calls to the nodes through a Ray Compiled Graph instead of plain actor calls "
                      "(falls back to plain calls, saying so, if the graph fails). Faster rounds, but Ray's channel "
                      "readers busy-wait: each node spends a core while this coordinator is connected.")
INSECURE_CLUSTER_HELP = ("Use a Ray head that does not enforce token authentication (RAY_AUTH_MODE=token): anyone "
                         "who reaches it could join and run code here. Warns on every start.")


def check_cluster_options(cluster: Optional[str], plan_file: Optional[Path], remote_timeout: float,
                          plan_trust: list[Path] | None = None, insecure: bool = False, graph: bool = False) -> None:
    """verify-and-run's and serve's --cluster, --plan, --plan-trust, --insecure-cluster, --cluster-graph and
    --remote-timeout, before anything is read."""
    import math

    if (cluster is None) != (plan_file is None):
        raise UsageError("--cluster and --plan go together")
    if cluster is not None and not 1 <= len(cluster) <= 300:
        raise UsageError("--cluster must be the Ray head's HOST:PORT")
    if not math.isfinite(remote_timeout):
        raise UsageError(f"--remote-timeout must be a number of seconds, got {remote_timeout}")
    if cluster is not None and not plan_trust:
        raise UsageError("--cluster needs --plan-trust OPERATOR.pub: the plan's signature is checked before it is used")
    if cluster is None and (plan_trust or insecure or graph):
        raise UsageError("--plan-trust, --insecure-cluster and --cluster-graph need --cluster")


def cluster_args(cluster: Optional[str], plan_file: Optional[Path], plan_trust: list[Path], insecure: bool,
                 remote_timeout: float, graph: bool = False) -> dict:
    """The checked cluster options as `open_model`'s arguments (none without --cluster)."""
    if cluster is None:
        return {}
    return dict(cluster=cluster, plan=plan_file, plan_trust=plan_trust, insecure_cluster=insecure,
                cluster_timeout=remote_timeout, cluster_graph=graph)


CACHE_POLICY_HELP = ("Which cached shard is evicted first: lru, lfu or lfu-da (LFU with dynamic aging); default: "
                     "the runtime's choice, named in the report.")


def check_cache_policy(name: str | None) -> str | None:
    """--cache-policy: one of the runtime's policies (None: its default). Call after `set_compute_threads`: it
    loads the runtime, and so numpy; no file has been read yet."""
    if name is None:
        return None
    from shardtool.runtime import CACHE_POLICIES

    if name not in CACHE_POLICIES:
        raise UsageError(f"--cache-policy must be one of {', '.join(CACHE_POLICIES)}, got '{printable(name[:40])}'")
    return name


PAGE_CACHE_HELP = ("What a verified read leaves in the kernel's page cache: keep (the next process reads the model "
                   "from memory), drop (POSIX_FADV_DONTNEED after the read: under a memory cap that counts the page "
                   "cache, the shard cache alone decides what stays), direct (O_DIRECT: nothing is cached) or auto "
                   "(the default: keep when the shard cache holds the whole model, else drop); the report names it.")


def check_page_cache(name: str | None) -> str | None:
    """--page-cache: auto or one of the verified read's modes (None: the runtime's default). Loads neither the runtime
    nor numpy: it runs with the first option checks, before any file (a receipt key) is read."""
    from shardtool.manifest import PAGE_CACHE_CHOICES

    if name is None:
        return None
    if name not in PAGE_CACHE_CHOICES:
        raise UsageError(f"--page-cache must be one of {', '.join(PAGE_CACHE_CHOICES)}, got '{printable(name[:40])}'")
    return name


LOOKAHEAD_HELP = ("Predict each next layer's experts with its router and start reading and verifying them while "
                  "the current layer computes (not with --cluster). Off by default: on 2 busy cores it did not "
                  "halve the time waiting for shards (benchmarks/bench_runtime.py part e).")


def load_operator_key(key: Path, passphrase_file: Optional[Path], option: str = "--receipt-passphrase-file"):
    """The operator's private key that signs run receipts (verify-and-run and serve) or a cluster plan (plan), or a
    node's key (node), loaded at start: a missing file, a wrong passphrase or a malformed key fails here, before
    any work. `option`: the command's name for the passphrase file."""
    from shardtool.cli._passphrase import get_passphrase
    from shardtool.keys import load_private_key
    return load_private_key(key, lambda: get_passphrase(passphrase_file, new_key=False, option=option))


def unpinned_warning(model_id: str) -> str:
    """What a verifier says when the operator did not pin the model: any model the keys signed would pass."""
    return (f"warning: no --model-id given: any model these keys signed is accepted; pass --model-id {model_id} "
            "to refuse the others")


def say(message: str) -> None:
    """Human text goes to stderr so stdout stays clean for --json. Control characters are escaped on
    every line (a safety net: untrusted names are escaped where they are quoted, with `printable`)."""
    print(printable_lines(message), file=sys.stderr, flush=True)


def emit_json(document: Any) -> None:
    # allow_nan=False: NaN and Infinity are not JSON; a figure that overflowed is a bug to see, not to print.
    import json  # here: only --json runs print it

    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n")
    sys.stdout.flush()


def run_app(app: typer.Typer, args: list[str] | None = None, *, group: bool = False) -> None:
    """Run a typer app: every error is one line on stderr and a distinct exit code. `group`: run it as a
    group of commands even when only one is registered (typer would make a lone command the program).

    Our errors carry their own exit code; typer's usage errors (unknown flag, bad value) exit 2. Any other
    exception is a bug: its traceback is printed and the exit code is EXIT_CRASH (70), never a fake verdict.
    """
    from shardtool.cli import _params

    _params.install()
    command = typer.main.get_group(app) if group else typer.main.get_command(app)
    name = app.info.name
    _ROLE.set("verifier")  # until a producer command starts (an earlier in-process call may have set it)
    try:
        rv = command.main(args=args, prog_name=name, standalone_mode=False)
    except ShardtoolError as err:
        say(f"{name}: error: {err.one_line()} [{type(err).__name__}]")
        sys.exit(exit_code(err))
    except typer.Exit as ex:  # raised by commands for a chosen exit code (and by --help)
        sys.exit(ex.exit_code)
    except typer.Abort:
        say(f"{name}: aborted")
        sys.exit(EXIT_USAGE)
    except typer.TyperException as ex:  # click's UsageError / BadParameter, as vendored by typer
        message = ex.format_message() if hasattr(ex, "format_message") else str(ex)
        ctx = getattr(ex, "ctx", None)
        where = ctx.command_path if ctx is not None else name
        say(f"{name}: usage error: {' '.join(message.split())} (see {where} --help) [UsageError]")
        sys.exit(getattr(ex, "exit_code", EXIT_USAGE))
    except OSError as e:  # a path the operator named that the system refuses (too long, no space, ...)
        where = f"{printable(os.fsdecode(e.filename))}: " if e.filename is not None else ""
        say(f"{name}: error: {where}{e.strerror or e} [StorageError]")
        sys.exit(EXIT_IO)
    except KeyboardInterrupt:
        say(f"{name}: interrupted")
        sys.exit(EXIT_IO)
    except Exception:  # noqa: BLE001 - not caught to be hidden: printed whole, with a code no verdict uses
        traceback.print_exc()
        say(f"{name}: internal error: the traceback above is a bug in shardtool, not a verdict on the input "
            f"(exit {EXIT_CRASH})")
        sys.exit(EXIT_CRASH)
    sys.exit(rv if isinstance(rv, int) else 0)


_BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def set_compute_threads(threads: int, readers: int) -> int:
    """Give the forward pass `threads` compute threads (0: the cores the readers leave free, at least 1) and return
    how many. Every weight product runs in the runtime's native kernels (`_packed.set_threads`), so OpenBLAS, which
    is left only attention's small products, gets one thread: its pool spins and runs in lock-step, and on cores
    shared with the reader pool or a busy machine one descheduled thread stalls every product (streaming decode
    measured 2-8x slower with 2 BLAS threads + 2 readers on 2 loaded cores); kernel threads plus BLAS's would also
    be more threads than cores. Without the kernels (SHARDTOOL_KERNELS=0) OpenBLAS gets the threads instead. Sized
    before numpy loads; an OpenBLAS variable already in the environment is left as it is."""
    if threads == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores - readers)
    native = os.environ.get("SHARDTOOL_KERNELS", "1") != "0"
    if "numpy" not in sys.modules and not any(v in os.environ for v in _BLAS_THREAD_VARS):
        os.environ["OPENBLAS_NUM_THREADS"] = "1" if native else str(threads)
    from shardtool.runtime import MAX_KERNEL_THREADS, native_kernels, set_kernel_threads

    threads = min(threads, MAX_KERNEL_THREADS)
    set_kernel_threads(threads)
    if native and native_kernels() is None:  # not built (no C compiler at install): numpy multiplies, slower
        say(f"warning: shardtool's native kernels are not built; weights are multiplied by numpy on "
            f"{os.environ.get('OPENBLAS_NUM_THREADS', 'its own')} BLAS thread(s) (reinstall with a C compiler)")
    return threads


# Seconds a thread holding the GIL runs before a waiting one gets it (Python's default is 5 ms).
READER_SWITCH_INTERVAL = 0.0005


def share_gil_with_readers() -> None:
    """Reader threads give the GIL up around every 1 MiB read and hash and need it back to go on; while the forward
    pass holds it, each return waits up to the switch interval, so at Python's 5 ms a prefetched expert was seldom
    ready when its layer came. Set with --lookahead (a 6-layer bf16 model with 786 KB experts, shard cache of a
    quarter of them, 3 runs each on 2 busy cores: time waiting for experts with lookahead 0.21-0.32 s at 0.5 ms
    against 0.35-0.60 s at 5 ms; without lookahead 0.33-0.75 s at 5 ms and 0.52-0.70 s at 0.5 ms, no clear change)."""
    sys.setswitchinterval(READER_SWITCH_INTERVAL)


def keep_freed_memory() -> None:
    """glibc hands blocks above a dynamic threshold (128 KiB at start) back to the kernel when freed, so the
    float32 copy of every bf16/FP8 weight, made again each token, arrives as fresh zero-filled pages: ~28k
    page faults and 3x slower decode per token on a bf16 model (benchmarks/bench_runtime.py). Keep blocks up
    to 32 MiB in the heap for reuse; the budget's working reserve already counts these copies."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not a C library with mallopt: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt(m_mmap_threshold, 32 * 2**20)
    mallopt(m_trim_threshold, 32 * 2**20)
