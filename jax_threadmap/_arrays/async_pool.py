"""The threads of background calls: the pool that runs them, and exit.

- The async pool (:class:`_Pool`): daemon threads of its own, started on demand,
  at most ``JAX_THREADMAP_ASYNC_THREADS`` of them counted at once, idle ones
  exiting after :data:`IDLE_S`. A call given up on while it runs (timeout,
  ``cancel()``) takes its thread out of the bound at once (Python cannot stop
  it): the thread is *abandoned* until its function returns (:class:`_Pool`).
- The calls in flight (:data:`live`) and the report at exit
  (:func:`abandon_at_exit`): calls still running, and threads still in calls
  given up on, are named in one warning; the calls are abandoned.
- Landings (:func:`landing`): what a thread of ours runs in JAX for a call (its
  values placed, a deferred program dispatched); exit waits for those in
  flight and lets none start.

``async def`` calls run on the event loop of :mod:`.._coroutines.event_loop`
instead of the pool, and timeouts fire there (:meth:`.EventLoop.call_later`).
Everything here only calls the methods of :class:`Call` and :class:`LiveCall`
(which ``task.Task`` has), so this module knows nothing of what a call computes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import jax

from .._support import fork as _fork
from .._support.cpus import available_cpus
from .._support.environment import ENV_ASYNC_THREADS, env_async_threads

logger = logging.getLogger("jax_threadmap._async")

#: Seconds an idle pool thread waits for a call before it exits.
IDLE_S = 5.0


def default_async_threads() -> int:
    """The number of threads that run ``async_call`` s at once (not abandoned).

    ``JAX_THREADMAP_ASYNC_THREADS`` when set, else ``min(32, cpus + 4)``, or
    the number of local devices when that is more: the calls are mostly I/O
    (network, disk) or native code that releases the GIL, so a few more threads
    than cores pay off, as in CPython's ``ThreadPoolExecutor`` default; the cap
    keeps hundreds of pending arrays from becoming hundreds of threads; and the
    shards of one ``async_array_from_callback`` start together on a machine
    with more devices than cores. The pool is separate from the one that runs
    ``threadmap`` kernels, so a kernel that waits on an ``AsyncArray`` never
    waits on work queued behind itself. Worked out once per change of the
    variable (every call asks: the CPUs and devices are not counted each time).
    """
    return _async_threads(os.environ.get(ENV_ASYNC_THREADS))


@functools.lru_cache(maxsize=1)
def _async_threads(raw: str | None) -> int:
    del raw  # the key: the bound is worked out again when the variable changes
    n = env_async_threads()  # (None when unset; never 0)
    return n or max(min(32, available_cpus() + 4), jax.local_device_count())


class Call(Protocol):
    """What the threads here need of a background call."""

    #: Shown in the name of the thread that runs it (tracebacks, profilers).
    name: str

    def run(self, worker: Worker | None = None) -> None:
        """Runs the call here, unless it has already started (or ended)."""


class LiveCall(Protocol):
    """What the report at exit needs of a call in flight."""

    future: concurrent.futures.Future

    @property
    def returned(self) -> bool:
        """Whether its function returned (its values are being placed), or its
        data landed (a deferred program, being dispatched)."""

    def run(self) -> None:
        """Runs the call here, unless it has started (or ended)."""

    def abandon(self) -> object:
        """At exit: ends the call (what its function returns later is dropped)."""


#: ``in_pool``: whether this thread is one of the pool's (while it runs a call).
worker_state = threading.local()


# --- the async pool -------------------------------------------------------------------


#: The cap on abandoned threads, as a multiple of the bound: at most
#: ``ABANDONED_PER_BOUND * bound`` threads run calls given up on, so the pool
#: has at most ``(1 + ABANDONED_PER_BOUND) * bound`` threads.
ABANDONED_PER_BOUND = 1


class Worker:
    """One pool thread: whether it counts against the bound, what it runs."""

    __slots__ = ("counted", "task")

    def __init__(self) -> None:
        self.counted = True
        self.task: Call | None = None  # the call it runs (given up on or not)


class AsyncPoolStatus(NamedTuple):
    """What the threads that run ``async_call`` s are doing now."""

    #: At most this many calls run at once (``JAX_THREADMAP_ASYNC_THREADS``).
    bound: int
    #: Calls running on the pool's threads now.
    running: int
    #: Calls waiting for a thread.
    queued: int
    #: Calls given up on (a ``timeout`` or ``cancel()``) whose function still
    #: runs, by name: their threads are outside the bound until it returns. At
    #: most ``ABANDONED_PER_BOUND`` times the bound; beyond, a thread whose call
    #: is given up on stays in the bound (counted in ``running``).
    abandoned: tuple[str, ...]


class _Pool:
    """The threads that run the calls, at most ``bound`` counted at once.

    Lock rule: every field is read and written under ``_cond``. ``counted``
    threads are alive and count against the bound (running a call or idle);
    a thread whose call is given up on stops counting at once (:meth:`abandon`)
    and counts again, if there is room, when its function returns. At most
    ``cap`` (:data:`ABANDONED_PER_BOUND` times the bound) threads are
    abandoned: beyond that, a thread whose call is given up on is *held* (it
    still counts against the bound) until an abandoned thread returns, or its
    own function does. So at the cap, new calls wait in the queue, and a call
    with a timeout that passes there fails without ever starting.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[Call] = collections.deque()
        self._bound = 1
        self._counted = 0
        self._idle = 0
        self._abandoned: set[Worker] = set()
        self._held: set[Worker] = set()  # given up on, kept counted (the cap)
        self._names = itertools.count()
        #: Whether exit has begun (:func:`abandon_at_exit`): no thread starts.
        self.exiting = False

    @property
    def cap(self) -> int:
        """The most threads abandoned at once."""
        return ABANDONED_PER_BOUND * self._bound

    def submit(self, task: Call) -> None:
        with self._cond:
            self._bound = default_async_threads()
            self._queue.append(task)
            self._cond.notify()
            self._grow()

    def abandon(self, worker: Worker, task: Call) -> None:
        """Takes the thread of a call given up on out of the bound (or holds it)."""
        with self._cond:
            if not worker.counted or worker.task is not task:  # it has moved on
                return
            self._held.add(worker)
            self._release_held()

    def _release_held(self) -> None:  # lock held
        """Moves held threads out of the bound while the cap allows."""
        while self._held and len(self._abandoned) < self.cap:
            worker = self._held.pop()
            worker.counted = False
            self._counted -= 1
            self._abandoned.add(worker)
        self._grow()

    def _grow(self) -> None:  # lock held
        """Starts a thread if calls wait that the idle threads will not take
        (not once exit has begun: Python 3.12+ refuses new threads then, and
        exit runs what must still run itself, :func:`abandon_at_exit`)."""
        if len(self._queue) <= self._idle or self._counted >= self._bound:
            return
        if self.exiting:
            return
        worker = Worker()
        thread = threading.Thread(
            target=self._work,
            args=(worker,),
            name=f"jax_threadmap-async-{next(self._names)}",
            daemon=True,
        )
        self._counted += 1
        try:
            thread.start()
        except RuntimeError:  # too many threads: the queue waits for one to free
            self._counted -= 1
            logger.warning(
                "jax_threadmap: could not start a thread for async calls (%d "
                "threads alive); the calls wait for a running one.",
                threading.active_count(),
                exc_info=True,
            )

    def _next(self, worker: Worker) -> Call | None:
        """The next call to run, or ``None`` when this thread should exit."""
        with self._cond:
            worker.task = None
            self._held.discard(worker)
            if not worker.counted:  # its call was given up on: back if there is room
                self._abandoned.discard(worker)
                self._release_held()
                if self._counted >= self._bound:
                    return None
                worker.counted = True
                self._counted += 1
            self._idle += 1
            try:
                while not self._queue:
                    if not self._cond.wait(IDLE_S) and not self._queue:
                        self._counted -= 1
                        return None
            finally:
                self._idle -= 1
            worker.task = self._queue.popleft()
            return worker.task

    def _work(self, worker: Worker) -> None:
        thread = threading.current_thread()
        while (task := self._next(worker)) is not None:
            worker_state.in_pool = True
            thread.name = f"jax_threadmap-async ({task.name})"  # for tracebacks
            try:
                task.run(worker)
            except BaseException:  # Task.run routes errors; this is a last resort
                logger.exception("jax_threadmap: an async call escaped its task")
            finally:
                worker_state.in_pool = False
                thread.name = "jax_threadmap-async (idle)"
            del task  # not kept (with its values) while the thread waits for work

    def abandoned(self) -> tuple[str, ...]:
        """The calls given up on whose function still runs (asks no backend)."""
        with self._cond:
            return tuple(str(w.task) for w in self._abandoned)

    def status(self) -> AsyncPoolStatus:
        with self._cond:
            bound = self._bound if self._counted else default_async_threads()
            return AsyncPoolStatus(
                bound=bound,
                running=self._counted - self._idle,
                queued=len(self._queue),
                abandoned=tuple(str(w.task) for w in self._abandoned),
            )


