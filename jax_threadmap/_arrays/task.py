"""Background calls: :class:`Task`, the life of every ``AsyncArray``'s call.

:class:`Task` is one call of ``fn`` and its outcome, shared by every array of
its result: its state and what it holds in each (the one owner: each move one
of its methods, under its lock, refused if not in its table), what the call
runs, how what it returned lands (checked, placed, published), and the uses of
its value. No other module reads or writes a call's fields, and a subclass (a
sharded load and its shards, :mod:`.shard_loads`; a deferred program run,
:mod:`.dispatch`) changes what the call does through override points only. A
plain ``fn`` runs on the async pool (:mod:`.async_pool`), an ``async def`` one
on the event loop (:mod:`.._coroutines.event_loop`): :meth:`Task.run`,
:meth:`Task._run_on_loop`; a thread that needs a value whose call has not
started runs it itself (:meth:`Task.wait`), so a full pool cannot deadlock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import inspect
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax

from .._coroutines import event_loop as _event_loop
from .._support import fork as _fork
from .._support.errors import KeptError
from .._support.validate import callable_name, is_coroutine_function
from . import async_pool as _async_pool
from . import outcomes as _outcomes
from .async_pool import worker_state
from .leaves import (
    LeafSpec,
    check_call,
    check_result,
    describe_error,
    place,
)

logger = logging.getLogger("jax_threadmap._async")


class CallState(enum.Enum):
    """A call's states (the moves: :class:`Task`'s table)."""

    PENDING = "pending"
    RUNNING = "running"
    FINISHING = "finishing"
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


PENDING, RUNNING, FINISHING, FINISHED = CallState

#: The moves of a call's state (:meth:`Task._move`); any other is a bug, refused
#: with ``InvalidStateError`` as ``concurrent.futures.Future`` refuses one.
CALL_MOVES = frozenset(
    {
        (PENDING, RUNNING),  # claimed
        (PENDING, FINISHING),  # given up on, or abandoned, before it started
        (RUNNING, FINISHING),  # returned, raised, given up on, abandoned
        (FINISHING, FINISHED),  # published, or its error set
    }
)


class Outcome:
    """The outcome of a call, shared by every array of its result, and its uses.

    As a ``concurrent.futures.Future`` beside the work that sets it: set once,
    by the call's end (:meth:`Task._publish`, :meth:`Task._conclude`); read by
    every use, which may run the call here (:meth:`run`, the call's).
    """

    __slots__ = ("name", "api", "timeout", "future", "_value", "_kept", "_error_text")

    def __init__(self, name: str, api: str, timeout: float | None):
        self.name, self.api = name, api
        self.timeout = timeout  # seconds from the call before it is given up on
        # Holds the list of placed leaves, or the exception of the call.
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        # The same list, once the future holds it: read without a lock.
        self._value: list[jax.Array] | None = None
        self._kept: KeptError | None = None  # the error, raised by every use
        # What the programs deferred on its arrays raise, once it failed.
        self._error_text: str | None = None

    def run(self, worker: Any = None) -> None:
        """Runs the call here, unless it has already started (or ended)."""
        raise NotImplementedError

    def ran_elsewhere(self) -> bool:
        """Whether the call started in the parent of this forked child."""
        raise NotImplementedError

    def status(self) -> str:
        """``done``, ``failed: <error>`` or ``pending``; never blocks."""
        if self.future.done():
            error = self.future.exception()
            return "done" if error is None else f"failed: {describe_error(error)}"
        return "pending"

    def failure_text(self) -> str:
        """The error the programs deferred on the call's arrays raise (once the
        call failed)."""
        return self._error_text or f"{self.name} ({self.api}) failed"

    def value(
        self, leaf: int, timeout: float | None, describe: Callable[[], str]
    ) -> jax.Array:
        """The placed ``leaf``; raises the call's error or TimeoutError.
        ``describe()`` names the array, for the errors."""
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
                # not yet started) threads. No-op once started.
                # Not a call with a timeout (but in a pool thread, where it may
                # be what frees the pool): its timeout must hold for the caller.
                self.run()
            if self.ran_elsewhere():
                raise _outcomes.forked_error(what)
            if not _outcomes.wait_polling(self.future, timeout):
                assert timeout is not None
                raise _outcomes.not_ready_error(what, timeout)
        if self._kept is not None:
            self._kept.reraise()
        return self.future.result()


class Task(Outcome):
    """One call of ``fn``: its state, what it holds in each (its shared outcome:
    :class:`Outcome`).

    Timed out, cancelled and abandoned calls are failed calls whose error says
    so; a call given up on drops what ``fn`` returns later. In a forked child,
    a call that ran at the fork fails at its first use (:meth:`ran_elsewhere`).
    Each move of its state (:class:`CallState`) is one of its methods, under
    its lock, through :meth:`_move`, which refuses a move not in
    :data:`CALL_MOVES`:

    ==================  ==========================  =========  =========================
    state               event (method)              next       taken (+), given back (-)
    ==================  ==========================  =========  =========================
    pending             submit                      same       + queue entry or loop
                                                               task, + deadline,
                                                               + live entry
    pending             claim (_claim)              running    + pool slot (its thread);
                                                               not submitted in this
                                                               process: + live entry,
                                                               + deadline
    running             fn returns (_accept)        finishing  nothing
    running             fn raises (_fail)           finishing  + error text
    pending, running    give_up (timeout, cancel)   finishing  - pool slot (abandon),
                                                               - loop task (cancel),
                                                               + error text
    pending, running    abandon (at exit)           finishing  nothing
    finishing           _publish, _conclude (_end)  finished   - live entry
    finishing,finished  its thread leaves run       same       - pool slot (once
                                                               published; at give_up if
                                                               given up on)
    finishing,finished  fn returns or raises late   same       nothing (dropped)
    ==================  ==========================  =========  =========================

    Override points (subclasses never write its fields): :meth:`_start`,
    :meth:`_accept`, :meth:`time_out`, :meth:`_stop_parts`; they end a call with
    :meth:`_fail`, :meth:`_conclude`, :meth:`_publish` or :meth:`_publish_placed`.
    """

    #: Whether its arrays stand for the ``jax.Array`` s of a jitted call (so
    #: ``str()`` prints their values, as a ``jax.Array``'s does).
    stands_for_an_array = False
    #: Names the part of a larger call that this one computes, in errors (a
    #: sharded load's shard: "the shard at index [0:2] ..."); "": none.
    what = ""
    #: Whether an ``async def`` call lands with the others of its turn of the
    #: event loop (:meth:`_land_burst`), or at once (a shard: its buffer is
    #: dropped as soon as it is placed, not held until the burst is placed).
    bursts = True

    # Named in one string: a thousand calls in flight, each without a __dict__.
    __slots__ = tuple(
        "_lock _state _submitted _clock _pid _worker _source _fn _args _kwargs "
        "treedef specs coroutine __weakref__".split()
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
        coroutine: bool | None = None,
    ):
        self._lock = threading.Lock()
        self._state = PENDING
        self._submitted = False
        self._clock = False  # whether the timeout's clock runs
        self._pid = os.getpid()
        super().__init__(name, api, timeout)
        # The pool thread running fn, while it runs (it leaves the bound if the
        # call is given up on); its asyncio task while it runs on the event
        # loop (cancelled if the call is given up on).
        self._worker: _async_pool.Worker | None = None
        self._source: asyncio.Task | None = None
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self.treedef = treedef
        self.specs: list[LeafSpec] = specs
        # Whether fn runs on the event loop (None: asks fn).
        self.coroutine = is_coroutine_function(fn) if coroutine is None else coroutine

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

    # -- its state: each move under its lock --

    def _move(self, to: CallState) -> None:  # lock held
        """The one change of the call's state: refuses (``InvalidStateError``,
        as ``concurrent.futures.Future`` does) a move not in :data:`CALL_MOVES`."""
        if (self._state, to) not in CALL_MOVES:
            raise concurrent.futures.InvalidStateError(
                f"{self}: the call cannot move from {self._state} to {to}"
            )
        self._state = to

    @property
    def started(self) -> bool:
        """Whether the call was claimed, or ended (read without the lock: a hint)."""
        return self._state is not PENDING

    @property
    def returned(self) -> bool:
        """Whether ``fn`` returned and its values are being placed."""
        return self._state == FINISHING

    def ran_elsewhere(self) -> bool:
        """Whether the call started in the parent of this forked child (then
        it never ends here)."""
        return self._state != PENDING and self._pid != os.getpid()

    def __str__(self) -> str:
        return f"{self.name} ({self.api})"

    # -- start --

    def submit(self) -> None:
        """Queues the call on the pool or loop (once); its timeout counts from now."""
        with self._lock:
            if self._submitted or self._state != PENDING:
                return
            self._submitted = True
        self._track()
        self._start()

    def _track(self) -> None:
        """Counts the call as live (for exit) and starts its timeout's clock (once)."""
        with _async_pool.live_lock:
            _async_pool.live.add(self)
        with self._lock:
            if self._clock or self.timeout is None:
                return
            self._clock = True
        _event_loop.event_loop().call_later(self.timeout, _time_out, weakref.ref(self))

    def _start(self) -> None:
        """Queues the call's work, at :meth:`submit` (once): a coroutine call on
        the event loop, any other on the pool. Override point."""
        if self.coroutine:
            _event_loop.event_loop().submit(self._run_on_loop, self.name)
        else:
            _async_pool.POOL.submit(self)

    def run(self, worker: _async_pool.Worker | None = None) -> None:
        """Runs the call here, in this thread, unless it has already started (or
        ended). Not a coroutine call: it runs on the event loop (submitted with
        the call), with no bounded pool to get around."""
        if self.coroutine or not self._claim(worker):
            return
        try:
            out = self._work()
        except BaseException as e:  # routed to every use, like a Future does
            self._left_runner()
            self._fail(e, raised_by_fn=True)
            return
        self._left_runner()
        if inspect.isawaitable(out):  # e.g. a lambda that calls an async def
            awaited = functools.partial(self._run_on_loop, out)
            _event_loop.event_loop().submit(awaited, self.name)
            return
        self._finish(out)

    async def _run_on_loop(self, awaitable: Any = None) -> None:
        """Runs the call on the event loop: its coroutine, or ``awaitable``
        (what its thread returned).

        Claimed here, on the loop, before ``fn`` is called: asyncio would run a
        task cancelled before its first step up to its first ``await``.
        """
        source = asyncio.current_task()
        if awaitable is not None and not self._adopt(source):
            _event_loop.close_awaitable(awaitable)  # given up on on its way here
            return
        if awaitable is None and not self._claim(None, source):
            return
        try:
            out = self._work() if awaitable is None else awaitable
            while inspect.isawaitable(out):
                out = await out
        except BaseException as e:  # our cancel included: then dropped by _fail
            self._left_runner()
            self._fail(e, raised_by_fn=True)
            return
        self._left_runner()
        if not self.bursts:
            self._finish(out)
            return
        # Landed with the other calls whose fn returns in this turn of the
        # loop, one turn later (:meth:`_land_burst`); running until then.
        if not _burst:
            asyncio.get_running_loop().call_soon(Task._land_burst)
        _burst.append((self, out))

    @staticmethod
    @_async_pool.landing
    def _land_burst() -> None:
        """Lands the ``async def`` calls whose fn returned in the last turn of
        the event loop (on its thread): all are checked and placed before any
        is published, so that a thread waiting for them wakes once per burst,
        not once per load (each wake-up would cost the loop's thread the GIL
        at every placement), and the per-load steps run back to back."""
        batch = _burst.copy()
        _burst.clear()
        # Every check first, then every placement: each runs back to back
        # (measured: placements so run at several times the speed).
        checked = [(task, task._accept(out)) for task, out in batch]
        del batch
        landed = [(task, task._place(c)) for task, c in checked if c is not None]
        placed = [(task, leaves) for task, leaves in landed if leaves is not None]
        del checked, landed
        try:  # one wait for every copy (they run meanwhile)
            jax.block_until_ready([leaves for _, leaves in placed])
        except BaseException:  # each call's own copies then say which failed
            placed = [(task, lv) for task, lv in placed if task._ready(lv)]
        for task, leaves in placed:
            try:  # one call's end never keeps the rest of the burst running
                task._publish(leaves)
            except BaseException:  # noqa: BLE001 - logged; the value is set
                logger.exception("landing %s of %s", task.api, task)

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
            self._track()
        return True

    def _left_runner(self) -> None:  # fn returned or raised: its runner is not ours
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

    def _work(self) -> Any:  # calls what computes the call
        fn, args, kwargs = self._fn, self._args, self._kwargs
        # The arguments may be large (raw bytes, file handles): do not keep them.
        self._fn = self._args = self._kwargs = None
        assert fn is not None  # Results (nothing to run) lands when made
        return fn(*args, **kwargs)

    # -- the end: returned, raised, given up on, abandoned --

    def _settle(self) -> bool:
        """Ends a running call's run (-> finishing); ``False``: it was given up on."""
        with self._lock:
            if self._state != RUNNING:
                return False
            self._move(FINISHING)
            return True

    def abandon(self) -> tuple[Any, Any] | None:
        """Ends a pending or running call (-> finishing; at exit, what it returns
        later is dropped): its thread and coroutine, for :meth:`give_up`;
        ``None``: it had ended."""
        with self._lock:
            if self._state not in (PENDING, RUNNING):
                return None
            self._move(FINISHING)
            worker, source = self._worker, self._source
            self._worker = self._source = None
        return worker, source

    def _end(self, error_text: str | None = None) -> None:
        """The finishing call's outcome is set (-> finished); ``error_text``:
        what the programs deferred on its arrays raise, if it failed."""
        with self._lock:
            self._move(FINISHED)
            self._error_text = error_text
        with _async_pool.live_lock:
            _async_pool.live.discard(self)

    def time_out(self) -> None:
        """Gives up on the call because its timeout has passed (override point:
        a sharded load names the shards still missing)."""
        cancels = self.coroutine or self._source is not None  # on the loop now
        assert self.timeout is not None
        self.give_up(_outcomes.timed_out(self.name, self.api, self.timeout, cancels))

    def cancel(self) -> bool:
        """Gives up on the call (``CancelledError``) unless it has finished."""
        return self.give_up(_outcomes.cancelled(self.name, self.api))

    def give_up(self, error: BaseException, text: str | None = None) -> bool:
        """Fails the call with ``error`` (which names it) now, unless it has ended;
        ``text``: what the programs deferred on its arrays raise (default: ``error``).
        Its thread, if any, keeps running (Python cannot stop it) but leaves the
        pool's bound at once; what it returns or raises later is dropped. Returns
        whether the call was given up on."""
        taken = self.abandon()
        if taken is None:
            return False
        worker, source = taken
        if worker is not None:
            _async_pool.POOL.abandon(worker, self)
        if source is not None:
            _event_loop.event_loop().cancel(source)
        if text is None:
            text = describe_error(error)
        self._conclude(error, raised_by_fn=False, text=text)
        return True

    @_async_pool.landing
    def _finish(self, out: Any) -> None:
        """Lands what ``fn`` returned, in the thread it returned to."""
        accepted = self._accept(out)
        if accepted is None:
            return
        leaves = self._place(accepted)
        if leaves is not None and self._ready(leaves):
            self._publish(leaves)

    def _accept(self, out: Any) -> list[Any] | None:
        """Lands what ``fn`` returned, or starts to. Override point.

        By default: checks it, settles the call (running -> finishing) and
        returns its frozen leaves, for :meth:`_place`, :meth:`_ready` and
        :meth:`_publish` (a burst runs each step for all its calls in turn).
        ``None``: the call failed, was given up on, or was landed here (as by
        :meth:`_publish_placed`, for a ``fn`` that returns placed arrays).
        """
        try:
            # Checked and copied now: a loader that refills the buffer it
            # returned (for its next call) changes nothing here.
            frozen = check_result(self, out)
        except BaseException as e:
            self._fail(e, raised_by_fn=False)
            return None
        if not self._settle():
            logger.debug("%s of %s returned after it was given up on", self.api, self)
            return None
        return frozen

    def _place(self, frozen: list[Any]) -> list[jax.Array] | None:
        """Places the settled call's leaves (``None``: that failed, and the
        call with it)."""
        try:
            return place(self, frozen)
        except BaseException as e:
            self._conclude(e, raised_by_fn=False)
            return None

    def _ready(self, leaves: list[jax.Array]) -> bool:
        """Waits until the copies of ``leaves`` to their devices are done
        (then ``done()`` means the data is there); ``False``: one failed, and
        the call with it (finishing -> finished)."""
        try:
            jax.block_until_ready(leaves)
        except BaseException as e:
            self._conclude(e, raised_by_fn=False)
            return False
        return True

    def _publish_placed(self, leaves: list[jax.Array]) -> bool:
        """Settles a running call and publishes ``leaves``, placed already, at
        once (nothing is checked, copied or waited for). ``False``: the call
        had been given up on."""
        if not self._settle():
            logger.debug("%s of %s returned after it was given up on", self.api, self)
            return False
        self._publish(leaves)
        return True

    def _publish(self, leaves: list[jax.Array]) -> None:
        """The placed leaves become the call's value (finishing -> finished)."""
        try:
            self._end()
        finally:  # set even if the end failed: no use waits for good
            self.future.set_result(leaves)
            self._value = leaves  # after: value() never answers before done()

    def _fail(self, error: BaseException, *, raised_by_fn: bool) -> None:
        """Fails a running call with ``error`` (unless it was given up on);
        ``raised_by_fn``: ``error`` is the loader's own (it gets a note)."""
        if not self._settle():
            logger.debug("%s of %s failed after it was given up on", self.api, self)
            return
        self._conclude(error, raised_by_fn=raised_by_fn)

    def _conclude(
        self, error: BaseException, *, raised_by_fn: bool, text: str | None = None
    ) -> None:
        """Sets the error of the finishing call: every use raises it, and every
        program deferred on its arrays.

        ``text``: what those programs raise, if not the call's own account of
        ``error`` (a timeout or cancel names the call already; a sharded load
        passes on its failed shard's).
        """
        self._stop_parts()  # first: the parts go before uses are told
        what = self.what
        if raised_by_fn:
            n = len(self.specs)
            _outcomes.note_on(error, self.name, self.api, n, what)
        self._kept = KeptError(error)
        if text is None:
            text = _outcomes.failure_text(error, self.name, self.api, part=what)
        self._end(text)
        self.future.set_exception(error)

    def _stop_parts(self) -> None:
        """The call ended: the calls it is made of that have not ended are
        given up on (override point: a sharded load's shards)."""


def _time_out(ref: weakref.ref[Task]) -> None:
    """At a call's deadline, on the event loop's thread: gives up on the call,
    unless it ended. Held weakly: a call that ended and whose arrays are gone is
    not kept (with its values) until its deadline."""
    task = ref()
    if task is not None:
        try:
            task.time_out()
        except BaseException:  # noqa: BLE001 - logged; the loop serves every call
            logger.exception("jax_threadmap: could not time out %s", task)


#: The ``async def`` calls whose fn returned in this turn of the event loop,
#: with what it returned, until :meth:`Task._land_burst` lands them; touched on
#: the loop's thread only.
_burst: list[tuple[Task, Any]] = []


@_fork.in_child
def _after_fork_in_child() -> None:
    # Returned in the parent's loop, whose thread does not exist here: those
    # calls fail at their first use in the child (Task.wait). A landing left
    # here would keep the child's loop from ever scheduling one.
    _burst.clear()
