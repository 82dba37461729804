"""Background calls: the :class:`Task` behind every ``AsyncArray``.

- :class:`Task`: one call of ``fn`` (or one wrapped ``Future``) and its outcome,
  shared by every array of the call's result: the placed ``jax.Array`` leaves, or
  the exception. A task ends once, by one of :meth:`Task.run` (``fn`` returned or
  raised), :meth:`Task.on_source_done` (a wrapped ``Future`` completed) or
  :meth:`Task.give_up` (timeout, ``cancel()``); what comes later is dropped.
- An ``async def`` ``fn`` (or a plain one that returns an awaitable) runs as a
  coroutine on the package's event loop (:mod:`._event_loop`), not on the pool:
  :meth:`Task._run_coroutine` claims the call there first (a call given up on
  before it started never calls ``fn``), and giving up cancels the coroutine.
- Its ``timeout`` counts from the call (``async_call``) or its first use
  (``deferred_call``), time spent waiting for a thread included: the clock starts
  in :meth:`Task.submit` (or when the call first runs in place), and the
  timeouts' thread of :mod:`._async_threads` calls :meth:`Task.time_out`.
- A call given up on while it runs takes its thread out of the pool's bound
  (:meth:`._async_threads._Pool.abandon`), so that later calls start at once.

A thread that needs a value whose call has not started yet runs that call itself
instead of waiting on work queued behind it (:meth:`Task.wait`), so a call that
waits on another call's arrays cannot deadlock a full pool.

The dispatch mechanism keeps per-call state on the task (its gates, under the
task's lock) and is told when a call ends through :func:`set_gate_release`, so
that this module does not depend on how dispatch works.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from . import _async_threads, _event_loop
from ._async_threads import worker_state
from ._errors import KeptError, add_note
from ._leaves import (
    LeafSpec,
    check_result,
    describe_error,
    host_view,
    index_of,
    leaf_specs,
    place,
)
from ._validate import callable_name, check_callable, check_timeout

logger = logging.getLogger("jax_threadmap._async")

#: The longest a wait in Python sleeps at once. Lock waits are interruptible on
#: POSIX anyway; the slices keep Ctrl-C prompt on every platform, and cost
#: nothing measurable (a wake-up per slice).
POLL_S = 0.5

PENDING, RUNNING, FINISHING, FINISHED = "pending", "running", "finishing", "finished"

# The start of the note added to a loader's exception (once per call).
_NOTE_START = "This error was raised by"


# --- what the dispatch mechanism is told ----------------------------------------------

#: A function ``(task, gates)`` that releases the gate programs of a task when its
#: call ends (with ``task.host`` or ``task.error_text`` set); set by the dispatch
#: mechanism, so that tasks need not import it.
GateRelease = Callable[["Task", dict], None]


def _no_gates(task: Task, gates: dict) -> None:
    del task, gates


_gate_release_fn: GateRelease = _no_gates


def set_gate_release(fn: GateRelease) -> None:
    """Installs the mechanism's handler for the gates of a finished call."""
    global _gate_release_fn
    _gate_release_fn = fn


# --- one call, shared by the arrays of its result -------------------------------------


