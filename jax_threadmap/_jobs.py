"""A map's chunks: claiming, running, failing, and the thread that runs a kernel.

- A map is a :class:`Job`. Chunks are claimed with guided scheduling: each claim
  takes a share of what is left, so fast kernels run in a few large chunks that
  amortise the scheduling cost, and the last chunks shrink to a single element so
  that slow kernels keep every worker busy until the end. A map whose outputs are
  summed on the host gets fixed chunk bounds instead, so that its sums do not
  depend on timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from . import _compat
from . import _scheduling as policy
from ._errors import ExecutorError
from ._loops import running_element

#: Runs elements ``[start, stop)`` of a job; checks ``job.failed`` between elements.
ChunkFn = Callable[[int, int, "Job"], None]


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


class _Local(threading.local):
    #: The job whose chunk this thread is running (a kernel is running here).
    job: Job | None = None


_local = _Local()


def current_job() -> Job | None:
    """The map whose kernel this thread is running, if any."""
    return _local.job


class Job:
    """One flat map: ``n`` elements, run by ``fn(start, stop, job)`` per chunk.

    ``fn`` checks :attr:`failed` (element loops: :attr:`halt`, then
    :meth:`halted`) between elements, so that a failure stops the chunks already
    running; the chunks not yet started are never handed out. A thread with
    nothing left to claim takes the tail of another's running chunk
    (:meth:`_steal`), guided maps only.

    Lock rule: the job's fields are written under the job's lock (``_lock``),
    with two exceptions, each owned by one other lock: :attr:`hands` belongs to
    the job's runner and is read and written under the runner's lock (the
    shared threads' lock, or the lock of :func:`._runners._run_on_threads`), and
    :attr:`grow` is set once by the runner before the job is handed a thread.
    Reads without the lock are of single values whose staleness is harmless:
    :attr:`failed` (one more element runs), :attr:`limit` (a watch comes a
    period later), :attr:`completed` (a progress bar lags), except :attr:`halt`,
    which a chunk loop reads before each element: it is set under the lock
    before a tail is taken, so a loop that reads it false is at most in the
    element the taker sees, and one that reads it true asks :meth:`halted`,
    which waits for the lock.

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
            or waiting (:func:`._scheduling.record_chunk`); chunks are then
            sized from the measured time of an element. Guided maps only.
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
        self._measure = policy.Measure()
        # While limited: when each thread's chunk started (wall and CPU clocks).
        self._started: dict[int, tuple[float, float]] = {}
        self.failed = False
        #: Set when a running chunk loop must look before its next element
        #: (:meth:`halted`): the map failed, or a chunk's tail was taken.
        self.halt = False
        # Guided maps: per thread, its running chunk [start, stop) if longer
        # than one element (its stop
        # lowered when another thread takes the tail), where lowered stops
        # wait to be seen by their threads, and the tails taken, to be claimed.
        self._running: dict[int, list[int]] = {}
        self._splits: dict[int, int] = {}
        self._given_back: list[tuple[int, int]] = []
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
        """The next chunk to run, or ``None`` when none is left: a chunk given
        back (:meth:`_steal`), else the next one from the front."""
        with self._lock:
            back = self._given_back
            remaining = self.n - self._next
            if back:
                remaining += sum(stop - start for start, stop in back)
            if remaining <= 0 or self.failed:
                if self.failed or self.fixed or not self._steal():
                    return None
                remaining = sum(stop - start for start, stop in back)
            if self.fixed:
                size = self.fixed
            elif self.limited:
                size = policy.chunk_size(remaining, self.divisor, self._measure, True)
                self._started[threading.get_ident()] = (
                    time.perf_counter(),
                    time.thread_time(),
                )
            else:
                size = policy.chunk_size(remaining, self.divisor, self._measure, False)
            if back:
                return self._claim_given_back(size)
            start = self._next
            self._next = stop = min(self.n, start + size)
            if stop - start > 1 and not self.fixed:  # a tail another may take
                self._running[threading.get_ident()] = [start, stop]
            self._outstanding += 1
            return start, stop

    def _claim_given_back(self, size: int) -> tuple[int, int]:  # lock held
        back = self._given_back
        start, end = back[0]
        stop = min(end, start + size)
        if stop == end:
            back.pop(0)
        else:
            back[0] = (stop, end)
        if stop - start > 1:
            self._running[threading.get_ident()] = [start, stop]
        self._outstanding += 1
        return start, stop

    def _steal(self) -> bool:  # lock held
        """Takes the elements not yet started of another thread's running chunk
        (:func:`._scheduling.steal_split`) and gives them back to be claimed;
        whether there were any.

        The chunk's thread learns its new end at its next element
        (:meth:`halted`); :attr:`halt` is set first, so that it cannot start
        one more element before the end is recorded. Only loops generated by
        :mod:`._loops` say where they are (:func:`._loops.running_element`);
        other chunks keep their elements.
        """
        # (Chunks of one element are not in _running.)
        if not self._running or not _compat.OTHER_THREADS_FRAMES_SAFE:
            return False
        me = threading.get_ident()
        others = [k for k, (a, b) in self._running.items() if b - a > 1 and k != me]
        if not others:
            return False
        self.halt = True
        try:
            frames = _compat.current_frames()
            where: dict[int, tuple[int, int]] = {}
            for ident in others:
                current = running_element(frames.get(ident), self)
                if current is not None:
                    where[ident] = (current, self._running[ident][1])
            del frames
            split = policy.steal_split(where)
            if split is None:
                return False
            ident, at = split
            chunk = self._running[ident]
            self._given_back.append((at, chunk[1]))
            chunk[1] = self._splits[ident] = at
            return True
        finally:
            self.halt = self.failed or bool(self._splits)

    def halted(self, i: int) -> bool:
        """Called by a chunk loop before element ``i`` once :attr:`halt` is set:
        whether the chunk stops there (the map failed, or another thread took
        the chunk's elements from ``i`` on)."""
        with self._lock:
            if self.failed:
                return True
            ident = threading.get_ident()
            at = self._splits.get(ident)
            if at is None or i < at:
                return False
            del self._splits[ident]
            self.halt = bool(self._splits)
            return True

    def _measured(self, elements: int) -> bool:  # lock held
        """Times the chunk this thread just ran, if the map was limited when it
        was claimed; returns whether the limit rose to every worker."""
        started = self._started.pop(threading.get_ident(), None)
        if started is None or not self.limited:
            return False
        wall = time.perf_counter() - started[0]
        cpu = time.thread_time() - started[1]
        if not policy.record_chunk(self._measure, elements, wall, cpu, self.limit):
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
            left = max(0.0, end - time.monotonic())
            if self.done.wait(min(policy.WATCH_PERIOD, left)):
                return True
            self.watch()
            if time.monotonic() >= end:
                return False
        return self.done.wait(max(0.0, end - time.monotonic()))

    def watch(self) -> None:
        """Called by the thread that waits for the map: a limited map whose
        chunk is stuck (:func:`._scheduling.is_stuck`) gets every worker
        (its elements may wait for each other)."""
        with self._lock:
            if not self.limited or not self._started:
                return
            oldest = min(wall for wall, _ in self._started.values())
            now = time.perf_counter()
            stuck = policy.is_stuck(oldest, now)
            if stuck:
                self._measure.one_each = True
            rose = stuck and self._unlimit()
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
            self.failed = self.halt = True
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
        began = time.perf_counter()
        try:
            self.fn(start, stop, self)
        except BaseException as e:  # routed to the waiting thread, like CPython's pool
            self.fail(e)
        finally:
            _local.job = outer
            with self._lock:
                if self._running:  # (never for chunks of one element)
                    stop = self._ran(stop)
                rose = self.limited and self._measured(stop - start)
                if not rose:
                    self._count(start, stop, began)
            if rose:
                # Before the chunk counts as done, so that the map (and its
                # executor) is still there for the threads added.
                try:
                    if self.grow is not None:
                        self.grow()
                finally:
                    with self._lock:
                        self._count(start, stop, began)

    def _ran(self, stop: int) -> int:  # lock held
        """Where the chunk this thread just ran stopped (earlier than claimed
        when another thread took its tail)."""
        ident = threading.get_ident()
        chunk = self._running.pop(ident, None) if self._running else None
        if self._splits and self._splits.pop(ident, None) is not None:
            self.halt = self.failed or bool(self._splits)  # the loop raised first
        return stop if chunk is None else chunk[1]

    def _count(self, start: int, stop: int, began: float) -> None:  # lock held
        """Counts a chunk as done."""
        if self.fixed is None:
            wall = time.perf_counter() - began
            policy.record_time(self._measure, stop - start, wall)
        self.completed += stop - start
        self._outstanding -= 1
        self._check_done()

    def add_completed(self, elements: int) -> None:
        """Counts elements done elsewhere (shipped to another process)."""
        with self._lock:
            self.completed += elements

    def drain(self) -> None:
        """Claims and runs chunks until none are left."""
        while (chunk := self.claim()) is not None:
            self.run(*chunk)

    def exhausted(self) -> bool:
        with self._lock:
            return self.failed or (self._next >= self.n and not self._given_back)

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
        left = self._next < self.n or self._given_back
        if self._outstanding == 0 and (self.failed or not left):
            self.done.set()


class LimitedGate:
    """One limited map at a time on an executor (a pool, a user's executor).

    A limited map starts on fewer threads than its executor has, and takes the
    rest once its elements prove slow, waiting, or stuck. Two limited maps at
    once could each hold part of the executor and wait for good for the rest,
    held by the other (elements that wait for each other). So a second limited
    map starts only once the first holds every thread it may use, or is over.
    This costs fast maps nothing: a limited map already keeps every CPU busy.

    Lock rule: :attr:`_holder` is read and written under :attr:`_cond`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holder: Job | None = None

    def enter(self, job: Job) -> None:
        """Waits until ``job``, if limited, is the only limited map here."""
        if not job.limited:
            return
        with self._cond:
            while self._holder is not None and not job.failed:
                self._cond.wait(policy.WATCH_PERIOD)  # Ctrl-C, and exit's abandon
            self._holder = job

    def leave(self, job: Job) -> None:
        """``job`` is unlimited or over: the next limited map may start."""
        with self._cond:
            if self._holder is job:
                self._holder = None
                self._cond.notify_all()


def _stopped_by_parent() -> ExecutorError:
    # Never reported to the user: the parent's own (first) error is.
    return ExecutorError(
        "This map was stopped because the map whose kernel started it failed."
    )
