"""Defects of issue 43 (a hostile pass over the async wing), each a test that
failed (or hung, bounded) before its fix, and what that pass did not reach.

1. (``test_async_shards.py``) A shard that aliased the callback's memory.
2. A shard whose check raised ``TypeError`` (a ``shape`` that is an int, a dtype
   NumPy cannot read with a wrong shape) left its part running for good; the
   same object given to ``async_call`` raised ``TypeError``, not the
   ``ValueError`` naming the leaf.
3. An ``async def`` kernel element whose result raised ``KeyboardInterrupt`` or
   ``SystemExit`` (from ``__array__``) killed the event loop's thread: the map
   never returned, and nor did any later ``async def`` map or loader.
4. A loader's exception whose ``__setattr__`` raises: ``result()`` raised
   ``AttributeError`` instead of it.

Every wait is bounded (``result(timeout=...)``, ``returns_within``); no
assertion rests on a clock.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import (
    async_array_from_callback,
    async_call,
)

pytestmark = pytest.mark.timeout(120)

SDS = jax.ShapeDtypeStruct
F32 = SDS((), jnp.float32)
WAIT = 30.0
DEVICE = jax.devices()[0]
ONE = jax.sharding.SingleDeviceSharding(DEVICE)


# --- 2. a shard (or a leaf) whose check raised TypeError ----------------------------


class IntShape:
    """Another library's array whose ``shape`` is an int."""

    shape = 4
    dtype = np.float32


class UnknownDtype:
    """Another library's array of a dtype NumPy cannot read (torch.float32),
    of the wrong shape."""

    shape = (2, 2)
    dtype = object()


class ShapeRaises:
    """An array whose ``shape`` property raises."""

    dtype = np.float32

    @property
    def shape(self):
        raise TypeError("no shape yet")


class Odd(BaseException):
    """An exception of no usual kind."""


class ArrayRaises:
    """The right shape and dtype, but reading its data raises ``Odd``."""

    shape = (4,)
    dtype = np.float32

    def __array__(self, dtype=None, copy=None):
        raise Odd("the data could not be read")


BAD_LEAVES = {
    "int shape": (IntShape, "whose shape is 4, not a sequence of integers"),
    "unknown dtype": (UnknownDtype, "shape (2, 2) and dtype <object object"),
    "shape raises": (ShapeRaises, "whose shape or dtype could not be read"),
}


@pytest.mark.parametrize("bad", list(BAD_LEAVES))
@pytest.mark.parametrize("kind", ["plain", "async"])
def test_a_shard_whose_check_raised_type_error_fails_naming_the_shard(bad, kind):
    make, words = BAD_LEAVES[bad]

    def fetch(index):
        return make()

    async def fetch_async(index):
        return make()

    x = async_array_from_callback(
        (4,), ONE, fetch if kind == "plain" else fetch_async, np.float32
    )
    with pytest.raises(ValueError) as info:
        x.result(timeout=WAIT)  # was: TimeoutError (the part ran for good)
    text = str(info.value)
    assert words in text, text
    assert "for the shard at index [:] (device 0)" in text, text


@pytest.mark.parametrize("bad", list(BAD_LEAVES))
def test_async_call_names_the_leaf_of_the_same_objects(bad):
    make, words = BAD_LEAVES[bad]
    x = async_call(lambda: {"w": make()}, {"w": SDS((4,), np.float32)})["w"]
    with pytest.raises(ValueError, match="do not match result_shape_dtypes") as info:
        x.result(timeout=WAIT)
    assert "at ['w']: " in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_any_exception_of_a_shard_reaches_the_array_naming_the_shard(kind):
    def fetch(index):
        return ArrayRaises()

    async def fetch_async(index):
        return ArrayRaises()

    x = async_array_from_callback(
        (4,), ONE, fetch if kind == "plain" else fetch_async, np.float32
    )
    with pytest.raises(Odd, match="the data could not be read") as info:
        x.result(timeout=WAIT)
    if sys.version_info >= (3, 11):
        assert any(
            "for the shard at index [:] (device 0)" in n for n in info.value.__notes__
        ), info.value.__notes__
    # The next load works.
    y = async_array_from_callback((4,), ONE, lambda i: np.ones(4)[i], np.float32)
    np.testing.assert_array_equal(y.result(timeout=WAIT), 1.0)
