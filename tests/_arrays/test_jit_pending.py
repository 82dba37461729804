"""``jax.jit`` with pending inputs, modelled on JAX's own ``JitTest`` categories.

A compact guard of what ``benchmarks/jax_suite.py`` runs at length (JAX's own tests
with every input a pending AsyncArray): pytrees, static and keyword arguments,
``device_put``, ``block_until_ready``, effects, errors, and ``jax.Array`` methods
of the results; each compared with the same call on the landed ``jax.Array``.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PATIENCE, returns_within

from jax_threadmap import async_call

pytestmark = pytest.mark.timeout(120)

SDS = jax.ShapeDtypeStruct


def _check(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.array([1.0, -1.0, 2.0], np.float32)


def test_pytrees_in_and_out(held):
    f = jax.jit(lambda t: {"s": t["a"] + t["b"][0], "p": (t["a"] * 2, t["b"][1])})
    tree = {"a": held(A), "b": [held(B), held(np.int32(3))]}
    out = returns_within(f, tree, limit=PATIENCE)  # returns while held
    held.release()
    _check(out, f({"a": A, "b": [B, np.int32(3)]}))


def test_static_and_keyword_arguments(held):
    @functools.partial(jax.jit, static_argnums=1, static_argnames="axis")
    def f(x, power, *, axis, scale):
        return (x**power).sum(axis=axis) * scale

    x, scale = held(A), held(np.float32(0.5))
    out = returns_within(lambda: f(x, 2, axis=1, scale=scale), limit=PATIENCE)
    held.release()
    _check(out, f(A, 2, axis=1, scale=np.float32(0.5)))


def test_device_put_and_block_until_ready(held):
    x = held(A)
    device = jax.devices()[0]
    threading.Timer(0.05, held.release).start()
    put = jax.device_put(x, device)  # waits for the value, as documented
    y = jax.jit(lambda a: a - 1)(put)
    assert jax.block_until_ready(y) is y
    _check(y, A - 1)
    assert y.devices() == {device}


def test_methods_of_results_and_of_inputs(held):
    x = held(A)
    y = jax.jit(lambda a: a * 3)(x)
    outs = returns_within(
        lambda: (
            y.T,
            x.sum(0),
            x.astype(jnp.int32),
            x.reshape(3, 2),
            x.at[0, 0].set(9),
        ),
        limit=PATIENCE,
    )
    held.release()
    ref = jnp.asarray(A)
    _check(
        outs,
        (
            (ref * 3).T,
            ref.sum(0),
            ref.astype(jnp.int32),
            ref.reshape(3, 2),
            ref.at[0, 0].set(9),
        ),
    )
    assert y.tolist() == (A * 3).tolist() and x.item(4) == 4.0


def test_effects_run_once_with_the_landed_value(held):
    seen = []

    def record(v):
        seen.append(np.asarray(v).copy())

    @jax.jit
    def f(a):
        jax.debug.callback(record, a)
        return a + 1

    x = held(B)
    out = returns_within(f, x, limit=PATIENCE)
    held.release()
    _check(out, B + 1)
    jax.effects_barrier()
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], B)


def test_errors_at_the_call_are_those_of_jax(held):
    f = jax.jit(lambda a, b: a @ b)
    x = held(A)
    with pytest.raises(TypeError) as pending_error:
        f(x, B.reshape(1, 3))
    with pytest.raises(TypeError) as plain_error:
        f(A, B.reshape(1, 3))
    assert str(pending_error.value) == str(plain_error.value)
    with pytest.raises(ValueError, match="Non-hashable static"):
        jax.jit(lambda a, n: a * n, static_argnums=1)(x, np.ones(2))
    held.release()


def test_a_failed_load_fails_the_results_not_the_call():
    release = threading.Event()

    def load():
        release.wait(PATIENCE)
        raise OSError("disk gone")

    x = async_call(load, SDS((3,), np.float32))
    y = jax.jit(lambda a: a + 1)(x)  # the load has not failed yet
    release.set()
    with pytest.raises(Exception, match="disk gone"):
        np.asarray(y)
    with pytest.raises(OSError, match="disk gone"):
        x.tolist()


def test_a_donated_input_is_deleted(held):
    x = held(A)
    # Released by a timer, while the donating program may wait for its data.
    threading.Timer(0.1, held.release).start()
    y = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    _check(y, A * 2)
    assert x.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
        x.tolist()
