"""The shared threads: the daemon threads that run the kernels of every pool.

- :class:`ThreadPool` (``executor=None`` and ``executor=N``) is a bound, not a
  set of threads: at most ``N`` kernels of its maps run at once. The kernels of
  every pool run on one set of daemon threads (:class:`_Threads`), started on
  demand: a thread starts only when no idle one is left, so the threads alive
  never outnumber the most places (threads running, or about to run, a pool's
  kernels) the pools have held at once, and a thread idle for ``IDLE_TIMEOUT``
  seconds exits.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from . import _scheduling as policy
from . import _validate
from ._errors import ExecutorError
from ._jobs import Job, LimitedGate, _local
from ._progress import Progress, wait
from ._scheduling import IDLE_TIMEOUT, available_cpus


def default_num_threads() -> int:
    """The size of the shared pool used by ``executor=None``.

    ``JAX_THREADMAP_NUM_THREADS`` when set, else the number of CPUs this process
    may run on: kernels that release the GIL and use the CPU scale up to that, and
    I/O-bound kernels (network, disk, sleeps) should set a larger value.
    """
    n = _validate.env_num_threads()
    return available_cpus() if n is None else n


class ThreadPool:
    """A bound on the kernels of its maps that run at once, on the shared threads.

    Args:
        max_workers: At most this many kernels of this pool's maps run at once
            (see :func:`run_map` for the one exception, nested maps).
    """

    def __init__(self, max_workers: int):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1. Got {max_workers=}.")
        self.max_workers = max_workers
        # Both under the shared threads' lock:
        self.active = 0  # threads that hold one of the pool's places
        self.peak = 0  # the most places held at once
        self.gate = LimitedGate()
        self._shutdown = False

    def __repr__(self) -> str:
        return f"ThreadPool(max_workers={self.max_workers})"

    def run(self, job: Job, progress: Progress | None = None) -> None:
        """Runs ``job`` to completion (or first failure) and returns."""
        if job.n == 0:
            return
        threads = _threads

        def grow() -> None:
            self.gate.leave(job)
            threads.hand(self, job)

        job.grow = grow
        self.gate.enter(job)
        try:
            threads.submit(self, job)
            if _local.job is None:
                # The pool's threads run every chunk, and the last one to finish
                # drops the job from the queue.
                wait(job, job.poll, progress)
                return
            # A kernel that calls threadmap: work on our own chunks rather than
            # wait for them behind the outer maps.
            try:
                job.drain()
                wait(job, job.poll, progress)
            finally:
                threads.forget(job)
        finally:
            self.gate.leave(job)

    def shutdown(self) -> None:
        """Refuses new maps. Safe to call twice; the threads are shared and exit
        when idle."""
        with _threads.lock:
            self._shutdown = True


class _Worker:
    """One shared thread: the job (and pool) it has been handed, if any."""

    __slots__ = ("cancelled", "job", "pool", "running", "started", "wake")

    def __init__(self, pool: ThreadPool, job: Job):
        self.pool: ThreadPool | None = pool
        self.job: Job | None = job
        self.started = False  # its thread runs (set by the thread, under the lock)
        self.cancelled = False  # its thread must not run: the start failed
        # Its thread runs a chunk (a kernel). Written by its thread only, read
        # under the threads' lock: a stale read only delays a thread's start.
        self.running = False
        # Released (under the threads' lock) to wake the idle thread: it then
        # finds its job set, without taking the threads' lock again.
        self.wake = threading.Lock()
        self.wake.acquire()


class _Threads:
    """The daemon threads that run the kernels of every :class:`ThreadPool`.

    Every field is read and written under :attr:`lock`. A job is queued with its
    pool; each thread holds one place of one pool while it drains one of the
    pool's jobs, and is handed work directly: an idle thread wakes with its job
    set, and no thread wakes to find nothing.
    A thread that finishes a job takes the next queued job of the same pool,
    keeping its place, else gives the place back and takes any queued job whose
    pool has a free place, else waits ``IDLE_TIMEOUT`` seconds to be handed one
    and exits.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: collections.deque[tuple[ThreadPool, Job]] = collections.deque()
        self.idle: list[_Worker] = []  # the last to go idle is handed work first
        self.threads: set[threading.Thread] = set()
        self.workers: set[_Worker] = set()  # of the threads alive
        self.started = 0
        self.exiting = False
        #: Maps still taken at exit: those of programs that JAX waits for.
        self.kept_at_exit: Callable[[Job], bool] = lambda job: False

    def submit(self, pool: ThreadPool, job: Job) -> None:
        """Queues ``job`` and hands it as many threads as it can use now."""
        self.hand(pool, job, queue=True)

    def hand(self, pool: ThreadPool, job: Job, queue: bool = False) -> None:
        """Hands ``job`` (queued unless ``queue``) as many threads as it can use
        now: up to its limit, within its pool's bound."""
        new: list[tuple[threading.Thread, _Worker]] = []
        with self.lock:
            if not queue and (self.exiting or pool._shutdown):
                return  # more threads for a map in flight: it keeps those it has
            if pool._shutdown or (self.exiting and not self.kept_at_exit(job)):
                raise ExecutorError(
                    "jax_threadmap's thread pool has been shut down"
                    + (
                        " (the interpreter is exiting). Start no new maps during "
                        "interpreter shutdown."
                        if self.exiting
                        else ". Pass executor=None or an int for a shared pool."
                    )
                )
            if queue:
                self.queue.append((pool, job))
            elif job.exhausted():
                return
            returning = None  # threads about to look for work, once counted
            for _ in range(min(job.n, job.limit) - job.hands):
                if pool.active >= pool.max_workers:
                    break
                if self.idle:
                    _take_place(pool, job)
                    worker = self.idle.pop()
                    worker.pool, worker.job = pool, job
                    worker.wake.release()
                    continue
                if returning is None:
                    returning = self._returning()
                if returning >= policy.SPARE_THREADS():
                    break  # they take the job from the queue (_hand_next)
                _take_place(pool, job)
                new.append(self._new_thread(pool, job))
        # Outside the lock, so that the other threads keep going meanwhile.
        for i, (t, _) in enumerate(new):
            try:
                t.start()
            except BaseException as e:  # refused (too many threads), or Ctrl-C
                self._cancel(pool, new[i:])
                self.forget(job)
                if not isinstance(e, RuntimeError):
                    job.fail(e)
                    raise
                job.fail(
                    ExecutorError(
                        f"Could not start a thread for {pool!r} "
                        f"({threading.active_count()} threads alive): "
                        f"{type(e).__name__}: {e}. Pass a smaller executor=N.",
                        cause=e,
                    )
                )
                return

    def _returning(self) -> int:  # lock held
        """Threads neither idle nor running a kernel: done with their job's
        chunks, each about to take a queued job or go idle."""
        return sum(
            1
            for w in self.workers
            if not w.running
            and w.started
            and w not in self.idle
            and (w.job is None or w.job.exhausted())
        )

    def _cancel(
        self, pool: ThreadPool, new: list[tuple[threading.Thread, _Worker]]
    ) -> None:
        """Gives back the places of threads whose start failed."""
        with self.lock:
            for t, worker in new:
                if not worker.started:  # a start cut short may yet run it: it won't
                    worker.cancelled = True
                    self.threads.discard(t)
                    self.workers.discard(worker)
                    pool.active -= 1
                    if worker.job is not None:
                        worker.job.hands -= 1

    def forget(self, job: Job) -> None:
        """Drops ``job`` from the queue, where a thread has not yet done so."""
        with self.lock:
            for entry in self.queue:
                if entry[1] is job:
                    self.queue.remove(entry)
                    return

    def _new_thread(
        self, pool: ThreadPool, job: Job
    ) -> tuple[threading.Thread, _Worker]:  # lock held
        worker = _Worker(pool, job)
        t = threading.Thread(
            target=self._work,
            args=(worker,),
            name=f"jax_threadmap_{self.started}",
            daemon=True,
        )
        self.started += 1
        self.threads.add(t)
        self.workers.add(worker)
        return t, worker

    def _work(self, worker: _Worker) -> None:
        with self.lock:
            if worker.cancelled:
                return
            worker.started = True
        while (job := worker.job) is not None:
            while (chunk := job.claim()) is not None:
                worker.running = True
                job.run(*chunk)
                worker.running = False
            with self.lock:
                self._hand_next(worker)
                idle = worker.job is None and not self.exiting
                if idle:
                    self.idle.append(worker)
                elif worker.job is None:
                    self.threads.discard(threading.current_thread())
                    self.workers.discard(worker)
            if idle:
                self._wait_for_work(worker)

    def _wait_for_work(self, worker: _Worker) -> None:
        """Waits ``IDLE_TIMEOUT`` seconds to be handed a job; leaves the thread
        registered only if it was."""
        woke = worker.wake.acquire(timeout=IDLE_TIMEOUT)
        with self.lock:
            if not woke and not worker.wake.acquire(blocking=False):
                if worker in self.idle:  # no one can hand us a job now
                    self.idle.remove(worker)
            if worker.job is None:  # timed out, or told to exit
                self.threads.discard(threading.current_thread())
                self.workers.discard(worker)

    def _hand_next(self, worker: _Worker) -> None:  # lock held
        """Hands ``worker`` (just done with a job) its next job, or none."""
        pool = worker.pool
        assert pool is not None
        worker.pool = worker.job = None
        other = None
        for entry in list(self.queue):
            p, job = entry
            if job.exhausted():
                self.queue.remove(entry)
            elif job.hands >= job.limit:  # as many threads as it may use
                continue
            elif p is pool:  # keep our place for the next map of our pool
                worker.pool, worker.job = entry
                job.hands += 1
                return
            elif other is None and p.active < p.max_workers:
                other = entry
        pool.active -= 1
        if other is not None:
            _take_place(*other)
            worker.pool, worker.job = other

    def exit(self, keep: Callable[[Job], bool]) -> list[threading.Thread]:
        """Refuses new maps but those that ``keep`` accepts; idle threads exit.
        Returns the threads alive."""
        with self.lock:
            self.exiting = True
            self.kept_at_exit = keep
            for worker in self.idle:
                worker.wake.release()
            self.idle.clear()
            return list(self.threads)

    def count(self) -> int:
        with self.lock:
            return len(self.threads)


