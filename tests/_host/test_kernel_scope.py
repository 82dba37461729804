"""JAX calls inside kernels run on the host, never on a device that waits for them.

On an accelerator, the program that called a map holds its device until its host
callback returns: a kernel that ran a program there would wait forever. The CPU
client runs many programs at once, so on a CPU-only machine nothing is held;
these tests make the CPU device count as held (``_holds``) to check, on any
machine, that such a program raises at once, naming the device and the kernel,
and that the next call works. The tests marked ``accelerator`` run the real
thing where the default backend is not the CPU (on the lent TPU).
"""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import returns_within

from jax_threadmap import threadmap
from jax_threadmap._host import kernel_scope as _kernel_scope
from jax_threadmap._jax import program_runs as _program_runs

SDS = jax.ShapeDtypeStruct
ON_ACCELERATOR = jax.default_backend() != "cpu"
#: A bound on a hang (the failure this file guards against), never a timing.
HANG = 120.0


@pytest.fixture
def cpu_held(monkeypatch):
    """Makes this machine's CPU devices count as held by the programs that call
    a map, as an accelerator's are, and the CPU the host to move JAX calls to."""
    if _program_runs.runs_unavailable() is not None:
        pytest.skip(_program_runs.runs_unavailable())
    host = jax.devices("cpu")[0]
    monkeypatch.setattr(_kernel_scope, "_holds", lambda device: True)
    monkeypatch.setattr(_kernel_scope, "_host_device", lambda: host)
    # The maps' programs on the CPU too (on an accelerator they would run there,
    # and the kernels' programs, on the CPU, would not be on a held device), in
    # every thread: the tests call the maps from another (returns_within), and
    # `with jax.default_device(...)` sets only this thread's default.
    before = jax.config.jax_default_device
    jax.config.update("jax_default_device", host)
    try:
        yield
    finally:
        jax.config.update("jax_default_device", before)


def mapped(kernel, shape=(2,)):
    def one(x):
        return threadmap(kernel, SDS(shape, x.dtype), x)

    return jax.jit(jax.vmap(one))


def add_one_in_jax(x):
    return np.asarray(jax.jit(lambda a: a + 1)(x))


@pytest.mark.parametrize("warm", [False, True])
def test_a_kernel_running_a_program_on_the_held_device_raises_at_once(cpu_held, warm):
    if warm:  # cached on JAX's C++ fast path, which the check cannot see
        jax.jit(lambda a: a + 1)(np.ones(2, np.float32)).block_until_ready()
    x = np.ones((3, 2), np.float32)
    # Under jit the kernel's error reaches the caller as JAX's runtime error,
    # whose text carries it (tests/_core/test_api.py); eager, as itself.
    with pytest.raises(Exception, match="HeldDeviceError") as info:
        returns_within(
            lambda: jax.block_until_ready(mapped(add_one_in_jax)(x)), limit=HANG
        )
    text = str(info.value)
    assert f"would run on {jax.devices('cpu')[0]}" in text
    assert "kernel 'add_one_in_jax'" in text and "backend='cpu'" in text
    # Nothing leaked into this thread, and the next map works.
    assert _program_runs.RUNS.refused.devices == frozenset()
    np.testing.assert_array_equal(mapped(np.negative)(x), -x)


def test_maps_a_kernel_runs_eagerly_inherit_the_held_devices(cpu_held):
    def outer(x):
        return np.asarray(threadmap(add_one_in_jax, SDS(x.shape, x.dtype), x))

    with pytest.raises(Exception, match="(?s)outer'.*HeldDeviceError"):
        returns_within(
            lambda: jax.block_until_ready(mapped(outer)(np.ones((2, 2), np.float32))),
            limit=HANG,
        )


def test_async_def_kernels_refuse_the_held_device_too(cpu_held):
    async def kernel(x):
        await asyncio.sleep(0)
        return add_one_in_jax(x)

    with pytest.raises(Exception, match="(?s)kernel'.*HeldDeviceError"):
        returns_within(
            lambda: jax.block_until_ready(mapped(kernel)(np.ones((2, 2), np.float32))),
            limit=HANG,
        )
    # Eager, no program holds a device: the same kernel runs.
    f = jax.vmap(lambda x: threadmap(kernel, SDS(x.shape, x.dtype), x))
    np.testing.assert_array_equal(f(np.ones((2, 2), np.float32)), 2.0)


def test_kernels_default_to_the_host_where_the_backend_is_an_accelerator(monkeypatch):
    # On an accelerator host (simulated: the CPU device is the host, none is
    # held) a kernel's JAX calls default to the CPU, in every kind of kernel.
    host = jax.devices("cpu")[0]
    monkeypatch.setattr(_kernel_scope, "_host_device", lambda: host)
    seen = []

    def where():  # where an array the kernel makes goes
        return jnp.zeros(1).devices()

    def kernel(x):
        seen.append(where())
        return add_one_in_jax(x)

    async def async_kernel(x):
        seen.append(where())
        await asyncio.sleep(0)
        seen.append(where())
        return add_one_in_jax(x)

    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    for k in (kernel, async_kernel):
        seen.clear()
        np.testing.assert_array_equal(mapped(k)(x), x + 1)
        assert seen and all(d == {host} for d in seen), seen
    assert jax.config.jax_default_device is None  # the caller's is untouched


def test_on_a_cpu_host_kernels_run_untouched():
    if ON_ACCELERATOR:
        pytest.skip("the default backend is an accelerator here")
    seen = []

    def kernel(x):
        seen.append(jax.config.jax_default_device)
        return add_one_in_jax(x)

    x = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(mapped(kernel)(x), x + 1)
    assert seen == [None, None]


@pytest.mark.skipif(not ON_ACCELERATOR, reason="needs an accelerator (default backend)")
def test_on_an_accelerator_a_kernel_calling_a_jitted_map_finishes():
    # The inner map runs on the host: the outer program holds the accelerator.
    inner = jax.jit(jax.vmap(lambda r: threadmap(np.sort, SDS(r.shape, r.dtype), r)))

    def kernel(rows):
        return np.asarray(inner(rows))

    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    f = mapped(kernel, shape=(4, 5))
    got = returns_within(lambda: np.asarray(f(x)), limit=HANG)
    np.testing.assert_array_equal(got, np.sort(x, axis=-1))


@pytest.mark.skipif(not ON_ACCELERATOR, reason="needs an accelerator (default backend)")
def test_on_an_accelerator_a_kernel_using_device_data_raises_at_once():
    # Committed to the accelerator the program holds (an uncommitted array would
    # follow the kernel's default device, the host).
    on_device = jax.device_put(jnp.ones(2), jax.devices()[0])

    def kernel(x):
        return np.asarray(jax.jit(lambda a, b: a + b)(x, on_device))

    f = jax.jit(jax.vmap(lambda x: threadmap(kernel, SDS((2,), x.dtype), x)))
    x = np.ones((3, 2), np.float32)
    f_outside = jax.jit(lambda a, b: a + b)
    f_outside(x[0], on_device).block_until_ready()  # warm JAX's fast path
    with pytest.raises(Exception, match="HeldDeviceError"):
        returns_within(lambda: np.asarray(f(x)), limit=HANG)
