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
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ._errors import ExecutorError

logger = logging.getLogger(__name__)

ENV_NUM_THREADS = "JAX_THREADMAP_NUM_THREADS"

ChunkFn = Callable[[int, int, "Job"], None]


def env_positive_int(name: str, what: str) -> int | None:
    """The positive integer in environment variable ``name``; ``None`` when unset.

    Args:
        name: The variable.
        what: What the number is, for the message when the value is not one.
    """
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"The environment variable {name} must be a positive integer ({what}). "
            f"Got {name}={value!r}. Set it to e.g. 8, or unset it to use the default."
        )
    return n


def default_num_threads() -> int:
    """The size of the shared pool used by ``executor=None``.

    ``JAX_THREADMAP_NUM_THREADS`` when set, else the number of CPUs this process
    may run on: kernels that release the GIL and use the CPU scale up to that, and
    I/O-bound kernels (network, disk, sleeps) should set a larger value.
    """
    n = env_positive_int(ENV_NUM_THREADS, "the number of threads of the shared pool")
    if n is not None:
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


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
        "completed",
        "fixed",
    )

    def __init__(self, n: int, fn: ChunkFn, *, min_chunk: int = 1, fixed: bool = False):
        self.n = n
        self.fn = fn
        self.next = 0
        self.outstanding = 0
        self.failed = False
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.divisor = 2
        self.min_chunk = max(1, min_chunk)
        self.completed = 0  # elements done, for progress bars
        # Chunks of exactly `min_chunk` elements (fixed bounds), else guided.
        self.fixed = fixed
        if n == 0:
            self.done.set()

    def exhausted(self) -> bool:
        # `failed` counts too: `fail` runs without the pool lock, and a claim racing
        # with it may move `next` back below `n`.
        return self.failed or self.next >= self.n

    def claim(self) -> tuple[int, int] | None:
        """Claims the next chunk (guided scheduling). Caller holds the pool lock."""
        remaining = self.n - self.next
        if remaining <= 0 or self.failed:
            return None
        if self.fixed:
            size = self.min_chunk
        else:
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

    def wait(self, progress: Progress | None = None) -> None:
        # A timed wait keeps the waiting thread responsive to signals; an interrupt
        # (Ctrl-C) stops handing out the chunks not yet started.
        interval = 0.5 if progress is None else progress.interval
        try:
            while not self.done.wait(interval):
                if progress is not None:
                    progress.update(self.completed)
        except BaseException as e:
            self.fail(e)
            raise
        finally:
            if progress is not None:
                progress.close(self.completed)


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

    def run(self, job: Job, progress: Progress | None = None) -> None:
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
        job.wait(progress)

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
            job.completed += chunk[1] - chunk[0]
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


# --- progress -------------------------------------------------------------------

ENV_PROGRESS = "JAX_THREADMAP_PROGRESS"