def _take_place(pool: ThreadPool, job: Job) -> None:  # shared threads' lock held
    pool.active += 1
    pool.peak = max(pool.peak, pool.active)
    job.hands += 1


_threads = _Threads()
_pools_lock = threading.Lock()
#: The shared pools by (what for, size): ``threadmap``'s ``executor=N`` pools, and
#: the pool of ``async_call`` (whose bound is its own, whatever its size).
_pools: dict[tuple[str, int], ThreadPool] = {}


def reset_after_fork() -> None:
    """The parent's threads do not exist in a forked child: start afresh."""
    global _threads, _pools_lock
    _threads = _Threads()
    _pools_lock = threading.Lock()
    _pools.clear()


def num_threads() -> int:
    """The number of shared threads alive (busy or idle)."""
    return _threads.count()


def get_pool(num_threads: int | None, purpose: str = "threadmap") -> ThreadPool:
    """The shared pool of ``num_threads`` threads (default: from the environment)."""
    n = default_num_threads() if num_threads is None else num_threads
    key = (purpose, n)
    pool = _pools.get(key)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(key)
            if pool is None:
                pool = _pools[key] = ThreadPool(n)
    return pool


def run_in_background(pool: ThreadPool, fn: Callable[[], None]) -> None:
    """Runs ``fn()`` on the shared threads, within ``pool``'s bound, and returns.

    For ``async_call``: the call runs on a daemon thread, never joined at exit,
    and nothing waits for it here (``fn`` routes its own outcome).
    """

    def chunk(start: int, stop: int, job: Job) -> None:
        del start, stop, job
        fn()

    _threads.submit(pool, Job(1, chunk))
