"""An ``AsyncArray`` is a ``jax.Array``: each place where JAX (or a library) treats
an object that passes ``isinstance(x, jax.Array)`` as an array, on a pending
array, against the same on the landed ``jax.Array``.

Each test holds the load until it releases it, so "returns without waiting" is
checked as ``not x.done()`` after the call (no clock). The table of these places
is in docs/async-internals.md ("An AsyncArray is a jax.Array").
"""

from __future__ import annotations

import copy
import pickle
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PATIENCE

import jax_threadmap as jtm
from jax_threadmap import AsyncArray, async_call

pytestmark = pytest.mark.timeout(120)

SDS = jax.ShapeDtypeStruct
A = np.arange(6, dtype=np.float32).reshape(2, 3)


def _same(got, want):
    assert (got.shape, got.dtype) == (np.shape(want), np.asarray(want).dtype)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _never(*_):
    threading.Event().wait(PATIENCE)


def test_every_state_is_a_jax_array(held):
    assert issubclass(AsyncArray, jax.Array)
    pending = held(A)
    deferred = jax.jit(lambda a: a + 1)(pending)
    assert not pending.done() and isinstance(deferred, AsyncArray)
    failed = async_call(lambda: 1 / 0, SDS((2,), np.float32))
    cancelled = async_call(_never, SDS((2,), np.float32))
    assert cancelled.cancel()
    landed = async_call(lambda: np.ones(2, np.float32), SDS((2,), np.float32))
    landed.result()
    for x in (pending, deferred, failed, cancelled, landed):
        assert isinstance(x, jax.Array), x
    held.release()
    _same(deferred, A + 1)
    with pytest.raises(ZeroDivisionError):
        failed.result()


def test_jnp_asarray_returns_it_unchanged_and_array_copies_without_waiting(held):
    x = held(A)
    assert jnp.asarray(x) is x  # as for a jax.Array: no copy, no wait
    y = jnp.array(x)  # a copy: a deferred program
    z = jnp.asarray(x, dtype=jnp.int32)
    assert not x.done() and y is not x
    held.release()
    _same(y, A)
    _same(z, A.astype(np.int32))


def test_device_put_with_nowhere_to_go_returns_it_without_waiting(held):
    # As for a jax.Array (JAX keeps only its own ArrayImpl: issue 56 item 5).
    x, ready = held(A), np.ones(2, np.float32)
    on = async_call(lambda: A, SDS(A.shape, A.dtype), device=jax.devices()[0])
    got = jax.device_put((x, ready, on))
    assert got[0] is x and got[2] is on and not x.done()
    assert jax.device_put(x, may_alias=True) is x
    _same(got[1], ready)
    copied = jax.device_put(on, may_alias=False)  # a copy: JAX's array
    assert copied is not on and copied.sharding == on.sharding
    held.release()
    _same(copied, A)
    _same(jax.device_put(x, may_alias=False), A)


def test_eager_ops_grad_vmap_and_lax_return_without_waiting(held):
    x = held(A)
    ops = {
        "sin": jnp.sin,
        "grad": jax.grad(lambda a: (a**2).sum()),
        "vmap": jax.vmap(jnp.sum),
        "tree": lambda a: jax.tree.map(lambda b: b * 2, {"a": a})["a"],
        "stop_gradient": jax.lax.stop_gradient,  # may return x itself
        "reshape": lambda a: jax.lax.reshape(a, (3, 2)),
        "where": lambda a: jnp.where(a > 1, a, 0.0),
        "cond": lambda a: jax.lax.cond(True, lambda b: b + 1, lambda b: b, a),
    }
    outs = {name: op(x) for name, op in ops.items()}
    assert not x.done()
    assert all(isinstance(v, AsyncArray) for v in outs.values())
    assert jax.typeof(x) == jax.core.ShapedArray((2, 3), jnp.float32)
    assert jnp.result_type(x) == jnp.float32
    assert jax.tree.leaves({"a": x}) == [x]  # a leaf, as a jax.Array
    held.release()
    ready = jnp.asarray(A)  # the same ops on a jax.Array: the same values
    for name, op in ops.items():
        np.testing.assert_array_equal(np.asarray(outs[name]), op(ready), name)


