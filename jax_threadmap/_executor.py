"""Where the elements of a flat map run: the shared pools and user executors.

This module owns every scheduling decision: how a map's flat index range
``[0, n)`` is cut into chunks, which threads run them, how a nested map avoids
waiting on work queued behind it, and what happens at fork and exit.

- A map is a :class:`Job`. Chunks are claimed with guided scheduling: each claim
  takes a share of what is left, so fast kernels run in a few large chunks that
  amortise the scheduling cost, and the last chunks shrink to a single element so
  that slow kernels keep every worker busy until the end. A map whose outputs are
  summed on the host gets fixed chunk bounds instead, so that its sums do not
  depend on timing.
- :class:`ThreadPool`: the shared pools (``executor=None`` and ``executor=N``). A
  pool of ``N`` workers starts at most ``N`` threads in its lifetime, and only
  those threads run kernels.
- A user's ``ThreadPoolExecutor`` gets one task per worker, each claiming chunks
  until none are left (the same claim-and-run loop as the pool's threads).
- Executors that pickle work (process pools, Dask) get packed chunks
  (:mod:`._remote`), sized from the kernel's measured cost.
- Nesting: the thread that starts a map waits and runs nothing, unless it is
  itself running a kernel of a map (a kernel that calls ``threadmap``). Then it
  works on the chunks of its own map while it waits, on whatever pool or thread
  executor that map runs, so it never waits on work queued behind itself: its
  thread (and its place in its own pool) is lent to the nested map. A map that
  fails stops the maps its kernels started.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any, Protocol

from . import _validate
from ._errors import ExecutorError, KernelError
from ._progress import Progress, progress_enabled, wait

ENV_NUM_THREADS = _validate.ENV_NUM_THREADS

#: Runs elements ``[start, stop)`` of a job; checks ``job.failed`` between elements.
ChunkFn = Callable[[int, int, "Job"], None]

#: Seconds of kernel work per task that amortise the per-task cost of an executor
#: that pickles work (about 1 ms for a process pool or Dask).
TASK_SECONDS_REMOTE = 0.05
#: Tasks in flight when an executor does not say how many workers it has.
UNKNOWN_WORKERS_IN_FLIGHT = 128
#: Workers assumed, for chunk sizes, of an executor that does not say.
UNKNOWN_WORKERS = 8


class MapWork(Protocol):
    """What the executor layer needs of a map (``_host.HostMap`` provides it)."""

    @property
    def name(self) -> str: ...  # for messages and progress bars

    @property
    def n(self) -> int: ...  # elements

    @property
    def sums(self) -> bool: ...  # chunk bounds must not depend on timing

    def run_chunk(self, start: int, stop: int, job: Job) -> None: ...

    def pack(self, start: int, stop: int) -> Callable[[], Any]:
        """A picklable task running ``[start, stop)`` in another process."""
        ...

    def store_packed(self, start: int, stop: int, outs: Any) -> None: ...


def available_cpus() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def default_num_threads() -> int:
    """The size of the shared pool used by ``executor=None``.

    ``JAX_THREADMAP_NUM_THREADS`` when set, else the number of CPUs this process
    may run on: kernels that release the GIL and use the CPU scale up to that, and
    I/O-bound kernels (network, disk, sleeps) should set a larger value.
    """
    n = _validate.env_num_threads()
    return available_cpus() if n is None else n


# --- jobs -----------------------------------------------------------------------------


class _Local(threading.local):
    #: The job whose chunk this thread is running (a kernel is running here).
    job: Job | None = None


_local = _Local()


def current_job() -> Job | None:
    """The map whose kernel this thread is running, if any."""
    return _local.job


class Job:
    """One flat map: ``n`` elements, run by ``fn(start, stop, job)`` per chunk.

    Every field is read and written under the job's lock. ``fn`` checks
    :attr:`failed` between elements, so that a failure stops the chunks already
    running; the chunks not yet started are never handed out.

    Args:
        n: The number of elements.
        fn: Runs one chunk.
        fixed: Chunks of exactly this many elements (fixed bounds); ``None`` for
            guided chunks.
        divisor: Guided chunks take ``1 / divisor`` of what is left.
        parent: The map whose kernel started this one; its failure stops this one.
    """

    def __init__(
        self,
        n: int,
        fn: ChunkFn,
        *,
        fixed: int | None = None,
        divisor: int = 2,
        parent: Job | None = None,
    ):
        self.n = n
        self.fn = fn
        self.fixed = fixed
        self.divisor = divisor
        self.failed = False
        self.error: BaseException | None = None
        self.completed = 0  # elements done, for progress bars
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._outstanding = 0
        self._children: set[Job] = set()
        self.parent = parent
        if n == 0:
            self.done.set()
        if parent is not None:
            parent._adopt(self)

    def claim(self) -> tuple[int, int] | None:
        """The next chunk to run, or ``None`` when none is left."""
        with self._lock:
            remaining = self.n - self._next
            if remaining <= 0 or self.failed:
                return None
            size = self.fixed or max(1, remaining // self.divisor)
            start = self._next
            self._next = stop = min(self.n, start + size)
            self._outstanding += 1
            return start, stop

    def fail(self, error: BaseException) -> None:
        """Records the first error and stops handing out chunks, here and in the
        maps this map's kernels started.

        A no-op once the job is done: a late error (a cancelled helper task)
        does not undo a finished map.
        """
        with self._lock:
            if self.done.is_set() and self.error is None:
                return
            if self.error is None:
                self.error = error
            self.failed = True
            self._check_done()
            children = list(self._children)
        for child in children:
            child.fail(_stopped_by_parent())

    def run(self, start: int, stop: int) -> None:
        """Runs a claimed chunk; its exception fails the job."""
        outer, _local.job = _local.job, self
        try:
            self.fn(start, stop, self)
        except BaseException as e:  # routed to the waiting thread, like CPython's pool
            self.fail(e)
        finally:
            _local.job = outer
            with self._lock:
                self.completed += stop - start
                self._outstanding -= 1
                self._check_done()

    def drain(self) -> None:
        """Claims and runs chunks until none are left."""
        while (chunk := self.claim()) is not None:
            self.run(*chunk)

    def exhausted(self) -> bool:
        with self._lock:
            return self.failed or self._next >= self.n

    def detach(self) -> None:
        """Forgets the parent, once this map is over."""
        if self.parent is not None:
            with self.parent._lock:
                self.parent._children.discard(self)

    def _adopt(self, child: Job) -> None:
        with self._lock:
            failed = self.failed
            if not failed:
                self._children.add(child)
        if failed:
            child.fail(_stopped_by_parent())

    def _check_done(self) -> None:  # lock held
        if self._outstanding == 0 and (self.failed or self._next >= self.n):
            self.done.set()


def _stopped_by_parent() -> ExecutorError:
    # Never reported to the user: the parent's own (first) error is.
    return ExecutorError(
        "This map was stopped because the map whose kernel started it failed."
    )


# --- the shared pools -----------------------------------------------------------------


class ThreadPool:
    """A bounded pool of worker threads that run :class:`Job` chunks.

    Args:
        max_workers: At most this many threads ever run kernels for this pool, and
            at most this many kernels run at once.
    """

    def __init__(self, max_workers: int):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1. Got {max_workers=}.")
        self.max_workers = max_workers
        self._cond = threading.Condition(threading.Lock())
        self._jobs: collections.deque[Job] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False

    def __repr__(self) -> str:
        return f"ThreadPool(max_workers={self.max_workers})"

    @property
    def num_threads_started(self) -> int:
        return len(self._threads)

    def run(self, job: Job, progress: Progress | None = None) -> None:
        """Runs ``job`` to completion (or first failure) and returns."""
        if job.n == 0:
            return
        with self._cond:
            if self._shutdown:
                raise ExecutorError(
                    "jax_threadmap's thread pool has been shut down (the interpreter "
                    "is exiting). Start no new maps during interpreter shutdown."
                )
            self._jobs.append(job)
            self._start_workers(min(job.n, self.max_workers))
            self._cond.notify_all()
        if _local.job is not None:
            # A kernel that calls threadmap: work on our own chunks rather than
            # wait for them behind the outer maps.
            job.drain()
            self._discard(job)
        wait(job, job.done.wait, progress)

    def _start_workers(self, wanted: int) -> None:  # lock held
        missing = min(wanted - self._idle, self.max_workers - len(self._threads))
        for _ in range(max(0, missing)):
            t = threading.Thread(
                target=self._work,
                name=f"jax_threadmap_{len(self._threads)}",
                daemon=True,
            )
            self._threads.append(t)
            t.start()

    def _discard(self, job: Job) -> None:
        with self._cond:
            try:
                self._jobs.remove(job)
            except ValueError:
                pass

    def _next_job(self) -> Job | None:
        with self._cond:
            while not self._jobs and not self._shutdown:
                self._idle += 1
                self._cond.wait()
                self._idle -= 1
            return self._jobs[0] if self._jobs else None

    def _work(self) -> None:
        while (job := self._next_job()) is not None:
            job.drain()
            self._discard(job)

    def shutdown(self, wait: bool = True) -> None:
        """Stops the workers once the queued maps are done. Safe to call twice."""
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join(timeout=10)


_pools_lock = threading.Lock()
_pools: dict[int, ThreadPool] = {}


def get_pool(num_threads: int | None) -> ThreadPool:
    """The shared pool of ``num_threads`` threads (default: from the environment)."""
    n = default_num_threads() if num_threads is None else num_threads
    pool = _pools.get(n)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(n)
            if pool is None:
                pool = _pools[n] = ThreadPool(n)
    return pool


def _after_fork_in_child() -> None:
    # The parent's worker threads do not exist in the child: start afresh.
    global _pools_lock
    _pools_lock = threading.Lock()
    _pools.clear()


def _shutdown_all() -> None:
    for pool in list(_pools.values()):
        pool.shutdown(wait=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_shutdown_all)


# --- user executors -------------------------------------------------------------------


def known_workers(executor: concurrent.futures.Executor) -> int | None:
    """The number of workers of ``executor``, where it tells."""
    n = getattr(executor, "_max_workers", None)
    if isinstance(n, int) and n > 0:
        return n
    client = getattr(executor, "_client", None)  # distributed.ClientExecutor
    if client is not None:
        try:
            return max(1, sum(client.nthreads().values()))
        except Exception:  # noqa: BLE001 - a client that cannot say: unknown
            return None
    return None


def shares_memory(executor: concurrent.futures.Executor) -> bool:
    """Whether the executor's workers are threads of this process."""
    return isinstance(executor, concurrent.futures.ThreadPoolExecutor)


