"""The arrays of one call's result: what each must be, its check, its placement.

:func:`leaf_specs` validates a declaration (``result_shape_dtypes`` and
``device``) at the call; :func:`check_result` checks what the call returned
against it, with ``threadmap``'s dtype rule, and freezes each leaf (a read-only
copy, taken when the call returns); :func:`place` puts the frozen leaves on
their devices. One shard of a sharded load is checked with the same rule
(:func:`checked_leaf`) in :mod:`.shards`.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Protocol

import jax
import numpy as np

from .._jax import avals as _jax_avals
from .._jax import hooks as _hooks
from .._jax import placement as _placement
from .._support import result_casts as _result_casts
from .._support.validate import check_callable, check_timeout, shape_dtype_of


class CallInfo(Protocol):
    """What a check needs to know of the call: its name and declaration."""

    name: str
    api: str
    treedef: Any
    specs: list[LeafSpec]


class LeafSpec:
    """What one leaf must be: the declared dtype, the aval jit sees, the target."""

    __slots__ = ("path", "shape", "dtype", "aval", "sharding")

    def __init__(
        self, path: str, shape: tuple[int, ...], dtype: Any, aval: Any, sharding: Any
    ):
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.aval = aval
        self.sharding = sharding


def output_specs(out_handler: Any) -> list[LeafSpec]:
    """The leaves of a compiled program's outputs (its ``out_handler``): their
    avals and shardings."""
    return specs_of(out_handler.out_avals, out_handler.out_shardings)


def specs_of(avals: Any, shardings: Any) -> list[LeafSpec]:
    """The leaves ``[0]``, ``[1]``, ... of a program's outputs."""
    return [
        LeafSpec(f"[{k}]", tuple(aval.shape), aval.dtype, aval, sharding)
        for k, (aval, sharding) in enumerate(zip(avals, shardings, strict=True))
    ]


