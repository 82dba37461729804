"""What a thread claims of a map, and the functions that run it.

A thread that runs a map's kernels claims from its :class:`._jobs.Job` either a
chunk, units ``[start, stop)`` with the :class:`Cursor` its loop publishes at,
or a place in the map's in-order run (:data:`IN_ORDER`): units drawn one at a
time, in index order, from an iterator that the run's threads share
(:func:`in_order`). :class:`MapWork` is what the executor layer needs of a map
(``_host.HostMap`` provides it): the functions that run a chunk and an
in-order run, and those that ship work to other processes.
"""

from __future__ import annotations

import operator
import sysconfig
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Owner(Protocol):
    """What a cursor reads of its chunk's map (``_jobs.Job``)."""

    _lock: threading.Lock
    failed: bool


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
    cursor that a job's chunks of one unit share is written
    by each of their loops, and by the in-order run's; no thread reads its
    :attr:`row`, since a chunk of one unit has no tail, and only a failure
    sets its :attr:`halt`.)
    """

    __slots__ = ("_job", "halt", "row", "stop")

    def __init__(self, job: Owner, stop: int):
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
    """A thread's flag: whether it runs a kernel (see :meth:`._jobs.Job.run`)."""

    running: bool


#: A claimed chunk: units ``[start, stop)`` and the cursor its loop publishes at.
Chunk = tuple[int, int, Cursor]

#: Runs units ``[start, stop)`` of a job, publishing each row of units at the
#: cursor before running it (see :class:`Cursor`).
ChunkFn = Callable[[int, int, Cursor], None]
#: Runs each unit that a shared iterator yields, until it is exhausted or the
#: cursor halts (see :meth:`._jobs.Job._run_in_order`).
UnitsFn = Callable[[Iterator[int], Cursor], None]


class InOrder:
    """What :meth:`._jobs.Job.claim` returns when the thread is to run units one at a
    time in index order, drawing them from the job's shared iterator."""

    __slots__ = ()


#: The claim of a thread that joins the in-order run (:meth:`._jobs.Job._run_in_order`).
IN_ORDER = InOrder()
#: What :meth:`._jobs.Job.claim` hands a thread: a chunk, the in-order run, or nothing.
Claim = Chunk | InOrder | None


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

    def run_units(self, units: Iterator[int], cursor: Cursor) -> None: ...

    def shared(self) -> list[Any]:
        """Operands shipped once per map to an executor that pickles work."""
        ...

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """A picklable task running ``[start, stop)`` in another process, called
        with the map's shared operands (see ``_remote.share``)."""
        ...

    def store_packed(self, start: int, stop: int, outs: Any) -> None: ...


#: Whether this CPython is a free-threaded build (3.13t: no GIL), where a
#: ``range`` iterator that several threads advance at once may hand two of
#: them the same unit (see :class:`._jobs.Job`'s lock rule).
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


class LockedRange:
    """A ``range`` iterator whose steps and length hint take a lock: the
    in-order iterator on a free-threaded build (see :class:`._jobs.Job`)."""

    __slots__ = ("_it", "_lock")

    def __init__(self, start: int, stop: int):
        self._it = iter(range(start, stop))
        self._lock = threading.Lock()

    def __iter__(self) -> LockedRange:
        return self

    def __next__(self) -> int:
        with self._lock:
            return next(self._it)

    def __length_hint__(self) -> int:
        with self._lock:
            return operator.length_hint(self._it)


def in_order(start: int, stop: int, locked: bool = FREE_THREADED) -> Iterator[int]:
    """The shared iterator of an in-order run over units ``[start, stop)``."""
    if locked:
        return LockedRange(start, stop)
    return iter(range(start, stop))


def one_by_one(fn: ChunkFn) -> UnitsFn:
    """Runs the units a shared iterator yields as chunks of one unit each."""

    def units(it: Iterator[int], cursor: Cursor) -> None:
        for i in it:
            if cursor.halt and cursor.halted(i):
                return
            fn(i, i + 1, cursor)

    return units