def test_a_jitted_function_that_closes_over_it_embeds_its_value():
    x = async_call(lambda: A, SDS(A.shape, A.dtype))
    # JAX embeds a closed-over array in the program: lowering waits for it.
    _same(jax.jit(lambda: x * 2)(), 2 * A)
    x.result()  # landed: its operators under the trace are traced, not wrapped
    _same(jax.jit(lambda: x * 2 + x.sum())(), 2 * A + A.sum())


@pytest.mark.parametrize("landed", [False, True])
def test_its_operators_with_a_traced_argument_trace(held, landed):
    x = held(A)
    if landed:
        held.release()
        x.result()
    f = jax.jit(lambda t: (x * t, t - x, x[t.astype(int)], x.at[0].add(t)))
    # Pending: the program's lowering waits for the value it embeds.
    threading.Timer(0.05, held.release).start()
    got = f(jnp.float32(1.0))
    ready = jnp.asarray(A)
    want = jax.jit(lambda t: (ready * t, t - ready, ready[t.astype(int)]))(1.0)
    for g, w in zip(got, (*want, ready.at[0].add(1.0)), strict=True):
        _same(g, np.asarray(w))


def test_what_reads_the_buffer_waits_then_gives_the_landed_arrays_answer(held):
    x = held(A)
    held.release()
    _same(np.asarray(x), A)
    try:  # (a TPU's buffers are no DLPack device: the same error as JAX's)
        want = np.from_dlpack(jnp.asarray(A))
    except Exception as e:
        with pytest.raises(type(e)):
            np.from_dlpack(x)
    else:
        _same(np.from_dlpack(x), want)
    _same(jax.device_get(x), A)
    assert jax.block_until_ready({"a": x})["a"] is x
    assert x.unsafe_buffer_pointer() == x.result().unsafe_buffer_pointer()
    _same(x.addressable_shards[0].data, A)
    _same(pickle.loads(pickle.dumps(x)), A)
    _same(copy.deepcopy(x), A)
    _same(jax.device_put(x, jax.devices()[0]), A)


def test_a_loader_that_returns_an_async_array_gives_its_value():
    a = async_call(lambda: A, SDS(A.shape, A.dtype))
    b = async_call(lambda: a * 2, SDS(A.shape, A.dtype))
    assert type(b.result()) is not AsyncArray
    _same(b.result(), 2 * A)


def test_a_loader_that_returns_a_weakly_typed_array_gives_the_declared_type():
    # jax.device_put(1.) is weakly typed; the array is declared float32, not weak:
    # its value was weak, and an op deferred on it failed (its trace and its run
    # disagreed), as JAX's test_devicearray_weakref_friendly found.
    go = threading.Event()
    x = async_call(lambda: go.wait(PATIENCE) and jax.device_put(1.0), SDS((), "f4"))
    y, z = x == 1.0, jax.jit(lambda a: a * 2)(x)
    go.set()
    assert not x.weak_type and not x.result().weak_type
    assert bool(y) and float(z) == 2.0 and not z.result().weak_type


@pytest.mark.parametrize("setting", ["debug_nans", "debug_infs"])
def test_a_debug_nans_context_holds_for_ops_and_programs_deferred_in_it(held, setting):
    # The context holds for its thread only; the deferred op and program run in
    # another, later: they run under the caller's settings (and x64's).
    bad = np.array([1.0, 0.0 if setting == "debug_infs" else -1.0], np.float32)
    x = held(bad)
    with getattr(jax, setting)(True):
        deferred = [jnp.log(x), jax.jit(jnp.log)(x)]
        dependent = x.sum() + deferred[0]
    outside = jnp.log(x)
    assert not x.done()
    held.release()
    for y in deferred:  # as on a jax.Array: FloatingPointError
        with pytest.raises(FloatingPointError, match="invalid value"):
            np.asarray(y)
    # (a program on its result: JaxRuntimeError, as for any failed argument)
    with pytest.raises(Exception, match="FloatingPointError: invalid value"):
        np.asarray(dependent)
    with np.errstate(divide="ignore", invalid="ignore"):
        _same(outside, np.log(bad))