#: The async pool: the one owner of its threads and queue, all under its lock
#: (``_cond``); a new one in a forked child (:func:`_after_fork_in_child`).
POOL = _Pool()


def async_pool_status() -> AsyncPoolStatus:
    """Says what the threads that run ``async_call`` s are doing now.

    A call given up on (its ``timeout`` passed, or ``AsyncArray.cancel()``)
    leaves the pool's bound at once, but Python cannot stop its thread: such
    calls are listed in ``abandoned`` until their function returns.

    The result's fields: ``bound``, the most calls that run at once; ``running`` and
    ``queued``, the calls now; ``abandoned``, the names of the calls given up on
    whose function still runs, at most as many as the bound (beyond, a thread
    whose call is given up on stays in the bound, counted in ``running``, and
    new calls wait in the queue).

    Returns:
        The named tuple ``AsyncPoolStatus(bound, running, queued, abandoned)``.

    Examples:
        >>> import threading
        >>> import jax, numpy as np
        >>> import jax_threadmap as jtm
        >>> started, never = threading.Event(), threading.Event()
        >>> def hangs():
        ...     started.set()
        ...     never.wait()
        ...     return np.zeros(2, np.float32)
        >>> x = jtm.async_call(hangs, jax.ShapeDtypeStruct((2,), np.float32))
        >>> started.wait(30), x.cancel()
        (True, True)
        >>> jtm.async_pool_status().abandoned
        ('`hangs` (async_call)',)
        >>> never.set()
    """
    return POOL.status()


