"""Background calls: the :class:`Task` behind every ``AsyncArray``.

:class:`Task` is one call of ``fn`` (or one wrapped ``Future``) and its outcome,
shared by every array of its result, and the one owner of the call's state:
each change of it is one of its methods, under its lock, through one method
that refuses a move not in its table (:meth:`Task._move`, the tables in its
docstring); no other module reads or writes its fields, and a subclass (a
sharded load, :mod:`.shard_loads`, whose :class:`Part` s are the call's too)
changes what the call does through override points only. A plain ``fn`` runs on
the async pool (:mod:`.async_pool`), an ``async def`` one on the event loop
(:mod:`.._support.event_loop`); a thread that needs a value whose call has not started
runs it itself (:meth:`Task.wait`), so a full pool cannot deadlock. The dispatch
mechanism lends a call a slot and gates (:class:`Lender`,
:meth:`Task.add_program`) and reports its programs' ends
(:meth:`Task.program_ran`); the task opens the gates and gives the slot back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from .._support import event_loop as _event_loop
from .._support import fork as _fork
from .._support.errors import KeptError
from .._support.validate import callable_name
from . import async_pool as _async_pool
from . import outcomes as _outcomes
from .async_pool import worker_state
from .leaves import (
    LeafSpec,
    check_call,
    check_future,
    check_result,
    describe_error,
    host_view,
    place,
)
from .shards import index_of

logger = logging.getLogger("jax_threadmap._async")

#: The ``async def`` calls whose fn returned in this turn of the event loop,
#: with what it returned, until :meth:`Task._land_all` lands them; touched on
#: the loop's thread only.
_returned: list[tuple[Task, Any]] = []


# --- what the dispatch mechanism lends a call -----------------------------------------


class Gate(Protocol):
    """The input of a call's gate programs on one device, until it is opened."""

    @property
    def array(self) -> jax.Array:
        """What the gate programs take as input (pending until :meth:`open`)."""

    def open(self, slot: int) -> None:
        """Lets the gate programs run; they find the call by ``slot``."""


class Lender(Protocol):
    """What the dispatch mechanism lends a call: its slot id, and its gates."""

    def lend_slot(self, task: Task) -> int:
        """A slot id (> 0) by which gate programs find ``task``."""

    def give_back_slot(self, slot: int) -> None:
        """No gate program reads the call of ``slot`` any more."""

    def pull(self, device: Any) -> Gate:
        """A new gate on ``device``."""


# --- one call, shared by the arrays of its result -------------------------------------

PENDING, RUNNING, FINISHING, FINISHED = "pending", "running", "finishing", "finished"
#: A part's states besides pending and running: its data placed, or stopped (the
#: call ended first).
PLACED, STOPPED = "placed", "stopped"

#: The moves of a call's state, and of a part's (:meth:`Task._move`); any other
#: is a bug, refused with ``InvalidStateError`` as ``concurrent.futures.Future``
#: refuses one.
CALL_MOVES = frozenset(
    {
        (PENDING, RUNNING),  # claimed
        (PENDING, FINISHING),  # given up on, or abandoned, before it started
        (RUNNING, FINISHING),  # returned, raised, given up on, abandoned
        (FINISHING, FINISHED),  # published, or its error set
    }
)
PART_MOVES = frozenset(
    {
        (PENDING, RUNNING),  # claimed
        (PENDING, STOPPED),  # the call ended before it started
        (RUNNING, PLACED),  # landed
        (RUNNING, STOPPED),  # failed, or the call ended first
    }
)


class Part:
    """A piece of a call that runs on its own and lands before the call ends
    (a sharded load's shard): its own fetch, the devices its data goes to.

    Its ``state``, ``worker`` and ``source`` are the call's: changed only by
    :class:`Task`'s methods, under the call's lock. A call of the async pool
    (``name``, :meth:`run`, :meth:`time_out`).
    """

    __slots__ = ("task", "name", "devices", "what", "state", "worker", "source")

    def __init__(self, task: Task, devices: list[Any], what: str) -> None:
        self.task = task
        self.name = task.name  # shown in the name of the thread that runs it
        self.devices = devices
        #: Names the part in errors: "the shard at index [0:2] (devices 0, 1)".
        self.what = what
        self.state = PENDING
        self.worker: _async_pool.Worker | None = None
        self.source: asyncio.Task | None = None

    def run(self, worker: _async_pool.Worker | None = None) -> None:
        self.task._run(self, worker)

    def time_out(self) -> None:  # the call's timeout covers its parts
        pass

    def __str__(self) -> str:
        return f"{self.task.name} ({self.task.api}, {self.what})"


