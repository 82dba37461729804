"""One map's chunks: claimed, run, helped to finish, failed.

- A map is a :class:`Job` over ``n`` work units (elements, or pieces of a
  vectorized map). Any thread that runs the map's kernels (a shared thread, a
  worker of a user's thread executor, the thread that waits for a nested map)
  claims chunks (:meth:`Job.claim`) and runs them (:meth:`Job.run`) until none
  are left (:meth:`Job.drain`). Chunk sizes are the policy's
  (:mod:`._scheduling`): guided (a share of what is left, so that fast kernels
  run in few chunks and the last chunks shrink to one element), or fixed bounds
  for a map whose outputs are summed on the host (sums that do not depend on
  timing).
- Help finish: each running chunk has a :class:`Cursor`, where its loop
  publishes the range of units it iterates. A thread that finds nothing left to
  claim takes the units not yet started of another thread's chunk
  (:meth:`Job.claim`, then ``_cut``): an element that waits for the next one in
  its chunk (a pair at a barrier) then finds it run by another thread, and a
  chunk slow to finish gives its rest to idle threads. Threads never inspect
  each other: the cursor is all that one learns of another.
- A limited map (:func:`._scheduling.starts_limited`) starts on one thread per
  CPU, times its chunks, and rises to every thread of its executor when its
  elements prove slow or waiting, or when the thread that waits for it sees a
  chunk stuck (:meth:`Job.poll`); it then runs one element per chunk, in index
  order (:func:`._scheduling.rise`). :class:`LimitedGate` lets one limited map
  at a time start on an executor.
- The first failure stops every running chunk at its next element and every
  map that the failed map's kernels started.
"""

from __future__ import annotations

import bisect
import operator
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from . import _fork
from . import _scheduling as policy
from ._errors import ExecutorError
from ._progress import POLL_INTERVAL


class Cursor:
    """Where a running chunk is: the one thing a thread learns of another's chunk.

    The chunk's loop publishes each row of units it runs, before running it:
    ``js = iter(range(j, end))``, ``cursor.row = (base + end, js)``, then
    ``for j in js: if cursor.halt and cursor.halted(base + j): return``. The
    range iterator is the position: advancing it is the loop's own step, and
    its length hint (``operator.length_hint``, the public protocol) says how
    many units of the row the loop has not taken yet. A thread that takes the
    chunk's tail holds the job's lock, sets :attr:`halt`, then reads where the
    loop is (:meth:`running`): the loop may still run that unit, but it reads
    :attr:`halt` after taking the next one and then asks the lock
    (:meth:`halted`), so every unit after it is the taker's. (A store then a
    load on each side, which the interpreter does in order: at least one side
    sees the other's store.) The loop pays nothing per unit for being
    watched but the check of :attr:`halt`, which a failure needs anyway.

    Lock rule: :attr:`row` is written only by the loop's thread; :attr:`halt`
    and :attr:`stop` are written under the job's lock. :attr:`halt`, once set
    by a failure or a taken tail, stays set until the chunk ends. (The one
    cursor that a job's chunks of one unit share, when not timed, is written
    by each of their loops; no thread reads its :attr:`row`, since a chunk of
    one unit has no tail, and only a failure sets its :attr:`halt`.)
    """

    __slots__ = ("_job", "halt", "row", "started", "stop")

    def __init__(self, job: Job, stop: int):
        self._job = job
        #: Set (under the job's lock) when the loop must ask :meth:`halted`
        #: before its next unit.
        self.halt = False
        #: Where the chunk stops: lowered (under the job's lock) when another
        #: thread takes its tail.
        self.stop = stop
        #: The row the loop runs: ``(flat end of the row, its range iterator)``;
        #: ``None`` before the loop starts.
        self.row: tuple[int, Iterator[int]] | None = None
        #: Wall and thread-CPU clocks when a chunk of a limited map started.
        self.started: tuple[float, float] | None = None

    def running(self) -> int | None:
        """The unit the loop runs, or the one before the next it takes (read
        by another thread after setting :attr:`halt`); ``None`` before the loop
        publishes a row (a chunk function that never does keeps its units)."""
        row = self.row
        if row is None:
            return None
        end, units = row
        return end - 1 - operator.length_hint(units)

    def halted(self, i: int) -> bool:
        """Whether the loop stops before unit ``i``: the map failed, or another
        thread took the chunk's units from there on."""
        job = self._job
        with job._lock:
            return job.failed or i >= self.stop


