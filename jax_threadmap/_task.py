"""One background call and its shared outcome: what backs an ``AsyncArray``.

``async_call(fn, result_shape_dtypes, *args)`` (in :mod:`._async`) makes one
:class:`Task`: ``fn`` runs exactly once on a small shared pool, and its outcome
(the placed ``jax.Array`` leaves, or the exception) is shared by every array of
its result. This module also holds the checks of a call's result against its
declaration (:func:`leaf_specs`, :func:`check_result`) and its placement on
device (:func:`place`).

Thread bounds: the pool has :func:`default_async_threads` daemon workers at most,
however many calls are pending. A thread that needs a value whose call has not
started yet runs that call itself instead of waiting on work queued behind it,
so a call that waits on another call's arrays cannot deadlock a full pool.

The dispatch mechanism (:mod:`._dispatch`) keeps per-call state on the task
(its gates) and is told when a call ends through :func:`set_gate_release`, so
that this module does not depend on how dispatch works.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _fork, _threads
from ._leaves import LeafSpec, check_result, describe_error, host_view, place
from ._scheduling import available_cpus
from ._validate import MAX_THREADS, env_positive_int

logger = logging.getLogger("jax_threadmap._async")

ENV_ASYNC_THREADS = "JAX_THREADMAP_ASYNC_THREADS"


def default_async_threads() -> int:
    """The number of worker threads of the pool that runs ``async_call``.

    ``JAX_THREADMAP_ASYNC_THREADS`` when set, else ``min(32, cpus + 4)``: the
    calls are mostly I/O (network, disk) or native code that releases the GIL,
    so a few more threads than cores pay off, as in CPython's
    ``ThreadPoolExecutor`` default; the cap keeps hundreds of pending arrays
    from becoming hundreds of threads. The pool is separate from the one that
    runs ``threadmap`` kernels, so a kernel that waits on an ``AsyncArray``
    never waits on work queued behind itself.
    """
    n = env_positive_int(
        ENV_ASYNC_THREADS,
        "the number of threads that run jax_threadmap.async_call",
        maximum=MAX_THREADS,
    )
    return min(32, available_cpus() + 4) if n is None else n


worker_state = threading.local()


def submit_background(fn: Callable[[], None]) -> None:
    """Runs ``fn`` in the background, on the async pool of the shared threads.

    Its own bound (``default_async_threads``), separate from threadmap's pools,
    so that a kernel that waits on an ``AsyncArray`` never waits on work queued
    behind itself. The threads are daemons, never joined at exit: calls still
    running then are reported by :func:`_at_exit`.
    """

    def run() -> None:
        # Named for what it runs now, as tracebacks and profilers show it.
        thread = threading.current_thread()
        name, thread.name = thread.name, f"jax_threadmap-async ({thread.name})"
        worker_state.in_pool = True
        try:
            fn()
        except BaseException:  # Task.run routes errors; this is a last resort
            logger.exception("jax_threadmap: an async call escaped its task")
        finally:
            worker_state.in_pool = False
            thread.name = name

    pool = _threads.get_pool(default_async_threads(), purpose="async_call")
    _threads.run_in_background(pool, run)


# --- what the dispatch mechanism is told ----------------------------------------------

#: A function ``(task, gates)`` that releases the gate programs of a task when its
#: call ends (with ``task.host`` or ``task.error_text`` set); set by the dispatch
#: mechanism (:mod:`._dispatch`), so that tasks need not import it.
GateRelease = Callable[["Task", dict], None]


def _no_gates(task: Task, gates: dict) -> None:
    del task, gates


_gate_release_fn: GateRelease = _no_gates


def set_gate_release(fn: GateRelease) -> None:
    """Installs the mechanism's handler for the gates of a finished call."""
    global _gate_release_fn
    _gate_release_fn = fn


def _gate_release(task: Task, gates: dict) -> None:
    _gate_release_fn(task, gates)


def _after_fork_in_child() -> None:
    # The async pool is reset with the other shared pools (_threads). Calls that
    # had not started yet run in the thread that first needs them (Task.wait).
    # The lock of the set of live calls may have been held by a thread that does
    # not exist in the child: a fresh one.
    global live_lock, _deadlines
    live_lock = threading.Lock()
    _deadlines = _Deadlines()  # its thread and the calls it watched are the parent's


_fork.in_child(_after_fork_in_child)


# --- one call, shared by the arrays of its result -------------------------------------

PENDING, RUNNING, FINISHING, FINISHED = (
    "pending",
    "running",
    "finishing",
    "finished",
)

#: The longest a wait in Python sleeps at once. Lock waits are interruptible on
#: POSIX anyway; the slices keep Ctrl-C prompt on every platform, and cost
#: nothing measurable (a wake-up per slice).
POLL_S = 0.5