def _refused(executor: Any, e: BaseException) -> ExecutorError:
    return ExecutorError(
        f"The executor {executor!r} passed as executor= refused new work: "
        f"{type(e).__name__}: {e}. Pass an executor that is running, or "
        "executor=None for the shared pool.",
        cause=e,
    )


def _puller(job: Job) -> None:
    """A task of a thread executor: claims chunks of ``job`` until none are left."""
    job.drain()


def _run_on_threads(
    executor: concurrent.futures.Executor, job: Job, progress: Progress | None
) -> None:
    """Runs ``job`` on a thread executor: one puller task per worker.

    A thread that runs a kernel itself (a nested map) also drains ``job``, since
    the executor's workers may all be busy waiting, for this very thread among
    others: the pullers are then extra hands, and the ones that never start are
    cancelled.
    """
    count = min(known_workers(executor) or UNKNOWN_WORKERS_IN_FLIGHT, job.n)
    left = [count]
    lock = threading.Lock()

    def on_done(f: concurrent.futures.Future[None]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if f.cancelled():
            if last:  # no puller will ever claim the rest
                job.fail(ExecutorError(f"The executor {executor!r} cancelled the map."))
        elif f.exception() is not None:
            job.fail(f.exception())  # type: ignore[arg-type]

    futures = []
    try:
        for _ in range(count):
            futures.append(executor.submit(_puller, job))
            futures[-1].add_done_callback(on_done)
    except RuntimeError as e:
        job.fail(_refused(executor, e))
        for _ in range(count - len(futures)):
            with lock:
                left[0] -= 1
    try:
        if _local.job is not None:
            job.drain()
        wait(job, job.done.wait, progress)
    finally:
        for f in futures:  # pullers that never started: nothing left to claim
            f.cancel()


def _cannot_ship(executor: Any, name: str, e: BaseException) -> ExecutorError:
    return ExecutorError(
        f"threadmap kernel {name!r} could not be sent to the executor "
        f"{executor!r}, which runs work in other processes and so pickles it: "
        f"{type(e).__name__}: {e}. Define the kernel at module level (not a lambda "
        "or closure), or use executor=None / a ThreadPoolExecutor.",
        cause=e,
    )


class _Shipper:
    """Ships a map to an executor that pickles work, in chunks sized as it runs.

    The first tasks hold one element each, one per worker, so slow elements all
    start at once; later ones hold about ``TASK_SECONDS_REMOTE`` of kernel work,
    from the measured seconds per element. A map with host-side sums ships
    chunks of fixed size instead, so its sums do not depend on timing.
    """

    def __init__(self, executor: concurrent.futures.Executor, work: MapWork, job: Job):
        self.executor = executor
        self.work = work
        self.job = job
        workers = known_workers(executor)
        self.cap = 2 * workers if workers else UNKNOWN_WORKERS_IN_FLIGHT
        self.first_wave = min(workers or UNKNOWN_WORKERS_IN_FLIGHT, self.cap)
        self.next = 0
        self.pending: dict[concurrent.futures.Future[Any], tuple[int, int]] = {}
        self.per_element: float | None = None

    def size(self) -> int:
        if self.job.fixed:
            return self.job.fixed
        if self.per_element is None:
            return 1
        remaining = self.job.n - self.next
        size = int(TASK_SECONDS_REMOTE / max(self.per_element, 1e-9))
        return max(1, min(size, -(-remaining // self.cap)))

    def submit(self, size: int) -> None:
        start, stop = self.next, min(self.job.n, self.next + size)
        task = self.work.pack(start, stop)
        try:
            fut = self.executor.submit(task)
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
        if self.job.failed:  # stopped from outside: its parent failed
            return True
        done, _ = concurrent.futures.wait(
            list(self.pending), timeout, concurrent.futures.FIRST_COMPLETED
        )
        for fut in done:
            start, stop = self.pending.pop(fut)
            try:
                outs, per_element = fut.result()
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                if "pickle" not in str(e).lower():
                    raise
                raise _cannot_ship(self.executor, self.work.name, e) from e
            self.work.store_packed(start, stop, outs)
            self.job.completed += stop - start
            self.per_element = (
                per_element
                if self.per_element is None
                else 0.5 * (self.per_element + per_element)
            )
        while self.next < self.job.n and len(self.pending) < self.cap:
            self.submit(self.size())
        return not self.pending

    def run(self, progress: Progress | None) -> None:
        try:
            self.start()
            wait(self.job, self.poll, progress)
        except BaseException as e:
            self.job.fail(e)
        finally:
            if self.job.failed:
                for fut in self.pending:
                    fut.cancel()


# --- one map --------------------------------------------------------------------------


def workers_of(executor: _validate.Executor) -> int:
    """How many kernels ``executor`` runs at once (a guess where it does not say)."""
    if executor is None or isinstance(executor, int):
        return get_pool(executor).max_workers
    return known_workers(executor) or UNKNOWN_WORKERS


def new_job(
    work: MapWork, executor: _validate.Executor, parent: Job | None = None
) -> Job:
    """The job of ``work`` on ``executor``, with its chunking policy."""
    workers = workers_of(executor)
    # Host-side sums need chunk bounds that do not depend on timing: about two
    # chunks per worker. Otherwise guided chunks, each a share of what is left.
    fixed = -(-work.n // (2 * workers)) if work.sums and work.n else None
    return Job(work.n, work.run_chunk, fixed=fixed, divisor=2 * workers, parent=parent)


def run_map(
    executor: _validate.Executor, work: MapWork, *, progress: bool | None
) -> None:
    """Runs every element of ``work`` on ``executor``; raises the map's error.

    Called from a kernel (a nested map), the calling thread works on the map's
    chunks while it waits, when the map runs on threads of this process: the
    kernel's thread is lent to the nested map, which can then run one kernel
    more than its executor's bound.
    """
    if work.n == 0:
        return
    job = new_job(work, executor, parent=_local.job)
    bar = Progress(job.n, work.name) if progress_enabled(progress) else None
    try:
        if executor is None or isinstance(executor, int):
            get_pool(executor).run(job, bar)
        elif shares_memory(executor):
            _run_on_threads(executor, job, bar)
        else:
            _Shipper(executor, work, job).run(bar)
    finally:
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
