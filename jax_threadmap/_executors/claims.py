"""What a thread claims of a map: a chunk of units ``[start, stop)`` with the
:class:`Cursor` its loop publishes at, and what the executor layer needs of a
map (:class:`MapWork`, which ``_host.maps.HostMap`` provides).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Owner(Protocol):
    """What a cursor asks of its chunk's map (``jobs.Job``)."""

    def halts(self, cursor: Cursor, i: int) -> bool: ...


class Cursor:
    """Where a running chunk is: all that a thread learns of another's chunk.

    The chunk's loop publishes each row of units before running it:
    ``js = iter(range(j, end))``, ``cursor.row = (base + end, js)``, then
    ``for j in js: if cursor.halt and cursor.halted(base + j): return``. The
    range iterator is the position: its length hint says how many units of the
    row the loop has not taken. A thread that takes the chunk's tail holds the
    job's lock, sets :attr:`halt`, then reads where the loop is
    (:meth:`running`); the loop reads :attr:`halt` after taking its next unit
    and then asks under the lock (:meth:`halted`), so every unit after the one
    read is the taker's (a store then a load on each side: one sees the other).

    Lock rule: :attr:`row` is written by the loop's thread only; :attr:`halt`
    and :attr:`stop` under the job's lock. :attr:`halt`, once set (a failure, a
    taken tail), stays set until the chunk ends.
    """

    __slots__ = ("_job", "halt", "row", "stop")

    def __init__(self, job: Owner, stop: int):
        self._job = job
        self.halt = False
        #: Where the chunk stops: lowered when another thread takes its tail.
        self.stop = stop
        #: ``(flat end of the row, its range iterator)``; ``None`` before the loop.
        self.row: tuple[int, Iterator[int]] | None = None

    def running(self) -> int | None:
        """The unit the loop runs (or the one before its next); ``None`` before
        the loop publishes a row (a chunk function that never does keeps its
        units)."""
        row = self.row
        if row is None:
            return None
        end, units = row
        return end - 1 - operator.length_hint(units)

    def halted(self, i: int) -> bool:
        """Whether the loop stops before unit ``i``: the map failed, or another
        thread took the units from there on."""
        return self._job.halts(self, i)


class Busy(Protocol):
    """A thread's flag: whether it runs a kernel (see ``jobs.Job.run``)."""

    running: bool


#: A claimed chunk: units ``[start, stop)`` and the cursor its loop publishes at.
Chunk = tuple[int, int, Cursor]

#: Runs units ``[start, stop)``, publishing each row at the cursor first.
ChunkFn = Callable[[int, int, Cursor], None]


class MapWork(Protocol):
    """What the executor layer needs of a map (``_host.maps.HostMap``)."""

    name: str  # for messages and progress bars
    n: int  # elements
    sums: bool  # outputs summed on the host: chunk bounds must not depend on timing
    vectorized: bool  # one kernel call per chunk

    @property
    def element_bytes(self) -> int: ...  # one element's operands and results

    def split(self, max_elements: int) -> int:
        """Cuts a vectorized map into chunks of at most ``max_elements``; returns
        how many (the work units)."""
        ...

    def run_chunk(self, start: int, stop: int, cursor: Cursor) -> None: ...

    def shared(self) -> list[Any]:
        """Operands shipped once per map to an executor that pickles work."""
        ...

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """A picklable task running ``[start, stop)`` in another process."""
        ...

    def store_packed(self, start: int, stop: int, outs: Any) -> None: ...
