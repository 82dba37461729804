"""Where the elements of a flat map run: the shared threads and user executors.

This module owns every scheduling decision: how a map's flat index range
``[0, n)`` is cut into chunks, which threads run them, how a nested map avoids
waiting on work queued behind it, and what happens at fork and exit.

- A map is a :class:`Job`. Chunks are claimed with guided scheduling: each claim
  takes a share of what is left, so fast kernels run in a few large chunks that
  amortise the scheduling cost, and the last chunks shrink to a single element so
  that slow kernels keep every worker busy until the end. A map whose outputs are
  summed on the host gets fixed chunk bounds instead, so that its sums do not
  depend on timing.
- :class:`ThreadPool` (``executor=None`` and ``executor=N``) is a bound, not a
  set of threads: at most ``N`` kernels of its maps run at once. The kernels of
  every pool run on one set of daemon threads (:class:`_Threads`), started on
  demand: a thread starts only when no idle one is left, so the threads alive
  never outnumber the most places (threads running, or about to run, a pool's
  kernels) the pools have held at once, and a thread idle for ``IDLE_TIMEOUT``
  seconds exits.
- A user's ``ThreadPoolExecutor`` gets one task per worker, each claiming chunks
  until none are left (the same claim-and-run loop as the shared threads).
- Threads per map: a large map (more than ``LIMITED_FROM`` elements per
  thread) whose executor has more threads than CPUs starts on one thread per
  CPU, and gets all of its executor's threads once its chunks show that its
  elements are slow, or that their threads mostly wait (I/O, sleeps) rather
  than compute. A fast kernel gains nothing from more threads than CPUs, and
  loses to threads taking turns at the GIL. A map's first pullers are queued
  together, so small maps started at once on one executor do not split its
  threads between them.
- Executors that pickle work (process pools, Dask) get packed chunks
  (:mod:`._remote`), sized from the kernel's measured cost.
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
import collections
import concurrent.futures
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast

from . import _remote, _validate
from ._errors import ExecutorError, KernelError
from ._progress import Progress, progress_enabled, wait

ENV_NUM_THREADS = _validate.ENV_NUM_THREADS

#: Runs elements ``[start, stop)`` of a job; checks ``job.failed`` between elements.
ChunkFn = Callable[[int, int, "Job"], None]

#: Seconds of kernel work per task that amortise the per-task cost of an executor
#: that pickles work (about 1 ms for a process pool or Dask).
TASK_SECONDS_REMOTE = 0.05
#: Seconds of kernel work that a task of an executor that pickles work holds at
#: least, also at the end of a map: a round trip to a worker costs more than the
#: balance that smaller tasks would buy (about 1 ms, tens of ms on a busy cluster).
MIN_TASK_SECONDS_REMOTE = 0.01
#: Tasks in flight when an executor does not say how many workers it has.
UNKNOWN_WORKERS_IN_FLIGHT = 128
#: Workers assumed, for chunk sizes, of an executor that does not say.
UNKNOWN_WORKERS = 8
#: Seconds a shared thread waits for work before it exits. Long enough that maps
#: called in a loop keep their threads (starting one costs about 50 us), short
#: enough that a burst of maps on many pool sizes leaves no crowd of idle threads.
IDLE_TIMEOUT = 2.0
#: Seconds that interpreter exit waits, in all, for kernels still running. A
#: kernel blocked for good (a read with no timeout) costs the exit this much, not
#: a join per thread.
EXIT_GRACE = 1.0
#: Seconds per element from which a map gets all its executor's threads: the
#: time threads spend taking turns is then small beside each element, and a
#: kernel that waits (a network read) gains from every thread.
SLOW_ELEMENT = 200e-6
#: A map gets all its executor's threads when its threads were on a CPU for
#: less than this share of their time, summed over the threads the map holds:
#: its elements wait rather than compute (sleeps, I/O). Threads that take turns
#: at the GIL add up to about one CPU; a 50 us sleep to about 0.1 per thread.
WAIT_SHARE = 0.5
#: Chunks in a row that must find the elements slow, or waiting, before a map
#: gets all its threads: one chunk may be slow for reasons of its own (a first
#: call that fills a cache, a thread that lost its CPU for a moment).
SLOW_VOTES = 2
#: While a map holds fewer threads than its executor has: seconds of work in a
#: chunk at least (measuring one costs a few us) and at most (so that a map
#: whose elements turn slow can still spread what is left over every thread).
MIN_CHUNK_SECONDS = 200e-6
MAX_CHUNK_SECONDS = 10e-3
#: Seconds a chunk of a map on fewer threads may run before the thread that
#: waits for the map gives it every thread: elements that wait for each other
#: (at a barrier, for replies that come once all requests are out) all start.
STUCK_CHUNK = 0.05
#: Elements per executor thread from which a map starts on fewer threads. A
#: smaller map runs as it did before maps were limited: on every thread at once,
#: mostly one element per chunk, so that elements which wait for each other all
#: start whatever else runs on the executor; its few elements cost little on
#: many threads.
LIMITED_FROM = 4


class MapWork(Protocol):
    """What the executor layer needs of a map (``_host.HostMap`` provides it)."""

    @property
    def name(self) -> str: ...  # for messages and progress bars

    @property
    def n(self) -> int: ...  # elements

    @property
    def sums(self) -> bool: ...  # chunk bounds must not depend on timing

    @property
    def vectorized(self) -> bool: ...  # one kernel call per chunk

    @property
    def element_bytes(self) -> int: ...  # one element's operands and results

    def split(self, max_elements: int) -> int:
        """Cuts a vectorized map into chunks of at most ``max_elements``; returns
        how many. Work units are then chunks, not elements."""
        ...

    def run_chunk(self, start: int, stop: int, job: Job) -> None: ...

    def shared(self) -> list[Any]:
        """Operands shipped once per map to an executor that pickles work."""
        ...

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """A picklable task running ``[start, stop)`` in another process, called
        with the map's shared operands (see :func:`._remote.share`)."""
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
        workers: The threads the map's executor has (default: one per element).
        cpus: When fewer than ``workers``, the map starts on this many threads,
            and gets all ``workers`` once its chunks find its elements slow
            (:data:`SLOW_ELEMENT`) or waiting (:data:`WAIT_SHARE`); chunks are
            then sized from the measured time of an element. Guided maps only.
    """

    def __init__(
        self,
        n: int,
        fn: ChunkFn,
        *,
        fixed: int | None = None,
        divisor: int = 2,
        parent: Job | None = None,
        workers: int | None = None,
        cpus: int | None = None,
    ):
        self.n = n
        self.fn = fn
        self.fixed = fixed
        self.divisor = divisor
        self.workers = n if workers is None else max(1, workers)
        #: Threads the map may hold now; raised to ``workers`` by :meth:`_measured`.
        self.limit = self.workers
        if cpus is not None and fixed is None and cpus < self.workers:
            self.limit = max(1, cpus)
        #: Threads handed the map (by its runner, under the runner's lock).
        self.hands = 0
        #: Hands the map more threads once its limit rises (set by its runner).
        self.grow: Callable[[], None] | None = None
        self._per_element = 0.0  # seconds, from the last chunk measured
        self._votes = 0  # chunks in a row that found the elements slow
        # While limited: when each thread's chunk started (wall and CPU clocks).
        self._started: dict[int, tuple[float, float]] = {}
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

    @property
    def limited(self) -> bool:
        """Whether the map holds fewer threads than its executor has."""
        return self.limit < self.workers

    def claim(self) -> tuple[int, int] | None:
        """The next chunk to run, or ``None`` when none is left."""
        with self._lock:
            remaining = self.n - self._next
            if remaining <= 0 or self.failed:
                return None
            if self.fixed:
                size = self.fixed
            elif self.limited:
                size = self._measured_size(remaining)
                self._started[threading.get_ident()] = (
                    time.perf_counter(),
                    time.thread_time(),
                )
            else:
                size = max(1, remaining // self.divisor)
            start = self._next
            self._next = stop = min(self.n, start + size)
            self._outstanding += 1
            return start, stop

    def _measured_size(self, remaining: int) -> int:  # lock held
        """A guided chunk of a limited map: one element until an element has
        been timed, then the share of what is left that it would take on every
        thread, between :data:`MIN_CHUNK_SECONDS` and :data:`MAX_CHUNK_SECONDS`
        of work: the first elements' time says little of the later ones'."""
        per = self._per_element
        if per <= 0.0:
            return 1
        size = max(remaining // self.divisor, int(MIN_CHUNK_SECONDS / per))
        return max(1, min(size, int(MAX_CHUNK_SECONDS / per)))

    def _measured(self, elements: int) -> bool:  # lock held
        """Times the chunk this thread just ran, if the map was limited when it
        was claimed; returns whether the limit rose to every worker."""
        started = self._started.pop(threading.get_ident(), None)
        if started is None or not self.limited:
            return False
        wall = time.perf_counter() - started[0]
        cpu = time.thread_time() - started[1]
        self._per_element = per = max(wall / elements, 1e-9)
        waits = cpu * self.limit < WAIT_SHARE * wall
        self._votes = self._votes + 1 if per >= SLOW_ELEMENT or waits else 0
        if self._votes < SLOW_VOTES:
            return False
        return self._unlimit()

    def _unlimit(self) -> bool:  # lock held
        """Lets the map use every worker; whether threads should be added."""
        self.limit = self.workers
        self._started.clear()
        return not self.failed and self._next < self.n

    def poll(self, timeout: float) -> bool:
        """Waits at most ``timeout`` seconds for the map to finish; says whether
        it has. Watches a limited map meanwhile (:meth:`watch`)."""
        end = time.monotonic() + timeout
        while self.limited:
            if self.done.wait(min(STUCK_CHUNK / 2, max(0.0, end - time.monotonic()))):
                return True
            self.watch()
            if time.monotonic() >= end:
                return False
        return self.done.wait(max(0.0, end - time.monotonic()))

    def watch(self) -> None:
        """Called by the thread that waits for the map: a limited map whose
        chunk has run for :data:`STUCK_CHUNK` seconds gets every worker (its
        elements may wait for each other)."""
        with self._lock:
            if not self.limited or not self._started:
                return
            oldest = min(wall for wall, _ in self._started.values())
            rose = time.perf_counter() - oldest >= STUCK_CHUNK and self._unlimit()
        if rose and self.grow is not None:
            self.grow()

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

    def abandon(self, error: BaseException) -> None:
        """Fails the job and releases its waiting thread at once, without waiting
        for the chunks still running (which write only into the map's own
        buffers). For interpreter exit, where those chunks may never return."""
        self.fail(error)
        self.done.set()

    def run(self, start: int, stop: int) -> None:
        """Runs a claimed chunk; its exception fails the job."""
        outer, _local.job = _local.job, self
        try:
            self.fn(start, stop, self)
        except BaseException as e:  # routed to the waiting thread, like CPython's pool
            self.fail(e)
        finally:
            _local.job = outer
            if self.limited:
                with self._lock:
                    rose = self._measured(stop - start)
                # Before the chunk counts as done, so that the map (and its
                # executor) is still there for the threads added.
                if rose and self.grow is not None:
                    self.grow()
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


# --- the shared threads ---------------------------------------------------------------


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
        self._shutdown = False

    def __repr__(self) -> str:
        return f"ThreadPool(max_workers={self.max_workers})"

    def run(self, job: Job, progress: Progress | None = None) -> None:
        """Runs ``job`` to completion (or first failure) and returns."""
        if job.n == 0:
            return
        threads = _threads
        job.grow = lambda: threads.hand(self, job)
        threads.submit(self, job)
        if _local.job is None:
            # The pool's threads run every chunk, and the last one to finish drops
            # the job from the queue.
            wait(job, job.poll, progress)
            return
        # A kernel that calls threadmap: work on our own chunks rather than wait
        # for them behind the outer maps.
        try:
            job.drain()
            wait(job, job.poll, progress)
        finally:
            threads.forget(job)

    def shutdown(self) -> None:
        """Refuses new maps. Safe to call twice; the threads are shared and exit
        when idle."""
        with _threads.lock:
            self._shutdown = True


class _Worker:
    """One shared thread: the job (and pool) it has been handed, if any."""

    __slots__ = ("cancelled", "job", "pool", "started", "wake")

    def __init__(self, pool: ThreadPool, job: Job):
        self.pool: ThreadPool | None = pool
        self.job: Job | None = job
        self.started = False  # its thread runs (set by the thread, under the lock)
        self.cancelled = False  # its thread must not run: the start failed
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
        self.started = 0
        self.exiting = False

    def submit(self, pool: ThreadPool, job: Job) -> None:
        """Queues ``job`` and hands it as many threads as it can use now."""
        self.hand(pool, job, queue=True)

    def hand(self, pool: ThreadPool, job: Job, queue: bool = False) -> None:
        """Hands ``job`` (queued unless ``queue``) as many threads as it can use
        now: up to its limit, within its pool's bound."""
        new: list[tuple[threading.Thread, _Worker]] = []
        with self.lock:
            if self.exiting or pool._shutdown:
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
            for _ in range(min(job.n, job.limit) - job.hands):
                if pool.active >= pool.max_workers:
                    break
                _take_place(pool, job)
                if self.idle:
                    worker = self.idle.pop()
                    worker.pool, worker.job = pool, job
                    worker.wake.release()
                else:
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

    def _cancel(
        self, pool: ThreadPool, new: list[tuple[threading.Thread, _Worker]]
    ) -> None:
        """Gives back the places of threads whose start failed."""
        with self.lock:
            for t, worker in new:
                if not worker.started:  # a start cut short may yet run it: it won't
                    worker.cancelled = True
                    self.threads.discard(t)
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
        return t, worker

    def _work(self, worker: _Worker) -> None:
        with self.lock:
            if worker.cancelled:
                return
            worker.started = True
        while (job := worker.job) is not None:
            job.drain()
            with self.lock:
                self._hand_next(worker)
                idle = worker.job is None and not self.exiting
                if idle:
                    self.idle.append(worker)
                elif worker.job is None:
                    self.threads.discard(threading.current_thread())
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

    def exit(self) -> list[threading.Thread]:
        """Stops handing out work; idle threads exit. Returns the threads alive."""
        with self.lock:
            self.exiting = True
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


