"""Checks of what users pass in, shared by ``threadmap``, ``kernel`` and async arrays.

Every check runs at call time, before anything is bound or started, and raises a
``TypeError`` or ``ValueError`` whose message names the argument, the expected and
the actual value, and what to do. Environment variables are arguments too: they
are parsed here, with one set of rules.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
from typing import Any

import jax
import numpy as np

from .._jax import avals as _avals

#: The most threads ``executor=N`` or ``JAX_THREADMAP_NUM_THREADS`` may ask for. Every
#: thread has its own stack (8 MB of address space, some of it touched), and beyond a
#: few hundred more threads only add memory and scheduling cost; a larger number is
#: almost always a mistake (such as passing a batch size as the thread count).
MAX_THREADS = 4096

#: The environment variable that sizes the shared pool of ``executor=None``.
ENV_NUM_THREADS = "JAX_THREADMAP_NUM_THREADS"

#: Keyword arguments of ``threadmap`` itself; they never reach the kernel.
RESERVED_KWARGS = ("executor", "progress", "vectorized", "max_in_flight")

#: Keywords of ``jax.pure_callback`` that ``threadmap`` refuses, rather than pass to
#: the kernel (where they fail at run time), with what it does instead.
CALLBACK_KWARGS = {
    "vmap_method": (
        "threadmap has no vmap_method: under any nesting of jax.vmap it always "
        "runs one flat map over all elements on the executor, one kernel call per "
        "element (or per chunk, with vectorized=True), and never tiles an "
        "unbatched argument. Drop the keyword."
    ),
    "sharding": (
        "threadmap takes no sharding: under jit with sharded inputs the host call "
        "runs where XLA's partitioner places it (as jax.pure_callback without "
        "sharding= does); to run one map per shard on the data where it lives, "
        "call threadmap inside jax.shard_map. Drop the keyword."
    ),
}


def check_callback_kwargs(kwargs: dict[str, Any], api: str) -> None:
    """Refuses the keywords of ``jax.pure_callback`` that ``threadmap`` lacks."""
    for name, instead in CALLBACK_KWARGS.items():
        if name in kwargs:
            raise TypeError(
                f"{api}: {name}= is a keyword of jax.pure_callback, not of "
                f"threadmap. {instead} (A kernel's own keyword argument cannot "
                f"be named {name!r}; rename it.) Got {name}={_short(kwargs[name])}."
            )


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
    result_shape_dtypes: Any, api: str = "threadmap"
) -> tuple[tuple[Any, ...], Any]:
    """Checks ``result_shape_dtypes``; returns its flat avals and treedef."""
    check_has_results(result_shape_dtypes, api)
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


# --- results ------------------------------------------------------------------------
#
# The one rule for storing a returned value as its declared dtype, shared by the
# host map (every element of every threadmap, derivative kernels included) and
# async arrays. NumPy would wrap integers (int64 2**31 + 5 becomes -2147483643 as
# int32) and overflow floats to inf with at most a warning; JAX's callbacks do the
# same. Here a value that does not survive the cast is an error.

#: Kinds in the order a result may widen through. Signed and unsigned integers are
#: one kind: their values are checked, so a count returned as int64 fits uint32.
_KINDS = (np.bool_, np.integer, np.floating, np.complexfloating)
_KIND_NAMES = ("bool", "integer", "floating", "complex")


class ResultCastError(ValueError):
    """A returned value that its declared dtype cannot hold.

    Attributes:
        got: What was returned, e.g. ``dtype complex64`` or ``300 (int64)``.
        reason: Why it does not convert, a clause for the caller's sentence.
        fix: What to do, one or two sentences.
    """

    def __init__(self, got: str, reason: str, fix: str):
        super().__init__(f"{got}: {reason}. {fix}")
        self.got = got
        self.reason = reason
        self.fix = fix


def _kind(dtype: np.dtype) -> int | None:
    # jnp.issubdtype also places ml_dtypes types (bfloat16, int4, float8_*), which
    # NumPy's can_cast treats as kind-less and would let anything into.
    for rank, generic in enumerate(_KINDS):
        if jax.numpy.issubdtype(dtype, generic):
            return rank
    return None


#: Per (returned dtype, declared dtype): None (every value fits), _BAD_KIND, or
#: the check of the values.
_BAD_KIND = "kind"
_plans: dict[tuple[np.dtype, np.dtype], Any] = {}


def _plan(src: np.dtype, dst: np.dtype) -> Any:
    if src.kind == "O":  # np.asarray of a Python int too large for 64 bits
        return _check_python_int
    src_kind, dst_kind = _kind(src), _kind(dst)
    if src_kind is None or dst_kind is None or src_kind > dst_kind:
        return _BAD_KIND
    if src_kind == 0:  # bool is 0 or 1 in every kind
        return None
    if dst_kind == 1:  # integer to integer
        s, d = jax.numpy.iinfo(src), jax.numpy.iinfo(dst)
        if d.min <= s.min and s.max <= d.max:
            return None
        return functools.partial(_check_integers, int(d.min), int(d.max))
    # To floating or complex: only overflow loses a value. Rounding and underflow
    # to zero are what any float cast does (float64 0.1 -> float32), and accepted.
    largest = float(jax.numpy.finfo(dst).max)
    info = jax.numpy.iinfo(src) if src_kind == 1 else jax.numpy.finfo(src)
    if float(info.max) <= largest:
        return None
    return functools.partial(_check_finite, largest)


def check_result_cast(value: np.ndarray, dtype: np.dtype) -> None:
    """Checks that ``value`` keeps its value when stored as ``dtype``.

    The rule for every result ``threadmap`` stores and ``async_call`` places:

    - kinds only widen: bool, then integers (signed or unsigned), then floating,
      then complex;
    - integers must lie in the range of an integer ``dtype``;
    - finite floats (each part of a complex) must stay finite: no overflow to
      inf (or to nan, for the float8 formats without inf). Rounding, underflow,
      inf and nan convert as NumPy converts them.

    Vectorised over the elements of ``value``; a call whose ``value.dtype`` is
    ``dtype`` costs one comparison.

    Raises:
        ResultCastError: naming the first value that does not fit.
    """
    src = value.dtype
    if src == dtype:
        return
    try:
        plan = _plans[(src, dtype)]
    except KeyError:
        plan = _plans[(src, dtype)] = _plan(src, dtype)
    if plan is None:
        return
    if plan is _BAD_KIND:
        raise _changes_kind(src, dtype)
    plan(value, dtype)


def _changes_kind(src: np.dtype, dtype: np.dtype) -> ResultCastError:
    return ResultCastError(
        f"dtype {src}",
        f"{src} does not convert to {dtype} without changing kind (results may "
        f"only widen: {', '.join(_KIND_NAMES)})",
        "Cast the result, or declare the dtype you return.",
    )


#: Arrays up to this size are scanned in Python: two NumPy reductions cost more.
_SMALL = 32


def _extremes(part: np.ndarray) -> tuple[Any, Any] | None:
    """``(min, max)`` of a real array, ``None`` when empty; a nan may show or not."""
    if part.ndim == 0:
        v = part.item()
        return v, v
    if part.size <= _SMALL:
        values = (part if part.ndim == 1 else part.ravel()).tolist()
        return (min(values), max(values)) if values else None
    return (part.min(), part.max()) if part.size else None


def _does_not_fit(
    value: Any, src: Any, where: tuple[int, ...] | None, dtype: np.dtype, why: str
) -> ResultCastError:
    got = f"{value!s} ({src})"
    if where is not None:
        got = f"an array whose element {list(where)} is {got}"
    return ResultCastError(
        got,
        f"{dtype} cannot hold it ({why})",
        f"Return values that {dtype} can hold, or declare a dtype that holds them "
        "(64-bit types need jax_enable_x64); to clip, wrap or overflow on purpose, "
        f"convert in the kernel, e.g. np.clip(x, lo, hi).astype(jnp.{dtype.name}).",
    )


def _check_integers(lo: int, hi: int, value: np.ndarray, dtype: np.dtype) -> None:
    ext = _extremes(value)
    if ext is None or (lo <= int(ext[0]) and int(ext[1]) <= hi):
        return
    if value.ndim == 0:
        where, v = None, int(value)
    else:
        # NumPy >= 2 compares with Python ints exactly, even out of range.
        where = tuple(int(i) for i in np.argwhere((value < lo) | (value > hi))[0])
        v = int(value[where])
    raise _does_not_fit(v, value.dtype, where, dtype, f"its range is {lo} to {hi}")


def _check_finite(largest: float, value: np.ndarray, dtype: np.dtype) -> None:
    complex_src = value.dtype.kind == "c"
    for part in (value.real, value.imag) if complex_src else (value,):
        ext = _extremes(part)
        if ext is None or (-largest <= ext[0] and ext[1] <= largest):
            continue
        if part.ndim == 0 and not math.isfinite(ext[0]):
            continue  # nan and inf stay what they are
        break  # beyond the largest finite value, or a nan: look closer
    else:
        return
    with np.errstate(all="ignore"):  # the overflow we are about to report
        cast = value.astype(dtype)
    lost = np.isfinite(value.real) & ~np.isfinite(cast.real)
    if complex_src:
        lost |= np.isfinite(value.imag) & ~np.isfinite(cast.imag)
    if not lost.any():
        return  # nan or inf returned, or values that round to the largest finite
    where = None if value.ndim == 0 else tuple(int(i) for i in np.argwhere(lost)[0])
    bad = value[()] if where is None else value[where]
    what = "part of a " if dtype.kind == "c" else ""
    why = f"the largest finite {what}{dtype} is {largest:g}, so it would overflow"
    raise _does_not_fit(bad, value.dtype, where, dtype, why)


def _check_python_int(value: np.ndarray, dtype: np.dtype) -> None:
    v = value[()] if value.ndim == 0 else None
    if type(v) is not int:
        raise _changes_kind(value.dtype, dtype)
    kind = _kind(dtype)
    if kind == 1:
        info = jax.numpy.iinfo(dtype)
        why = f"its range is {info.min} to {info.max}"
        raise _does_not_fit(v, "Python int", None, dtype, why)
    if kind is None or kind < 1:
        raise ResultCastError(
            f"the Python int {v}",
            f"an int does not convert to {dtype} without changing kind",
            "Cast the result, or declare the dtype you return.",
        )
    try:
        with np.errstate(all="ignore"):  # NumPy's cast from object goes via float
            fits = bool(np.isfinite(np.asarray(float(v)).astype(dtype)))
    except OverflowError:
        fits = False
    if not fits:
        largest = float(jax.numpy.finfo(dtype).max)
        why = f"the largest finite {dtype} is {largest:g}, so it would overflow"
        raise _does_not_fit(v, "Python int", None, dtype, why)


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


ENV_ASYNC_DISPATCH = "JAX_THREADMAP_ASYNC_DISPATCH"


def async_dispatch_enabled() -> bool:
    """Whether ``JAX_THREADMAP_ASYNC_DISPATCH`` allows async dispatch (default on)."""
    value = os.environ.get(ENV_ASYNC_DISPATCH, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{ENV_ASYNC_DISPATCH}={value!r} is not understood. Set it to 1 (jitted "
        "calls with pending AsyncArrays return at once, the default) or 0 (they "
        "wait for the data, as in earlier releases)."
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
