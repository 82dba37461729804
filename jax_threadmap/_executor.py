"""One map from start to end: its runner, its job, its error; fork and exit.

The executor layer, lowest first (``docs/architecture.md``):

- :mod:`._scheduling`: the policy, pure functions and named constants;
- :mod:`._jobs`: a map's chunks (:class:`Job`), claimed and run by any thread;
- :mod:`._pool`: the shared threads behind ``executor=None`` and ``executor=N``;
- :mod:`._runners`: one runner per kind of executor, chosen once per map;
- this module: :func:`run_map`, and what happens at fork and exit.

- Nesting: the thread that starts a map waits and runs nothing, unless it is
  itself running a kernel of a map (a kernel that calls ``threadmap``). Then it
  works on the chunks of its own map while it waits, on whatever pool or thread
  executor that map runs, so it never waits on work queued behind itself: its
  thread (and its place in its own pool) is lent to the nested map. A map that
  fails stops the maps its kernels started.
- Exit: at interpreter exit the maps still in flight (in daemon threads) are
  stopped and their waiting threads released, and the exit waits at most
  ``EXIT_GRACE`` seconds in all for kernels still running. Threads blocked in a
  kernel are left behind; they are daemon threads, so they do not hold up the
  exit.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import threading
import time

from . import _pool, _runners, _validate
from . import _scheduling as policy
from ._errors import ExecutorError, KernelError
from ._jobs import ChunkFn, Job, MapWork, _local, current_job
from ._pool import (
    ThreadPool,
    _Threads,
    default_num_threads,
    get_pool,
    num_threads,
    run_in_background,
)
from ._progress import Progress, progress_enabled
from ._runners import Runner, known_workers, runner_for
from ._scheduling import (
    EXIT_GRACE,
    VECTOR_CHUNK_BYTES,
    available_cpus,
)

__all__ = [
    "ChunkFn",
    "Job",
    "VECTOR_CHUNK_BYTES",
    "MapWork",
    "ThreadPool",
    "_Threads",
    "available_cpus",
    "current_job",
    "default_num_threads",
    "get_pool",
    "known_workers",
    "num_threads",
    "run_in_background",
    "run_map",
]

ENV_NUM_THREADS = _validate.ENV_NUM_THREADS


# --- maps in flight, fork and exit ----------------------------------------------------

#: Every map in flight, with the thread waiting for it. No lock: setting, popping
#: and listing the items of a dict are atomic, in free-threaded builds too.
_flights: dict[Job, threading.Thread] = {}


def _after_fork_in_child() -> None:
    # The parent's threads do not exist in the child, and neither do its maps in
    # flight (a fork from inside a kernel runs none of them here): start afresh.
    # Every lock and pool of the executor layer is replaced: a parent's thread
    # may have held any of them at the fork.
    _pool.reset_after_fork()
    _runners.reset_after_fork()
    _flights.clear()
    _local.job = None


def _at_exit() -> None:
    """Stops the maps in flight and waits at most ``EXIT_GRACE`` seconds in all.

    Only daemon threads can still be waiting for a map here (Python joins the
    others before running atexit). Releasing them lets a thread inside a jitted
    program leave it before the interpreter finalizes (a thread that needs the
    GIL inside XLA then aborts the process).
    """
    deadline = time.monotonic() + EXIT_GRACE
    flights = list(_flights.items())
    for job, _ in flights:
        job.abandon(
            ExecutorError(
                "The interpreter is exiting: this threadmap was stopped before it "
                "finished. Wait for maps running in other threads before the end "
                "of the program, or make those threads non-daemon."
            )
        )
    me = threading.current_thread()
    for t in [waiter for _, waiter in flights] + _pool._threads.exit():
        if t is not me and t.ident is not None:
            t.join(max(0.0, deadline - time.monotonic()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)


# --- one map --------------------------------------------------------------------------


def workers_of(executor: _validate.Executor) -> int:
    """How many kernels ``executor`` runs at once (a guess where it does not say)."""
    return runner_for(executor).workers


def vector_chunk_length(
    work: MapWork, workers: int, max_chunk: int | None = None
) -> int:
    """Elements per call of a vectorized kernel (see
    :func:`._scheduling.vector_chunk_length`)."""
    return policy.vector_chunk_length(work.n, workers, work.element_bytes, max_chunk)


def new_job(
    work: MapWork,
    executor: _validate.Executor,
    max_chunk: int | None = None,
    parent: Job | None = None,
    runner: Runner | None = None,
) -> Job:
    """The job of ``work`` on ``executor`` (whose ``runner`` the caller may have
    chosen already), with its chunking policy."""
    runner = runner_for(executor) if runner is None else runner
    workers = runner.workers
    units = work.n
    if work.vectorized and units:
        units = work.split(vector_chunk_length(work, workers, max_chunk))
    # Host-side sums need chunk bounds that do not depend on timing. Otherwise
    # guided chunks, each a share of what is left.
    fixed = policy.fixed_chunk(units, workers) if work.sums else None
    nested = parent is not None
    limited = policy.starts_limited(units, workers, nested, runner.on_threads)
    cpus = available_cpus() if limited else None
    return Job(
        units,
        work.run_chunk,
        fixed=fixed,
        divisor=policy.guided_divisor(workers),
        parent=parent,
        workers=workers,
        cpus=cpus,
    )


def run_map(
    executor: _validate.Executor,
    work: MapWork,
    *,
    progress: bool | None,
    max_chunk: int | None = None,
) -> None:
    """Runs every element of ``work`` on ``executor``; raises the map's error.

    ``max_chunk`` bounds the chunks of a vectorized map. Called from a kernel (a
    nested map), the calling thread works on the map's chunks while it waits,
    when the map runs on threads of this process: the kernel's thread is lent to
    the nested map, which can then run one kernel more than its executor's bound.
    """
    if work.n == 0:
        return
    runner = runner_for(executor)
    job = new_job(work, executor, max_chunk, parent=_local.job, runner=runner)
    bar = None
    if progress_enabled(progress):
        bar = Progress(job.n, work.name, unit="chunk" if work.vectorized else "el")
    _flights[job] = threading.current_thread()
    try:
        runner.run(job, work, bar)
    finally:
        _flights.pop(job, None)
        job.detach()
    if job.error is not None:
        raise _map_error(job.error, work.name)


def _map_error(e: BaseException, name: str) -> BaseException:
    """The error a failed map raises: kernel errors as they are, the rest wrapped."""
    if isinstance(e, (KernelError, ExecutorError, KeyboardInterrupt, SystemExit)):
        return e
    if isinstance(e, concurrent.futures.BrokenExecutor):
        return ExecutorError(
            f"The executor running threadmap kernel {name!r} broke while the map ran "
            f"({type(e).__name__}: {e}); a worker probably died. The map was "
            "abandoned; pass a working executor to the next call.",
            cause=e,
        )
    return ExecutorError(
        f"threadmap kernel {name!r}: the executor failed with {type(e).__name__}: {e}",
        cause=e,
    )
