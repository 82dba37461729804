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
- Exit: at interpreter exit the maps still in flight in the user's (daemon)
  threads are stopped and their waiting threads released, and the exit waits at
  most ``EXIT_GRACE`` seconds in all for kernels still running. Threads blocked
  in a kernel are left behind; they are daemon threads, so they do not hold up
  the exit. The maps of jitted programs that XLA runs on its own threads run to
  the end: JAX waits for those programs at exit. Maps on user executors of daemon
  threads are stopped before ``concurrent.futures`` shuts its executors down,
  so that their tasks not yet started are cancelled, not waited for.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
import time

from . import _fork, _pool, _runners, _validate
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
from ._runners import Runner, interpreter_exiting, known_workers, runner_for
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


def _run_for_jax(job: Job) -> bool:
    """Whether XLA runs the program that waits for ``job``, on a thread of its
    own (a program dispatched to several devices, or asynchronously).

    JAX waits for such programs at exit, after this module's exit hook (atexit
    runs the hooks registered last first), so their maps must run to the end,
    new ones included. Python sees XLA's threads as dummy threads.
    """
    return isinstance(_flights.get(job), threading._DummyThread)


def _exiting_error() -> ExecutorError:
    return ExecutorError(
        "The interpreter is exiting: this threadmap was stopped before it "
        "finished. Wait for maps running in other threads before the end "
        "of the program, or make those threads non-daemon."
    )


def _stop_maps_of_daemon_threads(deadline: float) -> None:
    """Stops the maps that the user's daemon threads wait for, and waits until
    those threads have left them (they do at once, unless the GIL is slow to
    come) or until ``deadline``."""
    stopped = [
        job
        for job, waiter in list(_flights.items())
        if waiter.daemon and not _run_for_jax(job)
    ]
    for job in stopped:
        job.abandon(_exiting_error())
    while any(job in _flights for job in stopped) and time.monotonic() < deadline:
        time.sleep(0.001)


_early_hook_lock = threading.Lock()
_early_hook = False


def register_early_exit_hook() -> None:
    """Registers, once, :func:`_before_executors_exit` with threading's exit hooks.

    Called when a map first runs on a user executor: ``concurrent.futures``
    registers its own hook when its executor module is first imported, and
    threading runs these hooks in reverse order, so ours then runs first.
    """
    global _early_hook
    if _early_hook:
        return
    with _early_hook_lock:
        register = getattr(threading, "_register_atexit", None)
        if not _early_hook and register is not None:
            try:
                register(_before_executors_exit)
            except RuntimeError:  # the interpreter is exiting already
                interpreter_exiting.set()
            _early_hook = True


def _before_executors_exit() -> None:
    """At exit, before ``concurrent.futures`` waits for every task its pools
    hold and refuses new ones: stops the maps of daemon threads, whose tasks
    not yet started are then cancelled rather than waited for."""
    interpreter_exiting.set()
    _stop_maps_of_daemon_threads(time.monotonic() + EXIT_GRACE)


def _at_exit() -> None:
    """Stops the maps in flight in the user's threads and waits at most
    ``EXIT_GRACE`` seconds in all for them to stop.

    Only daemon threads (or XLA's) can still be waiting for a map here (Python
    joins the others before running atexit). Releasing a daemon thread lets it
    leave a jitted program before the interpreter finalizes (a thread that needs
    the GIL inside XLA then aborts the process). The maps of programs that JAX
    waits for at exit (:func:`_run_for_jax`) run on. Only threads of this module
    are joined: XLA's cannot be, and the user's are not ours to wait for.
    """
    deadline = time.monotonic() + EXIT_GRACE
    interpreter_exiting.set()
    ours = _pool._threads.exit(keep=_run_for_jax)
    _stop_maps_of_daemon_threads(deadline)
    me = threading.current_thread()
    for t in ours:
        if t is not me and t.is_alive():  # one still starting is not joinable
            t.join(max(0.0, deadline - time.monotonic()))


_fork.in_child(_after_fork_in_child)
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
    if executor is not None and not isinstance(executor, int):
        register_early_exit_hook()
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
