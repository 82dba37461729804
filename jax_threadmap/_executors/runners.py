"""One map from start to end: :func:`run_map` picks its runner (one per kind
of ``executor=``, :func:`runner_for`), makes its job, runs it, raises its error;
chunks shipped to executors that pickle work (:mod:`.shipping`); interpreter
exit (docs/executors.md, "Ctrl-C and interpreter exit").
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
import time
from typing import Any, Protocol

from .._host.inner_threads import BLAS_LIMIT
from .._host.maps import HostMap
from .._support import fork as _fork
from .._support.cpus import available_cpus
from .._support.errors import ExecutorError, KernelError
from . import scheduling as policy
from . import thread_pools as _thread_pools
from .jobs import Job, interpreter_exiting, this_thread
from .progress import Progress, progress_enabled, wait
from .shipping import Shipper, refused, said

#: Where a map runs: the shared pool, a pool of N threads, or an executor (as
#: ``executor=`` takes them, out of their ``InOrder``: ``run_map``'s ``in_order``).
Executor = int | concurrent.futures.Executor | None


def known_workers(executor: concurrent.futures.Executor) -> int | None:
    """The number of workers of ``executor``, where it tells. No public API
    does: this reads ``_max_workers`` (``ThreadPoolExecutor``,
    ``ProcessPoolExecutor``, loky) and a Dask ``ClientExecutor``'s
    ``_client.nthreads()``; an executor that fails or answers nonsense does not
    say (``tests/_executors/test_runners.py`` checks both on installed versions)."""
    try:
        n = getattr(executor, "_max_workers", None)
        if isinstance(n, int) and n > 0:
            return n
        client = getattr(executor, "_client", None)
        return None if client is None else max(1, sum(client.nthreads().values()))
    except Exception:  # noqa: BLE001 - an executor that cannot say: unknown
        return None


#: Held while a map queues its first pullers on a user's thread executor: two
#: maps started at once would split its workers, and elements that wait for each
#: other could wait for good. One for every executor: their submit() takes one
#: lock of concurrent.futures' for all of them anyway.
_queueing = threading.Lock()


# --- one runner per kind of executor --------------------------------------------------


class Runner(Protocol):
    """Where a map's chunks run: one class per kind of executor."""

    workers: int  # kernels it runs at once (a guess where the executor does not say)
    on_threads: bool  # its workers are threads of this process

    def run(self, job: Job, work: HostMap, progress: Progress | None) -> None:
        """Runs ``job`` (the chunks of ``work``) to completion or first failure."""
        ...


class _UserExecutor:
    """A ``concurrent.futures.Executor`` passed as ``executor=``."""

    def __init__(self, executor: concurrent.futures.Executor):
        self.executor = executor
        self.known = known_workers(executor)
        self.workers = self.known or policy.UNKNOWN_WORKERS