def describe_error(error: BaseException) -> str:
    """``Type: message`` of an exception, even one whose ``str()`` raises."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception as e:  # a broken __str__ must not stop the error's way
        return (
            f"{type(error).__name__} (its message could not be built: str() "
            f"raised {type(e).__name__})"
        )


# --- checks ---------------------------------------------------------------------------


def leaf_specs(
    result_shape_dtypes: Any, device: Any, api: str
) -> tuple[Any, list[LeafSpec]]:
    """Validates ``result_shape_dtypes`` and ``device`` up front, at the call.

    The answer for one ``jax.ShapeDtypeStruct`` is kept (:func:`_leaf_specs`, the
    last :data:`MAX_CACHED_AVALS`): a thousand loads of one shape check it once.
    The specs are shared by the calls, and never written.
    """
    _hooks.require(_hooks.ASYNC_ARRAYS, f"jax_threadmap.{api}")  # (and the surface's)
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]
    if type(result_shape_dtypes) is jax.ShapeDtypeStruct:
        try:
            return _leaf_specs(result_shape_dtypes, device, api, x64)
        except TypeError:  # an unhashable sharding (any other error: again below)
            pass
    return _leaf_specs.__wrapped__(result_shape_dtypes, device, api, x64)


#: Abstract values kept by :func:`_aval`, and declarations by :func:`leaf_specs`
#: (a bound against ever new shapes).
MAX_CACHED_AVALS = 1024


@functools.lru_cache(MAX_CACHED_AVALS)
def _leaf_specs(
    result_shape_dtypes: Any, device: Any, api: str, x64: bool
) -> tuple[Any, list[LeafSpec]]:
    del x64  # a key only: the specs differ under it
    target = _target_sharding(device, api)
    flat, treedef = jax.tree_util.tree_flatten_with_path(result_shape_dtypes)
    if not flat:
        raise ValueError(
            f"jax_threadmap.{api}: result_shape_dtypes has no array leaves (got "
            f"{result_shape_dtypes!r}). Pass the shapes and dtypes that the call "
            "returns, e.g. jax.ShapeDtypeStruct((3,), jnp.float32); for a call "
            "without array results use a concurrent.futures executor instead."
        )
    specs = []
    for path, leaf in flat:
        where = jax.tree_util.keystr(path) or "<root>"
        shape, dtype = shape_dtype_of(
            leaf, f"result_shape_dtypes{where}", f"jax_threadmap.{api}"
        )
        sharding = target
        leaf_sharding = getattr(leaf, "sharding", None)
        if sharding is None and isinstance(leaf_sharding, jax.sharding.Sharding):
            sharding = leaf_sharding
        try:
            aval = _aval(shape, dtype, sharding)
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(
                f"jax_threadmap.{api}: the target sharding {sharding} cannot hold "
                f"the array of shape {shape} declared at {where} of "
                f"result_shape_dtypes ({e}). Pass a device= or sharding that fits "
                "every leaf (e.g. a replicated one), or give each leaf its own "
                "sharding with jax.ShapeDtypeStruct(shape, dtype, sharding=...)."
            ) from e
        specs.append(LeafSpec(where, shape, dtype, aval, sharding))
    return treedef, specs


def check_call(
    fn: Any, result_shape_dtypes: Any, device: Any, api: str, timeout: Any
) -> tuple[Any, list[LeafSpec], float | None]:
    """Checks ``api(fn, result_shape_dtypes, ..., device=, timeout=)`` at the call."""
    check_callable(
        fn,
        f"jax_threadmap.{api}",
        "fn",
        "Pass the function first, then result_shape_dtypes, then its arguments.",
    )
    treedef, specs = leaf_specs(result_shape_dtypes, device, api)
    seconds = check_timeout(
        timeout,
        f"jax_threadmap.{api}",
        zero=False,
        hint=" To pass a keyword argument named timeout to fn, bind it with "
        "functools.partial.",
    )
    return treedef, specs, seconds


def _aval(shape: tuple[int, ...], dtype: np.dtype, sharding: Any) -> Any:
    """The abstract value ``jit`` sees (the sharding checked), cached (the last
    :data:`MAX_CACHED_AVALS`): JAX takes about 10 us to make one, which a
    thousand calls in flight would pay."""
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]
    try:
        return _new_aval(shape, dtype, sharding, x64)
    except TypeError:  # an unhashable sharding (any other error: again below)
        return _new_aval.__wrapped__(shape, dtype, sharding, x64)


@functools.lru_cache(MAX_CACHED_AVALS)
def _new_aval(shape: tuple[int, ...], dtype: np.dtype, sharding: Any, x64: bool) -> Any:
    del x64  # a key only: the avals differ under it
    if sharding is not None:
        sharding.shard_shape(shape)
    return _jax_avals.typeof(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))


def _target_sharding(device: Any, api: str) -> jax.sharding.Sharding | None:
    if device is None or isinstance(device, jax.sharding.Sharding):
        return device
    if isinstance(device, jax.Device):
        return jax.sharding.SingleDeviceSharding(device)
    raise TypeError(
        f"jax_threadmap.{api}: device must be None, a jax.Device or a "
        f"jax.sharding.Sharding. Got device={device!r} of type "
        f"{type(device).__name__}. Pass e.g. device=jax.devices()[0]."
    )


def check_result(task: CallInfo, out: Any) -> list[Any]:
    """Checks the call's result against its declaration; returns frozen leaves.

    The rule of ``threadmap``'s results (:func:`.result_casts.check_result_cast`):
    the shape as declared, a dtype that stores every value as the dtype on
    device (the declared one, canonicalised as ``jnp.asarray`` does), whatever
    ``jax_enable_x64`` says. Each leaf comes back as a read-only copy in that
    dtype (a ``jax.Array`` of that dtype as it is: it is immutable), taken now,
    so that later changes to what ``fn`` returned change nothing.
    """
    flat, treedef = jax.tree_util.tree_flatten(out)
    if treedef != task.treedef:
        raise ValueError(
            f"{task.name}, run by jax_threadmap.{task.api}, returned a value of "
            f"structure {treedef}, but result_shape_dtypes declares the "
            f"structure {task.treedef}. Make the function return that structure, "
            "or fix result_shape_dtypes."
        )
    problems = []
    frozen = []
    for spec, leaf in zip(task.specs, flat, strict=True):
        try:
            frozen.append(_frozen_leaf(spec, leaf))
        except LeafProblem as e:
            problems.append(f"at {spec.path}: {e}")
    if problems:
        raise ValueError(
            f"{task.name}, run by jax_threadmap.{task.api}, returned arrays that "
            "do not match result_shape_dtypes: "
            + "; ".join(problems)
            + ". Make the function return the declared shapes and dtypes, or fix "
            "result_shape_dtypes."
        )
    return frozen


class LeafProblem(Exception):
    """What is wrong with one leaf of a result, for :func:`check_result`."""


def _frozen_leaf(spec: LeafSpec, leaf: Any) -> Any:
    value = checked_leaf(spec.shape, spec.dtype, spec.aval.dtype, leaf)
    if not isinstance(value, np.ndarray) and isinstance(value, jax.Array):
        # (np.ndarray first: jax.Array's check is an ABC's, slow.) Of the declared
        # type, never weak (jnp.array(1.) is): a cast that clears it.
        weak = value.weak_type
        return jax.lax.convert_element_type(value, value.dtype) if weak else value
    copy = np.array(value, dtype=spec.aval.dtype, order="C")
    copy.flags.writeable = False
    return copy


def checked_leaf(
    shape: tuple[int, ...], declared: Any, target: np.dtype, leaf: Any
) -> Any:
    """``leaf`` (a ``jax.Array`` of ``target``, or a NumPy array that may be cast
    to ``target``), or a :class:`LeafProblem` that says what is wrong."""
    if type(leaf) is np.ndarray and leaf.shape == shape and leaf.dtype == target:
        return leaf  # the common case, without the checks below (~10 us)
    expected = f"expected an array of shape {shape} and dtype {declared}"
    if inspect.isawaitable(leaf):
        if inspect.iscoroutine(leaf):
            leaf.close()  # no "never awaited" warning on top of this error
        raise LeafProblem(
            f"a {type(leaf).__name__} (an awaitable, never awaited) where an array "
            f"was expected ({expected}); await it inside the function, or make "
            "the function itself async def"
        )
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise LeafProblem(
            f"a ShapeDtypeStruct, which describes an array but holds no data "
            f"({expected}); return the data itself"
        )
    _check_shape_of(leaf, shape, declared, expected)
    if isinstance(leaf, jax.Array) and hasattr(leaf, "result"):
        leaf = leaf.result()  # an AsyncArray (a jax.Array): its value
    if isinstance(leaf, jax.Array) and leaf.dtype == target:
        return leaf
    try:
        value = np.asarray(leaf)
    except Exception as e:
        raise LeafProblem(
            f"a {type(leaf).__name__} whose data could not be read "
            f"({describe_error(e)}; {expected})"
        ) from None
    if value.dtype == object:
        raise LeafProblem(
            f"a {type(leaf).__name__} that holds no array data ({expected})"
        )
    try:
        _result_casts.check_result_cast(value, target)
    except _result_casts.ResultCastError as e:
        raise LeafProblem(
            f"{e.got}, declared {declared} ({target} on device); {e.reason}"
        ) from None
    return value


def _check_shape_of(
    leaf: Any, shape: tuple[int, ...], declared: Any, expected: str
) -> None:
    """Raises a :class:`LeafProblem` unless ``leaf`` has ``shape`` and a dtype.

    Another library's array has its own shape and dtype objects: an int for a
    shape, a dtype NumPy cannot read (``torch.float32``), a property that
    raises. Each is a problem of the leaf, said as such, never an error of
    the check itself.
    """
    try:
        got = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
    except Exception as e:
        raise LeafProblem(
            f"a {type(leaf).__name__} whose shape or dtype could not be read "
            f"({describe_error(e)}; {expected})"
        ) from None
    if got is None or dtype is None:
        raise LeafProblem(
            f"a {type(leaf).__name__} without shape and dtype ({expected})"
        )
    dims = shape_of(leaf)
    if dims is None:
        raise LeafProblem(
            f"a {type(leaf).__name__} whose shape is {got!r}, not a sequence of "
            f"integers ({expected})"
        )
    if dims != shape:
        raise LeafProblem(
            f"shape {dims} and dtype {dtype_text(dtype)} "
            f"(expected shape {shape} and dtype {declared})"
        )


def shape_of(value: Any) -> tuple[int, ...] | None:
    """``value.shape`` as a tuple of ints, or ``None`` if it has none such (an
    int, a missing attribute, a property that raises)."""
    try:
        return tuple(operator.index(n) for n in value.shape)
    except Exception:
        return None


def dtype_text(dtype: Any) -> str:
    """``dtype`` as NumPy names it, or as its own ``str`` if NumPy cannot read
    it (``torch.float32``): a message about a bad leaf must never fail."""
    try:
        return str(np.dtype(dtype))
    except Exception:
        try:
            return str(dtype)
        except Exception:
            return f"<a {type(dtype).__name__}>"


def place(task: CallInfo, frozen: list[Any]) -> list[jax.Array]:
    """Puts the frozen leaves on their devices (the copies may still run: wait
    with ``jax.block_until_ready`` before saying the data is there)."""
    placed = []
    for spec, leaf in zip(task.specs, frozen, strict=True):
        # The frozen copy is ours and never written: JAX may keep it as the
        # buffer (on CPU) instead of copying it once more.
        out = None
        if spec.sharding is None and isinstance(leaf, np.ndarray):
            out = _placement.put_on_device(
                spec.aval, leaf, None
            )  # 5x device_put's speed
        elif spec.sharding is None and isinstance(leaf, jax.Array):
            placed.append(leaf)
            continue
        if out is None:
            out = jax.device_put(leaf, spec.sharding, may_alias=True)
        placed.append(out)
    return placed


@functools.lru_cache(MAX_CACHED_AVALS)  # per output of every dispatch
def is_extended(dtype: Any) -> bool:
    """Whether ``dtype`` is one of JAX's extended dtypes (PRNG keys)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
