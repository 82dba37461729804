"""Arrays whose values a background call is still computing.

``async_call(fn, result_shape_dtypes, *args)`` (:mod:`._calls`) starts
``fn(*args)`` on a small shared pool and returns at once a pytree of
:class:`AsyncArray`. An
``AsyncArray`` knows its shape and dtype, so ``jax.jit`` traces and compiles with
it while ``fn`` still runs. When the compiled program is called, the
argument-sharding hook in :mod:`._compat` asks the dispatch mechanism
(:mod:`._dispatch`) for its buffers.

One :class:`~._task.Task` backs all the arrays of one call (:mod:`._task`). At
exit, calls still running are reported and abandoned (:func:`_at_exit`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import warnings
from collections.abc import Callable, Iterator
from typing import Any, overload

import jax
import numpy as np

from . import _compat, _deadlock, _dispatch, _task
from ._dispatch import ENV_ASYNC_DISPATCH as ENV_ASYNC_DISPATCH
from ._dispatch import MAX_WAITING_PROGRAMS as MAX_WAITING_PROGRAMS
from ._dispatch import AsyncCallFailed as AsyncCallFailed
from ._dispatch import async_dispatch_enabled as async_dispatch_enabled
from ._dispatch import async_dispatch_status as async_dispatch_status
from ._leaves import LeafSpec, describe_error, leaf_specs
from ._task import ENV_ASYNC_THREADS as ENV_ASYNC_THREADS
from ._task import PENDING, Task
from ._task import default_async_threads as default_async_threads

#: How long exit waits for calls whose function returned to place their values.
EXIT_PLACE_S = 5.0

#: How long exit waits for the deadlock watchdog's thread and probes to end.
EXIT_PROBES_S = 2.0


def _at_exit() -> None:
    _deadlock.watchdog.stop()
    with _task.live_lock:
        live = list(_task.live)
    # A call whose function returned may still be copying its values to the
    # device after its dependents got them (async dispatch): it is not abandoned.
    returned = [t.future for t in live if t.state == _task.FINISHING]
    concurrent.futures.wait(returned, timeout=EXIT_PLACE_S)
    unfinished = [t for t in live if not t.future.done()]
    if unfinished:
        names = ", ".join(f"{t.name} ({t.api})" for t in unfinished[:5])
        if len(unfinished) > 5:
            names += f" and {len(unfinished) - 5} more"
        warnings.warn(
            f"jax_threadmap: the interpreter is exiting while {len(unfinished)} "
            f"background call(s) have not returned: {names}. They are abandoned "
            "(their threads stop with the process) and their arrays never get "
            "values. Wait for them (x.block_until_ready()) before the script ends, "
            "or give the function a timeout.",
            RuntimeWarning,
            stacklevel=1,
        )
        for task in unfinished:
            task.abandon()
    _deadlock.watchdog.wait_stopped(EXIT_PROBES_S)
    _dispatch.mechanism.clean_up_at_exit()


# Registered after `import jax`, so it runs before JAX's own exit handlers.
atexit.register(_at_exit)


# --- the array ------------------------------------------------------------------------


def _binary(name: str) -> Callable[[AsyncArray, Any], Any]:
    def method(self: AsyncArray, other: Any) -> Any:
        if isinstance(other, AsyncArray):
            other = other.result()
        return getattr(self.result(), name)(other)

    method.__name__ = name
    method.__doc__ = f"Waits for the value, then applies ``jax.Array.{name}``."
    return method


def _unary(name: str) -> Callable[[AsyncArray], Any]:
    def method(self: AsyncArray) -> Any:
        return getattr(self.result(), name)()

    method.__name__ = name
    method.__doc__ = f"Waits for the value, then applies ``jax.Array.{name}``."
    return method


class AsyncArray:
    """An array whose value a background call is still computing.

    Made by [`async_call`][jax_threadmap.async_call],
    [`deferred_call`][jax_threadmap.deferred_call] or
    [`from_future`][jax_threadmap.AsyncArray.from_future], never directly. Its shape and
    dtype are known at once, so it can be passed to ``jax.jit`` functions (tracing and
    compilation proceed while the call runs; the program waits for the buffer only when
    it executes), eager ``jax.numpy`` functions, ``jax.device_put``, ``np.asarray`` and
    ``threadmap``. Python operators, indexing, ``bool``/``int``/``float`` wait for the
    value and act like those of the ``jax.Array`` that
    [`result`][jax_threadmap.AsyncArray.result] returns; use ``result()`` for any other
    ``jax.Array`` method.

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
        >>> jax.jit(lambda a: a * 2)(x)
        Array([2., 2.], dtype=float32)
    """

    __slots__ = ("_task", "_index", "__weakref__")
    _task: Task
    _index: int
    # Makes NumPy defer `ndarray + AsyncArray` to AsyncArray.__radd__.
    __array_priority__ = 100

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        raise TypeError(
            "AsyncArray cannot be constructed directly. Use "
            "jax_threadmap.async_call(fn, result_shape_dtypes, *args), "
            "jax_threadmap.deferred_call(...) or AsyncArray.from_future(...)."
        )

    @classmethod
    def _new(cls, task: Task, index: int) -> AsyncArray:
        self = object.__new__(cls)
        self._task = task
        self._index = index
        return self

    @overload
    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future[Any],
        result_shape_dtypes: jax.ShapeDtypeStruct,
        *,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> AsyncArray: ...

    @overload
    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future[Any],
        result_shape_dtypes: tuple[jax.ShapeDtypeStruct, ...],
        *,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> tuple[AsyncArray, ...]: ...

    @overload
    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future[Any],
        result_shape_dtypes: Any,
        *,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> Any: ...

    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future[Any],
        result_shape_dtypes: Any,
        *,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> Any:
        """Wraps a ``concurrent.futures.Future`` whose result is a pytree of arrays.

        The value is checked and copied to its device as soon as the future
        completes (in the thread that completes it).

        Args:
            future: A ``concurrent.futures.Future`` (from any executor) whose
                result has the structure of ``result_shape_dtypes``.
            result_shape_dtypes: A pytree whose leaves have ``shape`` and
                ``dtype`` (``jax.ShapeDtypeStruct``, arrays).
            device: Optional target ``jax.Device`` or ``jax.sharding.Sharding``
                for every leaf.

        Returns:
            A pytree of [`AsyncArray`][jax_threadmap.AsyncArray] with the structure of
            ``result_shape_dtypes``.

        Raises:
            TypeError: If ``future`` is not a ``concurrent.futures.Future``, or
                ``result_shape_dtypes`` or ``device`` is malformed.

        Examples:
            >>> from concurrent.futures import ThreadPoolExecutor
            >>> import jax, numpy as np
            >>> from jax_threadmap import AsyncArray
            >>> with ThreadPoolExecutor(1) as ex:
            ...     fut = ex.submit(np.arange, 3.0, dtype=np.float32)
            ...     x = AsyncArray.from_future(
            ...         fut, jax.ShapeDtypeStruct((3,), np.float32))
            ...     print(x + 1)
            [1. 2. 3.]
        """
        if not isinstance(future, concurrent.futures.Future):
            raise TypeError(
                "AsyncArray.from_future: future must be a concurrent.futures.Future. "
                f"Got {future!r} of type {type(future).__name__}. For a plain "
                "function use jax_threadmap.async_call(fn, result_shape_dtypes)."
            )
        treedef, specs = leaf_specs(
            result_shape_dtypes, device, "AsyncArray.from_future"
        )
        task = Task(
            None,
            None,
            None,
            name=f"a {type(future).__name__} of the caller",
            api="AsyncArray.from_future",
            treedef=treedef,
            specs=specs,
        )
        out = make_arrays(task)
        with _task.live_lock:
            _task.live.add(task)
        future.add_done_callback(task.on_source_done)
        return out

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
    def sharding(self) -> jax.sharding.Sharding | None:
        return self._spec.sharding

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
            timeout: Seconds to wait at most; ``None`` waits as long as needed.

        Returns:
            The ``jax.Array``, on its target device.

        Raises:
            TimeoutError: If ``timeout`` expires first. The array stays usable.
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
        return self._task.wait(timeout, self._describe())[self._index]

    def block_until_ready(self) -> AsyncArray:
        """Waits until the value is on its device; returns ``self``."""
        self.result().block_until_ready()
        return self

    def __jax_array__(self) -> jax.Array:
        return self.result()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return self.result().__array__(dtype=dtype, copy=copy)

    # -- never blocks --

    def _status(self) -> str:
        task = self._task
        fut = task.future
        if fut.done():
            error = fut.exception()
            if error is None:
                return "done"
            return f"failed: {describe_error(error)}"
        if task.state == PENDING and task.runnable and not task._submitted:
            return "deferred"
        return "pending"

    def _describe(self) -> str:
        return f"AsyncArray(shape={self.shape}, dtype={self.dtype})"

    def __repr__(self) -> str:
        return (
            f"AsyncArray(shape={self.shape}, dtype={self.dtype}, "
            f"{self._status()}, from {self._task.name})"
        )

    __str__ = __repr__

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __copy__(self) -> AsyncArray:
        return self  # immutable, like a tuple

    def __deepcopy__(self, memo: dict) -> AsyncArray:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self._describe()} cannot be pickled: its value may not exist yet. "
            "Pickle x.result() (the jax.Array, which waits for the value) instead."
        )

    # -- the rest waits for the value --

    def __iter__(self) -> Iterator[jax.Array]:
        return iter(self.result())

    def __getitem__(self, index: Any) -> jax.Array:
        return self.result()[index]

    __hash__ = None  # type: ignore[assignment]  # like jax.Array

    __add__ = _binary("__add__")
    __radd__ = _binary("__radd__")
    __sub__ = _binary("__sub__")
    __rsub__ = _binary("__rsub__")
    __mul__ = _binary("__mul__")
    __rmul__ = _binary("__rmul__")
    __truediv__ = _binary("__truediv__")
    __rtruediv__ = _binary("__rtruediv__")
    __floordiv__ = _binary("__floordiv__")
    __rfloordiv__ = _binary("__rfloordiv__")
    __mod__ = _binary("__mod__")
    __rmod__ = _binary("__rmod__")
    __divmod__ = _binary("__divmod__")
    __rdivmod__ = _binary("__rdivmod__")
    __pow__ = _binary("__pow__")
    __rpow__ = _binary("__rpow__")
    __matmul__ = _binary("__matmul__")
    __rmatmul__ = _binary("__rmatmul__")
    __and__ = _binary("__and__")
    __rand__ = _binary("__rand__")
    __or__ = _binary("__or__")
    __ror__ = _binary("__ror__")
    __xor__ = _binary("__xor__")
    __rxor__ = _binary("__rxor__")
    __lshift__ = _binary("__lshift__")
    __rlshift__ = _binary("__rlshift__")
    __rshift__ = _binary("__rshift__")
    __rrshift__ = _binary("__rrshift__")
    __eq__ = _binary("__eq__")
    __ne__ = _binary("__ne__")
    __lt__ = _binary("__lt__")
    __le__ = _binary("__le__")
    __gt__ = _binary("__gt__")
    __ge__ = _binary("__ge__")
    __neg__ = _unary("__neg__")
    __pos__ = _unary("__pos__")
    __abs__ = _unary("__abs__")
    __invert__ = _unary("__invert__")
    __bool__ = _unary("__bool__")
    __int__ = _unary("__int__")
    __float__ = _unary("__float__")
    __complex__ = _unary("__complex__")
    __index__ = _unary("__index__")


def make_arrays(task: Task) -> Any:
    """The pytree of arrays of ``task``'s call, one per result leaf."""
    arrays = [AsyncArray._new(task, i) for i in range(len(task.specs))]
    return jax.tree_util.tree_unflatten(task.treedef, arrays)


def _arrays_of(xs: list[AsyncArray], shardings: list[Any]) -> list[jax.Array]:
    # Called by jit only when a compiled program runs, after compilation.
    return _dispatch.mechanism.arrays_for(xs, shardings)


_compat.register_array_like(AsyncArray, AsyncArray._aval, _arrays_of)
