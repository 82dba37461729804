"""Async arrays and their constructors: what users hold and make.

- :class:`AsyncArray`: an array whose value a background call is still
  computing. ``jax.jit`` traces and compiles with its shape and dtype while the
  call runs; when a compiled program runs with it, the argument handler
  registered here (through :mod:`.._jax.array_types`) asks :mod:`.dispatch`
  for buffers; a run with it (the hook on program runs installed here,
  :func:`_around`) returns ``AsyncArray`` s of the call :mod:`.dispatch` hands
  back.
- :func:`async_call`: makes the :class:`~.task.Task` behind every array of
  one call.
- Exit (:func:`_at_exit`): calls still running are reported and abandoned.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, overload

import jax
import numpy as np

from .._coroutines import event_loop as _event_loop
from .._jax import array_types as _array_types
from .._jax import hooks as _hooks
from .._support.validate import check_timeout
from . import array_surface as _surface
from . import async_pool as _async_pool
from . import dispatch as _dispatch
from .leaves import LeafSpec
from .task import Task


def _at_exit() -> None:
    _async_pool.abandon_at_exit()
    _event_loop.close_at_exit()


# Registered after `import jax`, so it runs before JAX's own exit handlers.
atexit.register(_at_exit)


# --- the array ------------------------------------------------------------------------


class AsyncArray(jax.Array):
    """An array whose value a background call is still computing.

    Made by [`async_call`][jax_threadmap.async_call] (or
    [`async_array_from_callback`][jax_threadmap.async_array_from_callback]), never
    directly. Its shape and dtype are known at once, so it can be passed to ``jax.jit``
    functions (tracing and compilation proceed while the call runs; the program waits
    for the buffer only when it executes), eager ``jax.numpy`` functions,
    ``jax.device_put``, ``np.asarray`` and ``threadmap``. Every method, operator and
    property of ``jax.Array`` works as on the ``jax.Array`` that
    [`result`][jax_threadmap.AsyncArray.result] returns: those that need no value
    (``x.T``, ``x.sum()``, ``x.astype(t)``, ``x[0]``, ``x * 2``, ``x.at[i].set(v)``) run
    JAX's own under ``jax.jit`` and return at once; those that read the buffer
    (``item``, ``tolist``, ``np.asarray``, ``__dlpack__``, ``unsafe_buffer_pointer``,
    ``addressable_shards``, pickling) wait for the value in Python first. ``repr`` never
    waits; ``sharding`` is ``None`` when uncommitted. It is a ``jax.Array``
    (``isinstance(x, jax.Array)`` is ``True`` in every state), so JAX and the libraries
    that test for one (Equinox, Optax, Flax) take it as an array.

    If the call raised, every use of the array re-raises that exception (same
    type, message and ``__cause__``, with a note naming the call).

    Attributes:
        shape: The declared shape.
        dtype: The dtype of the value on device (the declared dtype,
            canonicalised as ``jnp.asarray`` does: float64 becomes float32
            unless ``jax_enable_x64`` is on).
        ndim: ``len(shape)``.
        size: The number of elements.
        sharding: Where the value goes: the target ``device`` or sharding, or
            ``None`` for the default device (uncommitted, like ``jnp.asarray``).

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import jax_threadmap as jtm
        >>> x = jtm.async_call(np.ones, jax.ShapeDtypeStruct((2,), jnp.float32),
        ...                    2, dtype=np.float32)
        >>> x.shape, x.dtype
        ((2,), dtype('float32'))
        >>> y = jax.jit(lambda a: a * 2)(x)  # an AsyncArray, as its argument
        >>> print(y)
        [2. 2.]
    """

    # jax.Array's C++ class has a weak-reference slot on JAX 0.6, none from 0.7.
    __slots__ = ("_task", "_index") + (
        () if jax.Array.__weakrefoffset__ else ("__weakref__",)
    )
    _task: Task
    _index: int
    # Makes NumPy defer `ndarray + AsyncArray` to AsyncArray.__radd__.
    __array_priority__ = 100

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        raise TypeError(
            "AsyncArray cannot be constructed directly. Use "
            "jax_threadmap.async_call(fn, result_shape_dtypes, *args)."
        )

    @classmethod
    def _new(cls, task: Task, index: int) -> AsyncArray:
        self = object.__new__(cls)
        self._task = task
        self._index = index
        return self

    @classmethod
    def _of_call(cls, task: Task) -> list[AsyncArray]:
        """The arrays of ``task``'s call, one per result leaf, in order."""
        return [cls._new(task, i) for i in range(len(task.specs))]

    def _pending(self) -> _dispatch.Pending:
        """What a dispatch reads of this array: its call and leaf."""
        return _dispatch.Pending(self._task, self._index, self)

    # -- what jit needs, without waiting --

    @property
    def _spec(self) -> LeafSpec:
        return self._task.specs[self._index]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype:
        return self._spec.aval.dtype

    @property
    def ndim(self) -> int:
        return len(self._spec.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._spec.shape, dtype=np.int64))

    @property
    def sharding(self) -> jax.sharding.Sharding | None:  # type: ignore[override]
        return self._spec.sharding

    @property
    def _committed(self) -> bool:
        # What jit reads of a jax.Array argument (and a key array of its key
        # data): committed where its sharding is known (device=, or a result).
        return self._spec.sharding is not None

    def _aval(self) -> Any:
        return self._spec.aval

    # -- the value --

    def cancel(self) -> bool:
        """Gives up on the call that computes this array, unless it has finished.

        Like ``concurrent.futures.Future.cancel``, but a call that is already
        running is given up on too: every use of its arrays (this one and the
        other leaves of the same call) raises ``concurrent.futures.CancelledError``
        naming the function, and so do the results of jitted calls already
        dispatched with them (as ``JaxRuntimeError``). The function's thread
        runs on until it returns (Python cannot stop a thread); what it
        returns then is dropped.

        Returns:
            ``True`` if the call was given up on now, ``False`` if it had
            already finished (with a value or an error).

        Examples:
            >>> import threading
            >>> import jax, numpy as np
            >>> import jax_threadmap as jtm
            >>> never = threading.Event()
            >>> x = jtm.async_call(lambda: never.wait(60) and np.zeros(2),
            ...                    jax.ShapeDtypeStruct((2,), np.float32))
            >>> x.cancel()
            True
            >>> x.done(), x.cancel()
            (True, False)
            >>> never.set()
        """
        return self._task.cancel()

    def done(self) -> bool:
        """Returns whether the value (or the call's error) is available now."""
        return self._task.future.done()

    def result(self, timeout: float | None = None) -> jax.Array:
        """Waits for the value and returns it as a ``jax.Array``.

        Args:
            timeout: Seconds to wait at most (0: do not wait); ``None`` waits as
                long as needed.

        Returns:
            The ``jax.Array``, on its target device.

        Raises:
            TimeoutError: If ``timeout`` expires first. The array stays usable.
            TypeError: If ``timeout`` is not ``None`` or a number.
            ValueError: If ``timeout`` is negative, NaN or infinite.
            Exception: Whatever the call raised, or a ``ValueError`` if it
                returned values that do not match ``result_shape_dtypes``.

        Examples:
            >>> import jax, numpy as np
            >>> import jax_threadmap as jtm
            >>> x = jtm.async_call(np.zeros, jax.ShapeDtypeStruct((2,), np.float32),
            ...                    2, dtype=np.float32)
            >>> x.result(timeout=30)
            Array([0., 0.], dtype=float32)
        """
        seconds = None
        if timeout is not None:
            seconds = check_timeout(timeout, "AsyncArray.result", zero=True)
        return self._task.value(self._index, seconds, self._describe)

    def is_ready(self) -> bool:
        """Whether the value is on its device now (never waits), as for
        ``jax.Array.is_ready``; ``False`` while the call runs or has failed."""
        if not self._task.future.done() or self._task.future.exception():
            return False
        return bool(self.result().is_ready())  # type: ignore[attr-defined]

    def block_until_ready(self) -> AsyncArray:
        """Waits until the value is on its device; returns ``self``."""
        self.result().block_until_ready()
        return self

    # -- never blocks --

    def _describe(self) -> str:
        return f"AsyncArray(shape={self.shape}, dtype={self.dtype})"

    def __repr__(self) -> str:
        # Landed: the jax.Array's repr (which raises once it is deleted or
        # donated); before, its state.
        if self._landed():
            return repr(self.result())
        return (
            f"AsyncArray(shape={self.shape}, dtype={self.dtype}, "
            f"{self._task.status()}, from {self._task.name})"
        )

    def __str__(self) -> str:
        # Landed, or the result of a jitted call on pending data (deferred
        # dispatch): its values, as the jax.Array it stands for prints.
        if self._task.stands_for_an_array or self._landed():
            return str(self.result())
        return repr(self)

    def _landed(self) -> bool:  # its value on the device, or deleted (no wait)
        done = self._task.status() == "done"
        return done and (self.result().is_deleted() or self.is_ready())

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self) -> Iterator[Any]:
        return _surface.iterate(self, _is_async)

    def __reversed__(self) -> Iterator[Any]:
        return iter(self[::-1])

    if sys.version_info >= (3, 12):  # the buffer protocol from Python (PEP 688)

        def __buffer__(self, flags: int) -> memoryview:
            _interrupted.error = None
            try:
                return _surface.landed(self).__buffer__(flags)
            except KeyboardInterrupt as e:
                # np.asarray tries this first and swallows its errors, a Ctrl-C's
                # too, then calls __array__: there it is raised again.
                _interrupted.error = e
                raise

    @property
    def aval(self) -> Any:
        return self._spec.aval

    @property
    def weak_type(self) -> bool:
        return bool(self._spec.aval.weak_type)

    # A key array (a dtype key<impl>): jax.random's eager rules read these two
    # fields of JAX's key arrays (hook PRNGKeyArray); the key data is deferred.
    @property
    def _impl(self) -> Any:
        if not jax.dtypes.issubdtype(self.dtype, jax.dtypes.prng_key):
            raise AttributeError("_impl: not a key array")
        return _hooks.get("PRNGKeyArray")(self.dtype)

    @property
    def _base_array(self) -> Any:
        self._impl  # noqa: B018 - a key array only
        return _surface.apply(jax.random.key_data, self, (), {}, _is_async)

    __hash__ = None  # type: ignore[assignment]  # like jax.Array


