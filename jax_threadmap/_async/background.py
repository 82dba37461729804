"""Background calls: the :class:`Task` behind every ``AsyncArray``.

:class:`Task` is one call of ``fn`` (or one wrapped ``Future``) and its outcome,
shared by every array of its result, and the one owner of the call's state:
each change of it is one of its methods, under its lock (the table in its
docstring); no other module reads or writes its fields. A plain ``fn`` runs on
the async pool (:mod:`.pool`), an ``async def`` one on the event loop
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

from .._support import event_loop as _event_loop
from .._support import fork as _fork
from .._support.errors import KeptError
from .._support.validate import callable_name
from . import outcomes as _outcomes
from . import pool as _async_threads
from .leaves import (
    LeafSpec,
    check_call,
    check_future,
    check_result,
    describe_error,
    host_view,
    index_of,
    place,
)
from .pool import worker_state

logger = logging.getLogger("jax_threadmap._async")

PENDING, RUNNING, FINISHING, FINISHED = "pending", "running", "finishing", "finished"

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


class Task:
    """One call of ``fn`` (or one wrapped Future) and its shared outcome.

    The one owner of the call's state: each transition is a method, under
    ``_lock``. States: ``pending`` (not started; a ``deferred_call`` not yet
    submitted), ``running``, ``finishing`` (its outcome is being set: values
    placed, or the error kept; no gate is added any more) and ``finished``
    (landed or failed). Timed out, cancelled and abandoned calls are failed
    calls whose error says so; a call given up on drops what ``fn`` returns
    later.

    ==========  =========================  =========  ==============================
    state       event (method)             next       taken (+), given back (-)
    ==========  =========================  =========  ==============================
    pending     submit                     pending    + queue entry or loop task,
                                                      + deadline, + live entry
    pending     claim (run, _run_corout.)  running    + pool slot (its thread)
    pend., run  add_program (a dispatch)   same       + gate program, + slot (first)
    running     fn returns (_land)         finishing  - pool slot; gates open: data
    running     fn raises (_fail)          finishing  - pool slot; gates open: error
    pend., run  give_up (timeout, cancel)  finishing  - pool slot (abandon), - loop
                                                      task (cancel); gates: error
    pend., run  abandon (at exit)          finishing  gates open: error
    finishing   _publish, or failed (_end) finished   - live entry
    any         program_ran                same       - gate program
    ended       no program left            same       - slot, - host data
    ended       fn returns or raises late  same       nothing (dropped)
    ==========  =========================  =========  ==============================

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
    """

    # Named in one string: a thousand calls in flight, each without a __dict__.
    __slots__ = tuple(
        "_lock _state _submitted _clock _pid _fn _args _kwargs name api treedef "
        "specs future runnable _kept _slot _lender _gates _host _error_text "
        "_programs timeout _worker coroutine _source _donated _value "
        "__weakref__".split()
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
        # gates by device, the data the gate programs copy (NumPy), the error
        # text they raise, and how many gate programs are still to run.
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
        self._worker: _async_threads.Worker | None = None
        # Whether fn runs on the event loop; its asyncio task while it runs
        # there (cancelled if the call is given up on).
        self.coroutine = _event_loop.is_coroutine_function(fn)
        self._source: asyncio.Task | None = None
        # The leaves donated to a jitted call (donate_argnums): later uses fail.
        self._donated: frozenset[int] = frozenset()

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
        with _async_threads.live_lock:
            _async_threads.live.add(task)
        return task

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

    # -- what the dispatch mechanism asks (a sharded load answers otherwise) --

    def serves(self, sharding: Any, shape: tuple[int, ...]) -> bool:
        """Whether gate programs can hand this call's data laid out by ``sharding``."""
        del sharding, shape
        return True

    def ready_shard(self, device: Any) -> jax.Array | None:
        """The shard of ``device``, placed before the call's end (lock held)."""
        del device
        return None

    def gate_data(self, leaf: int, where: tuple, device: Any) -> Any:
        """What the gate program of ``device`` copies; ``None``: the call failed."""
        del device
        host = self._host
        return None if host is None else host[leaf][index_of(where)]

    def failure_text(self) -> str:
        """The error the gate programs raise (once the call failed)."""
        return self._error_text or f"{self.name} ({self.api}) failed"

    def add_program(self, device: Any, lender: Lender) -> tuple[bool, jax.Array] | None:
        """Counts a gate program on ``device`` that will read this call.

        Returns ``(True, gate)``: the program's input, opened at the call's end
        (or when a sharded load's shard for ``device`` lands); ``(False,
        shard)``: the shard is placed already (no program is counted);
        ``None``: the call is ending (its value is waited for instead).
        """
        with self._lock:
            if self._state not in (PENDING, RUNNING):
                return None
            shard = self.ready_shard(device)
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

    def _open(self, gates: dict[Any, Gate]) -> None:
        """Opens ``gates``, taken from the call under its lock (with its data or
        error set); the programs then copy the data or raise the error."""
        while gates:  # dropped as opened, before the result is set (see _shard_loads)
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
        _async_threads.deadlines().add(self, self.timeout)

    def submit(self) -> None:
        """Queues the call on the pool or loop (once); its timeout counts from now."""
        with self._lock:
            if not self.runnable or self._submitted or self._state != PENDING:
                return
            self._submitted = True
        with _async_threads.live_lock:
            _async_threads.live.add(self)
        self._start_clock()
        if self.coroutine:
            _event_loop.event_loop().submit(self._run_coroutine, self.name)
        else:
            _async_threads.pool().submit(self)

    def _claim(
        self, worker: _async_threads.Worker | None, source: asyncio.Task | None = None
    ) -> bool:
        with self._lock:
            if self._state != PENDING:
                return False
            pid = os.getpid()
            # submit() did the two below, unless in the parent of this fork.
            known = self._submitted and self._pid == pid
            self._state = RUNNING
            self._pid = pid
            self._worker = worker
            self._source = source
        if not known:
            with _async_threads.live_lock:
                _async_threads.live.add(self)
            self._start_clock()
        return True

    def _left_runner(self) -> None:
        """``fn`` returned or raised: its thread or coroutine is no longer ours."""
        with self._lock:
            self._worker = self._source = None

    def run(self, worker: _async_threads.Worker | None = None) -> None:
        """Runs the call here, unless it has already started (or ended).

        A coroutine call is submitted to the event loop instead: there is no
        bounded pool to get around.
        """
        if self.coroutine:
            self.submit()
            return
        if not self.runnable or not self._claim(worker):
            return
        fn, args, kwargs = self._fn, self._args, self._kwargs
        # The arguments may be large (raw bytes, file handles): do not keep them.
        self._fn = self._args = self._kwargs = None
        assert fn is not None  # runnable
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:  # routed to every use, like a Future does
            self._left_runner()
            self._fail(e, raised_by_fn=True)
            return
        self._left_runner()
        if inspect.isawaitable(out):  # e.g. a lambda that calls an async def
            awaited = functools.partial(self._run_coroutine, out)
            _event_loop.event_loop().submit(awaited, self.name)
            return
        self._finish(out)

    async def _run_coroutine(self, awaitable: Any = None) -> None:
        """Runs the call on the event loop: ``fn``'s coroutine, or ``awaitable``.

        Claimed here, on the loop, before ``fn`` is called: asyncio would run a
        task cancelled before its first step up to its first ``await``.
        """
        source = asyncio.current_task()
        if awaitable is not None and not self._adopt(source):
            _event_loop.close_awaitable(awaitable)  # given up on while on its way here
            return
        if awaitable is None and not self._claim(None, source):
            return
        call = (self._fn, self._args, self._kwargs)
        self._fn = self._args = self._kwargs = None
        try:
            out = _event_loop.call(*call) if awaitable is None else awaitable
            while inspect.isawaitable(out):
                out = await out
        except BaseException as e:  # our cancel included: then dropped by _fail
            self._left_runner()
            self._fail(e, raised_by_fn=True)
            return
        self._left_runner()
        # Landed with the other loads whose fn returns in this turn of the
        # loop, one turn later (:meth:`_land_all`).
        if not _returned:
            asyncio.get_running_loop().call_soon(Task._land_all)
        _returned.append((self, out))

    @staticmethod
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
        checked = [(task, task._check(out)) for task, out in batch]
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

    def _adopt(self, source: asyncio.Task | None) -> bool:
        with self._lock:
            if self._state != RUNNING:
                return False
            self._source = source
            return True

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
        """Gives up on the call because its timeout has passed."""
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
            _async_threads.pool().abandon(worker, self)
        if source is not None:
            _event_loop.event_loop().cancel(source)
        self._conclude(error, gates, raised_by_fn=False, names_call=True)
        return True

    def _close(self, host: Any = None) -> dict[Any, Gate]:  # lock held
        """Ends the time in which gates are added; takes them (and keeps
        ``host``, what their programs copy, if there are any)."""
        self._state = FINISHING
        gates, self._gates = self._gates, {}
        if gates and host is not None:
            self._host = host
        return gates

    def _settle(self, host: Any = None) -> dict[Any, Gate] | None:
        """:meth:`_close` for a running call; ``None`` if it was given up on."""
        with self._lock:
            return None if self._state != RUNNING else self._close(host)

    def _finish(self, out: Any) -> None:
        leaves = self._land(out)
        if leaves is not None and self._ready(leaves):
            self._publish(leaves)

    def _land(self, out: Any) -> list[jax.Array] | None:
        """Checks and places what ``fn`` returned, and opens the gates; the
        placed leaves (their copies to device may still run), or ``None`` if
        the call failed or was given up on."""
        checked = self._check(out)
        return None if checked is None else self._place(*checked)

    def _check(self, out: Any) -> tuple[list[Any], dict[Any, Gate]] | None:
        """Checks what ``fn`` returned and settles the call (running ->
        finishing): its frozen leaves and the gates to open, or ``None`` if
        the call failed or was given up on."""
        try:
            # Checked and copied now: a loader that refills the buffer it
            # returned (for its next call) changes nothing here.
            frozen = check_result(self, out)
            # The gate programs copy from these, once their gate opens.
            host = [host_view(leaf) for leaf in frozen]
        except BaseException as e:
            self._fail(e, raised_by_fn=False)
            return None
        gates = self._settle(host)
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
            self._open(gates)  # empties it: the error below opens nothing
            return place(self, frozen)
        except BaseException as e:
            self._conclude(e, gates, raised_by_fn=False)
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

    def _publish(self, leaves: list[jax.Array]) -> None:
        """The placed leaves become the call's value (finishing -> finished)."""
        try:
            self._end()
        finally:  # set even if giving back the slot failed: no use waits for good
            self.future.set_result(leaves)
            self._value = leaves  # after: value() never answers before done()

    def _fail(self, error: BaseException, *, raised_by_fn: bool) -> None:
        gates = self._settle()
        if gates is None:
            logger.debug("%s of %s failed after it was given up on", self.api, self)
            return
        self._conclude(error, gates, raised_by_fn=raised_by_fn)

    def _end(self) -> None:
        with self._lock:
            self._state = FINISHED
        with _async_threads.live_lock:
            _async_threads.live.discard(self)
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
        """Sets the call's error: every use raises it, every gate program too.

        ``gates``: those taken at the end and not opened yet. ``names_call``:
        the error is one of this module's, whose message already names the
        call (a timeout, a cancel); it is then not named twice. ``part``: the
        part of the call that failed (a shard), for the messages.
        """
        if raised_by_fn:
            n = len(self.specs)
            _outcomes.note_on(error, self.name, self.api, self.runnable, n, part)
        self._kept = KeptError(error)
        if gates:  # the gate programs did not get the data
            self._fail_gates(
                gates,
                _outcomes.gate_text(
                    error,
                    self.name,
                    self.api,
                    self.runnable,
                    names_call=names_call,
                    part=part,
                ),
            )
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
