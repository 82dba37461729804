"""One shard of a sharded load: its index, its check, its placement.

The index helpers key (:func:`index_key`), name (:func:`index_str`) and measure
(:func:`slice_shape`) a shard's index; :func:`check_shard` checks one shard as
:func:`.leaves.check_result` checks a leaf, without a copy, and
:func:`place_shard` copies it to its devices (the one copy).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .._jax import avals as _jax_avals
from .leaves import LeafProblem, LeafSpec, checked_leaf, is_extended


def index_key(index: tuple) -> tuple:
    """A hashable key of an index (slices are not hashable before Python 3.12)."""
    return tuple(
        (i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index
    )


def index_str(index: tuple) -> str:
    """The index as NumPy code writes it: ``[0:2, :]`` (``[()]`` for a 0-d array)."""

    def one(i: Any) -> str:
        if not isinstance(i, slice):
            return repr(i)
        text = (
            f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
        )
        return text + ("" if i.step in (None, 1) else f":{i.step}")

    return "[" + (", ".join(one(i) for i in index) if index else "()") + "]"


def slice_shape(index: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of ``array[index]`` for an array of ``shape`` (slices only)."""
    return tuple(len(range(*i.indices(n))) for i, n in zip(index, shape, strict=True))


def check_shard(value: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The shard to place: ``value`` checked as :func:`check_result` checks a leaf.

    No copy is made here (:func:`place_shard` makes the one copy), but the cast
    into ``dtype`` where the dtype differs. Raises ``ValueError`` saying what is
    wrong with it (the caller names the shard).
    """
    if is_extended(dtype):  # PRNG keys: a jax.Array of that dtype, as it is
        got = getattr(value, "shape", None), getattr(value, "dtype", None)
        if not isinstance(value, jax.Array) or got != (shape, dtype):
            raise ValueError(
                f"a {type(value).__name__} of shape {got[0]} and dtype {got[1]} "
                f"(expected a jax.Array of shape {shape} and dtype {dtype})"
            )
        return value
    try:
        checked = checked_leaf(shape, dtype, dtype, value)
    except LeafProblem as e:
        raise ValueError(str(e)) from None
    if isinstance(checked, np.ndarray) and checked.dtype != dtype:
        return checked.astype(dtype)
    return checked


def extended_spec(shape: tuple[int, ...], dtype: Any, sharding: Any) -> LeafSpec:
    """The spec of an array of an extended dtype (``leaf_specs`` takes NumPy's)."""
    aval = _jax_avals.typeof(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return LeafSpec("<root>", shape, dtype, aval, sharding)


def place_shard(shard: Any, value: Any, devices: list[Any]) -> list[jax.Array]:
    """``shard`` on each of ``devices``, there when this returns; never aliased.

    ``value`` is what the callback returned (``shard`` itself, a view of its
    memory, or a cast copy). On CPU, ``jax.device_put`` may keep a NumPy buffer
    as the device buffer instead of copying it (one 64-byte aligned; seen in
    jax 0.6.2, 0.10.2 and 0.12, with any ``may_alias``): where it did (the same
    address) and the buffer is not a copy of ours, the shard is placed again
    from a copy of its own. Which memory is the callback's is decided by
    memory, not identity: a slice of an ``np.memmap`` (an ndarray subclass)
    reaches us as a base-class view of the file's pages. So a shard costs its
    buffer and one copy at most, as in ``jax.make_array_from_callback``.
    """
    placed = _put(shard, devices)
    if (
        isinstance(shard, np.ndarray)
        and not _own_copy(shard, value)
        and _aliased(placed, shard)
    ):
        del placed
        placed = _put(np.array(shard, order="C"), devices)
    return placed


def _own_copy(shard: np.ndarray, value: Any) -> bool:
    """Whether ``shard`` is a copy made here (a cast) of the callback's
    ``value``: an array that shares no memory with it. Anything else (the
    array itself, a view of it, what ``np.asarray`` made of another library's
    array) may be the callback's memory."""
    return (
        shard is not value
        and isinstance(value, np.ndarray)
        and not np.may_share_memory(shard, value)
    )


def _put(shard: Any, devices: list[Any]) -> list[jax.Array]:
    return jax.block_until_ready(
        [jax.device_put(shard, jax.sharding.SingleDeviceSharding(d)) for d in devices]
    )


def _aliased(placed: list[jax.Array], buffer: np.ndarray) -> bool:
    """Whether one of ``placed`` holds ``buffer``'s memory as its own."""
    if buffer.size == 0:
        return False
    start, end = buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes
    for array in placed:
        try:
            pointer = array.unsafe_buffer_pointer()
        except Exception:  # no single buffer to ask: assume the worst
            return True
        if start <= pointer < end:
            return True
    return False
