"""What a thread claims of a map: a chunk of units ``[start, stop)`` with the
:class:`Cursor` its loop publishes at, and what the executor layer needs of a
map (:class:`MapWork`, which ``_host.HostMap`` provides): the function that
runs a chunk, and those that ship work to other processes.
"""

from __future__ import annotations

import operator
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
    cursor that a job's chunks of one unit share is written by each of their
    loops; no thread reads its :attr:`row`, since a chunk of one unit has no
    tail, and only a failure sets its :attr:`halt`.)
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
