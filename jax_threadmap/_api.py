"""The public API: ``threadmap``, and the checks that run before anything is bound."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _compat
from ._batch_spec import BatchSpec
from ._primitive import Kernel, kernel_name, threadmap_p

Executor = int | concurrent.futures.Executor | None

#: Keyword arguments of ``threadmap`` itself; they never reach the kernel.
RESERVED_KWARGS = ("executor", "progress")


def check_executor(executor: Any, api: str = "threadmap") -> Executor:
    if executor is None or isinstance(executor, concurrent.futures.Executor):
        return executor
    if isinstance(executor, (bool, np.bool_)) or not isinstance(
        executor, (int, np.integer)
    ):
        raise TypeError(
            f"{api}: executor must be None (the shared pool), a positive int (a pool "
            "of that many threads) or a concurrent.futures.Executor. "
            f"Got executor={executor!r} of type {type(executor).__name__}."
        )
    if executor < 1:
        raise ValueError(
            f"{api}: executor=N must be a positive number of threads. "
            f"Got executor={executor!r}. Pass e.g. executor=8, or None for the "
            "shared pool."
        )
    return int(executor)


def shape_dtype_of(leaf: Any, where: str, api: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of one leaf of ``result_shape_dtypes``, checked.

    Args:
        leaf: The leaf; anything with ``.shape`` and ``.dtype``.
        where: The leaf's path, for messages (e.g. ``result_shape_dtypes['w']``).
        api: The public function, for messages.
    """
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{api}: {where} must have .shape and .dtype, like "
            "jax.ShapeDtypeStruct(shape, dtype). "
            f"Got {leaf!r} of type {type(leaf).__name__}."
        )
    try:
        return tuple(int(s) for s in shape), np.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"{api}: {where} has shape {shape!r} and dtype {dtype!r}; expected a "
            "tuple of ints and a NumPy dtype. Use jax.ShapeDtypeStruct(shape, dtype) "
            "with a concrete shape."
        ) from e


def result_avals(result_shape_dtypes: Any, api: str = "threadmap"):
    """Checks ``result_shape_dtypes``; returns its flat avals and treedef."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(result_shape_dtypes)
    avals = []
    for path, leaf in leaves:
        where = "result_shape_dtypes" + jax.tree_util.keystr(path)
        shape, dtype = shape_dtype_of(leaf, where, api)
        if any(s < 0 for s in shape):
            raise ValueError(
                f"{api}: {where} has a negative dimension in shape {shape}."
            )
        canonical = jax.dtypes.canonicalize_dtype(dtype)
        if canonical != dtype:
            raise ValueError(
                f"{api}: {where} asks for dtype {dtype}, but JAX would give "
                f"{canonical} because jax_enable_x64 is off. Declare {canonical}, or "
                "enable x64 with jax.config.update('jax_enable_x64', True)."
            )
        avals.append(_compat.ShapedArray(shape, dtype))
    return tuple(avals), jax.tree_util.tree_structure(result_shape_dtypes)


def check_operands(args: tuple, kwargs: dict, api: str = "threadmap"):
    """Flattens ``(args, kwargs)``; every leaf must be an array or a scalar."""
    with_path, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    for path, leaf in with_path:
        try:
            _compat.typeof(leaf)
        except TypeError:
            where = _arg_name(path)
            raise TypeError(
                f"{api}: {where} is a {type(leaf).__name__} ({_short(leaf)}), not an "
                "array. Arguments are passed to JAX, so every leaf must be an array "
                "(jax.Array, numpy.ndarray) or a number; bind other values with "
                "functools.partial or a closure over the kernel."
            ) from None
    return [leaf for _, leaf in with_path], in_tree


def _arg_name(path) -> str:
    """'positional argument 1 (at ['a'])' for a path into ``(args, kwargs)``."""
    top, first, *rest = path
    name = (
        f"positional argument {first.idx}"
        if top.idx == 0
        else f"keyword argument {first.key!r}"
    )
    return name + (f" (at {jax.tree_util.keystr(tuple(rest))})" if rest else "")


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def threadmap(
    kernel: Callable[..., Any],
    result_shape_dtypes: Any,
    *args: Any,
    executor: Executor = None,
    progress: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Calls a host kernel per element, as one threaded map under any ``vmap``.

    Call it like :func:`jax.pure_callback`: inside the function you ``vmap``, with
    the *unbatched* arguments. ``kernel`` receives NumPy arrays of exactly the
    unbatched shapes (0-d arrays for scalars, read-only views, no copies per
    element) plus ``kwargs``, and returns one element's result. However many
    ``vmap`` levels wrap the call, it stays one ``threadmap`` equation; the host
    runs one flat map over all elements on a thread pool, and arguments that are
    not batched are never tiled.

    Args:
        kernel: A function of NumPy arrays returning a pytree of arrays (or
            numbers) that matches ``result_shape_dtypes``. Pass the same function
            object on every call so that jit caches hit.
        result_shape_dtypes: A pytree of objects with ``.shape`` and ``.dtype``
            (e.g. :class:`jax.ShapeDtypeStruct`) describing one element's result.
        *args: Pytrees of arrays, passed positionally to ``kernel``.
        executor: Where the elements run. ``None``: the shared process-wide pool
            of ``JAX_THREADMAP_NUM_THREADS`` threads (default: one per CPU). An
            ``int`` N: a shared pool of N threads. A
            :class:`concurrent.futures.Executor`: used as given. A pool's size is
            a hard bound on the kernels running at once and on the threads that
            ever run kernels.
        progress: Show a progress bar (tqdm when installed, else lines on
            stderr) for maps that run longer than about a second. ``None``: on
            when the environment variable ``JAX_THREADMAP_PROGRESS=1`` is set.
            Costs nothing when off.
        **kwargs: Pytrees of arrays, passed by keyword to ``kernel``. The names
            ``executor`` and ``progress`` are reserved by ``threadmap`` and cannot
            reach the kernel.

    Returns:
        A pytree of arrays with the structure of ``result_shape_dtypes``; under
        ``vmap``, each leaf gains the batch axes.

    Raises:
        TypeError: ``kernel``, ``result_shape_dtypes``, ``executor`` or an argument
            is not what is expected (raised at call time, before anything runs).
        KernelError: At run time, when the kernel raises or returns a value of
            the wrong shape, dtype kind or structure; the message names the
            batch index. Under ``jit`` it arrives wrapped in JAX's runtime error.

    Example:
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
    """
    _compat.require(_compat.THREADMAP, "jax_threadmap.threadmap")
    if not callable(kernel):
        raise TypeError(
            f"threadmap: kernel must be callable. Got {kernel!r} of type "
            f"{type(kernel).__name__}. Pass the kernel first, then "
            "result_shape_dtypes, then the arguments."
        )
    executor = check_executor(executor)
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise TypeError(
            f"threadmap: progress must be True, False or None. Got {progress=}."
        )
    avals, out_tree = result_avals(result_shape_dtypes)
    leaves, in_tree = check_operands(args, kwargs)
    outs = threadmap_p.bind(
        *leaves,
        kernel=Kernel(kernel, kernel_name(kernel)),
        result_avals=avals,
        in_tree=in_tree,
        out_tree=out_tree,
        spec=BatchSpec.unbatched(len(leaves)),
        executor=executor,
        progress=None if progress is None else bool(progress),
    )
    return jax.tree_util.tree_unflatten(out_tree, outs)
