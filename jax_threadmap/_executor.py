"""Where the elements of a flat map run: the shared pools and user executors.

A map is a :class:`Job`: a range ``[0, n)`` of flat batch indices and a function
that runs a sub-range. Pools hand out sub-ranges ("chunks") with guided
scheduling: each claim takes a share of what is left, so fast kernels run in a
few large chunks that amortise the scheduling cost, and the last chunks shrink to
a single element so that slow kernels keep every worker busy until the end.

Thread bounds: a :class:`ThreadPool` of ``N`` workers starts at most ``N``
threads in its lifetime, and only those threads run kernels. The thread that
starts a map (the host-callback thread) waits and runs nothing, unless it is
itself a worker of the same pool (a kernel that calls ``threadmap``): then it
works on the chunks of its own map, so it never waits on work queued behind it.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import os
import threading
import weakref
from collections.abc import Callable

from ._errors import ExecutorError

logger = logging.getLogger(__name__)

ENV_NUM_THREADS = "JAX_THREADMAP_NUM_THREADS"

ChunkFn = Callable[[int, int, "Job"], None]


def default_num_threads() -> int:
    """The size of the shared pool used by ``executor=None``.

    ``JAX_THREADMAP_NUM_THREADS`` when set, else the number of CPUs this process
    may run on: kernels that release the GIL and use the CPU scale up to that, and
    I/O-bound kernels (network, disk, sleeps) should set a larger value.
    """
    value = os.environ.get(ENV_NUM_THREADS)
    if value is None or value.strip() == "":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not on Linux
            return max(1, os.cpu_count() or 1)
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"The environment variable {ENV_NUM_THREADS} must be a positive integer "
            f"(the number of threads of jax_threadmap's shared pool). "
            f"Got {ENV_NUM_THREADS}={value!r}. Set it to e.g. 8, or unset it to use "
            "one thread per CPU."
        )
    return n


class Job:
    """One flat map: ``n`` elements, run by ``fn(start, stop, job)`` per chunk.

    ``fn`` checks :attr:`failed` between elements so that a failure stops the
    chunks already running; the chunks not yet started are never handed out.
    """

    __slots__ = (
        "n",
        "fn",
        "next",
        "outstanding",
        "failed",
        "error",
        "done",
        "divisor",
        "min_chunk",
    )

    def __init__(self, n: int, fn: ChunkFn, *, min_chunk: int = 1):
        self.n = n
        self.fn = fn
        self.next = 0
        self.outstanding = 0
        self.failed = False
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.divisor = 2
        self.min_chunk = max(1, min_chunk)
        if n == 0:
            self.done.set()

    def exhausted(self) -> bool:
        return self.next >= self.n

    def claim(self) -> tuple[int, int] | None:
        """Claims the next chunk (guided scheduling). Caller holds the pool lock."""
        remaining = self.n - self.next
        if remaining <= 0 or self.failed:
            return None
        size = max(self.min_chunk, remaining // self.divisor)
        start = self.next
        self.next = stop = min(self.n, start + size)
        self.outstanding += 1
        return start, stop

    def fail(self, error: BaseException) -> None:
        """Records the first error and stops handing out chunks."""
        if self.error is None:
            self.error = error
        self.failed = True
        self.next = self.n

    def run_chunk(self, start: int, stop: int) -> None:
        try:
            self.fn(start, stop, self)
        except BaseException as e:  # routed to the waiting thread, like CPython's pool
            self.fail(e)

    def wait(self) -> None:
        # A timed wait keeps the waiting thread responsive to signals.
        while not self.done.wait(0.5):
            pass


_worker_of = threading.local()


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

    def run(self, job: Job, workers_wanted: int | None = None) -> None:
        """Runs ``job`` to completion (or first failure) and returns."""
        if job.n == 0:
            return
        job.divisor = 2 * self.max_workers
        helping = getattr(_worker_of, "pool", None) is self
        with self._cond:
            if self._shutdown:
                raise ExecutorError(
                    "jax_threadmap's thread pool has been shut down (the interpreter "
                    "is exiting). Start no new maps during interpreter shutdown."
                )
            self._jobs.append(job)
            self._start_workers(min(job.n, self.max_workers))
            self._cond.notify_all()
        if helping:
            # A kernel that calls threadmap: work on our own chunks rather than
            # wait for them behind the outer map's queue.
            while True:
                with self._cond:
                    chunk = job.claim()
                    if job.exhausted():
                        self._discard(job)
                if chunk is None:
                    break
                self._run(job, chunk)
        job.wait()

    def _start_workers(self, wanted: int) -> None:
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
        try:
            self._jobs.remove(job)
        except ValueError:
            pass

    def _run(self, job: Job, chunk: tuple[int, int]) -> None:
        job.run_chunk(*chunk)
        with self._cond:
            job.outstanding -= 1
            if job.outstanding == 0 and job.exhausted():
                self._discard(job)
                job.done.set()

    def _work(self) -> None:
        _worker_of.pool = self
        while True:
            with self._cond:
                while not self._jobs and not self._shutdown:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._jobs:
                    return
                job = self._jobs[0]
                chunk = job.claim()
                if job.exhausted():
                    self._discard(job)
            if chunk is not None:
                self._run(job, chunk)

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


# --- the shared pools ---------------------------------------------------------------

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


# --- user executors -----------------------------------------------------------------

_running_on = threading.local()


def _executor_task(job: Job, start: int, stop: int, executor_ref) -> None:
    _running_on.executor = executor_ref
    try:
        if not job.failed:
            job.run_chunk(start, stop)
    finally:
        _running_on.executor = None


def run_on_executor(executor: concurrent.futures.Executor, job: Job) -> None:
    """Runs ``job`` as tasks of a user-supplied executor; returns when all ended."""
    if job.n == 0:
        return
    ref = weakref.ref(executor)
    current = getattr(_running_on, "executor", None)
    if current is not None and current() is executor:
        # Nested call from a task of the same executor: its workers may all be
        # waiting on us, so run our chunks here.
        job.run_chunk(0, job.n)
        return
    workers = getattr(executor, "_max_workers", None)
    # An executor of unknown size gets one task per element up to 1024 tasks, so
    # that slow elements all run at once however many workers it has.
    num_tasks = min(job.n, 4 * workers if isinstance(workers, int) else 1024)
    bounds = [job.n * k // num_tasks for k in range(num_tasks + 1)]
    futures = []
    try:
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            futures.append(executor.submit(_executor_task, job, start, stop, ref))
    except RuntimeError as e:
        for f in futures:
            f.cancel()
        raise ExecutorError(
            f"The executor {executor!r} passed as executor= refused new work: {e}. "
            "Pass an executor that is running, or executor=None for the shared pool."
        ) from e
    pending = set(futures)
    while pending:
        done, pending = concurrent.futures.wait(
            pending, return_when=concurrent.futures.FIRST_EXCEPTION
        )
        for f in done:
            if f.cancelled():
                continue
            exc = f.exception()
            if exc is not None:
                job.fail(exc)
        if job.failed:
            for f in pending:
                f.cancel()
            concurrent.futures.wait(pending)
            break