class Busy(Protocol):
    """A thread's flag that says whether it runs a kernel (see :meth:`Job.run`)."""

    running: bool


#: A claimed chunk: units ``[start, stop)`` and the cursor its loop publishes at.
Chunk = tuple[int, int, Cursor]

#: Runs units ``[start, stop)`` of a job, publishing each row of units at the
#: cursor before running it (see :class:`Cursor`).
ChunkFn = Callable[[int, int, Cursor], None]


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

    def run_chunk(self, start: int, stop: int, cursor: Cursor) -> None: ...

    def shared(self) -> list[Any]:
        """Operands shipped once per map to an executor that pickles work."""
        ...

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """A picklable task running ``[start, stop)`` in another process, called
        with the map's shared operands (see ``_remote.share``)."""
        ...

    def store_packed(self, start: int, stop: int, outs: Any) -> None: ...


class _Local(threading.local):
    #: The job whose chunk this thread is running (a kernel is running here).
    job: Job | None = None


_local = _Local()


@_fork.in_child
def _forget_running_job() -> None:
    # A fork from inside a kernel: the child runs none of the parent's maps.
    _local.job = None


def current_job() -> Job | None:
    """The map whose kernel this thread is running, if any."""
    return _local.job


class Job:
    """One flat map: ``n`` units, run by ``fn(start, stop, cursor)`` per chunk.

    Lock rule: every field that more than one thread uses is written under
    the job's lock (``_lock``), :attr:`hands` included; :attr:`grow` is set once
    by the runner before the job is handed a thread. Reads without the lock are
    of single values whose staleness is harmless: :attr:`failed` (a shipper or
    a gate looks again a moment later), :attr:`limit` and :attr:`hands`
    (a thread more or fewer is offered, and :meth:`add_hand` decides under the
    lock), :attr:`completed` (a progress bar lags). A lock that the job's
    runner holds (the shared threads' lock) is taken before the job's, never
    after it.

    Args:
        n: The number of units.
        fn: Runs one chunk.
        fixed: Chunks of exactly this many units (fixed bounds); ``None`` for
            guided chunks.
        divisor: Guided chunks take ``1 / divisor`` of what is left.
        parent: The map whose kernel started this one; its failure stops this one.
        workers: The threads the map's executor has (default: one per unit).
        cpus: When fewer than ``workers``, the map starts on this many threads
            (limited), and gets all ``workers`` once its chunks find its
            elements slow or waiting (:func:`._scheduling.record_chunk`) or a
            chunk is stuck (:meth:`poll`). Guided maps only.
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
        #: Threads the map may hold now; raised to ``workers`` by ``_rise``.
        self.limit = self.workers
        if cpus is not None and fixed is None and cpus < self.workers:
            self.limit = max(1, cpus)
        #: Threads handed the map by its runner (:meth:`add_hand`).
        self.hands = 0
        #: Hands the map more threads once its limit rises (set by its runner).
        self.grow: Callable[[], None] | None = None
        self._measure = policy.Measure()
        self.failed = False
        self.error: BaseException | None = None
        self.completed = 0  # units done, for progress bars
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._next = 0  # the front: units from here on were never claimed
        # Units given back by cut chunks, to be claimed before the front, lowest
        # first (sorted).
        self._back: list[tuple[int, int]] = []
        self._running: set[Cursor] = set()  # but chunks of one unit, not timed:
        self._single = Cursor(self, 0)  # theirs, shared (its row is never read)
        self._outstanding = 0  # chunks claimed and not yet counted done
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

    # --- threads handed to the map -------------------------------------------------

    def add_hand(self, cap: int | None = None) -> bool:
        """Counts one more thread handed to the map, if it can use one: fewer
        than its limit (and ``cap``) hold it, and units are left to claim."""
        with self._lock:
            most = min(self.n, self.limit, self.n if cap is None else cap)
            if self.hands >= most or self._exhausted():
                return False
            self.hands += 1
            return True

    def drop_hand(self) -> None:
        """A thread counted by :meth:`add_hand` never came (its start failed)."""
        with self._lock:
            self.hands -= 1

    # --- claiming and running chunks -----------------------------------------------

    def claim(self) -> Chunk | None:
        """The next chunk ``(start, stop, cursor)``, or ``None`` when none is
        left: units given back (lowest first), else the front, else the tail of
        another thread's running chunk."""
        with self._lock:
            return self._claim()

    def _claim(self) -> Chunk | None:  # lock held
        if self.failed:
            return None
        back = self._back
        if not back and self._next >= self.n:
            if self.fixed or not self._steal():
                return None
        limited = self.limit < self.workers
        measure = self._measure
        size = (
            self.fixed
            or (measure.one_each and 1)
            or policy.chunk_size(self._remaining(), self.divisor, measure, limited)
        )
        if back:
            start, end = back[0]
            stop = min(end, start + size)
            if stop == end:
                del back[0]
            else:
                back[0] = (stop, end)
        else:
            start = self._next
            self._next = stop = min(self.n, start + size)
        self._outstanding += 1
        if stop - start == 1 and not limited:
            # Nothing to take from it, nothing to time: the shared cursor.
            return start, stop, self._single
        cursor = Cursor(self, stop)
        if limited:
            cursor.started = (time.perf_counter(), time.thread_time())
        self._running.add(cursor)
        return start, stop, cursor

    def _remaining(self) -> int:  # lock held
        left = self.n - self._next
        return (
            left + sum(end - start for start, end in self._back) if self._back else left
        )

    def _steal(self) -> bool:  # lock held
        """Gives back the tail of the running chunk with the most units not yet
        started (:func:`._scheduling.steal_split`); whether there was one."""
        where = {
            c: (at, c.stop) for c in self._running if (at := c.running()) is not None
        }
        split = policy.steal_split(where)
        return split is not None and self._cut(split[0])

    def _cut(self, cursor: Cursor) -> bool:  # lock held
        """Gives back the units of ``cursor``'s chunk after the one its loop
        runs (see :class:`Cursor`); whether there were any."""
        was = cursor.halt
        cursor.halt = True  # first: the loop then asks before its next unit
        at = cursor.running()
        if at is None or at + 1 >= cursor.stop:
            cursor.halt = was
            return False
        bisect.insort(self._back, (at + 1, cursor.stop))
        cursor.stop = at + 1
        return True

    def run(
        self,
        start: int,
        stop: int,
        cursor: Cursor,
        then_claim: bool = False,
        busy: Busy | None = None,
    ) -> Chunk | None:
        """Runs a claimed chunk (its exception fails the job); with
        ``then_claim``, returns the next chunk, claimed under the same hold of
        the lock as this one is counted done. ``busy.running`` is true while the
        chunk's kernels run, false before the chunk counts as done (so that
        whoever sees the map done sees this thread free)."""
        outer, _local.job = _local.job, self
        began = time.perf_counter()
        if busy is not None:
            busy.running = True
        try:
            self.fn(start, stop, cursor)
        except BaseException as e:  # routed to the waiting thread, like CPython's pool
            self.fail(e)
        finally:
            _local.job = outer
            if busy is not None:
                busy.running = False
        with self._lock:
            if cursor is not self._single:
                self._running.discard(cursor)
                stop = cursor.stop  # lowered if another thread took the tail
            rose = cursor.started is not None and self._measured(cursor, stop - start)
            if not rose:
                self._count(start, stop, began)
                return self._claim() if then_claim else None
        # The map rose: more threads before the chunk counts as done, so that
        # the map (and its executor) is still there for them.
        try:
            if self.grow is not None:
                self.grow()
        finally:
            with self._lock:
                self._count(start, stop, began)
        return self.claim() if then_claim else None

    def drain(self) -> None:
        """Claims and runs chunks until none are left."""
        chunk = self.claim()
        while chunk is not None:
            chunk = self.run(*chunk, then_claim=True)

    def _measured(self, cursor: Cursor, units: int) -> bool:  # lock held
        """Times a chunk of a limited map; whether the map rose to every thread."""
        if cursor.started is None or not self.limited or units <= 0:
            return False  # (a chunk claimed before the map rose)
        wall = time.perf_counter() - cursor.started[0]
        cpu = time.thread_time() - cursor.started[1]
        if not policy.record_chunk(self._measure, units, wall, cpu, self.limit):
            return False
        return self._rise()

    def _rise(self) -> bool:  # lock held
        """Lets the map use every thread, one unit per chunk in index order,
        the running chunks' tails given back (:func:`._scheduling.rise`);
        whether threads should be added."""
        self.limit = self.workers
        policy.rise(self._measure)
        for cursor in list(self._running):
            self._cut(cursor)
        return not self._exhausted()

    def _count(self, start: int, stop: int, began: float) -> None:  # lock held
        """Counts a chunk as done."""
        units = stop - start
        if self.fixed is None and units > 0 and not self._measure.one_each:
            wall = time.perf_counter() - began
            policy.record_time(self._measure, units, wall)
        self.completed += units
        self._outstanding -= 1
        if self._outstanding == 0:
            self._check_done()

    def add_completed(self, units: int) -> None:
        """Counts units done elsewhere (shipped to another process)."""
        with self._lock:
            self.completed += units

    def exhausted(self) -> bool:
        """Whether no unit is left to claim (but tails of running chunks)."""
        with self._lock:
            return self._exhausted()

    def _exhausted(self) -> bool:  # lock held
        return self.failed or (self._next >= self.n and not self._back)

    def _check_done(self) -> None:  # lock held
        if self._outstanding == 0 and self._exhausted():
            self.done.set()

    # --- the thread that waits -----------------------------------------------------

    def poll(self, timeout: float) -> bool:
        """Waits at most ``timeout`` seconds for the map to finish; says whether
        it has. Meanwhile, for a limited map, wakes when its oldest running
        chunk reaches :data:`._scheduling.STUCK_CHUNK` seconds, and then raises
        the map to every thread (its elements may wait for each other)."""
        end = time.monotonic() + timeout
        while (wake := self._watch()) is not None:
            left = end - time.monotonic()
            if self.done.wait(max(0.0, min(left, wake))):
                return True
            if left <= wake:
                return False
        return self.done.wait(max(0.0, end - time.monotonic()))

    def _watch(self) -> float | None:
        """Raises a limited map whose oldest chunk is stuck; returns the seconds
        until the oldest chunk would be, or ``None`` once the map is not limited."""
        with self._lock:
            if not self.limited or self.failed:
                return None
            now = time.perf_counter()
            starts = [c.started[0] for c in self._running if c.started is not None]
            oldest = min(starts, default=now)
            if not policy.is_stuck(oldest, now):
                return oldest + policy.STUCK_CHUNK - now
            rose = self._rise()
        if rose and self.grow is not None:
            self.grow()
        return None

    # --- failing ---------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Records the first error and stops the map: no chunk is handed out any
        more, each running chunk stops at its next unit, and so do the maps
        that this map's kernels started.

        A no-op once the job is done: a late error (a cancelled helper task)
        does not undo a finished map.
        """
        with self._lock:
            if self.done.is_set() and self.error is None:
                return
            if self.error is None:
                self.error = error
            self.failed = self._single.halt = True
            for cursor in self._running:
                cursor.halt = True
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


class LimitedGate:
    """One limited map at a time on an executor (a pool, a user's executor).

    A limited map starts on fewer threads than its executor has, and takes the
    rest once its elements prove slow, waiting, or stuck. Two limited maps at
    once could each hold part of the executor and wait for good for the rest,
    held by the other (elements that wait for each other:
    ``test_two_large_maps_whose_elements_wait_for_each_other`` hangs without the
    gate). So a second limited map starts only once the first holds every
    thread it may use, or is over. This costs fast maps nothing: a limited map
    already keeps every CPU busy.

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
                # Timed: a job failed from outside (its parent, exit) leaves.
                self._cond.wait(POLL_INTERVAL)
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
