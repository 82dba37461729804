"""A background call's state machine: :class:`Call`, the base of every ``Task``.

:class:`Call` is the one owner of a call's state (:class:`CallState`): each
change is one of its methods, under its lock, through :meth:`Call._move`, which
refuses a move not in :data:`CALL_MOVES` (the table in :class:`CallState`'s
docstring); no other class reads or writes its fields, its subclass
:class:`.task.Task` included, which says what the call runs and how its
outcome lands. With the state it owns the threads and coroutine it claimed
(given up on when the call is), whether its timeout's clock runs, and the
error text that the programs deferred on its arrays raise if it fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import os
import threading
from typing import Any

from . import async_pool as _async_pool

logger = logging.getLogger("jax_threadmap._async")


def checked_move(state: Any, to: Any, moves: frozenset, owner: Any, what: str) -> Any:
    """``to``, if ``(state, to)`` is one of ``moves``; else raises
    ``InvalidStateError`` (as ``concurrent.futures.Future`` refuses an illegal
    move), naming ``owner`` and ``what`` moved."""
    if (state, to) not in moves:
        raise concurrent.futures.InvalidStateError(
            f"{owner}: {what} cannot move from {state} to {to}"
        )
    return to


class CallState(enum.Enum):
    """A call's states: not started (queued, or not yet submitted), running,
    finishing (its outcome is being set: values placed, or the error kept) and
    finished (landed or failed). Each move is a method of :class:`Call`, the
    owner, through :meth:`Call._move`:

    ==================  ==========================  =========  =====================
    state               event (method)              next       taken (+), given
                                                               back (-)
    ==================  ==========================  =========  =====================
    pending             submit                      same       + queue entry or loop
                                                               task, + deadline,
                                                               + live entry
    pending             claim (_claim)              running    + pool slot (its
                                                               thread); a call not
                                                               submitted in this
                                                               process (claimed
                                                               before its submit,
                                                               or in a forked
                                                               child): + live
                                                               entry, + deadline
    running             fn returns (_accept)        finishing  nothing
    running             fn raises (_fail)           finishing  + error text
    pending, running    give_up (timeout, cancel)   finishing  - pool slot (abandon),
                                                               - loop task (cancel);
                                                               + error text
    pending, running    abandon (at exit)           finishing  nothing
    finishing           _publish, _conclude (_end)  finished   - live entry
    finishing,finished  its thread leaves run       same       - pool slot (once
                                                               placed and published;
                                                               at give_up if given
                                                               up on)
    finishing,finished  fn returns or raises late   same       nothing (dropped)
    ==================  ==========================  =========  =====================
    """

    PENDING = "pending"
    RUNNING = "running"
    FINISHING = "finishing"
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


PENDING, RUNNING, FINISHING, FINISHED = CallState

#: The moves of a call's state (:meth:`Call._move`); any other is a bug, refused
#: with ``InvalidStateError`` as ``concurrent.futures.Future`` refuses one.
CALL_MOVES = frozenset(
    {
        (PENDING, RUNNING),  # claimed
        (PENDING, FINISHING),  # given up on, or abandoned, before it started
        (RUNNING, FINISHING),  # returned, raised, given up on, abandoned
        (FINISHING, FINISHED),  # published, or its error set
    }
)


class Call:
    """The state of one background call, and what it holds in each state.

    Timed out, cancelled and abandoned calls are failed calls whose error says
    so; a call given up on drops what ``fn`` returns later. In a forked child,
    a call that ran at the fork fails at its first use (:meth:`ran_elsewhere`).
    The moves are :class:`CallState`'s table; :meth:`_start` (what
    :meth:`submit` queues) is a subclass's.
    """

    __slots__ = tuple(
        "_lock _state _submitted _clock _pid _worker _source _error_text "
        "name api timeout".split()
    )
    #: Holds the list of placed leaves, or the exception of the call (a
    #: subclass's).
    future: concurrent.futures.Future

    def __init__(self, name: str, api: str, timeout: float | None) -> None:
        self._lock = threading.Lock()
        self._state = PENDING
        self._submitted = False
        self._clock = False  # whether the timeout's clock runs
        self._pid = os.getpid()
        self.name = name
        self.api = api
        # Seconds from the call before it is given up on.
        self.timeout = timeout
        # The pool thread running fn, while it runs (it leaves the bound if the
        # call is given up on); its asyncio task while it runs on the event
        # loop (cancelled if the call is given up on).
        self._worker: _async_pool.Worker | None = None
        self._source: asyncio.Task | None = None
        # What the programs deferred on its arrays raise, once it failed.
        self._error_text: str | None = None

    @property
    def returned(self) -> bool:
        """Whether ``fn`` returned and its values are being placed."""
        return self._state == FINISHING

    def _move(self, to: CallState) -> None:  # lock held
        """The one change of the call's state: refuses a move that is not in
        :data:`CALL_MOVES`."""
        self._state = checked_move(self._state, to, CALL_MOVES, self, "the call")

    def failure_text(self) -> str:
        """The error the programs deferred on the call's arrays raise (once the
        call failed)."""
        return self._error_text or f"{self.name} ({self.api}) failed"

    # -- start --

    def _start_clock(self) -> None:
        with self._lock:
            if self._clock or self.timeout is None:
                return
            self._clock = True
        _async_pool.deadlines().add(self, self.timeout)

    def submit(self) -> None:
        """Queues the call on the pool or loop (once); its timeout counts from now."""
        with self._lock:
            if self._submitted or self._state != PENDING:
                return
            self._submitted = True
        with _async_pool.live_lock:
            _async_pool.live.add(self)
        self._start_clock()
        self._start()

    def _start(self) -> None:
        """Queues the call's work, at :meth:`submit` (once): a subclass's."""
        raise NotImplementedError

    def run(self, worker: _async_pool.Worker | None = None) -> None:
        """Runs the call here, unless it has started (or ended): a subclass's."""
        raise NotImplementedError

    def time_out(self) -> None:
        """Gives up on the call, whose timeout has passed: a subclass's."""
        raise NotImplementedError

    def _claim(
        self, worker: _async_pool.Worker | None, source: asyncio.Task | None = None
    ) -> bool:
        """Claims the call (pending -> running) for this thread or coroutine;
        ``False``: already claimed, or ended."""
        pid = os.getpid()
        with self._lock:
            if self._state != PENDING:
                return False
            # submit() did the two below, unless in the parent of this fork.
            known = self._submitted and self._pid == pid
            self._move(RUNNING)
            self._worker, self._source = worker, source
            self._pid = pid
        if not known:
            with _async_pool.live_lock:
                _async_pool.live.add(self)
            self._start_clock()
        return True

    def _left_runner(self) -> None:
        """``fn`` returned or raised: its thread or coroutine is no longer ours."""
        with self._lock:
            self._worker = self._source = None

    def _adopt(self, source: asyncio.Task | None) -> bool:
        """The coroutine that awaits what the call's thread returned; ``False``:
        the call was given up on meanwhile."""
        with self._lock:
            if self._state != RUNNING:
                return False
            self._source = source
            return True

    def _on_loop_now(self) -> bool:
        """Whether an asyncio task runs the call (cancelled if given up on)."""
        return self._source is not None

    def ran_elsewhere(self) -> bool:
        """Whether the call started in the parent of this forked child (then
        it never ends here)."""
        return self._state != PENDING and self._pid != os.getpid()

    # -- the end --

    def _settle(self) -> bool:
        """Ends a running call's run (-> finishing); ``False``: it was given up on."""
        with self._lock:
            if self._state != RUNNING:
                return False
            self._move(FINISHING)
            return True

    def _take_runners(self) -> tuple[Any, Any] | None:
        """Ends a pending or running call (-> finishing): its thread and
        coroutine, to give up on; ``None``: it had ended."""
        with self._lock:
            if self._state not in (PENDING, RUNNING):
                return None
            self._move(FINISHING)
            worker, source = self._worker, self._source
            self._worker = self._source = None
        return worker, source

    def abandon(self) -> None:
        """At exit: ends a call that is still running (what it returns later
        is dropped)."""
        self._take_runners()

    def _end(self, error_text: str | None = None) -> None:
        """The finishing call's outcome is set (-> finished); ``error_text``:
        what the programs deferred on its arrays raise, if it failed."""
        with self._lock:
            self._move(FINISHED)
            self._error_text = error_text
        with _async_pool.live_lock:
            _async_pool.live.discard(self)

    def __str__(self) -> str:
        return f"{self.name} ({self.api})"
