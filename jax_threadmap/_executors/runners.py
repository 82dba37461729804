"""One map from start to end: :func:`run_map` picks its runner (one per kind
of ``executor=``, :data:`RUNNERS`), makes its job, runs it, raises its error;
chunks shipped to executors that pickle work (:class:`_Shipper`); interpreter
exit (docs/executors.md, "Ctrl-C and interpreter exit").
"""

from __future__ import annotations

import atexit
import concurrent.futures
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .._host import remote as _remote
from .._host.inner_threads import BLAS_LIMIT
from .._host.kernel_scope import KernelScope
from .._support import fork as _fork
from .._support.cpus import available_cpus
from .._support.errors import ExecutorError, KernelError, restore_shipped_cause
from . import scheduling as policy
from . import shared_threads as _shared_threads
from . import thread_executors as _thread_executors
from .jobs import Job, this_thread
from .progress import Progress, progress_enabled, wait
from .refusals import interpreter_exiting, refused, said
from .scheduling import InOrder

#: What ``executor=`` accepts: the shared pool, a pool of N threads, or an executor;
#: any of these in ``InOrder`` for one element per claim in index order.
Executor = int | concurrent.futures.Executor | InOrder | None


def known_workers(executor: concurrent.futures.Executor) -> int | None:
    """The number of workers of ``executor``, where it tells. No public API
    does: this reads ``_max_workers`` (``ThreadPoolExecutor``,
    ``ProcessPoolExecutor``, loky) and a Dask ``ClientExecutor``'s
    ``_client.nthreads()``; an executor that fails or answers nonsense does
    not say (``tests/test_runners.py`` checks both on the installed versions)."""
    try:
        n = getattr(executor, "_max_workers", None)
        if isinstance(n, int) and n > 0:
            return n
        client = getattr(executor, "_client", None)
        return None if client is None else max(1, sum(client.nthreads().values()))
    except Exception:  # noqa: BLE001 - an executor that cannot say: unknown
        return None


class MapWork(Protocol):
    """What the executor layer needs of a map (``_host.maps.HostMap``)."""

    name: str  # for messages and progress bars
    n: int  # elements
    sums: bool  # outputs summed on the host: chunk bounds must not depend on timing
    vectorized: bool  # one kernel call per chunk
    scope: KernelScope | None  # entered around each chunk run here (kernel_scope.py)

    @property
    def element_bytes(self) -> int: ...  # one element's operands and results

    def split(self, max_elements: int) -> int:
        """Cuts a vectorized map into chunks of at most ``max_elements``; returns
        how many (the work units)."""
        ...

    def run_chunk(self, start: int, stop: int, job: Any) -> None: ...

    def shared(self) -> list[Any]:
        """Operands shipped once per map to an executor that pickles work."""
        ...

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """A picklable task running ``[start, stop)`` in another process."""
        ...

    def store_packed(self, start: int, stop: int, outs: Any) -> None: ...


# --- one runner per kind of executor --------------------------------------------------


class Runner(Protocol):
    """Where a map's chunks run: one class per kind of executor."""

    workers: int  # kernels it runs at once (a guess where the executor does not say)
    on_threads: bool  # its workers are threads of this process

    def run(self, job: Job, work: MapWork, progress: Progress | None) -> None:
        """Runs ``job`` (the chunks of ``work``) to completion or first failure."""
        ...


class SharedThreads:
    """``executor=None`` or ``executor=N``."""

    on_threads = True

    def __init__(self, executor: int | None):
        self.pool = _shared_threads.get_pool(executor)
        self.workers = self.pool.max_workers

    def run(self, job: Job, work: MapWork, progress: Progress | None) -> None:
        self.pool.run(job, progress)


class _UserExecutor:
    """A ``concurrent.futures.Executor`` passed as ``executor=``."""

    def __init__(self, executor: concurrent.futures.Executor):
        self.executor = executor
        self.known = known_workers(executor)
        self.workers = self.known or policy.UNKNOWN_WORKERS


class ThreadExecutor(_UserExecutor):
    """A user's ``ThreadPoolExecutor``."""

    on_threads = True

    def run(self, job: Job, work: MapWork, progress: Progress | None) -> None:
        _thread_executors.run_on_executor(self.executor, job, progress)


class PicklingExecutor(_UserExecutor):
    """An executor that runs work in other processes."""

    on_threads = False

    def run(self, job: Job, work: MapWork, progress: Progress | None) -> None:
        _Shipper(self.executor, work, job, self.known).run(progress)