# --- maps in flight, fork and exit ----------------------------------------------------

#: Every map in flight, with the thread waiting for it. No lock: setting, popping
#: and listing the items of a dict are atomic, in free-threaded builds too.
_flights: dict[Job, threading.Thread] = {}


def _after_fork_in_child() -> None:
    # The parent's threads do not exist in the child, and neither do its maps in
    # flight (a fork from inside a kernel runs none of them here): start afresh.
    global _threads, _pools_lock
    _threads = _Threads()
    _pools_lock = threading.Lock()
    _pools.clear()
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
    for t in [waiter for _, waiter in flights] + _threads.exit():
        if t is not me and t.ident is not None:
            t.join(max(0.0, deadline - time.monotonic()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)


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


#: Per thread executor, a lock held while a map queues its first pullers.
_queue_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = (
    weakref.WeakKeyDictionary()
)
_queue_locks_lock = threading.Lock()
_queue_locks_fallback = threading.Lock()


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

    job.grow = hand
    with _queueing(executor):
        hand()
    try:
        if _local.job is not None:
            job.drain()
        wait(job, job.poll, progress)
    finally:
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
        self.sharing = _remote.Sharing([])

    def size(self) -> int:
        if self.job.fixed:
            return self.job.fixed
        if self.per_element is None:
            return 1
        remaining = self.job.n - self.next
        per_element = max(self.per_element, 1e-9)
        size = int(TASK_SECONDS_REMOTE / per_element)
        least = int(MIN_TASK_SECONDS_REMOTE / per_element)
        return max(1, min(size, max(least, -(-remaining // self.cap))))

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
            except KernelError:
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


# --- one map --------------------------------------------------------------------------


def workers_of(executor: _validate.Executor) -> int:
    """How many kernels ``executor`` runs at once (a guess where it does not say)."""
    if executor is None or isinstance(executor, int):
        return get_pool(executor).max_workers
    return known_workers(executor) or UNKNOWN_WORKERS


#: Bytes of operands and results that one chunk of a vectorized kernel may touch
#: when its length is automatic: big enough that the per-call cost vanishes,
#: small enough that copies of chunks stay far below the batch's size.
VECTOR_CHUNK_BYTES = 16 * 2**20


def vector_chunk_length(
    work: MapWork, workers: int, max_chunk: int | None = None
) -> int:
    """Elements per call of a vectorized kernel.

    Four chunks per worker keep every worker busy when chunks take unequal
    time; :data:`VECTOR_CHUNK_BYTES` bounds the memory of one chunk; the user's
    ``max_chunk`` bounds it further (memory-hungry kernels).
    """
    length = -(-work.n // (4 * workers))
    length = min(length, max(1, VECTOR_CHUNK_BYTES // max(1, work.element_bytes)))
    if max_chunk is not None:
        length = min(length, max_chunk)
    return max(1, length)


def new_job(
    work: MapWork,
    executor: _validate.Executor,
    max_chunk: int | None = None,
    parent: Job | None = None,
    pool: ThreadPool | None = None,
) -> Job:
    """The job of ``work`` on ``executor`` (the shared ``pool`` it names, when
    the caller has looked it up), with its chunking policy."""
    workers = pool.max_workers if pool is not None else workers_of(executor)
    units = work.n
    if work.vectorized and units:
        units = work.split(vector_chunk_length(work, workers, max_chunk))
    # Host-side sums need chunk bounds that do not depend on timing: about two
    # chunks per worker. Otherwise guided chunks, each a share of what is left.
    fixed = -(-units // (2 * workers)) if work.sums and units else None
    # A large map on threads starts on one per CPU (see Job); a small one
    # (LIMITED_FROM) and a nested one take every thread at once, since their
    # elements may wait on each other (and the thread that waits for a nested
    # map runs a kernel and watches nothing).
    on_threads = (
        executor is None or isinstance(executor, int) or shares_memory(executor)
    )
    large = units > LIMITED_FROM * workers
    cpus = available_cpus() if on_threads and parent is None and large else None
    return Job(
        units,
        work.run_chunk,
        fixed=fixed,
        divisor=2 * workers,
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
    pool = get_pool(executor) if executor is None or isinstance(executor, int) else None
    job = new_job(work, executor, max_chunk, parent=_local.job, pool=pool)
    bar = None
    if progress_enabled(progress):
        bar = Progress(job.n, work.name, unit="chunk" if work.vectorized else "el")
    _flights[job] = threading.current_thread()
    try:
        if pool is not None:
            pool.run(job, bar)
        elif shares_memory(user := cast(concurrent.futures.Executor, executor)):
            _run_on_threads(user, job, bar)
        else:
            _Shipper(user, work, job).run(bar)
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
