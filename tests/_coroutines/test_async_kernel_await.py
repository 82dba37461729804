"""A forgotten ``await`` in a kernel (``async def`` or plain): the error says so.

Without it, Python says only "'coroutine' object is not subscriptable" (the
"never awaited" warning comes at exit). The map's ``KernelError`` names the
element, says that the kernel used (or returned) a coroutine without awaiting
it, and what to write; the next call works.
"""

from __future__ import annotations

import asyncio
import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import KernelError, threadmap

F32 = jax.ShapeDtypeStruct((), jnp.float32)
X = np.arange(4, dtype=np.float32)


async def fetch(x):
    await asyncio.sleep(0)
    return np.stack([x, x + 1])


def run(kernel):
    # Not under jit: there the KernelError comes inside JAX's runtime error.
    return np.asarray(jax.vmap(lambda x: threadmap(kernel, F32, x))(X))


async def good(x):
    return (await fetch(x))[1]


async def forgot_at_2(x):
    data = fetch(x) if x == 2 else await fetch(x)
    try:
        return data[1]
    finally:
        if x == 2:
            data.close()  # no "never awaited" warning at the test's end


async def returns_at_1(x):
    if x == 1:
        return fetch(x)
    return (await fetch(x))[1]


def test_a_kernel_that_indexes_an_unawaited_coroutine():
    with pytest.raises(KernelError) as info:
        run(forgot_at_2)
    message = str(info.value)
    assert info.value.index == (2,)
    assert "'forgot_at_2' at batch index (2,)" in message
    assert (
        "used a coroutine without awaiting it (TypeError: 'coroutine' object is not "
        "subscriptable): calling an async def function returns a coroutine, which "
        "runs only when awaited: write `await f(...)`, not `f(...)`." in message
    )
    assert "return data[1]" in message  # the kernel's line
    cause = info.value.__cause__
    if type(cause).__name__ == "SimplifiedTraceback":  # JAX's, on Python 3.10
        cause = cause.__cause__
    assert isinstance(cause, TypeError)
    np.testing.assert_array_equal(run(good), X + 1)  # the next call works


def test_a_kernel_that_returns_an_unawaited_coroutine():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KernelError) as info:
            run(returns_at_1)
        gc.collect()
    assert info.value.index == (1,)
    assert (
        "'returns_at_1' at batch index (1,) (batch shape (4,)) returned a coroutine "
        "of 'fetch' for output 0, expected float32 (shape ()); a coroutine is what "
        "calling an async def function returns, and it runs only when awaited. "
        "Await it: write `await fetch(...)` in an async def function" in str(info.value)
    ), str(info.value)
    # The coroutine was closed: no "never awaited" warning later, at exit.
    assert not [w for w in caught if "never awaited" in str(w.message)]
    np.testing.assert_array_equal(run(good), X + 1)


def test_a_coroutine_in_a_returned_tuple_is_named_too():
    out = (F32, F32)

    async def pair(x):
        return (await fetch(x))[0], fetch(x)

    with pytest.raises(
        KernelError, match="returned a coroutine of 'fetch' for output 1"
    ):
        jax.vmap(lambda x: threadmap(pair, out, x))(X)


def test_other_type_errors_keep_their_own_message():
    async def wrong(x):
        return (await fetch(x))[0] + "a"  # a TypeError of its own

    with pytest.raises(KernelError) as info:
        run(wrong)
    assert "without awaiting" not in str(info.value)
    assert "raised UFuncTypeError" in str(info.value), str(info.value)


class BrokenStr(TypeError):
    def __str__(self):
        raise RuntimeError("no text")


async def raises_broken_str(x):
    raise BrokenStr


def test_a_type_error_whose_str_fails_is_still_the_element_s_error():
    # The check for "'coroutine'" reads the message safely: the map ends in the
    # element's KernelError, never in an error of the check (or a hang).
    with pytest.raises(KernelError) as info:
        run(raises_broken_str)
    assert "raised BrokenStr: <exception str() failed>" in str(info.value)
    np.testing.assert_array_equal(run(good), X + 1)


# A plain def kernel that returns an async def function's coroutine (a lambda
# around one, say): its result is checked like any other, and the check says
# what it is, whatever shape was declared.


def plain_returns_at_3(x):
    return fetch(x) if x == 3 else np.float32(x + 1)


@pytest.mark.parametrize("shape", [(), (2,)], ids=["scalar", "vector"])
def test_a_plain_kernel_that_returns_a_coroutine(shape):
    out = jax.ShapeDtypeStruct(shape, jnp.float32)

    def kernel(x):
        value = plain_returns_at_3(x)
        return value if asyncio.iscoroutine(value) else np.full(shape, value)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KernelError) as info:
            jax.vmap(lambda x: threadmap(kernel, out, x))(X)
        gc.collect()
    assert info.value.index == (3,)
    assert (
        f"kernel' at batch index (3,) (batch shape (4,)) returned a coroutine of "
        f"'fetch' for output 0, expected float32 (shape {shape}); a coroutine is "
        "what calling an async def function returns, and it runs only when "
        "awaited. Await it: write `await fetch(...)` in an async def function"
        in str(info.value)
    ), str(info.value)
    # Closed by the check: no "never awaited" warning later, at exit.
    assert not [w for w in caught if "never awaited" in str(w.message)]
    np.testing.assert_array_equal(run(good), X + 1)  # the next call works


def test_a_plain_kernel_s_coroutine_under_jit_is_named_in_jax_s_error():
    f = jax.jit(jax.vmap(lambda x: threadmap(plain_returns_at_3, F32, x)))
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(f(X))
    assert "'plain_returns_at_3' at batch index (3,)" in str(info.value)
    assert "returned a coroutine of 'fetch' for output 0" in str(info.value)
    np.testing.assert_array_equal(f(X[:3]), X[:3] + 1)
