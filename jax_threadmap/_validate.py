"""Checks of what users pass in, shared by ``threadmap``, ``kernel`` and async arrays.

Every check runs at call time, before anything is bound or started, and raises a
``TypeError`` or ``ValueError`` whose message names the argument, the expected and
the actual value, and what to do. Environment variables are arguments too: they
are parsed here, with one set of rules.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any

import jax
import numpy as np

from . import _compat

#: What ``executor=`` accepts: the shared pool, a pool of N threads, or an executor.
Executor = int | concurrent.futures.Executor | None

#: The most threads ``executor=N`` or ``JAX_THREADMAP_NUM_THREADS`` may ask for. Every
#: thread has its own stack (8 MB of address space, some of it touched), and beyond a
#: few hundred more threads only add memory and scheduling cost; a larger number is
#: almost always a mistake (such as passing a batch size as the thread count).
MAX_THREADS = 4096

#: The environment variable that sizes the shared pool of ``executor=None``.
ENV_NUM_THREADS = "JAX_THREADMAP_NUM_THREADS"

#: Keyword arguments of ``threadmap`` itself; they never reach the kernel.
RESERVED_KWARGS = ("executor", "progress")


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


def check_executor(executor: Any, api: str = "threadmap") -> Executor:
    """``executor`` as ``threadmap`` uses it (an int is normalised to ``int``).

    ``None`` also checks ``JAX_THREADMAP_NUM_THREADS``, so that a bad value fails
    the call rather than the map.
    """
    if executor is None:
        env_num_threads()
        return None
    if isinstance(executor, concurrent.futures.Executor):
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
    if executor > MAX_THREADS:
        raise ValueError(
            f"{api}: executor=N must be at most {MAX_THREADS} threads. Got "
            f"executor={int(executor)}. Pass the number of kernels that should run at "
            "once (e.g. 32 for network reads), not the number of elements; for more "
            "concurrency than that, pass your own concurrent.futures.Executor."
        )
    return int(executor)


def check_progress(progress: Any, api: str = "threadmap") -> bool | None:
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise TypeError(
            f"{api}: progress must be True, False or None. Got {progress=}."
        )
    return None if progress is None else bool(progress)


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


def result_avals(
    result_shape_dtypes: Any, api: str = "threadmap"
) -> tuple[tuple[Any, ...], Any]:
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


def check_operands(
    args: tuple[Any, ...], kwargs: dict[str, Any], api: str = "threadmap"
) -> tuple[list[Any], Any]:
    """Flattens ``(args, kwargs)``; every leaf must be an array or a scalar."""
    with_path, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    for path, leaf in with_path:
        try:
            jax.typeof(leaf)
        except TypeError:
            where = _arg_name(path)
            raise TypeError(
                f"{api}: {where} is a {type(leaf).__name__} ({_short(leaf)}), not an "
                "array. Arguments are passed to JAX, so every leaf must be an array "
                "(jax.Array, numpy.ndarray) or a number; bind other values with "
                "functools.partial or a closure over the kernel."
            ) from None
    return [leaf for _, leaf in with_path], in_tree


def _arg_name(path: tuple[Any, ...]) -> str:
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


# --- environment variables ------------------------------------------------------------


def env_positive_int(name: str, what: str, maximum: int | None = None) -> int | None:
    """The positive integer in environment variable ``name``; ``None`` when unset.

    Args:
        name: The variable.
        what: What the number is, for the message when the value is not one.
        maximum: The largest value accepted, if any.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"The environment variable {name} must be a positive integer ({what}). "
            f"Got {name}={os.environ[name]!r}. Set it to e.g. 8, or unset it to use "
            "the default."
        )
    if maximum is not None and n > maximum:
        raise ValueError(
            f"The environment variable {name} must be at most {maximum} ({what}). "
            f"Got {name}={os.environ[name]!r}. Set it to the number of kernels that "
            "should run at once (e.g. 32 for network reads), or unset it to use the "
            "default."
        )
    return n


def env_num_threads() -> int | None:
    """``JAX_THREADMAP_NUM_THREADS``, checked; ``None`` when unset."""
    return env_positive_int(
        ENV_NUM_THREADS, "the number of threads of the shared pool", MAX_THREADS
    )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, what: str) -> bool:
    """The boolean in environment variable ``name``; ``False`` when unset.

    Args:
        name: The variable.
        what: What the flag turns on, for the message when the value is not one.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value or value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise ValueError(
        f"The environment variable {name} turns on {what}; it must be one of "
        f"{', '.join(_TRUE + _FALSE)}. Got {name}={os.environ[name]!r}."
    )