class Task:
    """One call of ``fn`` (or one wrapped Future) and its shared outcome.

    The one owner of the call's state: each change is a method here, under
    ``_lock``, and goes through :meth:`_move`, which refuses a move that is not
    in :data:`CALL_MOVES` (or :data:`PART_MOVES`). States: ``pending`` (not
    started; a ``deferred_call`` not yet submitted), ``running``, ``finishing``
    (its outcome is being set: values placed, or the error kept; no gate is
    added any more) and ``finished`` (landed or failed). Timed out, cancelled
    and abandoned calls are failed calls whose error says so; a call given up
    on drops what ``fn`` returns later.

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
                                                               process (a waiter
                                                               runs a deferred
                                                               call): + live entry,
                                                               + deadline
    pending, running    add_program (a dispatch)    same       + gate program,
                                                               + slot (the first)
    running             fn returns (_accept)        finishing  gates open: data
    running             fn raises (_fail)           finishing  gates open: error
    pending, running    give_up (timeout, cancel)   finishing  - pool slot (abandon),
                                                               - loop task (cancel);
                                                               gates open: error
    pending, running    abandon (at exit)           finishing  gates open: error
    finishing           _publish, _conclude (_end)  finished   - live entry
    finishing,finished  its thread leaves run       same       - pool slot (once
                                                               placed and published;
                                                               at give_up if given
                                                               up on)
    any                 program_ran                 same       - gate program
    finishing,finished  no gate program left        same       - slot, - host data
    finishing,finished  fn returns or raises late   same       nothing (dropped)
    ==================  ==========================  =========  =====================

    A call of :class:`Part` s (a sharded load) runs each part on its own, and
    is running from its first part's claim; each part moves so:

    ==================  ==========================  =========  =====================
    part                event (method)              next       taken (+), given
                                                               back (-)
    ==================  ==========================  =========  =====================
    pending             claim (_claim)              running    + pool slot or loop
                                                               task
    running             lands (_land_part)          placed     its devices' gates
                                                               open: its data; the
                                                               last: the call is
                                                               settled
    running             fails (_part_failed)        stopped    the call fails
    pending, running    the call ends (_stop_parts) stopped    - pool slot (abandon),
                                                               - loop task (cancel)
    ==================  ==========================  =========  =====================

    A dispatch after a part has landed gets its placed data for those devices,
    not a gate.

    An ``async def`` call whose fn returned is landed (checked, placed, its
    gates opened) one turn of the event loop later, together with every other
    call whose fn returned in that turn (:meth:`_land_all`), and published
    once all of them are placed and their copies done: a thread waiting for
    them wakes once per burst, not once each. Until then it is ``running``.

    Gates are added only while pending or running; the end takes (under the
    lock) and opens every gate there is: each opens once, none is missed. The
    slot is given back in one place (:meth:`_give_back_slot`), by the later of
    the call's end and its last gate program. In a forked child, a call that
    ran at the fork fails at its first use (:meth:`wait`).

    Subclasses change what a call does, never its fields, through these
    override points: :meth:`_start` (what ``submit`` queues), :meth:`_work`
    (what runs for the call or a part), :meth:`_accept` (what ``fn`` returned,
    landed: by default checked, then placed by :meth:`_place` and published
    once its copies are done; a call whose ``fn`` returns placed arrays
    publishes them at once with :meth:`_publish_placed`), :meth:`_part_returned`
    and :meth:`_all_parts_landed` (a call of parts), :meth:`serves` and
    :meth:`time_out`. They end a call with :meth:`_fail`, :meth:`_conclude` or
    :meth:`_publish`, and land a part with :meth:`_land_part`.
    """

    #: Whether its arrays stand for the ``jax.Array`` s of a jitted call (so
    #: ``str()`` prints their values, as a ``jax.Array``'s does).
    stands_for_an_array = False

    # Named in one string: a thousand calls in flight, each without a __dict__.
    __slots__ = tuple(
        "_lock _state _submitted _clock _pid _fn _args _kwargs name api treedef "
        "specs future runnable _kept _slot _lender _gates _host _error_text "
        "_programs timeout _worker coroutine _source _donated _value _parts "
        "_left _early __weakref__".split()
    )

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        args: Any,
        kwargs: Any,
        *,
        name: str,
        api: str,
        treedef: Any,
        specs: list[LeafSpec],
        timeout: float | None = None,
    ):
        self._lock = threading.Lock()
        self._state = PENDING
        self._submitted = False
        self._clock = False  # whether the timeout's clock runs
        self._pid = os.getpid()
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self.name = name
        self.api = api
        self.treedef = treedef
        self.specs: list[LeafSpec] = specs
        # Holds the list of placed leaves, or the exception of the call.
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        # The same list, once the future holds it: read without a lock.
        self._value: list[jax.Array] | None = None
        # False for a wrapped Future: there is nothing to run, only to wait for.
        self.runnable = fn is not None
        self._kept: KeptError | None = None  # the error, raised by every use
        # Async dispatch: the slot the gates carry (0: none) and its lender, the
        # gates by device, the data the gate programs copy (NumPy: by leaf, or
        # by device for a call of parts), the error text they raise, and how
        # many gate programs are still to run.
        self._slot = 0
        self._lender: Lender | None = None
        self._gates: dict[Any, Gate] = {}
        self._host: Any = None
        self._error_text: str | None = None
        self._programs = 0
        # Seconds from the call (or first use) before it is given up on.
        self.timeout = timeout
        # The pool thread running fn, while it runs (it leaves the bound if the
        # call is given up on).
        self._worker: _async_pool.Worker | None = None
        # Whether fn runs on the event loop; its asyncio task while it runs
        # there (cancelled if the call is given up on).
        self.coroutine = _event_loop.is_coroutine_function(fn)
        self._source: asyncio.Task | None = None
        # The leaves donated to a jitted call (donate_argnums): later uses fail.
        self._donated: frozenset[int] = frozenset()
        # A call of parts (_set_parts): the parts, how many are still to land,
        # and the data placed so far, by device (until the call settles).
        self._parts: tuple[Part, ...] | None = None
        self._left = 0
        self._early: dict[Any, jax.Array] = {}

    @classmethod
    def for_call(
        cls,
        fn: Any,
        result_shape_dtypes: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        device: Any,
        api: str,
        timeout: Any,
    ) -> Task:
        """The task of ``api(fn, result_shape_dtypes, *args, **kwargs)``, checked."""
        treedef, specs, seconds = check_call(
            fn, result_shape_dtypes, device, api, timeout
        )
        name = f"`{callable_name(fn)}`"
        return cls(
            fn,
            args,
            kwargs,
            name=name,
            api=api,
            treedef=treedef,
            specs=specs,
            timeout=seconds,
        )

    @classmethod
    def for_future(cls, future: Any, result_shape_dtypes: Any, device: Any) -> Task:
        """The task that waits for ``future`` (``AsyncArray.from_future``), live."""
        api = "AsyncArray.from_future"
        treedef, specs = check_future(future, result_shape_dtypes, device)
        name = f"a {type(future).__name__} of the caller"
        task = cls(None, None, None, name=name, api=api, treedef=treedef, specs=specs)
        with _async_pool.live_lock:
            _async_pool.live.add(task)
        return task

    def _set_parts(self, parts: list[Part]) -> None:
        """Makes this a call of ``parts`` (once, before it is submitted)."""
        with self._lock:
            if self._parts is not None or self._state != PENDING or self._submitted:
                raise concurrent.futures.InvalidStateError(
                    f"{self}: parts are set once, before the call starts"
                )
            self._parts = tuple(parts)
            self._left = len(parts)

    @property
    def parts(self) -> tuple[Part, ...]:
        """The call's parts (none for a call without parts)."""
        return self._parts or ()

    @property
    def returned(self) -> bool:
        """Whether ``fn`` returned and its values are being placed."""
        return self._state == FINISHING

    @property
    def deferred(self) -> bool:
        """Whether nothing has asked for the call yet (a ``deferred_call``)."""
        return self._state == PENDING and self.runnable and not self._submitted

    @property
    def host(self) -> Any:
        """What the gate programs copy (``None`` before the call returns)."""
        return self._host

    def status(self) -> str:
        """``done``, ``failed: <error>``, ``deferred`` or ``pending``; never blocks."""
        if self.future.done():
            error = self.future.exception()
            return "done" if error is None else f"failed: {describe_error(error)}"
        return "deferred" if self.deferred else "pending"

    def _move(self, to: str, part: Part | None = None) -> None:  # lock held
        """The one change of the call's state (or of ``part``'s): refuses a move
        that is not in :data:`CALL_MOVES` (:data:`PART_MOVES`)."""
        now = self._state if part is None else part.state
        if (now, to) not in (CALL_MOVES if part is None else PART_MOVES):
            what = "the call" if part is None else part.what
            raise concurrent.futures.InvalidStateError(
                f"{self}: {what} cannot move from {now} to {to}"
            )
        if part is None:
            self._state = to
        else:
            part.state = to

    # -- what the dispatch mechanism asks --

    def serves(self, sharding: Any, shape: tuple[int, ...]) -> bool:
        """Whether gate programs can hand this call's data laid out by ``sharding``.

        Override point: a call of parts serves only its own layout.
        """
        del sharding, shape
        return True

    def gate_data(self, leaf: int, where: tuple, device: Any) -> Any:
        """What the gate program of ``device`` copies; ``None``: the call failed."""
        host = self._host
        if host is None:
            return None
        if self._parts is not None:  # one leaf, laid out as its parts (serves)
            return host.get(device)
        return host[leaf][index_of(where)]

    def failure_text(self) -> str:
        """The error the programs dispatched on the call's arrays raise (once the
        call failed): its gate programs, or the deferred programs behind it."""
        return self._error_text or f"{self.name} ({self.api}) failed"

    def add_program(self, device: Any, lender: Lender) -> tuple[bool, jax.Array] | None:
        """Counts a gate program on ``device`` that will read this call.

        Returns ``(True, gate)``: the program's input, opened at the call's end
        (or when the part of a call of parts for ``device`` lands); ``(False,
        shard)``: that part is placed already (no program is counted); ``None``:
        the call is ending (its value is waited for instead).
        """
        with self._lock:
            if self._state not in (PENDING, RUNNING):
                return None
            shard = self._early.get(device)
            if shard is not None:
                return False, shard
            if not self._slot:
                self._slot, self._lender = lender.lend_slot(self), lender
            gate = self._gates.get(device)
            if gate is None:
                gate = self._gates[device] = lender.pull(device)
            self._programs += 1
            return True, gate.array

    def program_ran(self) -> None:
        """A gate program counted by :meth:`add_program` ran (or never will)."""
        with self._lock:
            self._programs -= 1
        self._give_back_slot()

    def _give_back_slot(self) -> None:
        """Gives the slot back once the call ended and no gate program is left."""
        with self._lock:
            if self._programs or self._state in (PENDING, RUNNING) or not self._slot:
                return
            slot, lender = self._slot, self._lender
            self._slot, self._lender, self._host = 0, None, None
        assert lender is not None
        lender.give_back_slot(slot)

    def _open(
        self, gates: dict[Any, Gate], host: Callable[[], Any] | None = None
    ) -> None:
        """Opens ``gates``, taken from the call under its lock (with its data or
        error set); the programs then copy the data or raise the error.

        ``host()``: what the programs copy (by leaf), made only if there are
        gates: a host copy of a device array costs a transfer that nothing
        else needs.
        """
        if gates and host is not None:
            data = host()
            with self._lock:
                self._host = data
        while gates:  # dropped as opened, before the result is set (see _land_part)
            device, gate = gates.popitem()
            try:
                gate.open(self._slot)
            except Exception:  # its programs never run: say so, open the rest
                logger.exception("jax_threadmap: could not open the gate on %s", device)
            del gate
        self._give_back_slot()

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
            if not self.runnable or self._submitted or self._state != PENDING:
                return
            self._submitted = True
        with _async_pool.live_lock:
            _async_pool.live.add(self)
        self._start_clock()
        self._start()

    def _start(self) -> None:
        """Queues the call's work, at :meth:`submit` (once). Override point.

        A call of parts starts every part not started yet (one with no parts
        settles at once), a coroutine call runs on the event loop, any other
        on the pool.
        """
        if self._parts is not None:
            if not self._parts and self._claim(None):
                gates = self._settle()
                if gates is not None:
                    self._all_parts_landed({}, gates)
            for part in self._parts:
                if part.state != PENDING:  # a hint: _claim decides
                    continue
                if self.coroutine:
                    coroutine = functools.partial(self._run_coroutine, part)
                    _event_loop.event_loop().submit(coroutine, self.name)
                else:
                    _async_pool.pool().submit(part)
        elif self.coroutine:
            _event_loop.event_loop().submit(self._run_coroutine, self.name)
        else:
            _async_pool.pool().submit(self)

    def _claim(
        self,
        worker: _async_pool.Worker | None,
        source: asyncio.Task | None = None,
        part: Part | None = None,
    ) -> bool:
        """Claims the call (pending -> running) for this thread or coroutine, or
        one of its parts (the call too, with the first); ``False``: already
        claimed, or ended."""
        pid = os.getpid()
        with self._lock:
            if part is None and self._state != PENDING:
                return False
            if part is not None:
                if self._state not in (PENDING, RUNNING) or part.state != PENDING:
                    return False
                if self._state == RUNNING and self._pid != pid:
                    return False  # running in the parent of this fork: never ends here
                self._move(RUNNING, part)
                part.worker, part.source = worker, source
            # submit() did the two below, unless in the parent of this fork.
            known = self._submitted and self._pid == pid
            if self._state == PENDING:
                self._move(RUNNING)
            if part is None:
                self._worker, self._source = worker, source
            self._pid = pid
        if not known:
            with _async_pool.live_lock:
                _async_pool.live.add(self)
            self._start_clock()
        return True

    def _left_runner(self, part: Part | None) -> None:
        """``fn`` returned or raised: its thread or coroutine is no longer ours."""
        with self._lock:
            if part is None:
                self._worker = self._source = None
            else:
                part.worker = part.source = None

    def _adopt(self, source: asyncio.Task | None, part: Part | None) -> bool:
        """The coroutine that awaits what the call's thread returned."""
        with self._lock:
            if (self._state if part is None else part.state) != RUNNING:
                return False
            if part is None:
                self._source = source
            else:
                part.source = source
            return True

    def run(self, worker: _async_pool.Worker | None = None) -> None:
        """Runs the call here, unless it has already started (or ended).

        A coroutine call is submitted to the event loop instead: there is no
        bounded pool to get around. A call of parts starts them all, and runs
        here those not started yet (a waiting thread helps).
        """
        if self._parts is not None:
            self.submit()
            if not self.coroutine:
                for part in self._parts:
                    self._run(part, None)
        elif self.coroutine:
            self.submit()
        elif self.runnable:
            self._run(None, worker)

    def _work(self, part: Part | None) -> Any:
        """Calls what computes the call (or ``part``); returns what it returned.
        Override point (a call of parts fetches each)."""
        del part
        fn, args, kwargs = self._fn, self._args, self._kwargs
        # The arguments may be large (raw bytes, file handles): do not keep them.
        self._fn = self._args = self._kwargs = None
        return _event_loop.call(fn, args, kwargs)

    def _run(self, part: Part | None, worker: _async_pool.Worker | None) -> None:
        """Runs the call (or ``part``) here, in a thread, once claimed."""
        if not self._claim(worker, None, part):
            return
        try:
            out = self._work(part)
        except BaseException as e:  # routed to every use, like a Future does
            self._left_runner(part)
            self._raised(part, e)
            return
        self._left_runner(part)
        if inspect.isawaitable(out):  # e.g. a lambda that calls an async def
            awaited = functools.partial(self._run_coroutine, part, out)
            _event_loop.event_loop().submit(awaited, self.name)
            return
        self._returned(part, out)

    async def _run_coroutine(
        self, part: Part | None = None, awaitable: Any = None
    ) -> None:
        """Runs the call (or ``part``) on the event loop: its coroutine, or
        ``awaitable`` (what its thread returned).

        Claimed here, on the loop, before ``fn`` is called: asyncio would run a
        task cancelled before its first step up to its first ``await``.
        """
        source = asyncio.current_task()
        if awaitable is not None and not self._adopt(source, part):
            _event_loop.close_awaitable(awaitable)  # given up on while on its way here
            return
        if awaitable is None and not self._claim(None, source, part):
            return
        try:
            out = self._work(part) if awaitable is None else awaitable
            while inspect.isawaitable(out):
                out = await out
        except BaseException as e:  # our cancel included: then dropped by _fail
            self._left_runner(part)
            self._raised(part, e)
            return
        self._left_runner(part)
        if part is not None:
            self._returned(part, out)
            return
        # Landed with the other calls whose fn returns in this turn of the
        # loop, one turn later (:meth:`_land_all`).
        if not _returned:
            asyncio.get_running_loop().call_soon(Task._land_all)
        _returned.append((self, out))

    def _raised(self, part: Part | None, error: BaseException) -> None:
        if part is None:
            self._fail(error, raised_by_fn=True)
        else:
            self._part_failed(part, error)

    def _returned(self, part: Part | None, out: Any) -> None:
        if part is None:
            self._finish(out)
            return
        try:
            self._part_returned(part, out)
        except BaseException as e:  # whatever a landing raises ends the part
            self._part_failed(part, e)

    @staticmethod
    @_async_pool.landing
    def _land_all() -> None:
        """Lands the ``async def`` calls whose fn returned in the last turn of
        the event loop (on its thread): all are checked and placed before any
        is published, so that a thread waiting for them wakes once per burst,
        not once per load (each wake-up would cost the loop's thread the GIL
        at every placement), and the per-load steps run back to back."""
        batch = _returned.copy()
        _returned.clear()
        # Every check first, then every placement: each runs back to back
        # (measured: placements so run at several times the speed).
        checked = [(task, task._accept(out)) for task, out in batch]
        del batch
        landed = [(task, task._place(*c)) for task, c in checked if c is not None]
        placed = [(task, leaves) for task, leaves in landed if leaves is not None]
        del checked, landed
        try:  # one wait for every copy (they run meanwhile)
            jax.block_until_ready([leaves for _, leaves in placed])
        except BaseException:  # each call's own copies then say which failed
            placed = [(task, leaves) for task, leaves in placed if task._ready(leaves)]
        for task, leaves in placed:
            try:  # one call's end never keeps the rest of the burst running
                task._publish(leaves)
            except BaseException:  # noqa: BLE001 - logged; the value is set
                logger.exception("landing %s of %s", task.api, task)

    def on_source_done(self, source: concurrent.futures.Future) -> None:
        """Done-callback of a wrapped Future: checks and places its value."""
        if not self._claim(None):
            return
        try:
            out = source.result()
        except BaseException as e:
            self._fail(e, raised_by_fn=True)
            return
        self._finish(out)

    # -- the end: returned, raised, given up on, abandoned --

    def time_out(self) -> None:
        """Gives up on the call because its timeout has passed (override point:
        a call of parts names those still missing)."""
        cancels = self.coroutine or self._source is not None
        assert self.timeout is not None
        self.give_up(_outcomes.timed_out(self.name, self.api, self.timeout, cancels))

    def cancel(self) -> bool:
        """Gives up on the call (``CancelledError``) unless it has finished."""
        return self.give_up(_outcomes.cancelled(self.name, self.api, self.runnable))

    def give_up(self, error: BaseException) -> bool:
        """Fails the call with ``error`` (which names it) now, unless it has ended.

        The call's thread, if any, keeps running (Python cannot stop it) but
        leaves the pool's bound at once; what it returns or raises later is
        dropped. Returns whether the call was given up on.
        """
        with self._lock:
            if self._state not in (PENDING, RUNNING):
                return False
            gates = self._close()
            worker, source = self._worker, self._source
            self._worker = self._source = None
        if worker is not None:
            _async_pool.pool().abandon(worker, self)
        if source is not None:
            _event_loop.event_loop().cancel(source)
        self._conclude(error, gates, raised_by_fn=False, names_call=True)
        return True

    def _close(self) -> dict[Any, Gate]:  # lock held
        """Ends the time in which gates are added (-> finishing); takes them."""
        self._move(FINISHING)
        gates, self._gates = self._gates, {}
        return gates

    def _settle(self) -> dict[Any, Gate] | None:
        """:meth:`_close` for a running call; ``None`` if it was given up on."""
        with self._lock:
            return None if self._state != RUNNING else self._close()

    @_async_pool.landing
    def _finish(self, out: Any) -> None:
        """Lands what ``fn`` returned, in the thread it returned to."""
        accepted = self._accept(out)
        if accepted is None:
            return
        leaves = self._place(*accepted)
        if leaves is not None and self._ready(leaves):
            self._publish(leaves)

    def _accept(self, out: Any) -> tuple[list[Any], dict[Any, Gate]] | None:
        """Lands what ``fn`` returned, or starts to. Override point.

        By default: checks it and settles the call (running -> finishing);
        returns its frozen leaves and the gates to open, for :meth:`_place`,
        then :meth:`_ready` and :meth:`_publish` (for a burst of ``async def``
        calls, each step for every call of the burst in turn). ``None``:
        nothing more to do: the call failed or was given up on, or was landed
        here (a call whose ``fn`` returns placed arrays publishes them at once
        with :meth:`_publish_placed`).
        """
        try:
            # Checked and copied now: a loader that refills the buffer it
            # returned (for its next call) changes nothing here.
            frozen = check_result(self, out)
        except BaseException as e:
            self._fail(e, raised_by_fn=False)
            return None
        gates = self._settle()
        if gates is None:
            logger.debug("%s of %s returned after it was given up on", self.api, self)
            return None
        return frozen, gates

    def _place(
        self, frozen: list[Any], gates: dict[Any, Gate]
    ) -> list[jax.Array] | None:
        """Opens the settled call's gates and places its leaves (``None``: that
        failed, and the call with it)."""
        try:
            # The gate programs copy from these host arrays (made only if any).
            self._open(gates, lambda: [host_view(leaf) for leaf in frozen])
            return place(self, frozen)
        except BaseException as e:
            self._conclude(e, gates, raised_by_fn=False)  # _open emptied gates
            return None

    def _ready(self, leaves: list[jax.Array]) -> bool:
        """Waits until the copies of ``leaves`` to their devices are done
        (then ``done()`` means the data is there); ``False``: one failed, and
        the call with it (finishing -> finished)."""
        try:
            jax.block_until_ready(leaves)
        except BaseException as e:
            self._conclude(e, {}, raised_by_fn=False)
            return False
        return True

    def _publish_placed(self, leaves: list[jax.Array]) -> bool:
        """Settles a running call and publishes ``leaves``, placed already, at
        once (gate programs copy from them; nothing is checked, copied or
        waited for). ``False``: the call had been given up on."""
        gates = self._settle()
        if gates is None:
            logger.debug("%s of %s returned after it was given up on", self.api, self)
            return False
        try:
            self._open(gates, lambda: [host_view(leaf) for leaf in leaves])
        except BaseException as e:
            self._conclude(e, gates, raised_by_fn=False)
            return False
        self._publish(leaves)
        return True

    def _publish(self, leaves: list[jax.Array]) -> None:
        """The placed leaves become the call's value (finishing -> finished)."""
        try:
            self._end()
        finally:  # set even if giving back the slot failed: no use waits for good
            self.future.set_result(leaves)
            self._value = leaves  # after: value() never answers before done()

    def _fail(self, error: BaseException, *, raised_by_fn: bool) -> None:
        """Fails a running call with ``error`` (unless it was given up on);
        ``raised_by_fn``: ``error`` is the loader's own (it gets a note)."""
        gates = self._settle()
        if gates is None:
            logger.debug("%s of %s failed after it was given up on", self.api, self)
            return
        self._conclude(error, gates, raised_by_fn=raised_by_fn)

    def _end(self) -> None:
        with self._lock:
            self._move(FINISHED)
        with _async_pool.live_lock:
            _async_pool.live.discard(self)
        self._give_back_slot()

    def _conclude(
        self,
        error: BaseException,
        gates: dict[Any, Gate],
        *,
        raised_by_fn: bool,
        names_call: bool = False,
        part: str = "",
    ) -> None:
        """Sets the error of the finishing call: every use raises it, every gate
        program too.

        ``gates``: those taken at the end and not opened yet. ``names_call``:
        the error is one of this module's, whose message already names the
        call (a timeout, a cancel); it is then not named twice. ``part``: the
        part of the call that failed (a shard), for the messages.
        """
        self._stop_parts()  # first: the placed parts go before uses are told
        if raised_by_fn:
            n = len(self.specs)
            _outcomes.note_on(error, self.name, self.api, self.runnable, n, part)
        self._kept = KeptError(error)
        text = _outcomes.gate_text(
            error, self.name, self.api, self.runnable, names_call=names_call, part=part
        )
        with self._lock:  # what the programs that depend on the call are told
            self._error_text = text
        if gates:  # the gate programs did not get the data
            self._fail_gates(gates, text)
        self._end()
        self.future.set_exception(error)

    def _fail_gates(self, gates: dict[Any, Gate], text: str) -> None:
        with self._lock:
            self._error_text = text
        logger.warning(
            "jax_threadmap: the jitted programs dispatched with the arrays of "
            "%s (%s) raise this error when their results are used: %s",
            self.name,
            self.api,
            text,
        )
        try:
            self._open(gates)
        except Exception:  # the call's own uses must still get the error
            logger.exception("jax_threadmap: could not open the gates")

    def abandon(self) -> None:
        """At exit: fails the gates of a call that is still running."""
        with self._lock:
            if self._state not in (PENDING, RUNNING):
                return
            gates = self._close()
        if gates:
            text = _outcomes.exit_text(self.name, self.api, self.runnable)
            self._fail_gates(gates, text)

    # -- a call of parts --

    @_async_pool.landing
    def _part_returned(self, part: Part, out: Any) -> None:
        """Checks and places what ``part``'s fetch returned, then lands it
        (:meth:`_land_part`), or fails the call. Override point of a call of
        parts."""
        del out
        self._part_failed(part, NotImplementedError(f"{self}: no part landing"))

    def _land_part(self, part: Part, placed: list[jax.Array]) -> None:
        """``part``'s data, placed on its devices (one array each): opens their
        gates; the last part's landing settles the call
        (:meth:`_all_parts_landed`). Dropped if the call ended meanwhile.

        Takes ``placed``: the list is emptied, so that no caller's frame holds
        the arrays (see below).
        """
        with self._lock:
            if self._state != RUNNING or part.state != RUNNING:
                placed.clear()
                return  # the call ended meanwhile: dropped
            self._move(PLACED, part)
            self._early.update(zip(part.devices, placed, strict=True))
            placed.clear()
            gates = self._gates
            released = {d: gates.pop(d) for d in part.devices if d in gates}
            if released:  # what the gate programs copy (a view on CPU)
                self._host = self._host or {}
                self._host.update((d, np.asarray(self._early[d])) for d in released)
            self._left -= 1
            last = self._left == 0
            early, rest = ({}, {}) if not last else (self._early, self._close())
            if last:
                self._early = {}
        # Arrays are freed before the result is set, never after: a daemon
        # thread still in JAX's C++ when the interpreter exits aborts it.
        if released:
            self._open(released)
        del released
        if last:
            self._all_parts_landed(early, rest)

    def _all_parts_landed(self, placed: dict[Any, jax.Array], gates: dict) -> None:
        """Makes the value from every part's placed data (by device), and
        publishes it; ``gates``: any left (for the error). Override point of a
        call of parts: it takes ``placed`` (empties it before it publishes)."""
        placed.clear()
        self._conclude(
            NotImplementedError(f"{self}: no assembly"), gates, raised_by_fn=False
        )

    def _part_failed(
        self, part: Part, error: BaseException, ours: bool = False
    ) -> None:
        """``part`` failed with ``error``: the call fails, naming the part
        (``ours``: the error is this package's, naming the call)."""
        with self._lock:  # its own thread or coroutine is not stopped
            if part.state == RUNNING:
                self._move(STOPPED, part)
            part.worker = part.source = None
        gates = self._settle()
        if gates is None:
            logger.debug("%s: %s failed after the call ended", self, part.what)
            return
        self._conclude(
            error,
            gates,
            raised_by_fn=not ours,
            names_call=ours,
            part=part.what,
        )

    def _stop_parts(self) -> None:
        """Parts not placed never start, or leave the pool's bound, or are cancelled."""
        if self._parts is None:
            return
        with self._lock:
            stopping = [p for p in self._parts if p.state in (PENDING, RUNNING)]
            handles = [(p, p.worker, p.source) for p in stopping]
            for p in stopping:
                self._move(STOPPED, p)
            self._early = {}
        for part, worker, source in handles:
            if worker is not None:
                _async_pool.pool().abandon(worker, part)
            if source is not None:
                _event_loop.event_loop().cancel(source)

    def parts_not_placed(self) -> list[Part]:
        """The parts whose data has not landed (for a timeout's message)."""
        with self._lock:
            return [p for p in self.parts if p.state != PLACED]

    # -- uses --

    def donation_of(self, leaf: int) -> Callable[[], None]:
        """What to call when ``leaf`` is donated to a jitted call."""
        return functools.partial(self._mark_donated, leaf)

    def _mark_donated(self, leaf: int) -> None:
        with self._lock:
            self._donated = self._donated | {leaf}

    def value(
        self, leaf: int, timeout: float | None, describe: Callable[[], str]
    ) -> jax.Array:
        """The placed ``leaf``; raises the call's error, TimeoutError, or that
        the leaf was donated. ``describe()`` names the array, for the errors."""
        if leaf in self._donated:
            raise _outcomes.donated_error(describe())
        value = self._value  # the common case, cheaply: no lock
        if value is not None:
            return value[leaf]
        return self.wait(timeout, describe())[leaf]

    def wait(self, timeout: float | None, what: str) -> list[jax.Array]:
        """Returns the placed leaves; raises the call's error or TimeoutError."""
        if not self.future.done():
            if _event_loop.event_loop().in_loop_thread():
                raise _outcomes.in_loop_error(what)
            if timeout is None and (
                self.timeout is None or getattr(worker_state, "in_pool", False)
            ):
                # Run it here rather than wait on work queued behind busy (or
                # not yet started, or deferred) threads. No-op once started.
                # Not a call with a timeout (but in a pool thread, where it may
                # be what frees the pool): its timeout must hold for the caller.
                self.run()
            else:
                self.submit()
            if self._state != PENDING and self._pid != os.getpid():
                raise _outcomes.forked_error(what)
            if not _outcomes.wait_polling(self.future, timeout):
                assert timeout is not None
                raise _outcomes.not_ready_error(what, timeout)
        if self._kept is not None:
            self._kept.reraise()
        return self.future.result()

    def __str__(self) -> str:
        return f"{self.name} ({self.api})"


@_fork.in_child
def _after_fork_in_child() -> None:
    # Returned in the parent's loop, whose thread does not exist here: those
    # calls fail at their first use in the child (Task.wait). A landing left
    # here would keep the child's loop from ever scheduling one.
    _returned.clear()
