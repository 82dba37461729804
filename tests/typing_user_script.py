"""A user's script, type checked (not run) by ``mypy --strict`` in test_typing.py.

Each ``assert_type`` fails the check when the library's return type is ``Any`` or
another type than a user can rely on.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import jax
import jax.numpy as jnp
import numpy as np
from typing_extensions import assert_type

import jax_threadmap
from jax_threadmap import AsyncArray, KernelFunction, Shared, threadmap

F32 = jax.ShapeDtypeStruct((3,), jnp.float32)


def scaled(x: np.ndarray, a: np.ndarray) -> np.ndarray:
    result: np.ndarray = np.sin(x) * a
    return result


def load() -> np.ndarray:
    return np.zeros(3, np.float32)


x = jnp.ones(3)
a = jnp.float32(2.0)

one = threadmap(scaled, F32, x, a)
assert_type(one, jax.Array)
pair = threadmap(lambda x: (x, x), (F32, F32), x)
assert_type(pair, tuple[jax.Array, ...])

decorate = jax_threadmap.kernel(F32)
assert_type(decorate(scaled), KernelFunction[jax.Array])
k = decorate(scaled)
assert_type(k(x, a), jax.Array)
assert_type(jax_threadmap.kernel((F32, F32))(scaled)(x), tuple[jax.Array, ...])

loading = jax_threadmap.async_call(load, F32)
assert_type(loading, AsyncArray)
assert_type(loading.result(), jax.Array)
assert_type(jax_threadmap.async_call(load, (F32, F32)), tuple[AsyncArray, ...])

sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
ROWS = np.zeros((4, 3), np.float32)


def fetch(index: tuple[slice, ...]) -> np.ndarray:
    return ROWS[index]


async def fetch_async(index: tuple[slice, ...]) -> np.ndarray:
    return ROWS[index]


sharded = jax_threadmap.async_array_from_callback((4, 3), sharding, fetch, np.float32)
assert_type(sharded, AsyncArray)
assert_type(
    jax_threadmap.async_array_from_callback(
        (4, 3), sharding, fetch_async, jnp.float32, timeout=10.0
    ),
    AsyncArray,
)


async def load_async() -> np.ndarray:
    return np.zeros(3, np.float32)


assert_type(jax_threadmap.async_call(load_async, F32), AsyncArray)


# Derivative kernels: one VJP kernel (returned, for decorating), or fwd and bwd
# with residuals (None).
def scaled_vjp(
    x: np.ndarray, a: np.ndarray, ct: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    return ct * np.cos(x) * a, np.sum(ct * np.sin(x))


def scaled_fwd(x: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.sin(x) * a, np.cos(x) * a


def scaled_bwd(res: np.ndarray, ct: np.ndarray) -> tuple[np.ndarray, None]:
    return ct * res, None


vjp_back: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, ...]]
vjp_back = k.defvjp(scaled_vjp)  # the very function, for decorating
assert_type(k.defvjp(scaled_fwd, scaled_bwd, residuals=F32), None)


# A resource shared by async def kernels: the handle knows what value() gives.
@contextlib.asynccontextmanager
async def connection() -> AsyncIterator[dict[str, float]]:
    yield {"scale": 2.0}


conn = jax_threadmap.shared(connection)
assert_type(conn, Shared[dict[str, float]])


async def use_connection(x: np.ndarray) -> np.ndarray:
    value = await conn.value()
    assert_type(value, dict[str, float])
    result: np.ndarray = x * value["scale"]
    return result
