"""User executors: a user's thread executor, and executors that pickle work.

- A user's ``ThreadPoolExecutor`` gets one task per worker, each claiming chunks
  until none are left (the same claim-and-run loop as the shared threads).
- Executors that pickle work (process pools, Dask) get packed chunks
  (:mod:`._remote`), sized from the kernel's measured cost.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # now, not lazily at exit (it then fails)
import dataclasses
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from . import _remote
from . import _scheduling as policy
from ._errors import ExecutorError, KernelError, restore_shipped_cause
from ._jobs import Job, LimitedGate, MapWork, _local
from ._pool import ThreadPool, get_pool
from ._progress import Progress, wait
from ._scheduling import UNKNOWN_WORKERS, UNKNOWN_WORKERS_IN_FLIGHT


@dataclasses.dataclass(frozen=True)
class SizeHook:
    """A private attribute of another library's executor that tells its size.

    No public API says how many workers an executor has. Each hook is optional,
    like a JAX hook of :mod:`._compat`: an executor without the attribute, or
    one that fails or answers nonsense, counts as one that does not say
    (:data:`._scheduling.UNKNOWN_WORKERS` for chunk sizes), never as an error.
    ``tests/test_runners.py`` checks that each still answers on the installed
    versions.
    """

    name: str
    why: str
    read: Callable[[Any], int | None]


def _max_workers(executor: Any) -> int | None:
    n = getattr(executor, "_max_workers", None)
    return n if isinstance(n, int) and n > 0 else None


def _dask_threads(executor: Any) -> int | None:
    client = getattr(executor, "_client", None)  # distributed.ClientExecutor
    return None if client is None else max(1, sum(client.nthreads().values()))


SIZE_HOOKS: tuple[SizeHook, ...] = (
    SizeHook(
        "concurrent.futures Executor._max_workers",
        "ThreadPoolExecutor and ProcessPoolExecutor (and loky) keep their size there",
        _max_workers,
    ),
    SizeHook(
        "distributed ClientExecutor._client",
        "Client.get_executor() keeps its client there; the client's nthreads() "
        "is the cluster's size",
        _dask_threads,
    ),
)


def known_workers(executor: concurrent.futures.Executor) -> int | None:
    """The number of workers of ``executor``, where it tells (:class:`SizeHook`)."""
    for hook in SIZE_HOOKS:
        try:
            n = hook.read(executor)
        except Exception:  # noqa: BLE001 - an executor that cannot say: unknown
            return None
        if n is not None:
            return n
    return None


def shares_memory(executor: concurrent.futures.Executor) -> bool:
    """Whether the executor's workers are threads of this process."""
    return isinstance(executor, concurrent.futures.ThreadPoolExecutor)


#: Set when the interpreter starts to exit (by :mod:`._executor`), for messages.
interpreter_exiting = threading.Event()


def _refused(executor: Any, e: BaseException) -> ExecutorError:
    if interpreter_exiting.is_set() or "interpreter shutdown" in str(e):
        return ExecutorError(
            "The interpreter is exiting: this threadmap was stopped before it "
            f"finished, because the executor {executor!r} refuses new work once "
            "the main thread has ended (concurrent.futures stops its executors at "
            "exit). Wait for maps on such executors before the end of the main "
            "thread.",
            cause=e,
        )
    return ExecutorError(
        f"The executor {executor!r} passed as executor= refused new work: "
        f"{type(e).__name__}: {e}. Pass an executor that is running, or "
        "executor=None for the shared pool.",
        cause=e,
    )


def _puller(job: Job) -> None:
    """A task of a thread executor: claims chunks of ``job`` until none are left."""
    job.drain()


#: Per thread executor, a lock held while a map queues its first pullers.
_queue_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = (
    weakref.WeakKeyDictionary()
)
#: Per thread executor, the gate that lets one limited map at a time start.
_gates: weakref.WeakKeyDictionary[Any, LimitedGate] = weakref.WeakKeyDictionary()
#: Guards both tables (not the locks and gates they hold).
_queue_locks_lock = threading.Lock()
_queue_locks_fallback = threading.Lock()
_gate_fallback = LimitedGate()


def _queueing(executor: concurrent.futures.Executor) -> threading.Lock:
    """The lock that keeps a map's first pullers together in ``executor``'s
    queue: two maps started at once do not split its workers between them (each
    could then wait for good for elements queued behind the other's)."""
    with _queue_locks_lock:
        try:
            lock = _queue_locks.get(executor)
            if lock is None:
                lock = _queue_locks[executor] = threading.Lock()
        except TypeError:  # an executor that takes no weak references
            lock = _queue_locks_fallback
        return lock


