"""The constructors of async arrays: ``async_call`` and ``deferred_call``.

Each checks its arguments, makes the :class:`~._task.Task` that backs every
array of the call, and returns the pytree of :class:`~._async.AsyncArray`
(``AsyncArray.from_future`` lives with the array, in :mod:`._async`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import jax

from ._async import AsyncArray, make_arrays
from ._leaves import leaf_specs
from ._task import Task
from ._validate import callable_name


def _new_task(
    fn: Any,
    result_shape_dtypes: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: Any,
    api: str,
    timeout: float | None = None,
) -> Task:
    if not callable(fn):
        raise TypeError(
            f"jax_threadmap.{api}: fn must be callable. Got {fn!r} of type "
            f"{type(fn).__name__}. Pass the function first, then "
            "result_shape_dtypes, then its arguments."
        )
    treedef, specs = leaf_specs(result_shape_dtypes, device, api)
    _check_timeout(timeout, api)
    return Task(
        fn,
        args,
        kwargs,
        name=f"`{callable_name(fn)}`",
        api=api,
        treedef=treedef,
        specs=specs,
        timeout=timeout,
    )


def _check_timeout(timeout: Any, api: str) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"jax_threadmap.{api}: timeout must be None or a number of seconds. "
            f"Got timeout={timeout!r} of type {type(timeout).__name__}. To pass a "
            "keyword argument named timeout to fn, bind it with functools.partial."
        )
    if not 0 < timeout < float("inf"):
        raise ValueError(
            f"jax_threadmap.{api}: timeout must be a positive, finite number of "
            f"seconds. Got timeout={timeout!r}. Pass None to let the call run as "
            "long as it takes."
        )


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
    threads (default ``min(32, cpus + 4)``) and runs exactly once, however many arrays
    it returns. When it finishes, its result is checked against ``result_shape_dtypes``
    and copied to its device. Meanwhile the returned
    [`AsyncArray`][jax_threadmap.AsyncArray] leaves can be passed to ``jax.jit``
    functions, which trace and compile with their shapes and dtypes and wait for the
    data only when the compiled program runs, so compilation hides behind the call.

    A thread that needs a value whose call has not started yet (all workers
    busy) runs the call itself rather than waiting.

    Args:
        fn: The function to call. It returns a pytree of arrays (NumPy arrays,
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
        timeout: Reserved keyword (not passed to ``fn``). Seconds that ``fn``
            may run, counted from when it starts; then the call is given up
            on: every use of its arrays raises a ``TimeoutError`` naming
            ``fn``, and so do the results of the jitted calls already
            dispatched with them (as ``JaxRuntimeError``). ``fn``'s thread
            runs on until it returns (Python cannot stop a thread); what it
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
            a device or sharding.
        ValueError: If ``result_shape_dtypes`` has no leaves, or ``device``
            cannot hold a declared shape.

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
        >>> predict(params, jnp.arange(3.0))  # compiles while loading
        Array([3., 3., 3.], dtype=float32)
    """
    task = _new_task(
        fn, result_shape_dtypes, args, kwargs, device, "async_call", timeout
    )
    out = make_arrays(task)
    task.submit()
    return out


@overload
def deferred_call(
    fn: Callable[..., Any],
    result_shape_dtypes: jax.ShapeDtypeStruct,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> AsyncArray: ...


@overload
def deferred_call(
    fn: Callable[..., Any],
    result_shape_dtypes: tuple[jax.ShapeDtypeStruct, ...],
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> tuple[AsyncArray, ...]: ...


@overload
def deferred_call(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> Any: ...


def deferred_call(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """Like ``async_call``, but runs ``fn`` only when a value is first needed.

    A thunk-backed array: nothing runs until the first use of any of the
    returned arrays (``result()``, ``block_until_ready()``, a jitted program
    that executes with it, ``np.asarray``, an operator...). That first use runs
    ``fn`` in its own thread, or on the pool when it is ``result(timeout=...)``,
    so that the timeout holds. ``done()`` and ``repr`` never start it, and
    ``jax.jit`` tracing and compiling with the arrays does not either, so
    a program that is traced but never run never pays for the call.

    Args:
        fn: The function to call, as in [`async_call`][jax_threadmap.async_call].
        result_shape_dtypes: A pytree whose leaves have ``shape`` and ``dtype``.
        *args: Positional arguments of ``fn``.
        device: Reserved keyword, as in [`async_call`][jax_threadmap.async_call].
        timeout: Reserved keyword, as in [`async_call`][jax_threadmap.async_call].
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        A pytree of [`AsyncArray`][jax_threadmap.AsyncArray] with the structure of
        ``result_shape_dtypes``.

    Raises:
        TypeError: As [`async_call`][jax_threadmap.async_call].
        ValueError: As [`async_call`][jax_threadmap.async_call].

    Examples:
        >>> import jax, numpy as np
        >>> import jax_threadmap as jtm
        >>> x = jtm.deferred_call(np.full, jax.ShapeDtypeStruct((2,), np.float32),
        ...                       2, 7.0, dtype=np.float32)
        >>> x.done()
        False
        >>> x + 1
        Array([8., 8.], dtype=float32)
    """
    task = _new_task(
        fn, result_shape_dtypes, args, kwargs, device, "deferred_call", timeout
    )
    return make_arrays(task)