def _is_shared(executor: Any) -> bool:
    return executor is None or isinstance(executor, int)


#: The kinds of executor, first match first: a test and a runner class.
RUNNERS: tuple[tuple[Callable[[Any], bool], Callable[[Any], Runner]], ...] = (
    (_is_shared, SharedThreads),
    (lambda e: isinstance(e, concurrent.futures.ThreadPoolExecutor), ThreadExecutor),
    (lambda executor: True, PicklingExecutor),
)


def runner_for(executor: Any) -> Runner:
    """The runner of ``executor=`` (see :data:`RUNNERS`)."""
    return next(make(executor) for is_kind, make in RUNNERS if is_kind(executor))


#: Every map in flight, with the thread waiting for it. No lock: setting, popping
#: and listing the items of a dict are atomic, in free-threaded builds too.
_flights: dict[Job, threading.Thread] = {}


def new_job(
    work: MapWork,
    executor: Executor,
    max_chunk: int | None = None,
    parent: Job | None = None,
    runner: Runner | None = None,
    in_order: bool = False,
) -> Job:
    """The job of ``work`` on ``executor`` (or its ``runner``), with its chunking
    policy; ``in_order``: asked for (:class:`.scheduling.InOrder`)."""
    runner = runner_for(executor) if runner is None else runner
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
    return Job(
        units,
        work.run_chunk,
        fixed=fixed,
        divisor=policy.guided_divisor(workers),
        parent=parent,
        workers=workers,
        cpus=cpus if limited else None,
        in_order=ordered,
        # Where the kernels' JAX calls run (kernel_scope.py), entered by each
        # thread that works on the map.
        scope=None if work.scope is None else work.scope.entered,
    )


def run_map(
    executor: Executor | InOrder,
    work: MapWork,
    *,
    progress: bool | None,
    max_chunk: int | None = None,
) -> None:
    """Runs every element of ``work`` on ``executor``; raises the map's error.
    ``max_chunk`` bounds the chunks of a vectorized map."""
    if work.n == 0:
        return
    in_order = isinstance(executor, InOrder)
    executor = executor.executor if isinstance(executor, InOrder) else executor
    runner = runner_for(executor)
    job = new_job(work, executor, max_chunk, this_thread.job, runner, in_order)
    bar = None
    if progress_enabled(progress):
        bar = Progress(job.n, work.name, unit="chunk" if work.vectorized else "el")
    if not _is_shared(executor):
        register_early_exit_hook()
    _flights[job] = threading.current_thread()
    # One BLAS thread per kernel while kernels run on several threads here.
    threads = min(runner.workers, job.n) if runner.on_threads else 1
    try:
        with BLAS_LIMIT.during_map(threads, work.name):
            runner.run(job, work, bar)
    finally:
        _flights.pop(job, None)
        job.detach()
    if job.error is not None:
        raise _map_error(job.error, work.name, executor)


def _map_error(e: BaseException, name: str, executor: Any) -> BaseException:
    """The error a failed map raises: kernel errors as they are, the rest wrapped."""
    if isinstance(e, (KernelError, ExecutorError, KeyboardInterrupt, SystemExit)):
        return e
    if isinstance(e, concurrent.futures.BrokenExecutor):
        return ExecutorError(
            f"The executor running threadmap kernel {name!r} broke while the map ran "
            f"({said(e)}). {_remote.broken_hint(executor)}",
            cause=e,
        )
    return ExecutorError(
        f"threadmap kernel {name!r}: the executor failed with {said(e)}.", cause=e
    )


def _cannot_ship(executor: Any, name: str, e: BaseException) -> ExecutorError:
    return ExecutorError(
        f"threadmap kernel {name!r} could not be sent to the executor "
        f"{executor!r}, which runs work in other processes and so pickles it: "
        f"{said(e)}. Define the kernel at module level (not a lambda "
        "or closure), or use executor=None / a ThreadPoolExecutor.",
        cause=e,
    )


def _chunk_failed(
    executor: Any, work: MapWork, start: int, stop: int, e: BaseException
) -> ExecutorError:
    """The error of a chunk that the executor could not run."""
    unit = "pieces" if work.vectorized else "elements"
    if isinstance(e, concurrent.futures.BrokenExecutor):
        hint = " " + _remote.broken_hint(executor)
    elif isinstance(e, _remote.KernelNotLoaded):
        hint = ""  # the worker's own account says what to do
    else:
        hint = " Pass a working executor to the next call."
    return ExecutorError(
        f"The executor {executor!r} failed to run {unit} [{start}, {stop}) (flat "
        f"indices, of {work.n}) of threadmap kernel {work.name!r}: {said(e)}." + hint,
        cause=e,
    )