# --- the calls in flight, and exit ---------------------------------------------------

# Calls submitted or running and not finished, for the report at exit.
live_lock = threading.Lock()
live: set[LiveCall] = set()

#: How long exit waits for calls whose function returned to place their values.
EXIT_PLACE_S = 5.0


class _Landings:
    """The landings in flight (see :func:`landing`); exit closes the door.

    Before Python 3.14 a daemon thread that wants the GIL back once the
    interpreter finalizes is ended with ``pthread_exit``, which unwinds every
    frame it is in: inside XLA's C++, that aborts the process ("terminate
    called without an active exception", "FATAL: exception not rethrown").
    So exit lets no landing start and waits for those in flight: no thread of
    ours is then in JAX when finalization starts.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0  # threads in a landing
        self._closed = False
        self._depth = threading.local()  # this thread's nested landings

    def enter(self) -> bool:
        """Enters a landing; ``False``: exit has closed them (nothing entered)."""
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                if self._closed:
                    return False
                self._inside += 1
        self._depth.n = depth + 1
        return True

    def leave(self) -> None:
        self._depth.n -= 1
        if self._depth.n == 0:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Lets no landing start; waits at most ``timeout`` s for those in
        flight; returns whether none is left."""
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: self._inside == 0, timeout)


_landings = _Landings()
_F = TypeVar("_F", bound=Callable[..., Any])


def landing(method: _F) -> _F:
    """Makes ``method`` a landing: code that a thread of ours runs in JAX for a
    call (placing its values, dispatching a deferred program). Once exit has
    begun, it is skipped (returns ``None``; the call is abandoned at exit)."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        landings = _landings
        if not landings.enter():
            return None
        try:
            return method(*args, **kwargs)
        finally:
            landings.leave()

    return guarded  # type: ignore[return-value]


def abandon_at_exit() -> None:
    """Warns about the calls still running at exit, and abandons them.

    A call whose function returned may still be copying its values to the
    device, and a deferred program whose data landed is being dispatched: exit
    waits for them, and for those their landing starts (at most
    :data:`EXIT_PLACE_S` in all), rather than report them. Then no landing
    starts, and those in flight are waited for (:class:`_Landings`).
    """
    with POOL._cond:
        POOL.exiting = True
    deadline = time.monotonic() + EXIT_PLACE_S
    _finish_landed(deadline)
    _landings.close(max(0.0, deadline - time.monotonic()))
    with live_lock:  # those whose landing was refused are still running
        unfinished = [c for c in live if not c.future.done()]
    # Not status(): its bound asks JAX for the device count, which would start
    # a backend in a process that never used one (on a TPU host: open the chip).
    abandoned = POOL.abandoned()
    if not unfinished and not abandoned:
        return
    parts = []
    if unfinished:
        parts.append(
            f"{len(unfinished)} background call(s) have not returned: "
            f"{_names([str(c) for c in unfinished])}. They are abandoned (their "
            "threads stop with the process, their coroutines are cancelled) and "
            "their arrays never get values"
        )
    if abandoned:
        parts.append(
            f"{len(abandoned)} thread(s) still run calls given up on earlier "
            f"(timeout or cancel): {_names(list(abandoned))}"
        )
    warnings.warn(
        "jax_threadmap: the interpreter is exiting while "
        + "; and ".join(parts)
        + ". Wait for the arrays you need (jax.block_until_ready) before the "
        "script ends, and give calls that may hang a timeout.",
        RuntimeWarning,
        stacklevel=1,
    )
    for call in unfinished:
        call.abandon()


def _finish_landed(deadline: float) -> None:
    """Until ``deadline``: waits for the calls that returned (placing their
    values) and dispatches here the deferred programs whose data landed; a call
    that lands may start another (a deferred program on it)."""
    while True:
        with live_lock:
            returned = [c for c in live if c.returned and not c.future.done()]
        left = deadline - time.monotonic()
        if not returned or left <= 0:
            return
        for call in returned:  # no-op for those running elsewhere
            call.run()
        concurrent.futures.wait([c.future for c in returned], timeout=left)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


@_fork.in_child
def _after_fork_in_child() -> None:
    # The parent's threads, and the calls they ran or queued, do not exist here,
    # and a lock one of them held at the fork stays held: start afresh. A call
    # that had not started runs in the thread that first needs it (Task.wait).
    global POOL, live_lock, _landings
    POOL = _Pool()
    live_lock = threading.Lock()
    _landings = _Landings()
