"""One map's chunks: claimed, run, helped to finish, failed.

- A map is a :class:`Job` over ``n`` work units (elements, or pieces of a
  vectorized map). Any thread that runs the map's kernels (a shared thread, a
  worker of a user's thread executor, the thread that waits for a nested map)
  claims chunks (:meth:`Job.claim`) and runs them until none are left
  (:meth:`Job.drain`). How a map is cut is decided when it starts
  (:mod:`._scheduling`): fixed bounds, claimed in index order (one unit each
  for a map in index order; a few per thread for a map whose outputs are
  summed on the host, sums that do not depend on timing), read no clock;
  guided chunks are sized from the times of the chunks before them.
- Help finish: each running chunk has a :class:`Cursor`, where its loop
  publishes the range of units it iterates. A thread that finds nothing left to
  claim takes the units not yet started of another thread's chunk
  (:meth:`Job.claim`, then ``_cut``), so that a chunk slow to finish gives its
  rest to idle threads. Threads never inspect each other: the cursor is all
  that one learns of another.
- A limited map (:func:`._scheduling.starts_limited`) starts on one thread per
  CPU, times its chunks, and gets every thread of its executor when its
  elements prove slow or waiting (:func:`._scheduling.record_chunk`).
- The first failure stops every running chunk at its next element and every
  map that the failed map's kernels started.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

from .._support import fork as _fork
from .._support.errors import ExecutorError
from . import scheduling as policy
from .claims import Busy, Chunk, ChunkFn, Cursor


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
    the job's lock (``_lock``), :attr:`hands` included (and the cursors'
    :attr:`~Cursor.halt` and :attr:`~Cursor.stop`; their rows are their
    loops', see :class:`Cursor`). :attr:`grow` is set once by the runner
    before the job is handed a thread. Reads without the lock are of single
    values whose staleness is harmless: :attr:`failed` (a shipper looks again a
    moment later), :attr:`limit` and :attr:`hands` (a thread more or fewer is
    offered, and :meth:`add_hand` decides under the lock). A lock that the
    job's runner holds (the shared threads' lock) is taken before the job's,
    never after it.

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
            elements slow or waiting (:func:`._scheduling.record_chunk`).
            Guided maps only.
        in_order: One unit per claim, in index order, on every thread
            (:func:`._scheduling.runs_in_order`): fixed chunks of one unit,
            ``fixed`` and ``cpus`` ignored.
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
        in_order: bool = False,
    ):
        self.n = n
        self.fn = fn
        #: Chunks of exactly this many units, claimed in index order.
        self.fixed = 1 if in_order else fixed
        self.divisor = divisor
        self.workers = n if workers is None else max(1, workers)
        #: Threads the map may hold now; raised to ``workers`` by its votes.
        self.limit = self.workers
        if cpus is not None and self.fixed is None:
            self.limit = max(1, min(cpus, self.workers))
        #: Threads handed the map by its runner (:meth:`add_hand`).
        self.hands = 0
        #: Hands the map more threads once its limit rises (set by its runner).
        self.grow: Callable[[], None] | None = None
        self._measure = policy.Measure()
        self.failed = False
        self.error: BaseException | None = None
        self._completed = 0  # units counted done by chunks (and shipped ones)
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._next = 0  # the front: units from here on were never claimed
        # Units given back by cut chunks, to be claimed before the front, lowest
        # first (sorted).
        self._back: list[tuple[int, int]] = []
        self._running: set[Cursor] = set()  # but chunks of one unit:
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

    @property
    def in_order(self) -> bool:
        """Whether the map runs one unit per claim, in index order."""
        return self.fixed == 1

    @property
    def completed(self) -> int:
        """Units done, for progress bars."""
        with self._lock:
            return self._completed

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

    def drain(self, busy: Busy | None = None) -> None:
        """Claims and runs chunks until none are left: the one claim-and-run
        loop of every thread that runs the map's kernels (see :meth:`run` for
        ``busy``)."""
        claim = self.claim()
        while claim is not None:
            claim = self.run(*claim, then_claim=True, busy=busy)

    def claim(self) -> Chunk | None:
        """The next chunk ``(start, stop, cursor)``: units given back (lowest
        first), else the front, else the tail of another thread's running
        chunk (guided chunks only); ``None`` when none is left."""
        with self._lock:
            return self._claim()

    def _claim(self) -> Chunk | None:  # lock held
        if self.failed:
            return None
        if not self._back and self._next >= self.n:
            if self.fixed or not self._steal():
                return None
        size = self.fixed or policy.chunk_size(
            self._remaining(), self.divisor, self._measure, self.limited
        )
        start, stop = self._take(size)
        self._outstanding += 1
        if stop - start == 1:  # nothing to take from it: the shared cursor
            return start, stop, self._single
        cursor = Cursor(self, stop)
        self._running.add(cursor)
        return start, stop, cursor

    def _take(self, size: int) -> tuple[int, int]:  # lock held
        """Units ``[start, stop)``, at most ``size``: the lowest given back,
        else the front's."""
        back = self._back
        if back:
            start, end = back[0]
            stop = min(end, start + size)
            if stop == end:
                del back[0]
            else:
                back[0] = (stop, end)
            return start, stop
        start = self._next
        self._next = stop = min(self.n, start + size)
        return start, stop

    def _remaining(self) -> int:  # lock held
        return self.n - self._next + sum(end - start for start, end in self._back)

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
        ``then_claim``, returns the next claim, made under the same hold of
        the lock as this chunk is counted done. ``busy.running`` is true while
        the chunk's kernels run, false before the chunk counts as done (so
        that whoever sees the map done sees this thread free). A guided
        chunk's time sizes the next chunks, and may give the map more
        threads; a fixed chunk reads no clock."""
        outer, _local.job = _local.job, self
        timed, limited = self.fixed is None, self.limited  # (see the lock rule)
        if busy is not None:
            busy.running = True
        began = time.perf_counter() if timed else 0.0
        cpu = time.thread_time() if limited else 0.0
        try:
            self.fn(start, stop, cursor)
        except BaseException as e:  # routed to the waiting thread, like CPython's pool
            self.fail(e)
        finally:
            wall = time.perf_counter() - began if timed else 0.0
            cpu = time.thread_time() - cpu if limited else 0.0
            _local.job = outer
            if busy is not None:
                busy.running = False
        with self._lock:
            if cursor is not self._single:
                self._running.discard(cursor)
                stop = cursor.stop  # lowered if another thread took the tail
            rose = self._record(stop - start, wall, cpu if limited else None)
            if not rose:
                self._count(stop - start)
                return self._claim() if then_claim else None
        # The map rose: more threads before the chunk counts as done, so that
        # the map (and its executor) is still there for them.
        try:
            if self.grow is not None:
                self.grow()
        finally:
            with self._lock:
                self._count(stop - start)
        return self.claim() if then_claim else None

    def _record(self, units: int, wall: float, cpu: float | None) -> bool:  # lock
        """Records a chunk's time (``cpu``: its thread's CPU time, when the map
        was limited as it started); whether the map now gets every thread."""
        if self.fixed or units <= 0:
            return False
        if cpu is None or not self.limited:
            policy.record_time(self._measure, units, wall)
            return False
        if not policy.record_chunk(self._measure, units, wall, cpu, self.limit):
            return False
        self.limit = self.workers
        return not self._exhausted()

    def _count(self, units: int) -> None:  # lock held
        """Counts a chunk of ``units`` as done."""
        self._completed += units
        self._outstanding -= 1
        if self._outstanding == 0:
            self._check_done()

    def add_completed(self, units: int) -> None:
        """Counts units done elsewhere (shipped to another process)."""
        with self._lock:
            self._completed += units

    def exhausted(self) -> bool:
        """Whether no unit is left to claim (but tails of running chunks)."""
        with self._lock:
            return self._exhausted()

    def _exhausted(self) -> bool:  # lock held
        return self.failed or (self._next >= self.n and not self._back)

    def _check_done(self) -> None:  # lock held
        if self._outstanding == 0 and self._exhausted():
            self.done.set()

    def poll(self, timeout: float) -> bool:
        """Waits at most ``timeout`` seconds for the map to finish; says whether
        it has (the waiting thread's step, ``_progress.wait``)."""
        return self.done.wait(timeout)

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


def _stopped_by_parent() -> ExecutorError:
    # Never reported to the user: the parent's own (first) error is.
    return ExecutorError(
        "This map was stopped because the map whose kernel started it failed."
    )