def _is_async(x: Any) -> bool:
    return isinstance(x, AsyncArray)


_surface.install(AsyncArray, _is_async)
_interrupted = threading.local()  # a Ctrl-C in __buffer__, for __array__
_waiting_array = _surface._waiting("__array__")


def _array(self: AsyncArray, *args: Any, **kwargs: Any) -> Any:
    if error := vars(_interrupted).pop("error", None):
        raise error
    return _waiting_array(self, *args, **kwargs)


AsyncArray.__array__ = _array  # type: ignore[method-assign,assignment]


def _delete(self: AsyncArray) -> None:
    """``jax.Array.delete``: waits for the value, lets the pending deferred programs
    that read it take it first, then deletes it."""
    value = _surface.landed(self)
    _dispatch.mechanism.settle(self._task)
    value.delete()


AsyncArray.delete = _delete  # type: ignore[method-assign,assignment]


def make_arrays(task: Task) -> Any:
    """The pytree of arrays of ``task``'s call, one per result leaf."""
    if not _dispatch.mechanism.prepared:  # before any dispatch with them
        _dispatch.mechanism.prepare(_around)
        # jax.device_put(x) with nowhere to go: x itself (a failed x raises)
        _hooks.or_missing("batched_device_put_impl", lambda _: None)(
            lambda x: _is_async(x) and not x._task.status().startswith("failed")
        )
    return jax.tree_util.tree_unflatten(task.treedef, AsyncArray._of_call(task))


