"""One map's chunks: claimed, run, failed.

A map is a :class:`Job` over ``n`` work units (elements, or pieces of a
vectorized map). Every thread that runs its kernels (a shared thread, a worker
of a user's thread executor, the thread that waits for a nested map) claims
chunks from the front and runs them until none are left (:meth:`Job.drain`).
Chunks are fixed (one unit for a map in index order, a few per thread for a
map summed on the host) or guided, sized from the times of those before
(:mod:`.scheduling`). A limited map starts on one thread per CPU and gets every
thread of its executor once its chunks find its elements slow or waiting. The
first failure stops every running chunk at its next unit (the loops read
:attr:`Job.failed` before each), and every map the failed map's kernels started.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .._host.loops import ChunkFn
from .._support import fork as _fork
from .._support.errors import ExecutorError
from . import scheduling as policy

#: A claimed chunk: units ``[start, stop)``.
Chunk = tuple[int, int]


class Busy(Protocol):
    """A thread's flag: whether it runs a kernel (see :meth:`Job.run`)."""

    running: bool


class ThisThread(threading.local):
    """What a thread publishes of itself to the maps it starts."""

    #: The job whose chunk this thread is running (a kernel is running here): a
    #: map started now is nested in it (its parent, which it drains while waiting).
    job: Job | None = None


#: This thread's :class:`ThisThread` (``this_thread.job``).
this_thread = ThisThread()


@_fork.in_child
def _forget_running_job() -> None:
    # A fork from inside a kernel: the child runs none of the parent's maps.
    this_thread.job = None


