"""The arrays of one call's result: what each must be, its check, its placement.

:func:`leaf_specs` validates a declaration (``result_shape_dtypes`` and
``device``) at the call; :func:`check_result` checks what the call returned
against it, with ``threadmap``'s dtype rule, and freezes each leaf (a read-only
copy, taken when the call returns); :func:`place` puts the frozen leaves on
their devices.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from . import _compat, _validate
from ._validate import shape_dtype_of


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


def _path_str(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def leaf_specs(
    result_shape_dtypes: Any, device: Any, api: str
) -> tuple[Any, list[LeafSpec]]:
    """Validates ``result_shape_dtypes`` and ``device`` up front, at the call."""
    _compat.require(_compat.ASYNC_ARRAYS, f"jax_threadmap.{api}")
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
        where = _path_str(path)
        shape, dtype = shape_dtype_of(
            leaf, f"result_shape_dtypes{where}", f"jax_threadmap.{api}"
        )
        sharding = target
        leaf_sharding = getattr(leaf, "sharding", None)
        if sharding is None and isinstance(leaf_sharding, jax.sharding.Sharding):
            sharding = leaf_sharding
        try:
            if sharding is not None:
                sharding.shard_shape(shape)
            aval = _compat.typeof(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
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

    The rule of ``threadmap``'s results (:func:`._validate.check_result_cast`):
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
        except _LeafProblem as e:
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


class _LeafProblem(Exception):
    """What is wrong with one leaf of a result, for :func:`check_result`."""


def _frozen_leaf(spec: LeafSpec, leaf: Any) -> Any:
    expected = f"expected an array of shape {spec.shape} and dtype {spec.dtype}"
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise _LeafProblem(
            f"a ShapeDtypeStruct, which describes an array but holds no data "
            f"({expected}); return the data itself"
        )
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise _LeafProblem(
            f"a {type(leaf).__name__} without shape and dtype ({expected})"
        )
    if tuple(shape) != spec.shape:
        raise _LeafProblem(
            f"shape {tuple(shape)} and dtype {np.dtype(dtype)} "
            f"(expected shape {spec.shape} and dtype {spec.dtype})"
        )
    target = spec.aval.dtype
    if isinstance(leaf, jax.Array) and leaf.dtype == target:
        return leaf
    try:
        value = np.asarray(leaf)
    except Exception as e:
        raise _LeafProblem(
            f"a {type(leaf).__name__} whose data could not be read "
            f"({describe_error(e)}; {expected})"
        ) from None
    if value.dtype == object:
        raise _LeafProblem(
            f"a {type(leaf).__name__} that holds no array data ({expected})"
        )
    try:
        _validate.check_result_cast(value, target)
    except _validate.ResultCastError as e:
        raise _LeafProblem(
            f"{e.got}, declared {spec.dtype} ({target} on device); {e.reason}"
        ) from None
    copy = np.array(value, dtype=target, order="C")
    copy.flags.writeable = False
    return copy


def host_view(leaf: Any) -> np.ndarray:
    """The host array that gate programs copy a frozen leaf from."""
    return leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf)


def place(task: CallInfo, frozen: list[Any]) -> list[jax.Array]:
    """Puts the frozen leaves on their devices and waits until they are there."""
    placed = []
    for spec, leaf in zip(task.specs, frozen, strict=True):
        if spec.sharding is None and isinstance(leaf, jax.Array):
            placed.append(leaf)
        else:
            # The frozen copy is ours and never written: JAX may keep it as
            # the buffer (on CPU) instead of copying it once more.
            placed.append(jax.device_put(leaf, spec.sharding, may_alias=True))
    # The copies to device run while we wait here, in a pool thread: done()
    # then means the data is on its device.
    return jax.block_until_ready(placed)