def _arrays_of(xs: list[AsyncArray]) -> list[jax.Array]:
    # Called by jit only when a compiled program runs, after compilation (a run
    # that was not deferred, or a deferred one whose data has landed).
    return _dispatch.mechanism.arrays_for([x._pending() for x in xs])


def _carrying(run: Any) -> tuple[Callable[..., Any], list[bool]]:
    """``run`` under this thread's settings (a deferred run is later, in any
    thread), and a flag to clear once the dispatch returned."""
    saved, caller, now = _surface.settings(), threading.get_ident(), [True]

    def as_called(program: Any, *frozen: Any) -> Any:
        with _surface.settings_as(saved):
            try:
                return run(program, *frozen)
            except Exception as e:  # jax_debug_nans: jit's own handling is over
                if type(e).__name__ != "InternalFloatingPointError" or (
                    now[0] and threading.get_ident() == caller
                ):
                    raise
                text = f"invalid value ({e.ty}) encountered in {e.name}"  # type: ignore[attr-defined]
                raise FloatingPointError(text) from None

    return as_called, now


def _around(run: Any, program: Any, args: tuple, effects: Any) -> Any:
    """Every run of a compiled program from Python, once the first
    ``AsyncArray`` is made: a run with ``AsyncArray`` arguments returns
    ``AsyncArray`` s (deferred until its data lands, or run now, blocking, and
    its array outputs wrapped); any other run is JAX's."""
    if not any(type(a) is AsyncArray for a in args):
        return run(program, *args)
    reads = [a._pending() if type(a) is AsyncArray else None for a in args]
    pending = any(r is not None and not r.task.future.done() for r in reads)
    as_called, now = _carrying(run) if pending else (run, [True])
    task, outs = _dispatch.mechanism.run(as_called, program, args, reads, effects)
    now[0] = False
    arrays = iter(make_arrays(task) if task is not None else ())
    return [next(arrays) if o is None else o for o in outs]