class Task:
    """One call of ``fn`` (or one wrapped Future) and its shared outcome.

    Lock rule: ``_lock`` guards the state and the dispatch fields (``gates``,
    ``programs``). Gates are only added while the state is pending or running,
    and the call's end offers exactly those that exist when it moves the state
    on, so every gate is offered once and none is missed.
    """

    __slots__ = (
        "_lock",
        "_state",
        "_submitted",
        "_clock",
        "_pid",
        "_fn",
        "_args",
        "_kwargs",
        "name",
        "api",
        "treedef",
        "specs",
        "future",
        "runnable",
        "_kept",
        "slot",
        "gates",
        "host",
        "error_text",
        "programs",
        "offered",
        "timeout",
        "worker",
        "coroutine",
        "source",
        "__weakref__",
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
        # False for a wrapped Future: there is nothing to run, only to wait for.
        self.runnable = fn is not None
        self._kept: KeptError | None = None  # the error, raised by every use
        # Async dispatch: the value the gates carry, the gates by device
        # ({device: (pull id, gate array)}), the checked leaves as NumPy arrays
        # for the gate programs, the error text they raise, and how many gate
        # programs that read this call are still to run.
        self.slot = 0
        self.gates: dict[Any, tuple[int, jax.Array]] = {}
        self.host: Any = None
        self.error_text: str | None = None
        self.programs = 0
        # Whether the gates were offered with the result (then never again).
        self.offered = False
        # Seconds from the call (or first use) before it is given up on.
        self.timeout = timeout
        # The pool thread running fn, while it runs (it leaves the bound if the
        # call is given up on).
        self.worker: _async_threads.Worker | None = None
        # Whether fn runs on the event loop; its asyncio task while it runs
        # there (cancelled if the call is given up on).
        self.coroutine = _event_loop.is_coroutine_function(fn)
        self.source: asyncio.Task | None = None

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
        check_callable(
            fn,
            f"jax_threadmap.{api}",
            "fn",
            "Pass the function first, then result_shape_dtypes, then its arguments.",
        )
        treedef, specs = leaf_specs(result_shape_dtypes, device, api)
        seconds = check_timeout(
            timeout,
            f"jax_threadmap.{api}",
            zero=False,
            hint=" To pass a keyword argument named timeout to fn, bind it with "
            "functools.partial.",
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
        if not isinstance(future, concurrent.futures.Future):
            raise TypeError(
                f"{api}: future must be a concurrent.futures.Future. Got "
                f"{future!r} of type {type(future).__name__}. For a plain "
                "function use jax_threadmap.async_call(fn, result_shape_dtypes)."
            )
        treedef, specs = leaf_specs(result_shape_dtypes, device, api)
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
        host = self.host
        return None if host is None else host[leaf][index_of(where)]

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
            self._state = RUNNING
            self._pid = os.getpid()
            self.worker = worker
            self.source = source
        with _async_threads.live_lock:
            _async_threads.live.add(self)
        self._start_clock()
        return True

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
            self._fail(e, raised_by_fn=True)
            return
        finally:
            self.worker = None
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
            _close(awaitable)  # given up on while on its way here
            return
        if awaitable is None and not self._claim(None, source):
            return
        call = (self._fn, self._args, self._kwargs)
        self._fn = self._args = self._kwargs = None
        try:
            out = _call(*call) if awaitable is None else awaitable
            while inspect.isawaitable(out):
                out = await out
        except BaseException as e:  # our cancel included: then dropped by _fail
            self.source = None
            self._fail(e, raised_by_fn=True)
            return
        self.source = None
        self._finish(out)

    def _adopt(self, source: asyncio.Task | None) -> bool:
        with self._lock:
            self.source = source
            return self._state == RUNNING

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

    def time_out(self) -> None:
        """Gives up on the call because its timeout has passed."""
        self.give_up(
            TimeoutError(
                f"{self.name}, which jax_threadmap.{self.api} ran, did not return "
                f"within timeout={self.timeout:g} s and was given up on ("
                + (
                    "its coroutine is cancelled)."
                    if self.coroutine or self.source is not None
                    else "its thread runs on until it returns; what it returns "
                    "is dropped)."
                )
            )
        )

    def cancel(self) -> bool:
        """Gives up on the call (``CancelledError``) unless it has finished."""
        verb = "ran" if self.runnable else "waited for"
        return self.give_up(
            concurrent.futures.CancelledError(
                f"{self.name}, which jax_threadmap.{self.api} {verb}, was "
                "cancelled (AsyncArray.cancel)."
            )
        )

    def give_up(self, error: BaseException) -> bool:
        """Fails the call with ``error`` (which names it) now, unless it has ended.

        The call's thread, if any, keeps running (Python cannot stop it) but
        leaves the pool's bound at once; what it returns or raises later is
        dropped. Returns whether the call was given up on.
        """
        with self._lock:
            if self._state not in (PENDING, RUNNING):
                return False
            self._state = FINISHING
            gates = dict(self.gates)
            worker, source = self.worker, self.source
        if worker is not None:
            _async_threads.pool().abandon(worker, self)
        if source is not None:
            _event_loop.event_loop().cancel(source)
        self._conclude(error, gates, raised_by_fn=False, names_call=True)
        return True

    def _settle(self) -> dict[Any, tuple[int, jax.Array]] | None:
        """Ends the time in which gates can be added; returns the gates.

        ``None`` when the call was already given up on: its outcome is set.
        """
        with self._lock:
            if self._state != RUNNING:
                return None
            self._state = FINISHING
            return dict(self.gates)

    def _finish(self, out: Any) -> None:
        try:
            # Checked and copied now: a loader that refills the buffer it
            # returned (for its next call) changes nothing here.
            frozen = check_result(self, out)
        except BaseException as e:
            self._fail(e, raised_by_fn=False)
            return
        gates = self._settle()
        if gates is None:
            logger.debug("%s of %s returned after it was given up on", self.api, self)
            return
        try:
            if gates:
                # The gate programs copy from these, once their gate arrives.
                self.host = [host_view(leaf) for leaf in frozen]
                _gate_release_fn(self, gates)
                self.offered = True
            leaves = place(self, frozen)
        except BaseException as e:
            self._conclude(e, gates, raised_by_fn=False)
            return
        self._end()
        self.future.set_result(leaves)

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

    def _conclude(
        self,
        error: BaseException,
        gates: dict,
        *,
        raised_by_fn: bool,
        names_call: bool = False,
        part: str = "",
    ) -> None:
        """Sets the call's error: every use raises it, every gate program too.

        ``names_call``: the error is one of this module's, whose message already
        names the call (a timeout, a cancel); it is then not named twice.
        ``part``: the part of the call that failed (a shard), for the messages.
        """
        verb = "ran" if self.runnable else "waited for"
        if raised_by_fn:
            what = (
                f"for {part}; every use of the array"
                if part
                else f"to compute {len(self.specs)} array(s); every use of any of "
                "those arrays"
            )
            add_note(
                error,
                f"{_NOTE_START} {self.name}, which jax_threadmap.{self.api} {verb} "
                f"{what} raises it.",
                _NOTE_START,
            )
        self._kept = KeptError(error)
        if gates and not self.offered:  # the gate programs did not get the data
            self.error_text = describe_error(error)
            if not names_call:
                self.error_text = (
                    f"{self.name}, which jax_threadmap.{self.api} {verb}, failed "
                    f"{f'for {part} ' if part else ''}with {self.error_text}"
                )
            logger.warning(
                "jax_threadmap: the jitted programs dispatched with the arrays of "
                "%s (%s) raise this error when their results are used: %s",
                self.name,
                self.api,
                self.error_text,
            )
            try:
                _gate_release_fn(self, gates)
            except Exception:  # the call's own uses must still get the error
                logger.exception("jax_threadmap: could not release the gates")
        self._end()
        self.future.set_exception(error)

    def abandon(self) -> None:
        """At exit: fails the gates of a call that is still running."""
        with self._lock:
            if self._state in (FINISHING, FINISHED):
                return
            self._state = FINISHING
            gates = dict(self.gates)
        if gates:
            self.error_text = (
                f"{self.name}, which jax_threadmap.{self.api} "
                f"{'ran' if self.runnable else 'waited for'}, had not returned "
                "when the interpreter exited"
            )
            _gate_release_fn(self, gates)

    def wait(self, timeout: float | None, what: str) -> list[jax.Array]:
        """Returns the placed leaves; raises the call's error or TimeoutError."""
        if not self.future.done():
            if _event_loop.event_loop().in_loop_thread():
                raise RuntimeError(
                    f"{what} was used inside an async def loader, on jax_threadmap's "
                    "event loop, before its value arrived: waiting there would "
                    "block every async def loader (maybe the one that computes "
                    "it). Wait in a thread instead: await asyncio.to_thread("
                    "x.result), or pass the array on without its value."
                )
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
                raise RuntimeError(
                    f"{what} was being computed by a thread of the parent process "
                    "when this process was forked, so its value will never arrive "
                    "here. Create the arrays after the fork, or wait for them "
                    "(block_until_ready) before forking."
                )
            if not _wait_polling(self.future, timeout):
                raise TimeoutError(
                    f"{what} was not ready within timeout={timeout:g} s. The call "
                    "keeps running and the array stays usable: call result() "
                    "again, with a longer timeout or none."
                )
        if self._kept is not None:
            self._kept.reraise()
        return self.future.result()

    def __str__(self) -> str:
        return f"{self.name} ({self.api})"


def _wait_polling(future: concurrent.futures.Future, timeout: float | None) -> bool:
    """Waits for ``future`` in slices of :data:`POLL_S`; returns whether done."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if left <= 0:
            return future.done()
        done, _ = concurrent.futures.wait([future], timeout=left)
        if done:
            return True


def _call(fn: Any, args: Any, kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _close(awaitable: Any) -> None:
    """Closes a coroutine that will never be awaited (no "never awaited" warning)."""
    if inspect.iscoroutine(awaitable):
        awaitable.close()