def _unpicklable(e: BaseException) -> bool:
    # Python 3.13 says "Can't get local object"; the pool's remote traceback
    # (the cause) names the pickler.
    return (
        isinstance(e, (pickle.PicklingError, AttributeError, TypeError))
        and "pickle" in f"{e} {e.__cause__}".lower()
    )


class _Shipper:
    """Ships a map to an executor that pickles work, in chunks of
    :func:`.scheduling.remote_chunk_size` (fixed for a map summed on the host).
    Used by the waiting thread alone: no lock."""

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        work: MapWork,
        job: Job,
        workers: int | None,
    ):
        self.executor = executor
        self.work = work
        self.job = job
        self.cap = policy.remote_in_flight(workers)
        self.first_wave = min(workers or policy.UNKNOWN_WORKERS_IN_FLIGHT, self.cap)
        self.next = 0
        self.pending: dict[concurrent.futures.Future[Any], tuple[int, int]] = {}
        self.per_element: float | None = None
        self.sharing = _remote.Sharing([])

    def top_up(self, most: int) -> None:
        """Ships tasks until ``most`` are in flight or nothing is left."""
        while self.next < self.job.n and len(self.pending) < most:
            self.submit()

    def submit(self) -> None:
        left = self.job.n - self.next
        size = self.job.fixed or policy.remote_chunk_size(
            self.per_element, left, self.cap
        )
        start, stop = self.next, self.next + min(size, left)
        task = self.work.pack(start, stop)
        try:
            fut = self.executor.submit(task, *self.sharing.args)
        except RuntimeError as e:
            if self.pending and isinstance(e, concurrent.futures.BrokenExecutor):
                # It broke while running this map's tasks, before their futures
                # said so: the error they will have, naming one of them.
                lost = next(iter(self.pending.values()))
                raise _chunk_failed(self.executor, self.work, *lost, e) from e
            raise refused(self.executor, e) from e
        except Exception as e:  # e.g. the kernel cannot be pickled
            raise _cannot_ship(self.executor, self.work.name, e) from e
        self.pending[fut] = (start, stop)
        self.next = stop

    def poll(self, timeout: float) -> bool:
        """Stores what has come back, ships more; whether the map is done."""
        if self.job.failed:  # stopped from outside: its parent failed, or exit
            return True
        done, _ = concurrent.futures.wait(
            list(self.pending), timeout, concurrent.futures.FIRST_COMPLETED
        )
        for fut in done:
            start, stop = self.pending.pop(fut)
            try:
                outs, per_element = fut.result()
            except KernelError as e:
                restore_shipped_cause(e)
                raise
            except Exception as e:
                if _unpicklable(e):
                    raise _cannot_ship(self.executor, self.work.name, e) from e
                raise _chunk_failed(self.executor, self.work, start, stop, e) from e
            self.work.store_packed(start, stop, outs)
            self.job.add_completed(stop - start)
            self.per_element = policy.smoothed(self.per_element, per_element)
        self.top_up(self.cap)
        return not self.pending

    def run(self, progress: Progress | None) -> None:
        try:
            # Large operands read whole by every element: once per map.
            self.sharing = _remote.share(self.executor, self.work.shared())
            self.top_up(self.first_wave)
            wait(self.job, self.poll, progress)
        except BaseException as e:
            self.job.fail(e)
        finally:
            if self.job.failed:
                for fut in self.pending:
                    fut.cancel()
            self.sharing.close()


@_fork.in_child
def _forget_flights() -> None:
    # A forked child runs none of the parent's maps.
    _flights.clear()


def _run_for_jax(job: Job) -> bool:
    """Whether XLA runs the program that waits for ``job`` on a thread of its
    own (a dummy thread to Python): JAX waits for it at exit, so it runs on."""
    return isinstance(_flights.get(job), threading._DummyThread)


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
    """Registers :func:`_before_executors_exit` once with threading's exit
    hooks (after ``concurrent.futures``' own, so that it runs first)."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None and _early_hook.acquire(blocking=False):
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
    ours = _shared_threads.exit_threads(keep=_run_for_jax)
    _stop_maps_of_daemon_threads(deadline)
    me = threading.current_thread()
    for t in ours:
        if t is not me and t.is_alive():  # one still starting is not joinable
            t.join(max(0.0, deadline - time.monotonic()))


atexit.register(_at_exit)
