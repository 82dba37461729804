"""Checks of the arguments users pass, shared by ``threadmap``, ``kernel`` and
async arrays.

Every check runs at call time, before anything is bound or started, and raises a
``TypeError`` or ``ValueError`` whose message names the argument, the expected and
the actual value, and what to do. The same rules for environment variables are in
:mod:`.environment`, and the rule for storing a returned value as its declared
dtype in :mod:`.result_casts`.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
from typing import Any

import jax
import numpy as np

from .._jax import avals as _avals

#: The most threads ``executor=N`` or ``JAX_THREADMAP_NUM_THREADS`` may ask for. Every
#: thread has its own stack (8 MB of address space, some of it touched), and beyond a
#: few hundred more threads only add memory and scheduling cost; a larger number is
#: almost always a mistake (such as passing a batch size as the thread count).
MAX_THREADS = 4096

#: Keyword arguments of ``threadmap`` itself; they never reach the kernel.
RESERVED_KWARGS = ("executor", "progress", "vectorized", "max_in_flight")

#: Keywords of ``jax.pure_callback`` that ``threadmap`` lacks, with what it does
#: instead; the refusal of one as a kernel's non-array argument says so.
CALLBACK_KWARGS = {
    "vmap_method": "it batches itself: under any nesting of jax.vmap it runs one "
    "flat map over all elements, one kernel call per element (or per chunk, with "
    "vectorized=True), and never tiles an unbatched argument",
    "sharding": "under jit with sharded inputs it runs where XLA's partitioner "
    "places it; to run one map per shard, call threadmap inside jax.shard_map",
}


def is_coroutine_function(fn: Any) -> bool:
    """Whether calling ``fn`` makes a coroutine: ``async def``, partials, callables.

    ``inspect.iscoroutinefunction`` unwraps ``functools.partial`` but misses an
    object whose ``__call__`` is ``async def`` (Python 3.10 to 3.13).
    """
    if inspect.iscoroutinefunction(fn):
        return True
    return callable(fn) and inspect.iscoroutinefunction(type(fn).__call__)


def callable_name(fn: Any) -> str:
    """The name a message or a jaxpr shows for a user function."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    if isinstance(fn, functools.partial):
        return f"partial({callable_name(fn.func)})"
    return type(fn).__name__


def check_callable(fn: Any, api: str, what: str, hint: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"{api}: {what} must be callable. Got {fn!r} of type "
            f"{type(fn).__name__}. {hint}"
        )


def check_progress(progress: Any, api: str = "threadmap") -> bool | None:
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise TypeError(
            f"{api}: progress must be True, False or None. Got {progress=}."
        )
    return None if progress is None else bool(progress)


def check_vectorized(
    vectorized: Any, api: str = "threadmap"
) -> tuple[bool, int | None]:
    """``vectorized=`` as ``(vectorized, max_chunk)``."""
    if isinstance(vectorized, (bool, np.bool_)):
        return bool(vectorized), None
    if isinstance(vectorized, (int, np.integer)) and vectorized >= 1:
        return True, int(vectorized)
    raise TypeError(
        f"{api}: vectorized must be False (one kernel call per element), True (one "
        "call per chunk of elements, of automatic length) or a positive int (one "
        f"call per chunk of at most that many elements). Got vectorized={vectorized!r}"
        f" of type {type(vectorized).__name__}."
    )


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
        # operator.index, not int: a dimension 2.5 is refused, not truncated to 2.
        checked = tuple(operator.index(s) for s in shape), np.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"{api}: {where} has shape {shape!r} and dtype {dtype!r}; expected a "
            "tuple of ints and a NumPy dtype. Use jax.ShapeDtypeStruct(shape, dtype) "
            "with a concrete shape of integers."
        ) from e
    if not _jax_holds(checked[1]):
        raise TypeError(
            f"{api}: {where} has dtype {checked[1]}, which a JAX array cannot hold "
            "(JAX arrays hold booleans and numbers: bool, int, uint, float, "
            "complex). Declare a numeric dtype, and return strings or objects "
            "encoded as numbers (e.g. codes into a table kept outside JAX)."
        )
    return checked


@functools.cache
def _jax_holds(dtype: np.dtype) -> bool:
    """Whether a JAX array can have ``dtype`` (bfloat16, int4 and float8 too)."""
    return (
        dtype == np.bool_
        or dtype == jax.dtypes.float0
        or bool(jax.dtypes.issubdtype(dtype, np.number))
    )


