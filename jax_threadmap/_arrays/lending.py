"""What the dispatch mechanism lends one call: a slot, gates, and their data.

:class:`Lending` is the one owner of that loan's state (:class:`LendingState`):
each change is one of its methods, under its lock, through
:meth:`Lending._move`, which refuses a move not in :data:`LENDING_MOVES`. The
call (:class:`.task.Task`) closes it when it ends (under the call's lock, then
this one: never the other way round); the dispatch mechanism counts its gate
programs (:meth:`Lending.add_program`, :meth:`Lending.program_ran`); the slot
goes back by the later of the two.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from .shards import index_of

logger = logging.getLogger("jax_threadmap._async")


class Gate(Protocol):
    """The input of a call's gate programs on one device, until it is opened."""

    @property
    def array(self) -> jax.Array:
        """What the gate programs take as input (pending until :meth:`open`)."""

    def open(self, slot: int) -> None:
        """Lets the gate programs run; they find the call by ``slot``."""


class Lender(Protocol):
    """What the dispatch mechanism lends a call: its slot id, and its gates."""

    def lend_slot(self, task: Any) -> int:
        """A slot id (> 0) by which gate programs find ``task`` (the call)."""

    def give_back_slot(self, slot: int) -> None:
        """No gate program reads the call of ``slot`` any more."""

    def pull(self, device: Any) -> Gate:
        """A new gate on ``device``."""


class LendingState(enum.Enum):
    """A loan's states: gates may be added (the call has not ended), closed
    (the call ended; gate programs may still run), given back (the slot)."""

    OPEN = "open"
    CLOSED = "closed"
    GIVEN_BACK = "given back"

    def __str__(self) -> str:
        return self.value


#: The moves of a loan (:meth:`Lending._move`); any other is a bug, refused with
#: ``InvalidStateError`` as ``concurrent.futures.Future`` refuses one.
LENDING_MOVES = frozenset(
    {
        (LendingState.OPEN, LendingState.CLOSED),  # the call ended
        (LendingState.CLOSED, LendingState.GIVEN_BACK),  # no gate program left
    }
)


class Lending:
    """The slot, gates and gate data of one call; the one owner of their state.

    ==================  ==========================  ==========  ====================
    loan                event (method)              next        taken (+), given
                                                                back (-)
    ==================  ==========================  ==========  ====================
    open                add_program (a dispatch)    same        + gate program,
                                                                + slot (the first)
    open                land (a part)               same        its devices' gates
                                                                opened
    open                close (the call ends)       closed      gates taken, to open
    open, closed        program_ran                 same        - gate program
    closed              no gate program left        given back  - slot, - host data
    ==================  ==========================  ==========  ====================

    Gates are added only while open; :meth:`close` takes every gate there is
    (each opens once, none is missed). A loan that never lent a slot stays
    closed. The host data the gate programs copy (NumPy: by leaf, or by
    device for a call of parts) is made only if there are gates.
    """

    __slots__ = tuple(
        "_lock _state _slot _lender _gates _host _error_text _programs _early".split()
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = LendingState.OPEN
        self._slot = 0  # the slot the gates carry (0: none), and its lender
        self._lender: Lender | None = None
        self._gates: dict[Any, Gate] = {}
        self._host: Any = None
        self._error_text: str | None = None
        self._programs = 0  # gate programs still to run
        # A call of parts: the data placed so far, by device, served instead
        # of a gate (until the call ends).
        self._early: dict[Any, jax.Array] = {}

    def _move(self, to: LendingState) -> None:  # lock held
        """The one change of the loan's state: refuses a move not in
        :data:`LENDING_MOVES`."""
        if (self._state, to) not in LENDING_MOVES:
            raise concurrent.futures.InvalidStateError(
                f"a call's gates cannot move from {self._state} to {to}"
            )
        self._state = to

    @property
    def state(self) -> LendingState:
        return self._state

    @property
    def host(self) -> Any:
        """What the gate programs copy (``None`` before the call returns)."""
        return self._host

    def add_program(
        self, task: Any, device: Any, lender: Lender
    ) -> tuple[bool, jax.Array] | None:
        """Counts a gate program on ``device`` that will read ``task`` (the
        call): see :meth:`.call.Call.add_program`."""
        with self._lock:
            if self._state != LendingState.OPEN:
                return None
            shard = self._early.get(device)
            if shard is not None:
                return False, shard
            if not self._slot:
                self._slot, self._lender = lender.lend_slot(task), lender
            gate = self._gates.get(device)
            if gate is None:
                gate = self._gates[device] = lender.pull(device)
            self._programs += 1
            return True, gate.array

    def program_ran(self) -> None:
        """A gate program counted by :meth:`add_program` ran (or never will)."""
        with self._lock:
            self._programs -= 1
        self.give_back()

    def give_back(self) -> None:
        """Gives the slot back once closed and no gate program is left."""
        with self._lock:
            if self._programs or self._state != LendingState.CLOSED or not self._slot:
                return
            self._move(LendingState.GIVEN_BACK)
            slot, lender = self._slot, self._lender
            self._slot, self._lender, self._host = 0, None, None
        assert lender is not None
        lender.give_back_slot(slot)

    def close(self) -> dict[Any, Gate]:
        """The call ended: no gate is added any more; takes every gate, to open
        (:meth:`open`), and drops the parts' early data."""
        with self._lock:
            self._move(LendingState.CLOSED)
            gates, self._gates = self._gates, {}
            self._early = {}
            return gates

    def land(self, devices: list[Any], placed: list[jax.Array]) -> dict[Any, Gate]:
        """A part's data, placed on ``devices`` (one array each): served to
        later dispatches; returns the gates of those devices, to open (their
        programs copy a host view)."""
        with self._lock:
            self._early.update(zip(devices, placed, strict=True))
            released = {d: self._gates.pop(d) for d in devices if d in self._gates}
            if released:  # what the gate programs copy (a view on CPU)
                self._host = self._host or {}
                self._host.update((d, np.asarray(self._early[d])) for d in released)
            return released

    def take_early(self) -> dict[Any, jax.Array]:
        """The parts' placed data, by device (the last part landed)."""
        with self._lock:
            early, self._early = self._early, {}
            return early

    def open(
        self, gates: dict[Any, Gate], host: Callable[[], Any] | None = None
    ) -> None:
        """Opens ``gates`` (with the call's data or error set); the programs
        then copy the data or raise the error.

        ``host()``: what the programs copy (by leaf), made only if there are
        gates: a host copy of a device array costs a transfer that nothing
        else needs.
        """
        if gates and host is not None:
            data = host()
            with self._lock:
                self._host = data
        while gates:  # dropped as opened, before the result is set
            device, gate = gates.popitem()
            try:
                gate.open(self._slot)
            except Exception:  # its programs never run: say so, open the rest
                logger.exception("jax_threadmap: could not open the gate on %s", device)
            del gate
        self.give_back()

    def gate_data(self, leaf: int, where: tuple, device: Any, by_device: bool) -> Any:
        """What the gate program of ``device`` copies; ``None``: the call failed."""
        host = self._host
        if host is None:
            return None
        if by_device:  # one leaf, laid out as the call's parts
            return host.get(device)
        return host[leaf][index_of(where)]

    def set_error_text(self, text: str) -> None:
        """What the programs that depend on the call are told (it failed)."""
        with self._lock:
            self._error_text = text

    @property
    def error_text(self) -> str | None:
        return self._error_text