class Job:
    """One flat map: ``n`` units, run by ``fn(start, stop, job)`` per chunk.

    Lock rule: every field more than one thread uses is written under
    ``_lock``; :attr:`grow` is set once, before the job gets a thread. Read
    without the lock: :attr:`failed` (each loop, before each unit),
    :attr:`limit` and :attr:`hands` (staleness costs at most a thread offered
    in vain: :meth:`add_hand` decides). A runner's lock is taken before the
    job's, never after.

    Args:
        n: The number of units.
        fn: Runs one chunk.
        fixed: Chunks of exactly this many units; ``None`` for guided chunks
            (:func:`.scheduling.chunk_size`).
        parent: The map whose kernel started this one; its failure stops this one.
        workers: The threads the map's executor has (default: one per unit).
        cpus: A guided map starts on this many threads when fewer than
            ``workers`` (limited), and rises to all (:func:`.scheduling.record_chunk`).
        in_order: Fixed chunks of one unit, on every thread.
        inline: The times of its equation's last map, for a map that runs on
            the thread that starts it (:func:`.scheduling.runs_inline`).
        scope: Entered by each thread around its chunks of the map (where the
            kernels' JAX calls run: ``_host/kernel_scope.py``).
    """

    def __init__(
        self,
        n: int,
        fn: ChunkFn,
        *,
        fixed: int | None = None,
        parent: Job | None = None,
        workers: int | None = None,
        cpus: int | None = None,
        in_order: bool = False,
        inline: policy.Measure | None = None,
        scope: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    ):
        self.n = n
        self.fn = fn
        self.scope = scope
        self.fixed = 1 if in_order else fixed
        self.workers = n if workers is None else max(1, workers)
        #: Threads the map may hold now (raised to ``workers`` once it rises).
        self.limit = self.workers
        self._measure = policy.Measure()
        self.inline = inline is not None and not in_order
        self._spent, self._timed = 0.0, 0  # seconds and units of timed chunks
        if inline is not None and self.inline:  # one thread; chunks sized at once
            cpus, self._measure.per_element = 1, inline.per_element
        if cpus is not None and (self.fixed is None or self.inline):
            self.limit = max(1, min(cpus, self.workers))
        #: Threads handed to the map (:meth:`add_hand`).
        self.hands = 0
        #: Hands the map more threads once its limit rises (set by its runner).
        self.grow: Callable[[], object] | None = None
        self.failed = False
        self.error: BaseException | None = None
        self._completed = 0  # units counted done (shipped ones too)
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._next = 0  # units from here on were never claimed
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
    def per_unit(self) -> float:
        """Seconds per unit of its chunks timed so far, on their threads."""
        return self._spent / self._timed if self._timed else 0.0

    @property
    def completed(self) -> int:
        """Units done, for progress bars."""
        with self._lock:
            return self._completed

    def add_hand(self) -> bool:
        """Counts one more thread handed to the map, if it can use one."""
        with self._lock:
            if self.hands >= min(self.n, self.limit) or self._exhausted():
                return False
            self.hands += 1
            return True

    def drop_hand(self) -> None:
        """A thread counted by :meth:`add_hand` never came (its start failed)."""
        with self._lock:
            self.hands -= 1

    # --- claiming and running chunks -----------------------------------------------

    def drain(self, busy: Busy | None = None) -> None:
        """Claims and runs chunks until none are left: the one loop of every
        thread that runs the map's kernels (``busy``: see :meth:`run`), inside
        the map's scope, if any."""
        with contextlib.nullcontext() if self.scope is None else self.scope():
            claim = self.claim()
            while claim is not None:
                claim = self.run(*claim, busy=busy)

    def claim(self) -> Chunk | None:
        """The next chunk ``(start, stop)`` from the front; ``None`` when none
        is left."""
        with self._lock:
            return self._claim()

    def _claim(self) -> Chunk | None:  # lock held
        if self._exhausted():
            return None
        start = self._next
        size = self.fixed or policy.chunk_size(
            self.n - start, self.workers, self._measure, self.limited
        )
        if self.inline and self._timed and self.limited and not self.fixed:
            size = policy.inline_chunk(self._spent, self._measure)
        self._next = stop = min(self.n, start + size)
        self._outstanding += 1
        return start, stop

    def run(self, start: int, stop: int, busy: Busy | None = None) -> Chunk | None:
        """Runs a claimed chunk (its exception fails the job) and returns the next
        claim, made under the hold of the lock that counts this chunk done.
        ``busy.running`` is true while the kernels run, false before the chunk
        counts done."""
        outer, this_thread.job = this_thread.job, self
        timed, limited = self.fixed != 1, self.limited  # (see the lock rule)
        if busy is not None:
            busy.running = True
        began = time.perf_counter() if timed else 0.0
        cpu = time.thread_time() if limited and not self.inline else 0.0  # (slow)
        try:
            self.fn(start, stop, self)
        except BaseException as e:  # routed to the waiting thread, like CPython's pool
            self.fail(e)
        finally:
            wall = time.perf_counter() - began if timed else 0.0
            cpu = time.thread_time() - cpu if cpu else 0.0
            this_thread.job = outer
            if busy is not None:
                busy.running = False
        units = stop - start
        with self._lock:
            if not (timed and self._record(units, wall, cpu, limited)):
                self._count(units)
                return self._claim()
        try:  # it rose: more threads before the chunk counts done (and the map ends)
            if self.grow is not None:
                self.grow()
        finally:
            with self._lock:
                self._count(units)
        return self.claim()

    def _record(self, units: int, wall: float, cpu: float, limited: bool) -> bool:
        """Records a chunk's time (lock held); whether the map rises now."""
        self._spent, self._timed = self._spent + wall, self._timed + units
        if not (limited and self.limited):
            policy.record_time(self._measure, units, wall)
            return False
        if self.inline:
            policy.record_time(self._measure, units, wall)
            if self._spent < policy.INLINE_SECONDS:
                return False
        elif not policy.record_chunk(self._measure, units, wall, cpu, self.limit):
            return False
        self.limit = self.workers
        return not self._exhausted()

    def _count(self, units: int) -> None:  # lock held
        self._completed += units
        self._outstanding -= 1
        if self._outstanding == 0 and self._exhausted():
            self.done.set()

    def add_completed(self, units: int) -> None:
        """Counts units done elsewhere (shipped to another process)."""
        with self._lock:
            self._completed += units

    def exhausted(self) -> bool:
        """Whether no unit is left to claim."""
        with self._lock:
            return self._exhausted()

    def _exhausted(self) -> bool:  # lock held
        return self.failed or self._next >= self.n

    # --- failing ---------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Records the first error and stops the map: no more claims, each
        running chunk stops at its next unit, and so do the maps its kernels
        started. A no-op once the job is done."""
        with self._lock:
            if self.done.is_set() and self.error is None:
                return
            if self.error is None:
                self.error = error
            self.failed = True
            if self._outstanding == 0:
                self.done.set()
            children = list(self._children)
        for child in children:
            child.fail(_stopped_by_parent())

    def abandon(self, error: BaseException) -> None:
        """Fails the job and releases its waiting thread at once, without waiting
        for its running chunks (they write only into the map's buffers): at exit."""
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


#: Set when the interpreter starts to exit (by ``runners``' exit hooks),
#: for messages.
interpreter_exiting = threading.Event()


def at_shutdown(e: BaseException) -> bool:
    """Whether ``e``, raised by starting a thread or submitting work, came from an
    interpreter that is exiting (CPython's words: "... at interpreter shutdown")."""
    return interpreter_exiting.is_set() or "interpreter shutdown" in str(e)