_array_types.register_array_like(AsyncArray, AsyncArray._aval, _arrays_of)


# --- the constructors -----------------------------------------------------------------


@overload
def async_call(
    fn: Callable[..., Any],
    result_shape_dtypes: jax.ShapeDtypeStruct,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> AsyncArray: ...


@overload
def async_call(
    fn: Callable[..., Any],
    result_shape_dtypes: tuple[jax.ShapeDtypeStruct, ...],
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> tuple[AsyncArray, ...]: ...


@overload
def async_call(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> Any: ...


def async_call(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """Starts ``fn(*args, **kwargs)`` in the background; returns its arrays now.

    ``fn`` starts at once on a shared pool of at most ``JAX_THREADMAP_ASYNC_THREADS``
    threads (default ``min(32, cpus + 4)``, or the number of local devices if more), or,
    if it is ``async def``, as a coroutine on the package's one event loop thread, and
    runs exactly once, however many arrays it returns. When it finishes, its result
    is checked against ``result_shape_dtypes`` and copied to its device. Meanwhile the
    returned [`AsyncArray`][jax_threadmap.AsyncArray] leaves can be passed to
    ``jax.jit`` functions, which trace and compile with their shapes and dtypes and
    wait for the data only when the compiled program runs, so compilation hides
    behind the call.

    A thread that needs a value whose call has not started yet (all workers
    busy) runs the call itself rather than waiting.

    Args:
        fn: The function to call, plain or ``async def`` (or returning an
            awaitable, which is awaited). It returns a pytree of arrays (NumPy arrays,
            ``jax.Array``, anything with ``shape`` and ``dtype`` that
            ``jax.device_put`` accepts) with the structure, shapes and dtypes of
            ``result_shape_dtypes``.
        result_shape_dtypes: A pytree whose leaves have ``shape`` and ``dtype``,
            such as ``jax.ShapeDtypeStruct``. A ``ShapeDtypeStruct`` leaf with a
            ``sharding`` sends that leaf there when ``device`` is not given.
        *args: Positional arguments of ``fn``.
        device: Reserved keyword (not passed to ``fn``). A ``jax.Device`` or
            ``jax.sharding.Sharding`` to put every leaf on as soon as it is
            ready; the arrays are then committed there. ``None`` (default) puts
            them on the default device, uncommitted. To pass a keyword argument
            named ``device`` to ``fn``, bind it with ``functools.partial``.
        timeout: Reserved keyword (not passed to ``fn``). Seconds from this
            call (time waiting for a pool thread included) after which the
            call is given up on: every use of its arrays raises a
            ``TimeoutError`` naming ``fn``, and so do the results of the
            jitted calls already dispatched with them (as
            ``JaxRuntimeError``). ``fn``'s thread runs on until it returns
            (Python cannot stop a thread), outside the pool's bound; what it
            returns then is dropped. ``None`` (default): no limit. To pass a
            keyword argument named ``timeout`` to ``fn``, bind it with
            ``functools.partial``.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        A pytree of [`AsyncArray`][jax_threadmap.AsyncArray] with the structure of
        ``result_shape_dtypes``.

    Raises:
        TypeError: If ``fn`` is not callable, or a leaf of
            ``result_shape_dtypes`` lacks a shape or dtype, or ``device`` is not
            a device or sharding, or ``timeout`` is not a number.
        ValueError: If ``result_shape_dtypes`` has no leaves, or ``device``
            cannot hold a declared shape, or ``timeout`` is not positive and
            finite.

    Errors of ``fn`` are not raised here: every use of any of its arrays
    re-raises them. A result of the wrong structure, shape or dtype makes every
    use raise a ``ValueError`` naming the expected and actual values.

    Examples:
        >>> import time
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import jax_threadmap as jtm
        >>> def load_weights(n):
        ...     time.sleep(0.1)  # a slow download
        ...     return {"w": np.ones((n, n), np.float32), "b": np.zeros(n, np.float32)}
        >>> shapes = {"w": jax.ShapeDtypeStruct((3, 3), jnp.float32),
        ...           "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
        >>> params = jtm.async_call(load_weights, shapes, 3)
        >>> predict = jax.jit(lambda p, x: p["w"] @ x + p["b"])
        >>> y = predict(params, jnp.arange(3.0))  # compiles while loading
        >>> print(y)  # waits for the weights
        [3. 3. 3.]
    """
    task = Task.for_call(
        fn, result_shape_dtypes, args, kwargs, device, "async_call", timeout
    )
    out = make_arrays(task)
    task.submit()
    return out