class ThreadExecutor(_UserExecutor):
    """A user's ``ThreadPoolExecutor``: one puller task (``job.drain``) per
    thread the map may use; a nested map's waiting thread drains it too."""

    on_threads = True

    def run(self, job: Job, work: HostMap, progress: Progress | None) -> None:
        executor = self.executor
        lock = threading.Lock()  # guards ``left`` and ``futures``
        left = [0]  # pullers submitted and not yet done
        futures: list[concurrent.futures.Future[None]] = []

        def on_done(f: concurrent.futures.Future[None]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if f.cancelled():
                if last:  # no puller will ever claim the rest
                    job.fail(
                        ExecutorError(f"The executor {executor!r} cancelled the map.")
                    )
            elif f.exception() is not None:
                job.fail(f.exception())  # type: ignore[arg-type]

        def hand() -> None:
            """Submits pullers up to the job's limit; a refusal fails the map when
            no puller runs it."""
            while job.add_hand():
                with lock:
                    left[0] += 1
                try:
                    future = executor.submit(job.drain)  # a puller
                except RuntimeError as e:
                    job.drop_hand()
                    with lock:
                        left[0] -= 1
                        alone = not futures
                    if alone:
                        job.fail(refused(executor, e))
                    return
                with lock:
                    futures.append(future)
                future.add_done_callback(on_done)

        job.grow = hand
        try:
            with _queueing:
                hand()
            if this_thread.job is not None:
                job.drain()
            wait(job, job.done.wait, progress)
        finally:
            with lock:
                started = list(futures)
            for f in started:  # pullers that never started: nothing left to claim
                f.cancel()


class PicklingExecutor(_UserExecutor):
    """An executor that runs work in other processes."""

    on_threads = False

    def run(self, job: Job, work: HostMap, progress: Progress | None) -> None:
        Shipper(self.executor, work, job, self.known).run(progress)


def _is_shared(executor: Any) -> bool:
    return executor is None or isinstance(executor, int)


def runner_for(executor: Any) -> Runner:
    """The runner of ``executor=``: the shared threads, a user's thread pool, or
    an executor that pickles work (any other)."""
    if _is_shared(executor):
        return _thread_pools.get_pool(executor)
    if isinstance(executor, concurrent.futures.ThreadPoolExecutor):
        return ThreadExecutor(executor)
    return PicklingExecutor(executor)


#: Every map in flight, with the thread waiting for it. No lock: setting, popping
#: and listing the items of a dict are atomic, in free-threaded builds too.
_flights: dict[Job, threading.Thread] = {}


def new_job(
    work: HostMap,
    runner: Runner,
    max_chunk: int | None = None,
    parent: Job | None = None,
    in_order: bool = False,
    last: policy.Measure | None = None,
) -> Job:
    """The job of ``work`` on ``runner``, with its chunking policy;
    ``in_order``: asked for (``executor=InOrder(...)``); ``last``: the times of
    the last map of its equation."""
    workers, on_threads, units = runner.workers, runner.on_threads, work.n
    if work.vectorized and units:
        units = work.split(
            policy.vector_chunk_length(units, workers, work.element_bytes, max_chunk)
        )
    ordered = policy.runs_in_order(in_order, units, workers, on_threads, work.sums)
    fixed = policy.fixed_chunk(units, workers) if work.sums else None
    cpus = available_cpus()
    limited = policy.starts_limited(
        units, workers, cpus, parent is not None, on_threads
    )
    # (A pool with more threads than CPUs is there for kernels that wait.)
    pool = isinstance(runner, _thread_pools.ThreadPool) and workers <= cpus
    shared = pool and parent is None
    return Job(
        units,
        work.run_chunk,
        fixed=fixed,
        parent=parent,
        workers=workers,
        cpus=cpus if limited else None,
        in_order=ordered,
        inline=last if policy.runs_inline(units, last, shared) else None,
        # Where the kernels' JAX calls run (kernel_scope.py), entered by each
        # thread that works on the map.
        scope=None if work.scope is None else work.scope.entered,
    )


def run_map(
    executor: Executor,
    work: HostMap,
    *,
    progress: bool | None,
    max_chunk: int | None = None,
    in_order: bool = False,
    last: policy.Measure | None = None,
) -> None:
    """Runs every element of ``work`` on ``executor``; raises the map's error.
    ``max_chunk`` bounds the chunks of a vectorized map; ``in_order``: one
    element per claim in index order (``executor=InOrder(...)``); ``last``: the
    times of the last map of its equation, which this one updates."""
    if work.n == 0:
        return
    runner = runner_for(executor)
    job = new_job(work, runner, max_chunk, this_thread.job, in_order, last)
    bar = None
    if progress_enabled(progress):
        bar = Progress(job.n, work.name, unit="chunk" if work.vectorized else "el")
    if not _is_shared(executor):
        register_early_exit_hook()
    _flights[job] = threading.current_thread()
    # One BLAS thread per kernel while kernels run on several threads here.
    threads = min(runner.workers, job.n) if runner.on_threads else 1
    try:
        with BLAS_LIMIT.during_map(1 if job.inline else threads, work.name):
            runner.run(job, work, bar)
    finally:
        _flights.pop(job, None)
        job.detach()
    if last is not None and job.per_unit:
        last.per_element = job.per_unit
    if job.error is not None:
        raise _map_error(job.error, work.name)


def _map_error(e: BaseException, name: str) -> BaseException:
    """The error a failed map raises: kernel errors as they are, the rest wrapped
    (an executor that pickles work names its broken workers as its chunks fail,
    ``shipping.py``; a thread pool breaks only when its initializer fails)."""
    if isinstance(e, (KernelError, ExecutorError, KeyboardInterrupt, SystemExit)):
        return e
    return ExecutorError(
        f"threadmap kernel {name!r}: the executor failed with {said(e)}.", cause=e
    )


#: The class Python gives threads it did not start (XLA's): CPython's private name,
#: else none and their default name (``tests/_executors/test_runners.py`` runs both).
_DUMMY = getattr(threading, "_DummyThread", None)


def _run_for_jax(job: Job) -> bool:
    """Whether XLA runs the program that waits for ``job`` on a thread of its
    own (a dummy thread to Python): JAX waits for it at exit, so it runs on."""
    waiter = _flights.get(job)
    if _DUMMY is not None:
        return isinstance(waiter, _DUMMY)
    return waiter is not None and waiter.name.startswith("Dummy-")


def _stop_maps_of_daemon_threads(deadline: float) -> None:
    """Stops the maps that the user's daemon threads wait for, and waits until
    those threads have left them or until ``deadline``."""
    stopped = [
        job
        for job, waiter in list(_flights.items())
        if waiter.daemon and not _run_for_jax(job)
    ]
    for job in stopped:
        job.abandon(
            ExecutorError(
                "The interpreter is exiting: this threadmap was stopped before it "
                "finished. Wait for maps running in other threads before the end "
                "of the program, or make those threads non-daemon."
            )
        )
    while any(job in _flights for job in stopped) and time.monotonic() < deadline:
        time.sleep(0.001)


#: Taken, for good, by the first registration.
_early_hook = threading.Lock()


def register_early_exit_hook() -> None:
    """Registers :func:`_before_executors_exit` once with threading's exit hooks,
    after ``concurrent.futures``' own, so that it runs before Python joins the
    pools' threads (whose pullers would run the map to its end); else with
    ``atexit``, after that join (``tests/_executors/test_runners.py`` runs both)."""
    register = getattr(threading, "_register_atexit", atexit.register)
    if _early_hook.acquire(blocking=False):
        try:
            register(_before_executors_exit)
        except RuntimeError:  # the interpreter is exiting already
            interpreter_exiting.set()


def _before_executors_exit() -> None:
    """Stops the maps of daemon threads before ``concurrent.futures`` waits for
    its pools' tasks (those not yet started are then cancelled)."""
    interpreter_exiting.set()
    _stop_maps_of_daemon_threads(time.monotonic() + policy.EXIT_GRACE)


def _at_exit() -> None:
    """Stops the maps in flight in the user's (daemon) threads, and waits at
    most ``EXIT_GRACE`` seconds in all (a daemon thread that needs the GIL
    inside XLA while the interpreter finalizes aborts the process)."""
    deadline = time.monotonic() + policy.EXIT_GRACE
    interpreter_exiting.set()
    ours = _thread_pools.exit_threads(keep=_run_for_jax)
    _stop_maps_of_daemon_threads(deadline)
    me = threading.current_thread()
    for t in ours:
        if t is not me and t.is_alive():  # one still starting is not joinable
            t.join(max(0.0, deadline - time.monotonic()))


atexit.register(_at_exit)


@_fork.in_child
def _start_afresh() -> None:
    """A forked child runs none of the parent's maps, and the queueing lock may
    have been held at the fork."""
    global _queueing
    _flights.clear()
    _queueing = threading.Lock()
