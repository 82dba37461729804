"""The shared threads of ``executor=None`` and ``executor=N``: the package's own
daemon threads, and their pools (:class:`ThreadPool`, a bound on the kernels that
run at once); docs/executors.md says what they promise. A thread that starts a
map from inside a kernel (a nested map) works on its chunks while it waits. (A
user's ``ThreadPoolExecutor`` is ``runners.ThreadExecutor``; the async pool of
``async_call`` is ``_arrays/async_pool.py``.)
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from .._support import environment as _environment
from .._support import fork as _fork
from .._support.cpus import available_cpus
from .._support.errors import ExecutorError
from .jobs import Job, at_shutdown, this_thread
from .progress import Progress, wait
from .scheduling import IDLE_TIMEOUT


def default_num_threads() -> int:
    """The size of the shared pool of ``executor=None``:
    ``JAX_THREADMAP_NUM_THREADS``, else the CPUs this process may run on."""
    n = _environment.env_num_threads()
    return available_cpus() if n is None else n


class ThreadPool:
    """At most ``workers`` kernels of its maps run at once, on the shared
    threads (a nested map's waiting thread, lent to it, is the one exception):
    the runner of ``executor=None`` and ``executor=N`` (``runners.runner_for``)."""

    on_threads = True

    def __init__(self, workers: int):  # (at least 1: checked where it is set)
        self.workers = workers
        self.active = 0  # threads that hold a place (under the threads' lock)
        self.peak = 0  # the most places held at once

    def __repr__(self) -> str:
        return f"ThreadPool(max_workers={self.workers})"

    def run(
        self, job: Job, work: object = None, progress: Progress | None = None
    ) -> None:
        """Runs ``job`` to completion or first failure (``work``: the map, which
        the shared threads do not need: they run ``job``'s chunks)."""
        threads = _threads
        job.grow = lambda: threads.hand(self, job)
        try:
            if job.inline and threads.take_place(self, job):
                try:  # a short map runs here, in a place of the pool (scheduling.py)
                    job.drain()
                finally:
                    threads.give_back(self)
                return wait(job, job.done.wait, progress)
            refused_at_exit = threads.hand(self, job, queue=True)
            if this_thread.job is not None or refused_at_exit:
                # A nested map: work on its chunks rather than wait behind ours.
                # So does a map whose threads the interpreter refuses at exit
                # (CPython 3.12.0 and 3.12.1 in atexit hooks, where JAX waits
                # for dispatched programs).
                job.drain()
            wait(job, job.done.wait, progress)
        finally:
            threads.forget(job)


class _Worker:
    """One shared thread: the job (and pool) it has been handed, if any."""

    __slots__ = ("job", "pool", "running", "thread", "wake")

    def __init__(
        self, pool: ThreadPool, job: Job, run: Callable[[_Worker], None], name: str
    ):
        self.pool: ThreadPool | None = pool
        self.job: Job | None = job  # cleared if its thread failed to start
        # It runs kernels: written by its thread (Job.run), read under the
        # threads' lock, false before its chunk counts done.
        self.running = False
        # Released (under the threads' lock) to wake the idle thread, its job set.
        self.wake = threading.Lock()
        self.wake.acquire()
        self.thread = threading.Thread(target=run, args=(self,), name=name, daemon=True)


class _Threads:
    """The daemon threads that run the kernels of every :class:`ThreadPool`.

    Lock rule: every field here, and each pool's ``active`` and ``peak``, under
    :attr:`lock`; a job's lock is taken inside it, never the reverse. Threads
    start under it, so a thread that fails to start gives its place back at
    once. A thread holds one place of one pool while it drains a job, and is
    handed work directly; done, it takes the next queued job of its pool, else
    any whose pool has a free place, else idles and exits.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: collections.deque[tuple[ThreadPool, Job]] = collections.deque()
        self.idle: list[_Worker] = []  # the last to go idle is handed work first
        self.workers: set[_Worker] = set()  # the threads alive
        self.peak = 0  # the most threads alive at once
        self.started = 0
        self.exiting = False
        #: Maps still taken at exit: those of programs that JAX waits for.
        self.kept_at_exit: Callable[[Job], bool] = lambda job: False

    def hand(self, pool: ThreadPool, job: Job, queue: bool = False) -> bool:
        """Hands ``job`` (queued first with ``queue``) the threads it can use now:
        idle ones, then new ones, unless threads about to return will take it.
        Returns whether the interpreter refused to start them as it exits."""
        with self.lock:
            if self.exiting and not self._admits_at_exit(job, queue):
                return False
            if queue:
                self.queue.append((pool, job))
            # (The room is read once: under this lock only this loop changes it,
            # and Job.add_hand decides against a limit lowered meanwhile. The
            # threads about to return are counted only when no thread is idle:
            # then each thread handed is a new one, which costs far more.)
            for _ in range(_room(pool, job)):
                if not self.idle and self._returning_take():
                    break
                if not _take_place(pool, job):
                    break
                if self._give_thread(pool, job):
                    return True
        return False

    def take_place(self, pool: ThreadPool, job: Job) -> bool:
        """A place of ``pool`` for the thread that started ``job``, if one is free."""
        with self.lock:
            return not self.exiting and _take_place(pool, job)

    def give_back(self, pool: ThreadPool) -> None:
        """Gives that place back, and the maps queued for ``pool`` their threads."""
        with self.lock:
            pool.active -= 1
            queued = [job for p, job in self.queue if p is pool]
        for job in queued:
            self.hand(pool, job)

    def _admits_at_exit(self, job: Job, queue: bool) -> bool:  # lock held
        """Whether a map gets threads while the interpreter exits: more threads
        for a map in flight, never (it keeps its own); a new map (``queue``),
        only one that JAX waits for, and any other is an error."""
        if not queue:
            return False
        if not self.kept_at_exit(job):
            raise ExecutorError(
                "jax_threadmap's thread pool has been shut down (the "
                "interpreter is exiting). Start no new maps during "
                "interpreter shutdown."
            )
        return True

    def _returning_take(self) -> bool:  # lock held, no thread idle
        """Whether threads about to look for work (neither idle nor running a
        kernel) will take the map from the queue (:meth:`_hand_next`), so that
        no new thread starts for it: when at least one per CPU of them are
        returning. A thread with no job is not one: outside this lock it is
        idle, or leaving (told to at exit), and takes nothing from the queue."""
        returning = sum(
            1
            for w in self.workers
            if not w.running and w.job is not None and w.job.exhausted()
        )
        return returning >= available_cpus()

    def _give_thread(self, pool: ThreadPool, job: Job) -> bool:  # lock held
        """Gives ``job`` (its place taken) the thread that went idle last, else
        a new one. Returns whether the interpreter refused to start it as it
        exits: then the caller runs the map."""
        if self.idle:
            worker = self.idle.pop()
            worker.pool, worker.job = pool, job
            worker.wake.release()
            return False
        return self._start(pool, job)

    def _start(self, pool: ThreadPool, job: Job) -> bool:  # lock held
        """Starts a thread for ``job``. One that fails to start gives its place
        back and fails the map, unless the interpreter refused it because it is
        exiting: then this returns ``True``, and the caller runs the map."""
        worker = _Worker(pool, job, self._work, f"jax_threadmap_{self.started}")
        self.started += 1
        self.workers.add(worker)
        self.peak = max(self.peak, len(self.workers))
        try:
            worker.thread.start()
        except BaseException as e:  # refused (too many threads), or Ctrl-C
            worker.pool = worker.job = None  # a start cut short may yet run it
            self.workers.discard(worker)
            pool.active -= 1
            job.drop_hand()
            if isinstance(e, RuntimeError) and at_shutdown(e):
                return True
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
        return False

    def forget(self, job: Job) -> None:
        """Drops ``job`` from the queue, where a thread has not yet done so."""
        with self.lock:
            for entry in self.queue:
                if entry[1] is job:
                    self.queue.remove(entry)
                    return

    def _work(self, worker: _Worker) -> None:
        with self.lock:  # (its starter has let go: a failed start cleared its job)
            job = worker.job
        while job is not None:
            job.drain(busy=worker)
            with self.lock:
                self._hand_next(worker)
                idle = worker.job is None and not self.exiting
                if idle:
                    self.idle.append(worker)
                elif worker.job is None:
                    self.workers.discard(worker)
            if idle:  # wait IDLE_TIMEOUT seconds to be handed a job, or leave
                woke = worker.wake.acquire(timeout=IDLE_TIMEOUT)
                with self.lock:
                    if not woke and not worker.wake.acquire(blocking=False):
                        # Still idle: whoever takes an idle thread releases it.
                        self.idle.remove(worker)  # no one can hand us a job now
                    if worker.job is None:  # timed out, or told to exit
                        self.workers.discard(worker)
            job = worker.job

    def _hand_next(self, worker: _Worker) -> None:  # lock held
        """Hands ``worker`` (just done with a job) its next job, or none."""
        pool = worker.pool
        assert pool is not None
        worker.pool = worker.job = None
        others = []
        for entry in list(self.queue):
            p, job = entry
            if job.exhausted():
                self.queue.remove(entry)
            elif p is pool:  # keep our place for the next map of our pool
                if job.add_hand():
                    worker.pool, worker.job = entry
                    return
            elif p.active < p.workers:
                others.append(entry)
        pool.active -= 1
        for other in others:
            if _take_place(*other):
                worker.pool, worker.job = other
                return

    def exit(self, keep: Callable[[Job], bool]) -> list[threading.Thread]:
        """Refuses new maps but those ``keep`` accepts; idle threads exit.
        Returns the threads alive."""
        with self.lock:
            self.exiting = True
            self.kept_at_exit = keep
            for worker in self.idle:
                worker.wake.release()
            self.idle.clear()
            return [w.thread for w in self.workers]


def _room(pool: ThreadPool, job: Job) -> int:  # threads' lock held
    """How many more threads of ``pool`` ``job`` may get: the pool's free
    places, and what the job has fewer than its units and than its limit (a
    limited map starts on one thread per CPU). The job's fields are read
    without its lock: :meth:`.jobs.Job.add_hand` decides."""
    return min(pool.workers - pool.active, min(job.n, job.limit) - job.hands)


def _take_place(pool: ThreadPool, job: Job) -> bool:  # shared threads' lock held
    """Hands ``job`` one more thread of ``pool``, if it can use one."""
    if not job.add_hand():
        return False
    pool.active += 1
    pool.peak = max(pool.peak, pool.active)
    return True


_threads = _Threads()
#: The shared pools by size (``async_call`` has its own, ``_arrays/async_pool.py``).
_pools: dict[int, ThreadPool] = {}


def num_threads() -> int:
    """The number of shared threads alive (busy or idle)."""
    return len(_threads.workers)  # (atomic: no lock)


def get_pool(num_threads: int | None) -> ThreadPool:
    """The shared pool of ``num_threads`` threads (default: from the environment)."""
    n = default_num_threads() if num_threads is None else num_threads
    # No lock: a dict's setdefault is atomic, in free-threaded builds too.
    return _pools.get(n) or _pools.setdefault(n, ThreadPool(n))


def exit_threads(keep: Callable[[Job], bool]) -> list[threading.Thread]:
    """At interpreter exit: refuses new maps but those ``keep`` accepts, lets
    idle threads exit; returns the threads alive (:meth:`_Threads.exit`)."""
    return _threads.exit(keep)


@_fork.in_child
def _start_afresh() -> None:
    """A forked child has none of the parent's threads, and any lock here may
    have been held at the fork."""
    global _threads
    _threads = _Threads()
    _pools.clear()