def progress_enabled(progress: bool | None) -> bool:
    if progress is not None:
        return bool(progress)
    return os.environ.get(ENV_PROGRESS, "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


class Progress:
    """A progress bar that appears only once a map has run for ``delay`` seconds.

    Uses tqdm when it is installed, else prints a line to stderr now and then.
    """

    interval = 0.1

    def __init__(self, total: int, name: str, delay: float = 1.0):
        self.total = total
        self.name = name
        self.start = time.perf_counter()
        self.delay = delay
        self.bar: Any = None
        self._last_print = 0.0

    def update(self, completed: int) -> None:
        now = time.perf_counter()
        if now - self.start < self.delay:
            return
        if self.bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(
                    total=self.total, desc=f"threadmap {self.name}", unit="el"
                )
            else:
                self.bar = False
        if self.bar:
            self.bar.update(completed - self.bar.n)
        elif now - self._last_print >= 1.0:
            self._last_print = now
            print(
                f"threadmap {self.name}: {completed}/{self.total} elements "
                f"({100 * completed / max(self.total, 1):.0f}%)",
                file=sys.stderr,
                flush=True,
            )

    def close(self, completed: int) -> None:
        if self.bar:
            self.bar.update(completed - self.bar.n)
            self.bar.close()


# --- user executors -----------------------------------------------------------------

_running_on = threading.local()

#: Seconds of kernel work per task that amortise the per-task cost of an executor
#: that pickles work (about 1 ms for a process pool or Dask).
TASK_SECONDS_REMOTE = 0.05
#: Tasks in flight when an executor does not say how many workers it has.
UNKNOWN_WORKERS_IN_FLIGHT = 128


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


def in_process(executor) -> bool:
    """Whether ``executor`` (a ``threadmap`` executor= value) runs kernels here."""
    return executor is None or isinstance(executor, int) or shares_memory(executor)


def workers_of(executor) -> int:
    """How many kernels ``executor`` runs at once (a guess where it does not say)."""
    if executor is None or isinstance(executor, int):
        return get_pool(executor).max_workers
    return known_workers(executor) or 8


def shares_memory(executor: concurrent.futures.Executor) -> bool:
    """Whether the executor's workers are threads of this process."""
    return isinstance(executor, concurrent.futures.ThreadPoolExecutor)


def _puller(job: Job, lock: threading.Lock, executor_ref) -> None:
    """A task of a thread executor: claims chunks of ``job`` until none are left."""
    _running_on.executor = executor_ref
    try:
        while True:
            with lock:
                chunk = job.claim()
            if chunk is None:
                return
            job.run_chunk(*chunk)
            with lock:
                job.completed += chunk[1] - chunk[0]
    finally:
        _running_on.executor = None


def _refused(executor, e: BaseException) -> ExecutorError:
    err = ExecutorError(
        f"The executor {executor!r} passed as executor= refused new work: "
        f"{type(e).__name__}: {e}. Pass an executor that is running, or "
        "executor=None for the shared pool."
    )
    err.__cause__ = e
    return err


def run_on_thread_executor(
    executor: concurrent.futures.Executor, job: Job, progress: Progress | None = None
) -> None:
    """Runs ``job`` on a thread executor: one puller task per worker."""
    ref = weakref.ref(executor)
    current = getattr(_running_on, "executor", None)
    if current is not None and current() is executor:
        # Nested call from a task of the same executor: its workers may all be
        # waiting on us, so run our chunks here.
        job.run_chunk(0, job.n)
        return
    workers = known_workers(executor) or UNKNOWN_WORKERS_IN_FLIGHT
    job.divisor = 2 * workers
    lock = threading.Lock()
    futures = []
    try:
        for _ in range(min(workers, job.n)):
            futures.append(executor.submit(_puller, job, lock, ref))
    except RuntimeError as e:
        with lock:
            job.fail(_refused(executor, e))
    _wait_futures(futures, job, progress)


def _wait_futures(futures, job: Job, progress: Progress | None) -> None:
    pending = set(futures)
    try:
        _wait_pending(pending, job, progress)
    except BaseException as e:  # e.g. KeyboardInterrupt while waiting
        job.fail(e)
        for f in pending:
            f.cancel()
        raise


def _wait_pending(pending, job: Job, progress: Progress | None) -> None:
    while pending:
        done, pending = concurrent.futures.wait(
            pending,
            timeout=None if progress is None else progress.interval,
            return_when=concurrent.futures.FIRST_EXCEPTION,
        )
        if progress is not None:
            progress.update(job.completed)
        for f in done:
            if not f.cancelled() and f.exception() is not None:
                job.fail(f.exception())
        if job.failed:
            for f in pending:
                f.cancel()
    if progress is not None:
        progress.close(job.completed)


def run_on_remote_executor(
    executor: concurrent.futures.Executor,
    job: Job,
    prepared,
    progress: Progress | None = None,
) -> None:
    """Runs ``job`` on an executor that pickles work (process pool, Dask).

    Each task carries only its chunk's slices of the operands. Chunk sizes adapt
    to the kernel's measured cost: the first tasks hold one element each (one per
    worker, so slow elements all start at once); later ones hold about
    ``TASK_SECONDS_REMOTE`` of kernel work.
    """
    workers = known_workers(executor)
    in_flight_cap = 2 * workers if workers else UNKNOWN_WORKERS_IN_FLIGHT
    first_wave = workers if workers else UNKNOWN_WORKERS_IN_FLIGHT
    n = job.n
    next_start = 0
    pending: dict[concurrent.futures.Future, tuple[int, int]] = {}
    seconds_per_element: float | None = None

    def submit(size: int) -> None:
        nonlocal next_start
        start, stop = next_start, min(n, next_start + size)
        task = prepared.remote_task(start, stop)
        try:
            fut = executor.submit(task)
        except RuntimeError as e:
            raise _refused(executor, e) from None
        except Exception as e:  # e.g. the kernel cannot be pickled
            raise _cannot_ship(executor, prepared, e) from None
        pending[fut] = (start, stop)
        next_start = stop

    try:
        while next_start < n and len(pending) < min(first_wave, in_flight_cap):
            submit(1)
        while pending:
            done, _ = concurrent.futures.wait(
                list(pending),
                timeout=None if progress is None else progress.interval,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
            for fut in done:
                start, stop = pending.pop(fut)
                try:
                    outs, per_element = fut.result()
                except (pickle.PicklingError, AttributeError, TypeError) as e:
                    # Python 3.13 says "Can't get local object"; the pool's
                    # remote traceback (the cause) names the pickler.
                    if "pickle" not in f"{e} {e.__cause__}".lower():
                        raise
                    raise _cannot_ship(executor, prepared, e) from None
                prepared.store_remote(start, stop, outs)
                job.completed += stop - start
                seconds_per_element = (
                    per_element
                    if seconds_per_element is None
                    else 0.5 * (seconds_per_element + per_element)
                )
            if progress is not None:
                progress.update(job.completed)
            while next_start < n and len(pending) < in_flight_cap:
                remaining = n - next_start
                size = 1
                if seconds_per_element is not None:
                    size = int(TASK_SECONDS_REMOTE / max(seconds_per_element, 1e-9))
                size = max(1, min(size, -(-remaining // in_flight_cap)))
                submit(size)
    except BaseException as e:
        job.fail(e)
        for fut in pending:
            fut.cancel()
    finally:
        if progress is not None:
            progress.close(job.completed)


def _cannot_ship(executor, prepared, e: BaseException) -> ExecutorError:
    err = ExecutorError(
        f"threadmap kernel {prepared.loop.name!r} could not be sent to the executor "
        f"{executor!r}, which runs work in other processes and so pickles it: "
        f"{type(e).__name__}: {e}. Define the kernel at module level (not a lambda "
        "or closure), or use executor=None / a ThreadPoolExecutor."
    )
    err.__cause__ = e
    return err


def run_map(executor, prepared, *, name: str, progress: bool | None) -> Job:
    """Runs every element of ``prepared`` on ``executor``; returns the finished job."""
    fixed = prepared.fixed_chunk
    job = Job(prepared.n, prepared.run_chunk, min_chunk=fixed or 1, fixed=bool(fixed))
    if job.n == 0:
        return job
    if fixed and not in_process(executor):
        raise ExecutorError(
            "A threadmap equation that sums its outputs on the host runs only on "
            f"executors in this process; got {executor!r}."
        )
    bar = Progress(job.n, name) if progress_enabled(progress) else None
    if executor is None or isinstance(executor, int):
        get_pool(executor).run(job, bar)
    elif shares_memory(executor):
        run_on_thread_executor(executor, job, bar)
    else:
        run_on_remote_executor(executor, job, prepared, bar)
    return job