# The start of the note added to a loader's exception (once per call).
_NOTE_START = "This error was raised by"

# Calls submitted or running and not finished, for the report at exit.
live_lock = threading.Lock()
live: set[Task] = set()


class Task:
    """One call of ``fn`` (or one wrapped Future) and its shared outcome.

    Async dispatch (see :class:`_Dispatch`) adds the gates: one pulled 4-byte
    array per device on which a program was dispatched with this call's arrays
    while it ran. Under ``_lock``, gates are only added while the state is
    pending or running, and ``_settle`` offers exactly those that exist when it
    moves the state on, so every gate is offered once and none is missed.
    """

    __slots__ = (
        "_lock",
        "_state",
        "_submitted",
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
        "_traceback",
        "_notes",
        "_chain",
        "slot",
        "gates",
        "host",
        "error_text",
        "programs",
        "offered",
        "timeout",
        "thread",
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
        self._pid = os.getpid()
        self._fn = fn
        self._args = args
        self._kwargs = kwargs
        self.name = name
        self.api = api
        self.treedef = treedef
        self.specs: list[LeafSpec] = specs
        # Holds the list of placed leaves, or the exception of the call.
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        # False for a wrapped Future: there is nothing to run, only to wait for.
        self.runnable = fn is not None
        self._traceback: Any = None
        self._notes: list[str] | None = None
        self._chain: tuple[Any, Any, bool] = (None, None, False)
        # Async dispatch: the value the gates carry, the gates by device
        # ({device: (pull id, gate array)}), the checked leaves as NumPy arrays
        # for the gate programs, the error text they raise, and how many gate
        # programs that read this call are still to run.
        self.slot = 0
        self.gates: dict[Any, tuple[int, jax.Array]] = {}
        self.host: list[np.ndarray] | None = None
        self.error_text: str | None = None
        self.programs = 0
        # Whether the gates were offered with the result (then never again).
        self.offered = False
        # Seconds fn may run before the call is given up on (TimeoutError).
        self.timeout = timeout
        # The ident of the thread running fn, while it runs (_deadlock reads it).
        self.thread: int | None = None

    @property
    def state(self) -> str:
        return self._state

    def submit(self) -> None:
        """Queues the call on the shared pool (once)."""
        with self._lock:
            if not self.runnable or self._submitted or self._state != PENDING:
                return
            self._submitted = True
        with live_lock:
            live.add(self)
        submit_background(self.run)

    def _claim(self) -> bool:
        with self._lock:
            if self._state != PENDING:
                return False
            self._state = RUNNING
            self._pid = os.getpid()
        with live_lock:
            live.add(self)
        if self.timeout is not None:
            _deadlines.add(self, self.timeout)
        return True

    def waiting_devices(self) -> list[Any]:
        """The devices whose gate programs wait for this call (none once it ends)."""
        with self._lock:
            if self._state not in (PENDING, RUNNING) or self.offered:
                return []
            return list(self.gates)

    def time_out(self) -> None:
        """Gives up on the call because it ran past its timeout."""
        self.give_up(
            TimeoutError(
                f"{self.name}, which jax_threadmap.{self.api} ran, did not return "
                f"within timeout={self.timeout} s and was given up on (its thread "
                "runs on until it returns; what it returns is dropped)."
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

    def run(self) -> None:
        """Runs the call, unless it has already started elsewhere."""
        if not self.runnable or not self._claim():
            return
        fn, args, kwargs = self._fn, self._args, self._kwargs
        # The arguments may be large (raw bytes, file handles): do not keep them.
        self._fn = self._args = self._kwargs = None
        assert fn is not None  # runnable
        self.thread = threading.get_ident()
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:  # routed to every use, like a Future does
            self._fail(e, raised_by_fn=True)
            return
        finally:
            self.thread = None
        self._finish(out)

    def on_source_done(self, source: concurrent.futures.Future) -> None:
        """Done-callback of a wrapped Future: checks and places its value."""
        if not self._claim():
            return
        try:
            out = source.result()
        except BaseException as e:
            self._fail(e, raised_by_fn=True)
            return
        self._finish(out)

    def _settle(self) -> dict[Any, tuple[int, jax.Array]] | None:
        """Ends the time in which gates can be added; returns the gates.

        ``None`` when the call was already given up on (cancelled, timed out,
        abandoned at exit): its outcome is set, and what ``fn`` returned or
        raised since is dropped.
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
            logger.debug(
                "%s of %s returned after it was given up on", self.api, self.name
            )
            return
        try:
            if gates:
                # The gate programs copy from these, once their gate arrives.
                self.host = [host_view(leaf) for leaf in frozen]
                _gate_release(self, gates)
                self.offered = True
            leaves = place(self, frozen)
        except BaseException as e:
            self._conclude(e, gates, raised_by_fn=False)
            return
        with self._lock:
            self._state = FINISHED
        with live_lock:
            live.discard(self)
        self.future.set_result(leaves)

    def _fail(self, error: BaseException, *, raised_by_fn: bool) -> None:
        gates = self._settle()
        if gates is None:
            logger.debug(
                "%s of %s failed after it was given up on", self.api, self.name
            )
            return
        self._conclude(error, gates, raised_by_fn=raised_by_fn)

    def give_up(self, error: BaseException) -> bool:
        """Fails the call with ``error`` now, unless it has finished.

        The call's thread, if any, keeps running (Python cannot stop it); what
        it returns or raises later is dropped. Returns whether it was given up.
        """
        with self._lock:
            if self._state not in (PENDING, RUNNING):
                return False
            self._state = FINISHING
            gates = dict(self.gates)
        self._conclude(error, gates, raised_by_fn=False)
        return True

    def _conclude(
        self, error: BaseException, gates: dict, *, raised_by_fn: bool
    ) -> None:
        """Sets the call's error: every use raises it, every gate program too."""
        verb = "ran" if self.runnable else "waited for"
        try:
            if raised_by_fn:
                _add_note(
                    error,
                    f"{_NOTE_START} {self.name}, which jax_threadmap.{self.api} "
                    f"{verb} to compute {len(self.specs)} array(s); every use of "
                    "any of those arrays raises it.",
                )
            self._traceback = error.__traceback__
            self._chain = (
                error.__cause__,
                error.__context__,
                error.__suppress_context__,
            )
            if hasattr(error, "__notes__"):
                self._notes = list(error.__notes__)
        except Exception:  # an exception that refuses notes still reaches uses
            logger.debug("jax_threadmap: could not annotate %s", type(error).__name__)
        if gates and not self.offered:  # the gate programs did not get the data
            self.error_text = (
                f"{self.name}, which jax_threadmap.{self.api} {verb}, failed with "
                f"{describe_error(error)}"
            )
            logger.warning(
                "%s; the jitted programs dispatched with its arrays raise this "
                "when their results are used.",
                self.error_text,
            )
            try:
                _gate_release(self, gates)
            except Exception:  # the call's own uses must still get the error
                logger.exception("jax_threadmap: could not release the gates")
        with self._lock:
            self._state = FINISHED
        with live_lock:
            live.discard(self)
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
            _gate_release(self, gates)

    def future_done(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for the outcome; returns whether it is there."""
        done, _ = concurrent.futures.wait([self.future], timeout=timeout)
        return bool(done)

    def wait(self, timeout: float | None, what: str) -> list[jax.Array]:
        """Returns the placed leaves; raises the call's error or TimeoutError."""
        if not self.future.done():
            if timeout is None and (
                self.timeout is None or getattr(worker_state, "in_pool", False)
            ):
                # Run it here rather than wait on work queued behind busy (or
                # not yet started, or deferred) workers. No-op once started.
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
                    f"{what} was not ready within timeout={timeout} s. The call "
                    "keeps running and the array stays usable: call result() "
                    "again, with a longer timeout or none."
                )
        error = self.future.exception()
        if error is not None:
            # Every use raises the same exception object, as Future.result()
            # does: restore the worker's traceback and the notes each time, so
            # that repeated uses (and JAX's traceback-filtering note, added at
            # each API boundary it crosses) do not pile up. On Python 3.10 that
            # filter chains a marker into __cause__ instead: restore the chain too.
            if self._notes is not None:
                error.__notes__ = list(self._notes)  # type: ignore[attr-defined]
            error.__cause__, error.__context__, error.__suppress_context__ = self._chain
            raise error.with_traceback(self._traceback)
        return self.future.result()


class _Deadlines:
    """One daemon thread that gives up on calls that ran past their timeout."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Task]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, task: Task, seconds: float) -> None:
        with self._cond:
            entry = (time.monotonic() + seconds, next(self._ids), task)
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="jax_threadmap-timeouts", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _due(self) -> list[Task]:
        with self._cond:
            while True:
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
                if due:
                    return due
                self._cond.wait(self._heap[0][0] - now if self._heap else None)

    def _run(self) -> None:
        while True:
            for task in self._due():
                try:
                    task.time_out()
                except BaseException:  # one call's failure must not stop the rest
                    logger.exception("jax_threadmap: could not time out %s", task.name)


_deadlines = _Deadlines()


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


def _add_note(error: BaseException, note: str) -> None:
    """Adds jax_threadmap's note to ``error``, replacing one from another call.

    One exception object raised by two calls (a cached error, say) carries the
    note of the call whose use raised it, once.
    """
    if not hasattr(error, "add_note"):  # Python < 3.11
        return
    notes = getattr(error, "__notes__", None)
    if notes is not None:
        notes[:] = [n for n in notes if not str(n).startswith(_NOTE_START)]
    error.add_note(note)
