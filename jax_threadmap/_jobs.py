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
  chunk stuck (:meth:`Job.poll`); it then runs one element per claim, in
  index order (:func:`._scheduling.rise`). :class:`LimitedGate` lets one
  limited map at a time start on an executor. A large map on no more threads
  than CPUs, or a nested one, probes instead
  (:func:`._scheduling.starts_probing`): one element per claim in index order,
  each timed, until a run of fast elements gives it guided chunks.
- In index order, threads draw units one at a time from a range iterator that
  they share, without the job's lock (:meth:`Job._run_in_order`; the lock rule
  of :class:`Job` says why that is sound).
- The first failure stops every running chunk at its next element and every
  map that the failed map's kernels started.
"""

from __future__ import annotations

import bisect
import operator
import threading
import time
from collections.abc import Callable, Iterator

from . import _fork
from . import _scheduling as policy
from ._claims import (
    IN_ORDER,
    Busy,
    ChunkFn,
    Claim,
    Cursor,
    InOrder,
    UnitsFn,
    in_order,
    one_by_one,
)
from ._errors import ExecutorError
from ._progress import POLL_INTERVAL


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
    the job's lock (``_lock``), :attr:`hands` included, but one: the in-order
    iterator (``_order``). It is assigned once, under the lock, before any
    thread may draw from it (a thread joins the in-order run by a claim under
    the lock, counted in ``_racers``, and reads ``_order`` after it), and from
    then on those threads advance it without the job's lock. That is sound
    because each ``next()`` is atomic: with the GIL (every CPython 3.10-3.13
    build but the free-threaded one), one step of a ``range`` iterator is a C
    function that calls no Python code and never releases the GIL, so no other
    thread's step interleaves with it, and each unit is drawn exactly once. The
    free-threaded build (3.13t) makes no such promise for iterators, so there
    (``_claims.FREE_THREADED``) the iterator is a ``_claims.LockedRange``, whose
    steps take a lock of their own. Its length hint (the units left to draw)
    is read under the job's lock. :attr:`grow` is set once by the runner
    before the job is handed a thread. Reads without the lock are of single
    values whose staleness is harmless: :attr:`failed` (a shipper or a gate
    looks again a moment later), :attr:`limit` and :attr:`hands` (a thread
    more or fewer is offered, and :meth:`add_hand` decides under the lock),
    whether the map probes (:meth:`run` times one chunk more or fewer;
    :meth:`_count` decides under the lock). A lock that the job's runner holds
    (the shared threads' lock) is taken before the job's, never after it.

    Args:
        n: The number of units.
        fn: Runs one chunk.
        units: Runs the units a shared iterator yields (``MapWork.run_units``);
            default: ``fn`` on one unit at a time.
        fixed: Chunks of exactly this many units (fixed bounds); ``None`` for
            guided chunks.
        divisor: Guided chunks take ``1 / divisor`` of what is left.
        parent: The map whose kernel started this one; its failure stops this one.
        workers: The threads the map's executor has (default: one per unit).
        cpus: When fewer than ``workers``, the map starts on this many threads
            (limited), and gets all ``workers`` once its chunks find its
            elements slow or waiting (:func:`._scheduling.record_chunk`) or a
            chunk is stuck (:meth:`poll`). Guided maps only.
        probe: The map starts probing (:func:`._scheduling.starts_probing`): one
            unit per claim in index order, each timed, until its elements prove
            fast (then guided chunks) or not (then in index order to the end,
            without the lock). Guided maps only.
    """

    def __init__(
        self,
        n: int,
        fn: ChunkFn,
        *,
        units: UnitsFn | None = None,
        fixed: int | None = None,
        divisor: int = 2,
        parent: Job | None = None,
        workers: int | None = None,
        cpus: int | None = None,
        probe: bool = False,
    ):
        self.n = n
        self.fn = fn
        self.run_units = one_by_one(fn) if units is None else units
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
        self._measure = policy.Measure(probing=probe and fixed is None)
        self.failed = False
        self.error: BaseException | None = None
        self._completed = 0  # units counted done by chunks (and shipped ones)
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._next = 0  # the front: units from here on were never claimed
        # Units given back by cut chunks, to be claimed before the front, lowest
        # first (sorted).
        self._back: list[tuple[int, int]] = []
        self._running: set[Cursor] = set()  # but chunks of one unit, not timed:
        self._single = Cursor(self, 0)  # theirs, shared (its row is never read)
        self._outstanding = 0  # chunks claimed and not yet counted done
        # In index order: the front, drawn one unit at a time without the lock
        # (see the lock rule), the units it held, the threads drawing from it.
        self._order: Iterator[int] | None = None
        self._order_units = 0
        self._racers = 0
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
    def completed(self) -> int:
        """Units done, for progress bars: exact once the map is over; while
        threads draw units in index order, those drawn but the ones that may
        still run."""
        with self._lock:
            done = self._completed
            if self._order is not None:
                drawn = self._order_units - operator.length_hint(self._order)
                done += max(0, drawn - self._racers)
            return done

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
            if isinstance(claim, InOrder):
                self._run_in_order(busy)
                claim = self.claim()
            else:
                claim = self.run(*claim, then_claim=True, busy=busy)

    def claim(self) -> Claim:
        """The next chunk ``(start, stop, cursor)``: units given back (lowest
        first), else the front, else the tail of another thread's running
        chunk; or :data:`IN_ORDER` (the front is drawn one unit at a time); or
        ``None`` when none is left."""
        with self._lock:
            return self._claim()

    def _claim(self) -> Claim:  # lock held
        if self.failed:
            return None
        back = self._back
        if not back and self._next >= self.n:
            if self._order is not None and operator.length_hint(self._order):
                self._racers += 1
                return IN_ORDER
            if self.fixed or not self._steal():
                return None
        limited = self.limit < self.workers
        measure = self._measure
        size = (
            self.fixed
            or (measure.one_each and 1)
            or policy.chunk_size(self._remaining(), self.divisor, measure, limited)
        )
        start, stop = self._take(size)
        self._outstanding += 1
        if stop - start == 1 and not limited:
            # Nothing to take from it, nothing to time: the shared cursor.
            return start, stop, self._single
        cursor = Cursor(self, stop)
        if limited:
            cursor.started = (time.perf_counter(), time.thread_time())
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
    ) -> Claim:
        """Runs a claimed chunk (its exception fails the job); with
        ``then_claim``, returns the next claim, made under the same hold of
        the lock as this chunk is counted done. ``busy.running`` is true while
        the chunk's kernels run, false before the chunk counts as done (so
        that whoever sees the map done sees this thread free)."""
        outer, _local.job = _local.job, self
        probing = self._measure.probing  # (see the lock rule)
        if busy is not None:
            busy.running = True
        began = time.perf_counter()
        cpu = time.thread_time() if probing else 0.0
        try:
            self.fn(start, stop, cursor)
        except BaseException as e:  # routed to the waiting thread, like CPython's pool
            self.fail(e)
        finally:
            wall = time.perf_counter() - began
            if probing:
                cpu = time.thread_time() - cpu
            _local.job = outer
            if busy is not None:
                busy.running = False
        with self._lock:
            if cursor is not self._single:
                self._running.discard(cursor)
                stop = cursor.stop  # lowered if another thread took the tail
            rose = cursor.started is not None and self._measured(cursor, stop - start)
            if not rose:
                self._count(start, stop, wall, cpu if probing else None)
                return self._claim() if then_claim else None
        # The map rose: more threads before the chunk counts as done, so that
        # the map (and its executor) is still there for them.
        try:
            if self.grow is not None:
                self.grow()
        finally:
            with self._lock:
                self._count(start, stop, wall, None)
        return self.claim() if then_claim else None

    def _run_in_order(self, busy: Busy | None) -> None:
        """Runs units drawn one at a time from the shared iterator, in index
        order, as ``ThreadPoolExecutor.map`` hands out its elements, until it
        is exhausted or the map fails. The claim of a unit is a step of the
        iterator, with no lock (see the lock rule): with a lock per unit, 32
        threads on 2 CPUs queued at it (the front-loaded benchmark took
        1.08-1.15x as long as with chunks of several units). The thread
        counted itself in ``_racers`` when it claimed the run, and takes the
        lock once more, to leave it; the job is done once no thread is in it
        and nothing is left to draw."""
        units = self._order
        assert units is not None  # set before any thread is counted in the run
        outer, _local.job = _local.job, self
        if busy is not None:
            busy.running = True
        try:
            self.run_units(units, self._single)
        except BaseException as e:  # routed to the waiting thread
            self.fail(e)
        finally:
            _local.job = outer
            if busy is not None:
                busy.running = False
        with self._lock:
            self._racers -= 1
            self._check_done()

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
        """Lets the map use every thread, one unit per claim in index order,
        the running chunks' tails given back (:func:`._scheduling.rise`);
        whether threads should be added."""
        self.limit = self.workers
        policy.rise(self._measure)
        for cursor in list(self._running):
            self._cut(cursor)
        self._go_in_order()
        return not self._exhausted()

    def _go_in_order(self) -> None:  # lock held
        """From now on the front is drawn one unit at a time, in index order,
        without the lock (:meth:`_run_in_order`); units given back by cut
        chunks, all below it, are claimed first, one at a time, under it."""
        if self._order is None and self._next < self.n:
            self._order = in_order(self._next, self.n)
            self._order_units = self.n - self._next
            self._next = self.n

    def _count(
        self, start: int, stop: int, wall: float, cpu: float | None
    ) -> None:  # lock held
        """Counts a chunk as done, which took ``wall`` seconds (``cpu`` on a
        CPU, when the map probed it)."""
        units = stop - start
        measure = self._measure
        if self.fixed is None and units > 0 and not measure.one_each:
            if cpu is not None and measure.probing:
                if policy.record_probe(measure, wall, cpu, self.workers):
                    self._go_in_order()
            else:
                policy.record_time(measure, units, wall)
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
        if self.failed:
            return True
        if self._next < self.n or self._back:
            return False
        return self._order is None or not operator.length_hint(self._order)

    def _check_done(self) -> None:  # lock held
        if self._outstanding == 0 and self._racers == 0 and self._exhausted():
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