def test_equinox_takes_it_for_an_array(held):
    eqx = pytest.importorskip("equinox")
    x = held(A)
    assert eqx.is_array(x)
    f = eqx.filter_jit(lambda t: t["a"] * 2)
    # filter_jit waits for a marker output of each call (its runtime errors):
    # the call returns once the load has landed and the program has run.
    threading.Timer(0.05, held.release).start()
    y = f({"a": x, "n": 3})  # a leaf that is not an array is static
    assert isinstance(y, jax.Array)
    _same(y, 2 * A)


def test_threadmap_takes_it_eagerly(held):
    x = held(A)
    held.release()  # an eager threadmap runs its kernel now, on the value
    y = jtm.threadmap(np.sin, SDS((3,), np.float32), x[0])
    np.testing.assert_allclose(np.asarray(y), np.sin(A[0]), rtol=1e-6)


RANDOM = {
    "normal": lambda k: jax.random.normal(k, (3,)),
    "uniform": lambda k: jax.random.uniform(k, (3,)),
    "randint": lambda k: jax.random.randint(k, (2,), 0, 10),
    "bits": lambda k: jax.random.bits(k, (2,)),
    "key_data": jax.random.key_data,
    "split": lambda k: jax.random.key_data(jax.random.split(k)),
    "split_row": lambda k: jax.random.key_data(jax.random.split(k, 3)[1]),
    "fold_in": lambda k: jax.random.key_data(jax.random.fold_in(k, 3)),
    "clone": lambda k: jax.random.key_data(jax.random.clone(k)),
    "permutation": lambda k: jax.random.permutation(k, 5),
    "categorical": lambda k: jax.random.categorical(k, jnp.zeros(4)),
}


@pytest.mark.parametrize("impl", [None, "rbg"])
def test_a_key_result_works_with_every_jax_random_function(held, impl):
    seed = held(np.uint32(7))
    threading.Timer(0.05, held.release).start()  # a key result waits at dispatch
    key = jax.jit(lambda s: jax.random.key(s, impl=impl))(seed)
    assert isinstance(key, AsyncArray) and isinstance(key, jax.Array)
    assert str(jax.random.key_impl(key)) == str(
        jax.random.key_impl(jax.random.key(7, impl=impl))
    )
    want = jax.random.key(7, impl=impl)
    # JAX's answers for a key of its own, in one program (one compile, not one per
    # function: jax.random gives the same bits in a jitted program as eagerly).
    expected = jax.jit(lambda k: {name: fn(k) for name, fn in RANDOM.items()})(want)
    for name, fn in RANDOM.items():
        got = fn(key)  # each function eagerly, on the AsyncArray
        assert isinstance(got, jax.Array), name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected[name]), name)
    # and as an argument of a jitted function
    got = jax.jit(lambda k: jax.random.normal(jax.random.split(k)[0], (2,)))(key)
    want_jit = jax.random.normal(jax.random.split(want)[0], (2,))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_jit))


def test_the_buffer_protocol_where_python_allows_it(held):
    x = held(A)
    if sys.version_info >= (3, 12):  # PEP 688: __buffer__ from Python
        # Pending: it waits for the value (in Python: Ctrl-C reaches the wait,
        # tests/_arrays/test_async_pool.py), here until the release that comes later.
        threading.Timer(0.05, held.release).start()
        assert memoryview(x).tobytes() == A.tobytes()
        assert np.asarray(x).tobytes() == A.tobytes()
    else:  # a Python class cannot export a buffer before 3.12
        held.release()
        x.block_until_ready()
        with pytest.raises(TypeError, match="bytes-like"):
            memoryview(x)
    x._check_if_deleted()  # JAX's own check, on the value
    x.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        x._check_if_deleted()
