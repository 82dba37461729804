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

import asyncio
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import returns_within

from jax_threadmap import (
    ExecutorError,
    KernelError,
    async_array_from_callback,
    async_call,
    kernel,
    threadmap,
)
from jax_threadmap._support import event_loop as _event_loop

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


# --- 3. an async def kernel whose result raised a BaseException ---------------------


def _raising(exc: BaseException):
    class Bad:
        def __array__(self, dtype=None, copy=None):
            raise exc

    return Bad()


def _async_map(fn, n):
    return jax.vmap(lambda i: threadmap(fn, F32, i))(jnp.arange(float(n)))


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_from_an_elements_result_reaches_the_caller(exc):
    async def element(i):
        return _raising(exc()) if i == 2 else i

    with pytest.raises(exc):
        returns_within(_async_map, element, 8, limit=WAIT, what="end the map")
    # The loop's thread lives on: the next map and loader run.
    got = returns_within(_async_map, element, 2, limit=WAIT, what="run the next map")
    np.testing.assert_array_equal(got, [0.0, 1.0])

    async def load():
        return np.ones(2, np.float32)

    np.testing.assert_array_equal(
        async_call(load, SDS((2,), np.float32)).result(timeout=WAIT), 1.0
    )


def test_any_other_exception_from_an_elements_result_names_the_element():
    async def element(i):
        await asyncio.sleep(0)
        return _raising(Odd("odd")) if i == 3 else i

    with pytest.raises(KernelError, match=r"batch index \(3,\).*Odd: odd") as info:
        returns_within(_async_map, element, 8, limit=WAIT, what="end the map")
    assert isinstance(info.value.__cause__, Odd)
    assert info.value.index == (3,)


def test_a_summed_output_whose_value_raises_names_its_element():
    # Cotangents of an unbatched operand are added later, in index order: the
    # error is the element's whose value raised, not the one stored then.
    @kernel(F32)
    async def k(x, a):
        return x * a

    @k.defvjp
    async def k_vjp(x, a, ct):
        for _ in range(int(8 - x)):  # earlier elements finish later
            await asyncio.sleep(0)
        return ct * a, (_raising(Odd("odd cotangent")) if x == 5 else ct * x)

    def grad_a():
        x = jnp.arange(8.0)
        return jax.grad(lambda a: jax.vmap(k, (0, None))(x, a).sum())(jnp.float32(2))

    with pytest.raises(KernelError, match=r"batch index \(5,\).*odd cotangent"):
        returns_within(grad_a, limit=WAIT, what="end the map")


def test_the_event_loop_outlives_a_coroutine_that_lets_an_interrupt_out(caplog):
    # asyncio lets KeyboardInterrupt and SystemExit out of run_forever: the
    # package's loop, which every loader and map shares, goes on.
    ran = threading.Event()

    async def escapes():
        raise SystemExit("out of the loop")

    _event_loop.event_loop().submit(escapes, "escapes")

    async def load():
        ran.set()
        return np.zeros(2, np.float32)

    x = async_call(load, SDS((2,), np.float32))
    np.testing.assert_array_equal(x.result(timeout=WAIT), 0.0)
    assert ran.is_set()
    assert any("the loop goes on" in r.getMessage() for r in caplog.records)


def test_a_map_never_returns_with_an_element_unwritten(monkeypatch):
    # Whatever ends an element without storing it (here: a store that writes
    # nothing for one element), the map fails rather than return that element
    # as whatever its output buffer held.
    from jax_threadmap._executors import coroutines as _coroutines

    real_store = _coroutines.AsyncMap._store

    def store(self, i, index, result):
        if i != 3:
            real_store(self, i, index, result)

    monkeypatch.setattr(_coroutines.AsyncMap, "_store", store)

    async def element(i):
        return i

    with pytest.raises(ExecutorError, match="1 of 8 element"):
        returns_within(_async_map, element, 8, limit=WAIT, what="end the map")


# --- 4. an exception that refuses attributes ----------------------------------------


class Frozen(Exception):
    def __setattr__(self, name, value):
        raise AttributeError("frozen exception")


@pytest.mark.parametrize("kind", ["async_call", "shards"])
def test_a_loaders_frozen_exception_is_what_every_use_raises(kind):
    def load(*index):
        raise Frozen("the loader's own error")

    if kind == "async_call":
        x = async_call(load, SDS((4,), np.float32))
    else:
        x = async_array_from_callback((4,), ONE, load, np.float32)
    for _ in range(2):  # every use: the same exception
        with pytest.raises(Frozen, match="the loader's own error"):
            x.result(timeout=WAIT)
