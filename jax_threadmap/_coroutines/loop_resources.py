"""``jax_threadmap.shared``: one async resource for every coroutine on the loop.

An ``async def`` kernel that talks to a service wants one client session (or
connection pool) for all its elements and all its maps, not one per element:
the session keeps connections alive and bounds how many are open. Such a
resource belongs to the event loop it was opened on, and only the package's
loop (:mod:`.event_loop`) runs the kernels. :func:`shared` wraps a factory of
an async context manager (``aiohttp.ClientSession``, a function decorated with
``contextlib.asynccontextmanager``) in a :class:`Shared` handle, which opens
nothing when made:

- ``await handle.value()`` in a coroutine on the package's loop (an ``async
  def`` kernel, derivative kernel or loader) enters the context manager on
  first use, once however many elements ask at the same time, and returns
  what it entered; later calls return the same value;
- an opening that fails fails every coroutine waiting for it with a
  ``ThreadmapError`` naming the resource, chained to the cause; the next use
  opens it afresh;
- at exit the loop exits every open one, after its pending coroutines were
  cancelled and before it closes (:meth:`.event_loop.EventLoop.on_close`), the
  last opened first;
- in a forked child, a resource that the parent opened is the parent's (it
  lives on the parent's loop): the child neither uses nor closes it, and opens
  its own on first use.

A handle's life (``closed``, ``opening``, ``open``) is changed only by its own
methods, under its lock; every context manager entered is exited once, at
exit, in :meth:`Shared._close_at_exit`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

from .._support import fork as _fork
from .._support.errors import ThreadmapError, describe
from .._support.validate import callable_name, check_callable
from .event_loop import event_loop

logger = logging.getLogger("jax_threadmap._async")

T = TypeVar("T")

#: Every handle made, so that a forked child can forget what its parent opened.
_handles: weakref.WeakSet[Shared[Any]] = weakref.WeakSet()
#: In a forked child: what the parent had opened, kept referenced so that the
#: child never finalizes (and so never reports) a resource of the parent's loop.
_parents_values: list[Any] = []


class Shared(Generic[T]):
    """A resource shared by the coroutines on jax_threadmap's event loop.

    Made by [`shared`][jax_threadmap.shared]; see there. Opened on the first
    [`value`][jax_threadmap.Shared.value], kept open across elements and maps,
    closed at exit.

    Its life is closed, opening, open, and each change is one of its methods,
    under its lock:

    - closed to opening: the first ``value()`` starts an opening task;
    - opening to open: the context manager was entered;
    - opening to closed: entering failed (its waiters get the error);
    - opening or open to closed: the loop closing at exit (an opening is
      cancelled, what was entered is exited);
    - any to closed: in a forked child (the parent's value left alone).

    Attributes:
        name: The resource's name in messages: the factory's name.

    Examples:
        >>> import contextlib, jax, jax.numpy as jnp, numpy as np
        >>> import jax_threadmap
        >>> @jax_threadmap.shared
        ... @contextlib.asynccontextmanager
        ... async def rates_db():
        ...     yield {"a": 1.0, "b": 2.0}  # opened once, on the loop
        >>> print(rates_db)
        <jax_threadmap.shared rates_db: closed>
        >>> @jax_threadmap.kernel(jax.ShapeDtypeStruct((), jnp.float32))
        ... async def lookup(i):
        ...     return (await rates_db.value())["ab"[int(i)]]
        >>> jax.vmap(lookup)(jnp.arange(2))
        Array([1., 2.], dtype=float32)
        >>> print(rates_db)  # its state, from any thread
        <jax_threadmap.shared rates_db: open>
    """

    def __init__(self, factory: Callable[[], AbstractAsyncContextManager[T]]):
        check_callable(
            factory,
            "jax_threadmap.shared",
            "factory",
            "Pass a factory of an async context manager, with no arguments: the "
            "class or function itself (e.g. aiohttp.ClientSession, or a function "
            "decorated with contextlib.asynccontextmanager; functools.partial for "
            "its arguments), not an instance.",
        )
        self.name = callable_name(factory)
        self._factory = factory
        # Lock rule: _lock guards every field below; they change only in the
        # transition methods (_begin_open ... _forget), on the loop's thread but
        # for _forget (a forked child's only thread).
        self._lock = threading.Lock()
        self._state = "closed"
        self._value: Any = None
        self._manager: Any = None
        self._pending: asyncio.Task[None] | None = None  # the opening
        _handles.add(self)

    def __repr__(self) -> str:
        with self._lock:
            state = self._state
        return f"<jax_threadmap.shared {self.name}: {state}>"

    # -- use ---------------------------------------------------------------------

    async def value(self) -> T:
        """The resource, opened on first use: what the context manager entered.

        Await it in a coroutine on jax_threadmap's event loop: an ``async def``
        kernel (or derivative kernel, or ``async def`` loader). Elements that
        ask while it opens wait for that one opening. A waiting element that
        is cancelled (its map failed) leaves the opening running, for the next
        use.

        Returns:
            What the context manager's ``__aenter__`` returned (for
            ``aiohttp.ClientSession``, the session).

        Raises:
            ThreadmapError: Opening failed (chained to the cause); every element
                waiting for that opening gets it, and the next use opens again.
            RuntimeError: Awaited outside jax_threadmap's event loop (in
                ``asyncio.run`` of your own, say), where the resource cannot live.

        Examples:
            >>> import asyncio, contextlib, jax, jax.numpy as jnp
            >>> import jax_threadmap
            >>> opened = []
            >>> @contextlib.asynccontextmanager
            ... async def connection():
            ...     opened.append(1)
            ...     yield 10.0
            >>> conn = jax_threadmap.shared(connection)
            >>> async def scaled(x):
            ...     return x * await conn.value()
            >>> S = jax.ShapeDtypeStruct((), jnp.float32)
            >>> f = jax.vmap(lambda x: jax_threadmap.threadmap(scaled, S, x))
            >>> f(jnp.arange(3.0)), f(jnp.ones(2))
            (Array([ 0., 10., 20.], dtype=float32), Array([10., 10.], dtype=float32))
            >>> len(opened)  # once, for five elements of two maps
            1
        """
        self._check_loop()
        while True:
            with self._lock:
                state, value, pending = self._state, self._value, self._pending
            if state == "open":
                return value
            if state == "closed":
                pending = self._begin_open()
            assert pending is not None
            await self._wait(pending)  # the opening (its error raises here)

    # -- the loop's side ---------------------------------------------------------

    def _check_loop(self) -> None:
        if not event_loop().in_loop_thread():
            raise RuntimeError(
                f"jax_threadmap.shared {self.name!r}: value() was awaited outside "
                "jax_threadmap's event loop. The resource lives on that loop (the "
                "one that runs async def kernels and loaders): await value() in an "
                "async def kernel, derivative kernel or loader, not in asyncio.run "
                "or an event loop of your own."
            )

    def _begin_open(self) -> asyncio.Task[None]:
        """closed -> opening: starts the opening task. Called by value() on
        the loop's thread right after it read "closed", with no await between:
        nothing else can have started one."""
        with self._lock:
            assert self._state == "closed", self._state
            self._state = "opening"
            task = asyncio.get_running_loop().create_task(
                self._open(), name=f"open shared {self.name}"
            )
            self._pending = task
        task.add_done_callback(self._ended)
        event_loop().on_close(self._close_at_exit)
        return task

    async def _open(self) -> None:
        try:
            manager = self._factory()
        except Exception as e:  # noqa: BLE001 - an opening that failed
            raise self._failed(e) from e
        try:
            enter = type(manager).__aenter__
            type(manager).__aexit__  # noqa: B018 - both, as `async with` needs
        except AttributeError:
            raise TypeError(
                f"jax_threadmap.shared {self.name!r}: the factory returned "
                f"{manager!r} of type {type(manager).__name__}, which is not an "
                "async context manager (it lacks __aenter__ or __aexit__). Return "
                "one, e.g. decorate an async generator with "
                "contextlib.asynccontextmanager."
            ) from None
        try:
            value = await enter(manager)
        except Exception as e:  # noqa: BLE001 - an opening that failed
            raise self._failed(e) from e
        self._opened(manager, value)

    def _failed(self, e: Exception) -> ThreadmapError:
        return ThreadmapError(
            f"jax_threadmap.shared {self.name!r} could not be opened: "
            f"{describe(e)}. Every element waiting for it fails with this error; "
            "the next use opens it again.",
            cause=e,
        )

    def _opened(self, manager: Any, value: Any) -> None:
        """opening -> open."""
        with self._lock:
            assert self._state == "opening", self._state
            self._state, self._manager, self._value = "open", manager, value
            self._pending = None

    def _ended(self, task: asyncio.Task[None]) -> None:
        """opening -> closed: the opening task ended without entering (it
        failed or was cancelled, even before it started). Its error goes to its
        waiters. Called by the task's done callback and by its waiters,
        whichever comes first."""
        with self._lock:
            if self._pending is task:
                self._state, self._pending = "closed", None

    async def _wait(self, pending: asyncio.Task[None]) -> None:
        """Waits for an opening; a waiter that is cancelled does not cancel it.
        Once it is done, its end is recorded here too (its done callback may not
        have run yet: waiting again would not wait)."""
        try:
            await asyncio.shield(pending)
        finally:
            if pending.done():
                self._ended(pending)

    async def _close_at_exit(self) -> None:
        """opening or open -> closed, at exit (the loop's closer): an opening
        is cancelled, then what was entered is exited, here only."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending.cancel()
            try:
                await self._wait(pending)
            except asyncio.CancelledError:
                if not pending.done():  # this closing itself was cancelled
                    raise
            except Exception:  # noqa: BLE001 - the opening's error: its waiters got it
                pass
        with self._lock:
            manager, self._manager, self._value = self._manager, None, None
            self._state = "closed"
        if manager is None:
            return
        try:
            await type(manager).__aexit__(manager, None, None, None)
        except Exception:  # noqa: BLE001 - closed all the same; say so
            logger.exception("jax_threadmap: shared %r failed to close", self.name)

    def _forget(self) -> None:
        """any -> closed, in a forked child: the parent's value stays the
        parent's (referenced, never finalized here)."""
        self._lock = threading.Lock()
        if self._manager is not None:
            _parents_values.append(self._manager)
        self._state, self._pending = "closed", None
        self._value = self._manager = None


def shared(factory: Callable[[], AbstractAsyncContextManager[T]]) -> Shared[T]:
    """Shares an async resource among the coroutines of jax_threadmap's loop.

    ``async def`` kernels run as coroutines on jax_threadmap's one event loop
    (see [async def kernels](async-kernels.md)). A client session or connection
    pool they share must be opened and closed on that loop: ``shared(factory)``
    returns a handle whose ``await handle.value()``, in an ``async def`` kernel
    (or derivative kernel, or ``async def`` loader of
    [`async_call`][jax_threadmap.async_call]), enters ``factory()`` on the loop
    the first time and returns what it entered, to every element of every map
    until exit, when the package exits it on the loop (after cancelling what is
    still pending there, before the loop closes; the last opened first). Nothing
    is opened when the handle is made, and a program that never uses it never
    starts the loop.

    Args:
        factory: A callable with no arguments returning an async context
            manager: ``aiohttp.ClientSession``, ``functools.partial(
            aiohttp.ClientSession, base_url=...)``, a function decorated with
            ``contextlib.asynccontextmanager`` (the value is what it yields), or
            a database pool factory. Usable as a decorator. Its name is the
            resource's name in messages.

    Returns:
        A [`Shared`][jax_threadmap.Shared] handle. Make it once (at module
        level, like the kernel), not per call.

    Raises:
        TypeError: ``factory`` is not callable (an instance was passed instead
            of its class). At the first use, a factory that returns no async
            context manager.

    Examples:
        An ``aiohttp`` session for every request of every map (a sketch: the
        server runs elsewhere; docs/async-kernels.md runs it against a local
        one)::

            import aiohttp
            session = jax_threadmap.shared(aiohttp.ClientSession)

            @jax_threadmap.kernel(jax.ShapeDtypeStruct((), jnp.float32))
            async def fetch(i):
                http = await session.value()
                async with http.get(f"http://127.0.0.1:8080/{int(i)}") as r:
                    return float(await r.text())

        Any async context manager:

        >>> import contextlib, jax, jax.numpy as jnp
        >>> import jax_threadmap
        >>> @jax_threadmap.shared
        ... @contextlib.asynccontextmanager
        ... async def offsets():
        ...     yield {"base": 100.0}  # a connection would open here...
        ...     # ...and close here, at exit
        >>> async def shifted(x):
        ...     return x + (await offsets.value())["base"]
        >>> jax.vmap(lambda x: jax_threadmap.threadmap(
        ...     shifted, jax.ShapeDtypeStruct((), jnp.float32), x))(jnp.arange(3.0))
        Array([100., 101., 102.], dtype=float32)
    """
    return Shared(factory)


@_fork.in_child
def _after_fork_in_child() -> None:
    for handle in list(_handles):
        handle._forget()
