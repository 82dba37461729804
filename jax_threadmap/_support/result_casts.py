"""The one rule for storing a kernel's returned value as its declared dtype.

Shared by the host map (every element of every threadmap, derivative kernels
included) and async arrays. NumPy would wrap integers (int64 2**31 + 5 becomes
-2147483643 as int32) and overflow floats to inf with at most a warning; JAX's
callbacks do the same. Here a value that does not survive the cast is an error
(:class:`ResultCastError`) that says what to return instead.
"""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any

import jax
import numpy as np

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


def unawaited(value: np.ndarray) -> ResultCastError | None:
    """For an object array holding coroutines (a plain function returned an
    ``async def`` function's result without awaiting it), the error that says
    so; the coroutines are closed (no "never awaited" warning at exit)."""
    coros = [v for v in value.flat if asyncio.iscoroutine(v)]
    for coro in coros:
        coro.close()
    if not coros:
        return None
    name = getattr(coros[0], "__qualname__", "f")
    return ResultCastError(
        f"a coroutine of {name!r}",
        "a coroutine is what calling an async def function returns, and it runs "
        "only when awaited",
        f"Await it: write `await {name}(...)` in an async def function (threadmap "
        "runs an async def kernel's elements on its event loop).",
    )


def _check_python_int(value: np.ndarray, dtype: np.dtype) -> None:
    if (coroutine := unawaited(value)) is not None:
        raise coroutine
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