def check_has_results(result_shape_dtypes: Any, api: str) -> None:
    """Refuses a declaration without leaves (``None``, ``()``, ``{}``).

    An equation without results would be removed as dead code under ``jit`` (as
    ``jax.pure_callback`` with ``result_shape_dtypes=()`` is) but run eagerly, so
    a kernel kept for its side effects would run or not depending on ``jit``.
    """
    if jax.tree_util.tree_leaves(result_shape_dtypes):
        return
    raise ValueError(
        f"{api}: result_shape_dtypes has no array leaves (got "
        f"{result_shape_dtypes!r}), so the kernel would have no results, and "
        "under jax.jit an equation without results is removed as dead code: the "
        "kernel would never run. Declare what one element returns, e.g. "
        "jax.ShapeDtypeStruct((), jnp.float32). For a kernel run for its side "
        "effects (writing files), return a small status per element, e.g. "
        "jax.ShapeDtypeStruct((), jnp.bool_) for 'done', and use it (return it "
        "from the jitted function); results that nothing uses are removed too."
    )


def result_avals(
    result_shape_dtypes: Any,
    api: str = "threadmap",
    *,
    name: str = "result_shape_dtypes",
) -> tuple[tuple[Any, ...], Any]:
    """Checks ``result_shape_dtypes``; returns its flat avals and treedef.

    ``name``: what the declaration is called in messages; any other than
    ``result_shape_dtypes`` (``residuals``) may have no leaves.
    """
    if name == "result_shape_dtypes":
        check_has_results(result_shape_dtypes, api)
    leaves, tree = jax.tree_util.tree_flatten_with_path(result_shape_dtypes)
    avals = []
    for path, leaf in leaves:
        where = name + jax.tree_util.keystr(path)
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
        avals.append(_avals.ShapedArray(shape, dtype))
    return tuple(avals), jax.tree_util.tree_structure(result_shape_dtypes)


def check_operands(
    args: tuple[Any, ...], kwargs: dict[str, Any], api: str = "threadmap"
) -> tuple[list[Any], Any]:
    """Flattens ``(args, kwargs)``; every leaf must be an array or a scalar."""
    with_path, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    for path, leaf in with_path:
        try:
            _avals.typeof(leaf)
        except TypeError:
            name = path[1].key if path[0].idx == 1 else None
            fix = (
                f"{name}= is a keyword of jax.pure_callback, not of threadmap: "
                f"{CALLBACK_KWARGS[name]}. Drop the keyword (a kernel's own argument "
                "of that name: bind it with functools.partial)."
                if name in CALLBACK_KWARGS
                else "Bind other values with functools.partial or a closure over "
                "the kernel."
            )
            raise TypeError(
                f"{api}: {arg_name(path)} is a {type(leaf).__name__} "
                f"({_short(leaf)}), not an array. Arguments are passed to JAX, so "
                "every leaf must be an array (jax.Array, numpy.ndarray) or a "
                f"number. {fix}"
            ) from None
    return [leaf for _, leaf in with_path], in_tree


def arg_name(path: tuple[Any, ...]) -> str:
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


# --- timeouts -------------------------------------------------------------------------


def check_timeout(
    timeout: Any, api: str, *, zero: bool, hint: str = ""
) -> float | None:
    """``timeout`` as seconds (a float), or ``None``; raises on anything else.

    Args:
        timeout: What the caller passed: ``None`` or a real number of seconds.
        api: The function that took it, for the message.
        zero: Whether 0 is accepted (``result(timeout=0)`` looks without waiting;
            a call may not be given 0 s to run).
        hint: A sentence added to the ``TypeError`` (e.g. how to pass a keyword
            named ``timeout`` on to a user's function).
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"{api}: timeout must be None or a number of seconds. Got "
            f"timeout={timeout!r} of type {type(timeout).__name__}.{hint}"
        )
    seconds = float(timeout)
    if not (0 <= seconds if zero else 0 < seconds) or not math.isfinite(seconds):
        what = "non-negative" if zero else "positive"
        raise ValueError(
            f"{api}: timeout must be a {what}, finite number of seconds. Got "
            f"timeout={timeout!r}. Pass None to wait as long as it takes."
        )
    return seconds
