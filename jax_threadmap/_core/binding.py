"""``threadmap``: one call checked and bound as a ``threadmap`` equation (a
``jax_threadmap.kernel``'s call binds through :func:`bind` too: ``api.py``)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, overload

import jax
import numpy as np

from .._coroutines import async_kernels as _async_kernels
from .._executors.runners import Executor
from .._host.batch_spec import BatchSpec
from .._jax import hooks as _hooks
from .._support import validate as _validate
from .params import InOrder, KernelParam, ResidualRule, hashable
from .primitive import threadmap_p


def check_executor(executor: Any, api: str = "threadmap") -> Executor | InOrder:
    """``executor`` as ``threadmap`` uses it. (``JAX_THREADMAP_NUM_THREADS``, the
    size of ``None``'s pool, is read where the map runs, and checked where a
    jitted call's program is built: ``lowering.py``.)"""
    if isinstance(executor, InOrder):
        if isinstance(executor.executor, InOrder):
            raise TypeError(
                f"{api}: InOrder takes the executor itself, not another InOrder. "
                f"Got executor={executor!r}. Pass InOrder(8), for example."
            )
        return InOrder(check_executor(executor.executor, api))
    if executor is None or isinstance(executor, concurrent.futures.Executor):
        return executor
    if isinstance(executor, (bool, np.bool_)) or not isinstance(
        executor, (int, np.integer)
    ):
        raise TypeError(
            f"{api}: executor must be None (the shared pool), a positive int (a pool "
            "of that many threads), a concurrent.futures.Executor, or one of these "
            "in jax_threadmap.InOrder (elements in index order). "
            f"Got executor={executor!r} of type {type(executor).__name__}."
        )
    if executor < 1:
        raise ValueError(
            f"{api}: executor=N must be a positive number of threads. "
            f"Got executor={executor!r}. Pass e.g. executor=8, or None for the "
            "shared pool."
        )
    if executor > _validate.MAX_THREADS:
        raise ValueError(
            f"{api}: executor=N must be at most {_validate.MAX_THREADS} threads. Got "
            f"executor={int(executor)}. Pass the number of kernels that should run at "
            "once (e.g. 32 for network reads), not the number of elements; for more "
            "concurrency than that, pass your own concurrent.futures.Executor."
        )
    return int(executor)


def bind(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    executor: Executor | InOrder,
    progress: bool | None,
    vectorized: tuple[bool, int | None],
    max_in_flight: int | None = None,
    jvp: Callable[..., Any] | None = None,
    vjp: Callable[..., Any] | ResidualRule | None = None,
    wrapped: bool = False,
) -> Any:
    """Binds one ``threadmap`` equation; every argument is checked already.

    ``jvp``, ``vjp``: a ``jax_threadmap.kernel``'s rules as the param carries
    them (``api.py``); ``wrapped``: called by a ``KernelFunction`` (for the
    message when it lacks a derivative kernel).
    """
    _hooks.require(_hooks.THREADMAP, "jax_threadmap.threadmap")
    avals, out_tree = _validate.result_avals(result_shape_dtypes)
    leaves, in_tree = _validate.check_operands(args, kwargs)
    outs = threadmap_p.bind(
        *leaves,
        kernel=KernelParam(
            hashable(fn),
            in_tree,
            out_tree,
            jvp,
            vjp,
            *vectorized,
            wrapped=wrapped,
            max_in_flight=max_in_flight,
        ),
        result_avals=avals,
        spec=BatchSpec.unbatched(len(leaves)),
        executor=executor,
        progress=progress,
    )
    return jax.tree_util.tree_unflatten(out_tree, outs)


@overload
def threadmap(
    kernel: Callable[..., Any],
    result_shape_dtypes: jax.ShapeDtypeStruct,
    /,
    *args: Any,
    executor: int | concurrent.futures.Executor | InOrder | None = None,
    progress: bool | None = None,
    vectorized: bool | int = False,
    max_in_flight: int | None = None,
    **kwargs: Any,
) -> jax.Array: ...


@overload
def threadmap(
    kernel: Callable[..., Any],
    result_shape_dtypes: tuple[jax.ShapeDtypeStruct, ...],
    /,
    *args: Any,
    executor: int | concurrent.futures.Executor | InOrder | None = None,
    progress: bool | None = None,
    vectorized: bool | int = False,
    max_in_flight: int | None = None,
    **kwargs: Any,
) -> tuple[jax.Array, ...]: ...


@overload
def threadmap(
    kernel: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    executor: int | concurrent.futures.Executor | InOrder | None = None,
    progress: bool | None = None,
    vectorized: bool | int = False,
    max_in_flight: int | None = None,
    **kwargs: Any,
) -> Any: ...


def threadmap(
    kernel: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    executor: int | concurrent.futures.Executor | InOrder | None = None,
    progress: bool | None = None,
    vectorized: bool | int = False,
    max_in_flight: int | None = None,
    **kwargs: Any,
) -> Any:
    """Calls a host kernel per element, as one threaded map under any ``vmap``.

    Call it like
    [`jax.pure_callback`](https://docs.jax.dev/en/latest/_autosummary/jax.pure_callback.html):
    inside the function you ``vmap``, with the *unbatched* arguments. ``kernel``
    receives NumPy arrays of exactly the unbatched shapes (0-d arrays for scalars,
    read-only views, no copies per element) plus ``kwargs``, and returns one element's
    result. However many ``vmap`` levels wrap the call, it stays one ``threadmap``
    equation; the host runs one flat map over all elements on a thread pool, and
    arguments that are not batched are never tiled.

    Args:
        kernel: A function of NumPy arrays returning a pytree of arrays (or
            numbers) that matches ``result_shape_dtypes``. Pass the same function
            object on every call so that jit caches hit.
        result_shape_dtypes: A pytree of objects with ``.shape`` and ``.dtype``
            (e.g.
            [`jax.ShapeDtypeStruct`](https://docs.jax.dev/en/latest/_autosummary/jax.ShapeDtypeStruct.html))
            describing one element's result.
        *args: Pytrees of arrays, passed positionally to ``kernel``.
        executor: Where the elements run. ``None``: the shared process-wide pool
            of ``JAX_THREADMAP_NUM_THREADS`` threads (default: one per CPU). An
            ``int`` N (at most 4096): a shared pool of N threads. A
            [`concurrent.futures.Executor`](https://docs.python.org/3/library/concurrent.futures.html#executor-objects):
            used as given. A pool's size is a hard bound on the kernels of all its
            maps running at once (but for a kernel waiting for a nested map, which
            runs that map's elements meanwhile); its threads are shared by every
            size, started on demand, and exit after 2 s idle (see
            [executors and threads](executors.md)). Any of these in
            [`InOrder`][jax_threadmap.InOrder]: the elements run one per claim in
            index order on every thread at once, as `ThreadPoolExecutor.map` does,
            for elements that wait for each other.
        progress: Show a progress bar (tqdm's; without tqdm, a warning) for
            maps that run longer than about a second. ``None``: on
            when the environment variable ``JAX_THREADMAP_PROGRESS=1`` is set.
            Costs nothing when off.
        vectorized: ``False``: ``kernel`` takes one element. ``True``: it takes a
            chunk of ``k`` elements: every operand (batched or not; unbatched
            ones as read-only views that repeat one element with stride 0)
            with one leading axis of length ``k``, and it returns every result
            with that leading axis. One call per chunk, chunks in parallel on the
            executor, any ``vmap`` nesting folded into one flat map; chunks are
            long enough that the per-call cost vanishes (a few per worker, at
            most about 16 MB of operands and results). An ``int`` N: vectorized,
            with at most N elements per chunk (for kernels that need memory per
            element).
        max_in_flight: For an ``async def`` kernel, the most elements awaited at
            once. ``None``: 2048. An ``async def`` kernel
            runs each element as a coroutine on jax_threadmap's one event loop
            (the loop of ``async def`` loaders), not a thread each; it takes
            ``executor=None`` and ``vectorized=False`` only (see
            [async def kernels](async-kernels.md)). Plain
            kernels ignore it.
        **kwargs: Pytrees of arrays, passed by keyword to ``kernel``. The names
            ``executor``, ``progress``, ``vectorized`` and ``max_in_flight`` are
            reserved by ``threadmap`` and cannot reach the kernel (``kernel`` and
            ``result_shape_dtypes`` are positional-only, so those names do reach
            it); ``sharding`` and
            ``vmap_method``, keywords of ``jax.pure_callback``, are refused.

    Returns:
        A pytree of arrays with the structure of ``result_shape_dtypes``; under
        ``vmap``, each leaf gains the batch axes.

    Raises:
        TypeError: ``kernel``, ``result_shape_dtypes``, ``executor``,
            ``max_in_flight`` or an argument is not what is expected (raised at
            call time, before anything runs); an ``async def`` kernel with an
            executor or ``vectorized``.
        ValueError: ``result_shape_dtypes`` has no leaves (``None``, ``()``,
            ``{}``): under ``jit`` the kernel would never run. A kernel run for
            its side effects returns a small status per element instead.
        KernelError: At run time, when the kernel raises or returns a value of
            the wrong shape, dtype kind or structure, or a value that the
            declared dtype cannot hold (an integer out of range, a finite float
            that would overflow; results are never wrapped or narrowed to inf);
            the message names the batch index (for a vectorized kernel, the
            chunk's range of batch indices). Under ``jit`` it arrives wrapped in
            JAX's runtime error.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax_threadmap import threadmap
        >>> def kernel(x, y):  # one element: x has shape (3,), y is 0-d
        ...     return np.sort(x) * y
        >>> def f(x, y):
        ...     out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     return threadmap(kernel, out, x, y)
        >>> x = jnp.arange(24.0).reshape(2, 4, 3)[..., ::-1]
        >>> y = jnp.arange(4.0)
        >>> jax.jit(jax.vmap(jax.vmap(f), in_axes=(0, None)))(x, y).shape
        (2, 4, 3)

        A vectorized kernel gets a chunk of elements at once:

        >>> def add(x, y):  # x: (k,), y: (k,) repeating one value
        ...     return x + y
        >>> g = jax.vmap(lambda x, y: threadmap(add, jax.ShapeDtypeStruct((),
        ...     x.dtype), x, y, vectorized=True), in_axes=(0, None))
        >>> g(jnp.arange(4.0), 10.0)
        Array([10., 11., 12., 13.], dtype=float32)
    """
    _validate.check_callable(
        kernel,
        "threadmap",
        "kernel",
        "Pass the kernel first, then result_shape_dtypes, then the arguments.",
    )
    executor = check_executor(executor)
    chunking = _validate.check_vectorized(vectorized)
    if max_in_flight is not None or _validate.is_coroutine_function(kernel):
        # (A plain kernel's call never visits the async kernels' module.)
        _async_kernels.check_async_kernel(
            kernel, executor=executor, vectorized=chunking[0], api="threadmap"
        )
        max_in_flight = _async_kernels.check_max_in_flight(max_in_flight)
    return bind(
        kernel,
        result_shape_dtypes,
        args,
        kwargs,
        executor=executor,
        progress=_validate.check_progress(progress),
        vectorized=chunking,
        max_in_flight=max_in_flight,
    )
