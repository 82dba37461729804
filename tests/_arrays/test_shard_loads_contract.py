"""``async_array_from_callback`` keeps ``jax.make_array_from_callback``'s contract.

Each check runs JAX's own function on the same arguments as the reference:
the dtype read from a shard when left out, PRNG key arrays, a callback that
returns a tracer (JAX's error, at the call, every time), JAX's words in the
error for a shard of the wrong shape, and what JAX's own tests of
``make_array_from_callback`` pass in (0-d arrays, shards returned as
``jax.Array`` s, 64-bit data with x64 off) on single-device, sharded and
replicated shardings. The 8-device cases (partial and replicated mesh axes,
uneven splits) are in ``shard_load_checks.py``.
"""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_threadmap import async_array_from_callback

pytestmark = pytest.mark.timeout(120)

WAIT = 30.0
DEVICE = jax.devices()[0]
SHARDINGS = {
    "single": jax.sharding.SingleDeviceSharding(DEVICE),
    "named": NamedSharding(jax.make_mesh((1,), ("x",)), P("x")),
    "replicated": NamedSharding(jax.make_mesh((1,), ("x",)), P()),
}


def same(ours, theirs) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert ours.sharding.is_equivalent_to(theirs.sharding, theirs.ndim)
    if jax.dtypes.issubdtype(theirs.dtype, jax.dtypes.extended):
        ours, theirs = jax.random.key_data(ours), jax.random.key_data(theirs)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("where", sorted(SHARDINGS))
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_, jnp.bfloat16])
def test_the_dtype_left_out_is_read_from_a_shard_as_jax_does(where, dtype):
    data = (np.arange(24) % 3).astype(dtype).reshape(4, 6)
    sharding = SHARDINGS[where]
    theirs = jax.make_array_from_callback(data.shape, sharding, lambda i: data[i])
    ours = async_array_from_callback(data.shape, sharding, lambda i: data[i])
    same(ours.result(timeout=WAIT), theirs)


def test_the_dtype_left_out_is_read_from_an_async_def_callback():
    data = np.arange(8, dtype=np.int16)

    async def fetch(index):
        await asyncio.sleep(0)
        return data[index]

    sharding = SHARDINGS["named"]
    ours = async_array_from_callback((8,), sharding, fetch)
    theirs = jax.make_array_from_callback((8,), sharding, lambda i: data[i])
    same(ours.result(timeout=WAIT), theirs)


@pytest.mark.parametrize("declared", [False, True])
def test_prng_key_arrays_load_as_in_jax(declared):
    keys = jax.random.split(jax.random.key(7), 8)
    sharding = SHARDINGS["named"]
    dtype = keys.dtype if declared else None
    ours = async_array_from_callback((8,), sharding, lambda i: keys[i], dtype)
    theirs = jax.make_array_from_callback((8,), sharding, lambda i: keys[i])
    assert ours.dtype == keys.dtype
    same(ours.result(timeout=WAIT), theirs)
    # Usable in a jitted program, as JAX's is.
    draw = jax.jit(lambda k: jax.random.uniform(k[0]))
    assert float(draw(ours)) == float(draw(theirs))


def test_a_format_is_refused_with_the_alternative():
    fmt = jax.device_put(np.zeros(4, np.float32), SHARDINGS["single"]).format
    with pytest.raises(TypeError) as info:
        async_array_from_callback((4,), fmt, lambda i: np.zeros(4)[i], np.float32)
    message = str(info.value)
    assert "sharding must be a jax.sharding.Sharding" in message
    assert "its .sharding, then jax.device_put(x.result(), fmt)" in message


@pytest.mark.parametrize("dtype", [None, np.float32])
def test_a_callback_that_returns_a_tracer_raises_jaxs_error_at_the_call(dtype):
    data = jnp.arange(4.0)

    def theirs(a):
        return jax.make_array_from_callback((4,), SHARDINGS["single"], lambda i: a[i])

    def ours(a):
        return async_array_from_callback(
            (4,), SHARDINGS["single"], lambda i: a[i], dtype
        )

    with pytest.raises(jax.errors.UnexpectedTracerError) as reference:
        jax.jit(theirs)(data)
    for _ in range(5):  # every time, never a ValueError of a pool thread
        with pytest.raises(jax.errors.UnexpectedTracerError) as got:
            jax.jit(ours)(data)
        assert "cannot be called within a traced context" in str(got.value)
        assert "cannot be called within a traced context" in str(reference.value)


def test_a_shard_of_the_wrong_shape_says_it_in_jaxs_words():
    data = np.arange(8.0, dtype=np.float32)
    sharding = SHARDINGS["single"]
    with pytest.raises(ValueError, match="Expected shard shape") as reference:
        jax.make_array_from_callback((8,), sharding, lambda i: data[:3])
    x = async_array_from_callback((8,), sharding, lambda i: data[:3], np.float32)
    with pytest.raises(ValueError, match="Expected shard shape") as got:
        x.result(timeout=WAIT)
    words = "Expected shard shape (8,) doesn't match the single device array shape"
    assert words in str(got.value) and words in str(reference.value)
    assert "data_callback" in str(got.value)  # and ours: which shard, what to do


# What JAX's own tests of make_array_from_callback pass in (array_test, pjit_test):
# a 0-d array, shards as jax.Arrays, 64-bit data with x64 off, Python scalars.
KINDS = {
    "0-d": ((), lambda i: np.float32(2.5)),
    "0-d int": ((), lambda i: np.asarray(7, np.int32)),
    "jax.Array shards": ((4, 2), lambda i: jnp.arange(8.0).reshape(4, 2)[i]),
    "float64 data": ((3,), lambda i: np.arange(3.0)[i]),
    "int64 data": ((2, 3), lambda i: np.arange(6).reshape(2, 3)[i]),
    "uint8 data": ((5,), lambda i: np.arange(5, dtype=np.uint8)[i]),
}


# P("x") cannot hold a 0-d array: refused by both (the next test).
PAIRS = [
    (kind, where)
    for kind in sorted(KINDS)
    for where in sorted(SHARDINGS)
    if not (where == "named" and KINDS[kind][0] == ())
]


@pytest.mark.parametrize(("kind", "where"), PAIRS)
def test_what_jaxs_own_tests_pass_loads_as_in_jax(kind, where):
    shape, callback = KINDS[kind]
    sharding = SHARDINGS[where]
    theirs = jax.make_array_from_callback(shape, sharding, callback)
    ours = async_array_from_callback(shape, sharding, callback)  # dtype read
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    same(ours.result(timeout=WAIT), theirs)
    declared = async_array_from_callback(shape, sharding, callback, theirs.dtype)
    same(declared.result(timeout=WAIT), theirs)


def test_a_sharding_that_cannot_hold_the_shape_is_refused_naming_it():
    # P("x") on a 0-d array: JAX fails inside (an AssertionError of its own
    # checks); ours says which argument and what to do (by design: docs/async.md).
    sharding = SHARDINGS["named"]
    with pytest.raises(Exception):  # noqa: B017 - JAX's internal error
        jax.make_array_from_callback((), sharding, lambda i: np.float32(1))
    with pytest.raises(ValueError, match=r"cannot hold (the|an) array of shape \(\)"):
        async_array_from_callback((), sharding, lambda i: np.float32(1), np.float32)
