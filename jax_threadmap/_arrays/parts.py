"""The parts of a call that run on their own (a sharded load's shards).

:class:`Parts` is the one owner of the parts' states (:class:`PartState`): each
change is one of its methods, under its lock, through :meth:`Parts._move`, which
refuses a move that is not in :data:`PART_MOVES`. The call (:class:`.task.Task`)
asks for each move under its own lock (the call's lock, then this one: never
the other way round), since a part moves only while the call is running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .async_pool import Worker


class Owner(Protocol):
    """The call a part belongs to (a ``Task``): what the part uses of it."""

    name: str
    api: str

    def run_part(self, part: Part, worker: Worker | None) -> None:
        """Runs ``part`` here, unless it has started (or ended)."""


def checked_move(state: Any, to: Any, moves: frozenset, owner: Any, what: str) -> Any:
    """``to``, if ``(state, to)`` is one of ``moves``; else raises
    ``InvalidStateError`` (as ``concurrent.futures.Future`` refuses an illegal
    move), naming ``owner`` and ``what`` moved. The one refusal of the async
    wing's state machines (a call's, :mod:`.call`; a part's, :class:`Parts`)."""
    if (state, to) not in moves:
        raise concurrent.futures.InvalidStateError(
            f"{owner}: {what} cannot move from {state} to {to}"
        )
    return to


class PartState(enum.Enum):
    """A part's states: not started, fetching, its data placed, or stopped
    (it failed, or the call ended first)."""

    PENDING = "pending"
    RUNNING = "running"
    PLACED = "placed"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


#: The moves of a part's state (:meth:`Parts._move`); any other is a bug,
#: refused with ``InvalidStateError`` as ``concurrent.futures.Future`` refuses one.
PART_MOVES = frozenset(
    {
        (PartState.PENDING, PartState.RUNNING),  # claimed
        (PartState.PENDING, PartState.STOPPED),  # the call ended before it started
        (PartState.RUNNING, PartState.PLACED),  # landed
        (PartState.RUNNING, PartState.STOPPED),  # failed, or the call ended first
    }
)


class Part:
    """A piece of a call that runs on its own and lands before the call ends
    (a sharded load's shard): its own fetch, the devices its data goes to.

    Its ``state``, ``worker`` and ``source`` are changed only by
    :class:`Parts`' methods. A call of the async pool (``name``, :meth:`run`,
    :meth:`time_out`).
    """

    __slots__ = ("task", "name", "devices", "what", "state", "worker", "source")

    def __init__(self, task: Owner, devices: list[Any], what: str) -> None:
        self.task = task
        self.name = task.name  # shown in the name of the thread that runs it
        self.devices = devices
        #: Names the part in errors: "the shard at index [0:2] (devices 0, 1)".
        self.what = what
        self.state = PartState.PENDING
        self.worker: Worker | None = None
        self.source: asyncio.Task | None = None

    def run(self, worker: Worker | None = None) -> None:
        self.task.run_part(self, worker)

    def time_out(self) -> None:  # the call's timeout covers its parts
        pass

    def __str__(self) -> str:
        return f"{self.task.name} ({self.task.api}, {self.what})"


class Parts:
    """The parts of one call, and the one owner of their states.

    ==================  ==========================  =========  =====================
    part                event (method)              next       taken (+), given
                                                               back (-)
    ==================  ==========================  =========  =====================
    pending             claim                       running    + pool slot or loop
                                                               task
    running             land                        placed     + its placed data;
                                                               the last: the call
                                                               is settled
    running             fail                        stopped    the call fails
    pending, running    stop (the call ends)        stopped    - pool slot (abandon),
                                                               - loop task (cancel),
                                                               - placed data
    ==================  ==========================  =========  =====================

    The call asks for each move under its own lock; :meth:`stop` returns the
    threads and coroutines of the parts it stopped, for the call to give up on.
    The parts' placed data waits here, by device, until the last one lands
    (:meth:`take_placed`).
    """

    __slots__ = ("_lock", "_parts", "_left", "_placed")

    def __init__(self, parts: list[Part]) -> None:
        self._lock = threading.Lock()
        self._parts = tuple(parts)
        self._left = len(self._parts)  # parts still to land
        self._placed: dict[Any, Any] = {}  # by device, until the last lands

    def __iter__(self) -> Any:
        return iter(self._parts)

    @property
    def all(self) -> tuple[Part, ...]:
        return self._parts

    def _move(self, part: Part, to: PartState) -> None:  # lock held
        """The one change of a part's state: refuses a move not in
        :data:`PART_MOVES`."""
        part.state = checked_move(part.state, to, PART_MOVES, part.task, part.what)

    def claim(
        self, part: Part, worker: Worker | None, source: asyncio.Task | None
    ) -> bool:
        """Claims ``part`` for this thread or coroutine; ``False``: it was
        claimed or stopped already."""
        with self._lock:
            if part.state != PartState.PENDING:
                return False
            self._move(part, PartState.RUNNING)
            part.worker, part.source = worker, source
            return True

    def left_runner(self, part: Part) -> None:
        """``part``'s fetch returned or raised: its thread or coroutine is no
        longer ours."""
        with self._lock:
            part.worker = part.source = None

    def adopt(self, part: Part, source: asyncio.Task | None) -> bool:
        """The coroutine that awaits what ``part``'s thread returned; ``False``:
        the part was stopped meanwhile."""
        with self._lock:
            if part.state != PartState.RUNNING:
                return False
            part.source = source
            return True

    def land(self, part: Part, placed: list[Any]) -> bool | None:
        """``part``'s data is placed on its devices (``placed``, one array
        each: taken, the list emptied); returns whether it was the last to land
        (``None``: the part was stopped meanwhile, its data is dropped)."""
        with self._lock:
            arrays = placed.copy()
            placed.clear()
            if part.state != PartState.RUNNING:
                return None
            self._placed.update(zip(part.devices, arrays, strict=True))
            self._move(part, PartState.PLACED)
            self._left -= 1
            return self._left == 0

    def fail(self, part: Part) -> None:
        """``part`` failed (its own thread or coroutine is not stopped)."""
        with self._lock:
            if part.state == PartState.RUNNING:
                self._move(part, PartState.STOPPED)
            part.worker = part.source = None

    def stop(self) -> list[tuple[Part, Any, Any]]:
        """The call ended: parts not placed never start or are given up on;
        returns each one's thread and coroutine, to abandon and cancel."""
        with self._lock:
            stopping = [
                p
                for p in self._parts
                if p.state in (PartState.PENDING, PartState.RUNNING)
            ]
            handles = [(p, p.worker, p.source) for p in stopping]
            for p in stopping:
                self._move(p, PartState.STOPPED)
            self._placed = {}
            return handles

    def take_placed(self) -> dict[Any, Any]:
        """Every part's placed data, by device (once the last has landed)."""
        with self._lock:
            placed, self._placed = self._placed, {}
            return placed

    def not_placed(self) -> list[Part]:
        """The parts whose data has not landed (for a timeout's message)."""
        with self._lock:
            return [p for p in self._parts if p.state != PartState.PLACED]