def reset_after_fork() -> None:
    """A forked child starts with fresh tables, locks and gates: a parent's
    thread may have held any of them at the fork, and never releases it here."""
    global _queue_locks, _gates, _queue_locks_lock, _queue_locks_fallback
    global _gate_fallback
    _queue_locks = weakref.WeakKeyDictionary()
    _gates = weakref.WeakKeyDictionary()
    _queue_locks_lock = threading.Lock()
    _queue_locks_fallback = threading.Lock()
    _gate_fallback = LimitedGate()


def _gate(executor: concurrent.futures.Executor) -> LimitedGate:
    """The :class:`._jobs.LimitedGate` of ``executor``."""
    with _queue_locks_lock:
        try:
            gate = _gates.get(executor)
            if gate is None:
                gate = _gates[executor] = LimitedGate()
        except TypeError:  # an executor that takes no weak references
            gate = _gate_fallback
        return gate


def _run_on_threads(
    executor: concurrent.futures.Executor, job: Job, progress: Progress | None
) -> None:
    """Runs ``job`` on a thread executor: one puller task per thread it may use
    (more once its limit rises, see :class:`Job`).

    A thread that runs a kernel itself (a nested map) also drains ``job``, since
    the executor's workers may all be busy waiting, for this very thread among
    others: the pullers are then extra hands, and the ones that never start are
    cancelled.
    """
    count = min(known_workers(executor) or UNKNOWN_WORKERS_IN_FLIGHT, job.n)
    # Guards ``left``, ``futures`` and ``job.hands`` (this runner's count).
    lock = threading.Lock()
    left = [0]  # pullers submitted and not yet done
    futures: list[concurrent.futures.Future[None]] = []

    def on_done(f: concurrent.futures.Future[None]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if f.cancelled():
            if last:  # no puller will ever claim the rest
                job.fail(ExecutorError(f"The executor {executor!r} cancelled the map."))
        elif f.exception() is not None:
            job.fail(f.exception())  # type: ignore[arg-type]

    def hand() -> None:
        """Submits pullers up to the job's limit. A refusal fails the map only
        when no puller runs it; later ones leave the work to those running."""
        while True:
            with lock:
                if job.hands >= min(count, job.limit) or job.exhausted():
                    return
                job.hands += 1
                left[0] += 1
            try:
                future = executor.submit(_puller, job)
            except RuntimeError as e:
                with lock:
                    left[0] -= 1
                    job.hands -= 1
                    alone = not futures
                if alone:
                    job.fail(_refused(executor, e))
                return
            with lock:
                futures.append(future)
            future.add_done_callback(on_done)

    gate = _gate(executor)

    def grow() -> None:
        # Pullers first: the next limited map, let in by the gate, queues its
        # pullers behind these, not before them.
        try:
            hand()
        finally:
            gate.leave(job)

    job.grow = grow
    gate.enter(job)
    try:
        with _queueing(executor):
            hand()
        if _local.job is not None:
            job.drain()
        wait(job, job.poll, progress)
    finally:
        gate.leave(job)
        with lock:
            started = list(futures)
        for f in started:  # pullers that never started: nothing left to claim
            f.cancel()


def _cannot_ship(executor: Any, name: str, e: BaseException) -> ExecutorError:
    return ExecutorError(
        f"threadmap kernel {name!r} could not be sent to the executor "
        f"{executor!r}, which runs work in other processes and so pickles it: "
        f"{type(e).__name__}: {e}. Define the kernel at module level (not a lambda "
        "or closure), or use executor=None / a ThreadPoolExecutor.",
        cause=e,
    )


def _chunk_failed(
    executor: Any, work: MapWork, start: int, stop: int, e: BaseException
) -> ExecutorError:
    """The error of a chunk that the executor could not run (its worker died)."""
    unit = "pieces" if work.vectorized else "elements"
    hint = (
        "a worker probably died"
        if isinstance(e, concurrent.futures.BrokenExecutor)
        else "the map was abandoned"
    )
    return ExecutorError(
        f"The executor {executor!r} failed to run {unit} [{start}, {stop}) (flat "
        f"indices, of {work.n}) of threadmap kernel {work.name!r}: "
        f"{type(e).__name__}: {e}. {hint[0].upper()}{hint[1:]}; pass a working "
        "executor to the next call (a Dask cluster replaces its dead workers).",
        cause=e,
    )


class _Shipper:
    """Ships a map to an executor that pickles work, in chunks sized as it runs.

    The first tasks hold one element each, one per worker, so slow elements all
    start at once; later ones hold about ``TASK_SECONDS_REMOTE`` of kernel
    work (:func:`._scheduling.remote_chunk_size`), from the measured seconds
    per element. A map with host-side sums ships
    chunks of fixed size instead, so its sums do not depend on timing.
    """

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
        self.first_wave = min(workers or UNKNOWN_WORKERS_IN_FLIGHT, self.cap)
        self.next = 0
        self.pending: dict[concurrent.futures.Future[Any], tuple[int, int]] = {}
        self.per_element: float | None = None
        self.sharing = _remote.Sharing([])

    def size(self) -> int:
        if self.job.fixed:
            return self.job.fixed
        remaining = self.job.n - self.next
        return policy.remote_chunk_size(self.per_element, remaining, self.cap)

    def submit(self, size: int) -> None:
        start, stop = self.next, min(self.job.n, self.next + size)
        task = self.work.pack(start, stop)
        try:
            fut = self.executor.submit(task, *self.sharing.args)
        except RuntimeError as e:
            raise _refused(self.executor, e) from e
        except Exception as e:  # e.g. the kernel cannot be pickled
            raise _cannot_ship(self.executor, self.work.name, e) from e
        self.pending[fut] = (start, stop)
        self.next = stop

    def start(self) -> None:
        while self.next < self.job.n and len(self.pending) < self.first_wave:
            self.submit(self.job.fixed or 1)

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
                # Python 3.13 says "Can't get local object"; the pool's
                # remote traceback (the cause) names the pickler.
                if (
                    isinstance(e, (pickle.PicklingError, AttributeError, TypeError))
                    and "pickle" in f"{e} {e.__cause__}".lower()
                ):
                    raise _cannot_ship(self.executor, self.work.name, e) from e
                raise _chunk_failed(self.executor, self.work, start, stop, e) from e
            self.work.store_packed(start, stop, outs)
            self.job.add_completed(stop - start)
            self.per_element = policy.smoothed(self.per_element, per_element)
        while self.next < self.job.n and len(self.pending) < self.cap:
            self.submit(self.size())
        return not self.pending

    def run(self, progress: Progress | None) -> None:
        try:
            # Large operands read whole by every element: once per map.
            self.sharing = _remote.share(self.executor, self.work.shared())
            self.start()
            wait(self.job, self.poll, progress)
        except BaseException as e:
            self.job.fail(e)
        finally:
            if self.job.failed:
                for fut in self.pending:
                    fut.cancel()
            self.sharing.close()


# --- one runner per kind of executor ---------------------------------------------


class Runner(Protocol):
    """Where a map's chunks run: one class per kind of executor, chosen once per
    map by :func:`runner_for`."""

    #: Kernels it runs at once (a guess where the executor does not say).
    workers: int
    #: Whether its workers are threads of this process (a map may then start
    #: limited, and a nested map's waiting thread works on its chunks).
    on_threads: bool

    def run(self, job: Job, work: MapWork, progress: Progress | None) -> None:
        """Runs ``job`` (the chunks of ``work``) to completion or first failure."""
        ...


class SharedThreads:
    """``executor=None`` or ``executor=N``: a :class:`._pool.ThreadPool`."""

    on_threads = True

    def __init__(self, executor: int | None):
        self.pool: ThreadPool = get_pool(executor)
        self.workers = self.pool.max_workers

    def run(self, job: Job, work: MapWork, progress: Progress | None) -> None:
        self.pool.run(job, progress)


class ThreadExecutor:
    """A user's ``ThreadPoolExecutor``: puller tasks (:func:`_run_on_threads`)."""

    on_threads = True

    def __init__(self, executor: concurrent.futures.Executor):
        self.executor = executor
        self.workers = known_workers(executor) or UNKNOWN_WORKERS

    def run(self, job: Job, work: MapWork, progress: Progress | None) -> None:
        _run_on_threads(self.executor, job, progress)


class PicklingExecutor:
    """An executor that runs work in other processes: packed chunks
    (:class:`_Shipper`)."""

    on_threads = False

    def __init__(self, executor: concurrent.futures.Executor):
        self.executor = executor
        self.known = known_workers(executor)
        self.workers = self.known or UNKNOWN_WORKERS

    def run(self, job: Job, work: MapWork, progress: Progress | None) -> None:
        _Shipper(self.executor, work, job, self.known).run(progress)


def _is_shared(executor: Any) -> bool:
    return executor is None or isinstance(executor, int)


#: The kinds of executor, first match first: whether ``executor=`` is of the
#: kind, and its runner. A new kind is a class above and a line here.
RUNNERS: tuple[tuple[Callable[[Any], bool], Callable[[Any], Runner]], ...] = (
    (_is_shared, SharedThreads),
    (shares_memory, ThreadExecutor),
    (lambda executor: True, PicklingExecutor),
)


def runner_for(executor: Any) -> Runner:
    """The runner of ``executor=`` (see :data:`RUNNERS`)."""
    return next(make(executor) for is_kind, make in RUNNERS if is_kind(executor))
