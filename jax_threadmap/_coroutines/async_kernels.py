"""``async def`` kernels: every element a coroutine on the package's event loop.

A kernel that waits (a request, a read from an object store) holds a thread per
waiting element when it is a plain function. An ``async def`` kernel instead runs
each element as a coroutine on the package's one event loop
(:mod:`.event_loop`, the loop of ``async def`` loaders), so thousands of
elements wait at once on one thread. The map is the same flat map of
:mod:`.._host.maps` (views in, results checked and written in place by the
caller's own checks, ``KernelError`` with the batch index); only what runs it
differs (:func:`run_async_map`, called by the primitive's host function instead
of ``runners.run_map``):

- at most ``max_in_flight`` elements are in flight: that many workers, each a task
  on the loop, draw flat indices in order from one iterator and await one element
  at a time, so a million-element map holds ``max_in_flight`` coroutines, never a
  million;
- the first failure is recorded and every other worker is cancelled at once (its
  element gets ``CancelledError`` at its current ``await``); the map raises without
  awaiting them, and a cancelled element stores nothing;
- the thread that waits for the map (the caller's, or XLA's under ``jit``) waits in
  :func:`.progress.wait`; Ctrl-C there cancels the map the same way;
- a step of an element (from one ``await`` to the next) that blocks holds up the
  loop, and with it every other element, loader and map on it; asyncio's debug
  mode (``PYTHONASYNCIODEBUG=1``) logs such steps with their task, named after
  the kernel, as it does for ``async def`` loaders;
- outputs summed on the host (the cotangent of an operand not batched at some
  level) are added in index order, so the sum does not depend on which element
  finished first; an element may then start only while fewer than
  ``max_in_flight`` elements before it wait to be added, which bounds the results
  held.

Everything but the first submission and the wait runs on the loop's thread, so
the map's fields that the workers touch need no lock; the fields that the waiting
thread touches too (the outcome, the main task) are under ``_lock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import types
from collections.abc import Generator, Iterator, Sequence
from typing import Any, cast

import numpy as np

from .._executors.progress import Progress, progress_enabled, wait
from .._host.kernel_scope import KernelScope
from .._host.maps import ElementCaller, HostMap
from .._support import validate as _validate
from .._support.errors import (
    PASS_THROUGH,
    ExecutorError,
    KernelError,
    describe,
    kernel_traceback,
)
from .._support.validate import is_coroutine_function
from .event_loop import event_loop

#: Elements of one map in flight at once when ``max_in_flight=`` does not say:
#: enough that 2,048 requests of 50 ms finish in about 50 ms, and few enough that
#: a kernel opening a connection per element stays under a raised
#: file-descriptor limit (4,096 on many systems).
DEFAULT_MAX_IN_FLIGHT = 2048

#: The largest bound accepted: each element in flight is a task and a coroutine
#: (a few kB); beyond this the bound is almost always a batch size by mistake.
MAX_IN_FLIGHT = 1_000_000

# --- checks at the call -------------------------------------------------------------


def check_async_kernel(
    fn: Any, *, executor: Any, vectorized: bool, api: str, what: str = "kernel"
) -> None:
    """Refuses the options an ``async def`` kernel (or a partial or callable of
    one) cannot run with, at the call."""
    if not is_coroutine_function(fn):
        return
    name = _validate.callable_name(fn)
    if executor is not None:
        raise TypeError(
            f"{api}: the {what} {name!r} is an async def function, which runs as "
            "coroutines on jax_threadmap's event loop, not on an executor; "
            "executor= must be None. Got "
            f"executor={executor!r}. Bound the elements in flight with "
            "max_in_flight=N instead, or make the kernel a plain def function to "
            "run it on threads or processes."
        )
    if vectorized:
        raise TypeError(
            f"{api}: the {what} {name!r} is an async def function, which runs one "
            "coroutine per element; vectorized= must be False. Got a vectorized "
            "kernel. Await one element per call, or make a vectorized kernel a "
            "plain def function."
        )


def check_max_in_flight(value: Any, api: str = "threadmap") -> int | None:
    """``max_in_flight=`` checked (``None``: :data:`DEFAULT_MAX_IN_FLIGHT`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{api}: max_in_flight must be None (the default, "
            f"{DEFAULT_MAX_IN_FLIGHT}) or a positive int: "
            "the most elements of an async def kernel awaited at once. Got "
            f"max_in_flight={value!r} of type {type(value).__name__}."
        )
    if not 1 <= value <= MAX_IN_FLIGHT:
        raise ValueError(
            f"{api}: max_in_flight must be between 1 and {MAX_IN_FLIGHT}. Got "
            f"max_in_flight={value}. Pass the number of elements that may wait at "
            "once (e.g. 256 for requests to one server), not the batch size."
        )
    return int(value)


# --- one element in the kernels' scope ----------------------------------------------


@types.coroutine
def _in_scope(coro: Any, scope: KernelScope | None) -> Generator[Any, Any, Any]:
    """Awaits ``coro`` as ``await coro`` would, each of its steps
    (``send``/``throw``: the kernel's own code between two ``await`` s) in
    ``scope`` (where the kernel's JAX calls run), if any. (A generator-based coroutine,
    one object per element: maps of thousands of elements in flight pay for
    every object the collector tracks.)"""
    value: Any = None
    error: BaseException | None = None
    step = contextlib.nullcontext if scope is None else scope.entered
    while True:
        try:
            with step():
                signal = coro.send(value) if error is None else coro.throw(error)
        except StopIteration as stop:
            return stop.value
        try:
            value, error = (yield signal), None
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as e:  # cancellation: thrown into the kernel
            value, error = None, e


# --- one map on the loop --------------------------------------------------------------


#: Why a coroutine that a kernel did not await is an error, and the fix.
_AWAIT = (
    "calling an async def function returns a coroutine, which runs only when "
    "awaited: write `{good}`, not `{bad}`."
)


def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of flat element ``i`` of ``shape`` (merged batch dims are mostly
    one: then no NumPy call)."""
    if len(shape) == 1:
        return (i,)
    return tuple(int(j) for j in np.unravel_index(i, shape))


class AsyncMap:
    """One map of an ``async def`` kernel, run by workers on the event loop.

    Lock rule: ``_lock`` guards ``_error`` (set once: the first failure, or the
    stop asked by the waiting thread) and ``_main`` (the main task, published by
    the loop's thread); ``_done`` is a ``threading.Event``. Every other field is
    touched only by the loop's thread.

    Args:
        work: The host map (views, outputs, the caller that checks and stores).
        limit: The most elements in flight at once.
    """

    def __init__(self, work: HostMap, limit: int):
        self.work = work
        self.caller = cast(ElementCaller, work.caller)  # never vectorized
        self.limit = limit
        self.n = work.n
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._main: asyncio.Task[None] | None = None
        self._done = threading.Event()
        self._completed = 0
        self._workers: list[asyncio.Task[None]] = []
        self._summed = [k in self.caller.accumulate for k in range(len(work.out_v))]
        self._sums = any(self._summed)
        self._held: dict[int, tuple[tuple[int, ...], list[Any]]] = {}
        self._next_sum = 0
        self._added: asyncio.Event | None = None

    # -- the waiting thread ------------------------------------------------------

    @property
    def completed(self) -> int:
        """Elements done (read by the progress bar; a plain int, so any thread)."""
        return self._completed

    def run(self, progress: Progress | None) -> None:
        """Runs the map and waits for it; raises its error."""
        if event_loop().in_loop_thread():
            raise ExecutorError(
                f"threadmap of async def kernel {self.work.name!r} was called on "
                "jax_threadmap's event loop (from a coroutine, or a kernel that "
                "blocks the loop), where it would wait for elements that need that "
                "very loop. Await the elements yourself (asyncio.gather) there, or "
                "call threadmap from a thread: await asyncio.to_thread(f, ...)."
            )
        try:
            event_loop().submit(self._run_main, f"threadmap {self.work.name}")
            wait(self, self._done.wait, progress)
        except BaseException as e:  # Ctrl-C, also before the wait: stop the map
            self.fail(e)
            raise
        if self._error is not None:
            raise self._error

    def fail(self, error: BaseException) -> None:
        """Stops the map with ``error`` (Ctrl-C in the waiting thread): its
        elements in flight are cancelled."""
        with self._lock:
            if self._error is None:
                self._error = error
            main = self._main
        self._done.set()
        if main is not None:
            event_loop().cancel(main)

    # -- the loop's thread -------------------------------------------------------

    def _record(self, error: BaseException) -> bool:
        """Records the first failure; whether this one was it."""
        with self._lock:
            first = self._error is None
            if first:
                self._error = error
        return first

    @property
    def _stopped(self) -> bool:
        with self._lock:
            return self._error is not None

    def _failed(self, error: BaseException) -> None:
        """The first failure of an element (on the loop): every other worker is
        cancelled now, and the waiting thread released without awaiting them."""
        if self._record(error):
            for task in self._workers:
                if task is not asyncio.current_task():
                    task.cancel()
            self._done.set()

    async def _run_main(self) -> None:
        with self._lock:
            if self._error is not None:  # stopped before it started
                return
            self._main = asyncio.current_task()
        indices = iter(range(self.n))
        self._added = asyncio.Event()
        loop = asyncio.get_running_loop()
        name = f"threadmap {self.work.name}"  # asyncio's debug log shows it
        self._workers = [
            loop.create_task(self._worker(indices), name=name)
            for _ in range(min(self.limit, self.n))
        ]
        try:
            await asyncio.wait(self._workers)
        except asyncio.CancelledError:  # Ctrl-C, or the loop closing at exit
            for task in self._workers:
                task.cancel()
            self._record(
                ExecutorError(
                    f"threadmap of async def kernel {self.work.name!r} was "
                    "cancelled: jax_threadmap's event loop closed (the interpreter "
                    "exits). Wait for maps before the end of the program."
                )
            )
        if self._completed != self.n:  # a no-op once the map has failed
            # Never a result with an element left unwritten, whatever ended a
            # worker early.
            self._record(
                ExecutorError(
                    f"threadmap of async def kernel {self.work.name!r} ended with "
                    f"{self.n - self._completed} of {self.n} element(s) not "
                    "stored: a worker on jax_threadmap's event loop ended early."
                )
            )
        self._done.set()

    async def _worker(self, indices: Iterator[int]) -> None:
        in_v = self.work.in_v
        shape = self.work.shape
        for i in indices:
            if self._sums:
                await self._wait_turn(i)
            if self._stopped:
                return
            index = _unravel(i, shape)
            element = index + (Ellipsis,)  # 0-d arrays, not NumPy scalars
            leaves = [v[element] for v in in_v]
            try:
                result = await self._element(leaves, i)
            except BaseException as e:  # noqa: BLE001 - the kernel's own error
                if not self._stopped:  # else cancelled by the map's failure or stop
                    # Ctrl-C and exit reach the caller as themselves, as from a
                    # plain loop (and never leave the loop's thread).
                    passed = isinstance(e, PASS_THROUGH)
                    self._failed(e if passed else self._raised(e, i))
                return
            if self._stopped:
                return  # the map failed meanwhile: store nothing
            try:
                self._store(i, index, result)
            except BaseException as e:  # noqa: BLE001 - ends the map, never the loop
                # (asyncio lets KeyboardInterrupt and SystemExit out of a task,
                # and with them out of the loop's thread.)
                self._failed(self._store_error(e, i))
                return

    def _raised(self, error: BaseException, i: int) -> KernelError:
        """The error for element ``i``'s kernel that raised ``error``; for a
        coroutine used as a value (Python says only "'coroutine' object is not
        subscriptable"), it says so and what to write."""
        text = describe(error)  # never raises, unlike a broken __str__
        if isinstance(error, (TypeError, AttributeError)) and "'coroutine'" in text:
            what = f"used a coroutine without awaiting it ({text}): "
            where = kernel_traceback(error)
            fix = _AWAIT.format(good="await f(...)", bad="f(...)")
            return self.caller.error(i, what + fix + where, error)
        return self.caller.kernel_raised(error, i)

    def _store_error(self, error: BaseException, i: int) -> BaseException:
        """What the map raises when checking or storing element ``i``'s result
        raised ``error`` (a value whose ``__array__`` raises, say): Ctrl-C and
        exit as themselves, as from a plain loop; any other as a
        ``KernelError`` naming the element."""
        if isinstance(error, (KernelError, *PASS_THROUGH)):
            return error
        return self.caller.error(
            i,
            f"returned a value whose check or store raised {describe(error)}.",
            cause=error,
        )

    def _element(self, leaves: list[Any], i: int) -> Any:
        coro = self.caller.call(leaves)
        if not hasattr(coro, "send"):
            raise TypeError(
                f"the async def kernel returned {type(coro).__name__}, not a "
                "coroutine, when called"
            )
        return _in_scope(coro, self.work.scope)

    def _store(self, i: int, index: tuple[int, ...], result: Any) -> None:
        caller = self.caller
        values = caller.result_leaves(result, i)
        for k, (o, v) in enumerate(zip(self.work.out_v, values, strict=True)):
            if not self._summed[k]:
                caller.store(o, index, v, k, i)
        if self._sums:  # the summed outputs: added in index order
            self._held[i] = (index, values)
            self._add_in_order()
        else:
            self._completed += 1

    # -- summed outputs: added in index order --------------------------------------

    async def _wait_turn(self, i: int) -> None:
        """Waits until fewer than ``limit`` elements before ``i`` wait to be added."""
        while i >= self._next_sum + self.limit and not self._stopped:
            assert self._added is not None
            await self._added.wait()

    def _add_in_order(self) -> None:
        caller = self.caller
        out_v: Sequence[Any] = self.work.out_v
        added = False
        while self._next_sum in self._held:
            i = self._next_sum
            index, values = self._held.pop(i)
            try:  # element i's summed outputs, added now (the error is i's)
                for k, (o, v) in enumerate(zip(out_v, values, strict=True)):
                    if self._summed[k]:
                        caller.store(o, index, v, k, i)
            except BaseException as e:  # noqa: BLE001 - raised as element i's
                raise self._store_error(e, i)  # noqa: B904 - chained as its cause
            self._next_sum += 1
            self._completed += 1
            added = True
        if added and self._added is not None:
            self._added.set()
            self._added = asyncio.Event()


def run_async_map(
    work: HostMap, *, max_in_flight: int | None, progress: bool | None
) -> None:
    """Runs every element of ``work`` (an ``async def`` kernel's map) on the
    event loop, at most ``max_in_flight`` at once; raises the map's error."""
    if work.n == 0:
        return
    bar = Progress(work.n, work.name) if progress_enabled(progress) else None
    AsyncMap(work, max_in_flight or DEFAULT_MAX_IN_FLIGHT).run(bar)
