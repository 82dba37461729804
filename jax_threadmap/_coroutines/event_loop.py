"""The package's one asyncio event loop, for ``async def`` loaders (and timeouts).

``async_call`` and ``async_array_from_callback`` run a
coroutine function (``async def``, a ``functools.partial`` of one, an object
whose ``__call__`` is one: :func:`.._support.validate.is_coroutine_function`) as a
coroutine on one event loop, on one daemon thread (``jax_threadmap-asyncio``),
so that a thousand loads in flight need no thousand threads. The loop:

- starts on first use (:meth:`EventLoop.submit`; :meth:`EventLoop.call_later`,
  where a call's timeout fires), never at import: a program without coroutine
  loaders or timeouts pays nothing;
- takes its work from a queue, waking up once per burst of submissions (one
  ``call_soon_threadsafe`` when the queue was empty), not once per call;
- runs each call's coroutine as an asyncio task named after the function (for
  asyncio's debug log, ``PYTHONASYNCIODEBUG=1``, and the report at exit), kept
  referenced until it ends (asyncio holds tasks weakly; the ended ones are
  dropped in bulk, :meth:`EventLoop._forget_done`);
- cancels a call's task on request (:meth:`EventLoop.cancel`): ``CancelledError``
  is raised inside the coroutine at its current ``await``;
- at exit (:meth:`EventLoop.close`), cancels what is still pending, lets the
  coroutines handle it (at most :data:`EXIT_CANCEL_S`), then runs its closers
  (:meth:`EventLoop.on_close`: the resources that ``jax_threadmap.shared`` opened
  on it close there, at most :data:`EXIT_CLOSE_S`), and closes;
- in a forked child is forgotten (its selector is the parent's epoll instance):
  the child starts a fresh loop on first use.

It runs only what it is given (:class:`_arrays.task.Task` hands it its own
coroutine), so it knows nothing of what a call computes. The thread publishes
its ident, so that a wait on that thread, which would block every loader, is
refused (:meth:`EventLoop.in_loop_thread`); no frame is read.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import threading
import time
import warnings
from collections.abc import Callable, Coroutine
from typing import Any

from .._support import fork as _fork

logger = logging.getLogger("jax_threadmap._async")

#: At exit, how long the coroutines still pending may take to handle their
#: cancellation (close connections) before the loop is closed without them.
EXIT_CANCEL_S = 2.0

#: At exit, how long the closers (:meth:`EventLoop.on_close`) may take together:
#: closing a client session or a connection pool takes a few turns of the loop.
EXIT_CLOSE_S = 2.0

#: How long exit waits for the loop's thread once the loop is told to stop.
EXIT_JOIN_S = 1.0

#: The tasks kept (asyncio holds them weakly) are sifted for the ended ones when
#: there are more than this many (and twice as many as after the last sift).
FORGET_MIN = 256

#: What the loop runs: a function that makes the coroutine, and its task's name.
Work = tuple[Callable[[], Coroutine[Any, Any, None]], str]


def close_awaitable(awaitable: Any) -> None:
    """Closes a coroutine that will never be awaited (no "never awaited" warning)."""
    if inspect.iscoroutine(awaitable):
        awaitable.close()


class EventLoop:
    """One asyncio loop on one daemon thread, started on first use.

    Lock rule: ``_lock`` guards every field; the loop's own thread reads
    ``_queue`` under it too. A loop once started never changes until fork or
    close. ``_tasks`` is touched only by the loop's thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._closed = False
        self._queue: collections.deque[Work] = collections.deque()
        self._tasks: set[asyncio.Task] = set()
        self._forget_at = FORGET_MIN  # the size of _tasks at which the ended go
        self._closers: list[Callable[[], Coroutine[Any, Any, None]]] = []
        #: Threads started by this loop (one, at first use): what benchmarks count.
        self.threads_started = 0

    def _start(self) -> asyncio.AbstractEventLoop:  # lock held
        if self._closed:
            raise RuntimeError(
                "jax_threadmap: an async def loader was started while the "
                "interpreter exits (the package's event loop is closed). Start "
                "loads before the end of the script, and wait for them."
            )
        if self._loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            thread = threading.Thread(
                target=self._run,
                args=(loop, ready),
                name="jax_threadmap-asyncio",
                daemon=True,
            )
            thread.start()
            self.threads_started += 1
            ready.wait()  # the thread has published its ident
            self._loop, self._thread = loop, thread
        return self._loop

    def _run(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        self._ident = threading.get_ident()
        loop.call_soon(ready.set)
        try:
            while True:
                try:
                    loop.run_forever()
                except BaseException:  # noqa: BLE001 - logged; the loop goes on
                    # asyncio lets KeyboardInterrupt and SystemExit out of a
                    # task's step, and so out of run_forever (the task keeps
                    # it as its exception). This loop serves every loader and
                    # map of the process: it must outlive any one coroutine.
                    logger.exception(
                        "jax_threadmap: a coroutine let this out of the event "
                        "loop; the loop goes on"
                    )
                    continue
                return  # stopped: close() at exit
        finally:
            asyncio.set_event_loop(None)

    # -- use --

    def submit(self, make: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Runs the coroutine ``make()`` on the loop, as a task named ``name``.

        ``make`` is called on the loop's thread. One wake-up of the loop per
        burst: only a submission to an empty queue wakes it.
        """
        with self._lock:
            loop = self._start()
            wake = not self._queue
            self._queue.append((make, name))
        if wake:
            loop.call_soon_threadsafe(self._drain, loop)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            for make, name in batch:
                try:
                    task = loop.create_task(make(), name=name)
                except Exception:  # one call's failure must not stop the rest
                    logger.exception("jax_threadmap: could not start %s", name)
                    continue
                self._tasks.add(task)
            self._forget_done()

    def _forget_done(self) -> None:
        """Drops the tasks that have ended from ``_tasks`` once it has doubled
        since the last time: amortized, with no done-callback per task (one
        more turn of the loop each)."""
        if len(self._tasks) > self._forget_at:
            self._tasks = {task for task in self._tasks if not task.done()}
            self._forget_at = 2 * len(self._tasks) + FORGET_MIN

    def run(self, awaitable: Any, name: str) -> Any:
        """Awaits ``awaitable`` on the loop and returns its result (from a
        thread that is not the loop's own: there it would block every loader)."""
        if self.in_loop_thread():
            close_awaitable(awaitable)
            raise RuntimeError(
                f"jax_threadmap: {name} was awaited to its end on the package's "
                "event loop from inside an async def loader on that loop. Pass "
                "dtype=, or call from a thread."
            )
        done: concurrent.futures.Future = concurrent.futures.Future()

        async def wait() -> None:
            try:
                done.set_result(await awaitable)
            except BaseException as e:  # to the caller, like a Future does
                done.set_exception(e)

        self.submit(wait, name)
        return done.result()

    def call_later(self, seconds: float, fn: Callable[..., object], *args: Any) -> None:
        """Calls ``fn(*args)`` on the loop's thread ``seconds`` from now (from
        any thread); not once the loop is closed (at exit). A deadline past the
        platform's ``time_t`` (``1e300``) never fires and stops nothing: asyncio
        caps each wait of its selector (at a day)."""
        when = time.monotonic() + seconds
        with self._lock:
            if self._closed:
                return
            loop = self._start()
        loop.call_soon_threadsafe(_call_at, loop, when, fn, args)

    def cancel(self, task: asyncio.Task) -> None:
        """Cancels ``task`` (from any thread): ``CancelledError`` at its ``await``."""
        with self._lock:
            loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's thread."""
        return self._ident is not None and threading.get_ident() == self._ident

    def on_close(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs ``closer()`` on the loop when it closes (at exit), after the
        pending coroutines were cancelled; the last added runs first, as
        ``contextlib.AsyncExitStack`` closes. Added once per object: a closer
        equal to one already added is not added again."""
        with self._lock:
            if closer not in self._closers:
                self._closers.append(closer)

    # -- end --

    def close(self, timeout: float = EXIT_CANCEL_S) -> list[str]:
        """Cancels what is pending and closes the loop (once; at exit).

        Returns the names of the coroutines that did not end when cancelled
        (they swallowed their cancellation): they stay referenced, so asyncio
        never reports them as destroyed while pending, and die with the process.
        """
        with self._lock:
            loop, thread, self._closed = self._loop, self._thread, True
        if loop is None or thread is None or not thread.is_alive():
            return []
        try:
            stuck = asyncio.run_coroutine_threadsafe(
                self._cancel_all(timeout), loop
            ).result(timeout + EXIT_CLOSE_S + EXIT_JOIN_S)
        except Exception:  # a coroutine that blocks the loop (time.sleep)
            stuck = ["(the loop did not answer: a coroutine blocks it)"]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(EXIT_JOIN_S)
        if not thread.is_alive():
            loop.close()
        return stuck

    async def _cancel_all(self, timeout: float) -> list[str]:
        self._drain(asyncio.get_running_loop())  # queued, not started: cancelled too
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        stuck: list[str] = []
        if pending:
            _, left = await asyncio.wait(pending, timeout=timeout)
            stuck = sorted(t.get_name() for t in left)
        await self._run_closers()
        await asyncio.get_running_loop().shutdown_asyncgens()
        return stuck

    async def _run_closers(self) -> None:
        """The closers, last added first, within :data:`EXIT_CLOSE_S` in all; a
        failing one is logged, and the others still run."""
        with self._lock:
            closers, self._closers = self._closers[::-1], []
        deadline = asyncio.get_running_loop().time() + EXIT_CLOSE_S
        for closer in closers:
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(closer(), max(left, 0.0))
            except Exception:  # noqa: BLE001 - at exit: say so, close the others
                logger.exception("jax_threadmap: %r did not close at exit", closer)


def _call_at(loop: asyncio.AbstractEventLoop, when: float, fn: Any, args: Any) -> None:
    """Schedules ``fn(*args)`` at ``when`` (on the loop's thread)."""
    # time.monotonic(), not loop.time(): another loop (uvloop) has another clock.
    loop.call_later(max(0.0, when - time.monotonic()), fn, *args)


_event_loop = EventLoop()


def event_loop() -> EventLoop:
    """The package's event loop (a new one in a forked child)."""
    return _event_loop


def close_at_exit() -> None:
    """Cancels the coroutines still pending; warns about those that do not end."""
    stuck = _event_loop.close()
    if stuck:
        warnings.warn(
            f"jax_threadmap: {len(stuck)} async def loader(s) did not end when "
            f"cancelled at exit: {', '.join(stuck[:5])}"
            f"{f' and {len(stuck) - 5} more' if len(stuck) > 5 else ''}. They are "
            "abandoned. Let a loader end on asyncio.CancelledError (re-raise it).",
            RuntimeWarning,
            stacklevel=1,
        )


@_fork.in_child
def _after_fork_in_child() -> None:
    # The parent's loop thread does not exist here, and its loop's selector is
    # the parent's epoll instance: never run it; start afresh on first use.
    # (Its file descriptors stay open in the child: closing them needs
    # asyncio's private fields.)
    global _event_loop
    _event_loop = EventLoop()
