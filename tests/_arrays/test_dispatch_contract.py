"""What dispatch on AsyncArrays promises (issue 48 items 1, 3, 4).

- **Inputs as they were at the call.** A program called on pending data reads its
  ready arguments as they were at the call, whatever later calls do to them: a
  donation (``donate_argnums``, through jit's C++ fast path too), ``delete()``, a
  donation by another deferred program in a chain. JAX's runtime promises this for
  the programs it has enqueued; deferred dispatch holds programs back, so it must
  keep the promise itself (``_arrays/dispatch.py``, ``Readers``).
- **Types never depend on timing.** A call with an ``AsyncArray`` argument returns
  ``AsyncArray`` s for its array outputs, whether the load ended before the call or
  after, blocking or not; a call without one returns what JAX returns; tokens stay
  tokens.

Each case is compared with the same program on ready data.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import examples, returns_within
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_threadmap import AsyncArray, async_call
from jax_threadmap._arrays import dispatch as _dispatch
from jax_threadmap._jax.placement import alias_or_copy

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        _dispatch.mechanism.status() is not None,
        reason=f"async dispatch is off here: {_dispatch.mechanism.status()}",
    ),
]

SDS = jax.ShapeDtypeStruct
WAIT = 30.0
F4 = SDS((4,), np.float32)


class Gate:
    """A load that returns only when released."""

    def __init__(self, value):
        self.value = value
        self.release = threading.Event()
        self.__name__ = "load"

    def __call__(self):
        if not self.release.wait(WAIT):
            raise RuntimeError("the test never released the gate")
        return self.value


def gated(value, shape=F4):
    gate = Gate(value)
    return gate, async_call(gate, shape)


def while_gated(fn, *args):
    """``fn(*args)`` in a thread; fails unless it returns while the data is missing."""
    return returns_within(fn, *args, limit=WAIT, what="return while the data missed")


def warmed(fn, *args):
    """``fn``, called once (and its result dropped): later calls take jit's C++
    fast path, which no hook sees."""
    jax.block_until_ready(fn(*[jnp.array(a, copy=True) for a in args]))
    return fn


BATCH = np.arange(4, dtype=np.float32)
PARAMS = np.full(4, 2.0, np.float32)


def loss(b, p):
    return b * p + 1


def test_a_later_donation_leaves_the_result_of_an_earlier_call_right():
    expected = np.asarray(jax.jit(loss)(BATCH, PARAMS))
    update = warmed(jax.jit(lambda p: p - 7, donate_argnums=0), PARAMS)
    gate, batch = gated(BATCH)
    params = jnp.asarray(PARAMS)
    y = while_gated(jax.jit(loss), batch, params)
    new = update(params)  # donated before the batch lands (the C++ fast path)
    gate.release.set()
    np.testing.assert_array_equal(np.asarray(y), expected)
    np.testing.assert_array_equal(np.asarray(new), PARAMS - 7)


def test_a_later_delete_leaves_the_result_of_an_earlier_call_right():
    expected = np.asarray(jax.jit(loss)(BATCH, PARAMS))
    gate, batch = gated(BATCH)
    params = jnp.asarray(PARAMS)
    y = while_gated(jax.jit(loss), batch, params)
    params.delete()
    gate.release.set()
    np.testing.assert_array_equal(np.asarray(y), expected)
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(params)  # the caller's array is gone, as in JAX


def test_a_chain_where_a_later_program_donates_an_earlier_ones_ready_input():
    # first reads w and waits for x; second donates w and waits for z, which
    # lands first: the second runs first, and the first still reads w as it was.
    first = jax.jit(lambda x, w: x * w)
    second = jax.jit(lambda w, z: w + z, donate_argnums=0)
    w0 = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    want_first = np.asarray(first(BATCH, w0))
    want_second = np.asarray(second(jnp.asarray(w0), BATCH + 10))
    gate_x, x = gated(BATCH)
    gate_z, z = gated(BATCH + 10)
    w = jnp.asarray(w0)
    a = while_gated(first, x, w)
    b = while_gated(second, w, z)
    gate_z.release.set()
    np.testing.assert_array_equal(np.asarray(b), want_second)  # before first
    gate_x.release.set()
    np.testing.assert_array_equal(np.asarray(b), want_second)
    np.testing.assert_array_equal(np.asarray(a), want_first)


def test_a_chain_where_a_later_program_donates_an_earlier_ones_pending_input():
    # y is pending (a program on x). first reads y and waits for z too; second
    # donates y. When x lands, second runs at once: first, called before it,
    # still reads y as it was (a copy at the conflict).
    double = jax.jit(lambda v: v * 2)
    first = jax.jit(lambda y, z: y - z)
    second = jax.jit(lambda y: y * 100, donate_argnums=0)
    want_first = np.asarray(first(double(BATCH), BATCH + 1))
    want_second = np.asarray(second(double(BATCH)))
    gate_x, x = gated(BATCH)
    gate_z, z = gated(BATCH + 1)
    y = while_gated(double, x)
    a = while_gated(first, y, z)
    b = while_gated(second, y)
    gate_x.release.set()
    np.testing.assert_array_equal(np.asarray(b), want_second)  # before first
    gate_z.release.set()
    np.testing.assert_array_equal(np.asarray(b), want_second)
    np.testing.assert_array_equal(np.asarray(a), want_first)
    # Both land together: the earlier reader is dispatched first.
    gate_x, x = gated(BATCH)
    y = while_gated(double, x)
    a = while_gated(jax.jit(lambda v: v + 1), y)
    b = while_gated(second, y)
    gate_x.release.set()
    np.testing.assert_array_equal(np.asarray(a), np.asarray(double(BATCH)) + 1)
    np.testing.assert_array_equal(np.asarray(b), want_second)


# --- the kind of a result -------------------------------------------------------------


def _kinds(tree):
    return jax.tree_util.tree_map(lambda v: type(v).__name__, tree)


@pytest.mark.parametrize("lands", ["before", "after"])
def test_the_kind_of_a_result_depends_on_the_arguments_only(lands):
    f = jax.jit(lambda p, c: {"y": p["w"] * c, "n": jnp.sum(p["w"]), "c": c + 1})
    gate, w = gated(BATCH)
    if lands == "before":
        gate.release.set()
        w.block_until_ready()
    out = while_gated(f, {"w": w}, jnp.ones(4))
    eager = while_gated(jnp.sin, w)
    gate.release.set()
    assert _kinds(out) == {"y": "AsyncArray", "n": "AsyncArray", "c": "AsyncArray"}
    assert isinstance(eager, AsyncArray)
    want = f({"w": BATCH}, jnp.ones(4))
    for key in want:
        np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(want[key]))
    np.testing.assert_allclose(np.asarray(eager), np.sin(BATCH), rtol=1e-6)
    # Without AsyncArray arguments: what JAX returns, unchanged.
    assert all(type(v) is type(want["y"]) for v in jax.tree_util.tree_leaves(want))
    assert type(jnp.sin(BATCH)) is type(jax.jit(jnp.sin)(BATCH))


def test_blocking_dispatch_returns_async_arrays_too(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_ASYNC_DISPATCH, "0")
    assert _dispatch.mechanism.status().startswith("disabled by")
    gate, x = gated(BATCH)
    threading.Timer(0.05, gate.release.set).start()
    y = jax.jit(lambda a: a * 3)(x)  # waits for the data here
    assert isinstance(y, AsyncArray) and y.done()
    np.testing.assert_array_equal(np.asarray(y), BATCH * 3)


def test_tokens_stay_tokens_and_arrays_become_async_arrays():
    f = jax.jit(lambda a, t: (a * 2, t))
    want, want_token = f(BATCH, jax.lax.create_token())
    gate, x = gated(BATCH)
    box = {}
    call = threading.Thread(target=lambda: box.update(out=f(x, jax.lax.create_token())))
    call.start()  # waits for the data at the call (a token output: not deferred)
    gate.release.set()
    call.join(WAIT)
    y, token = box["out"]
    assert isinstance(y, AsyncArray)
    assert type(token) is type(want_token)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    # A token that passes through, alone beside a pending array.
    y, token = jax.jit(lambda a, t: (a, t))(x, jax.lax.create_token())
    np.testing.assert_array_equal(np.asarray(y), BATCH)
    assert type(token) is type(want_token)


# --- many readers of one array --------------------------------------------------------


def test_pending_programs_on_one_ready_array_share_one_copy():
    readers = _dispatch.mechanism.readers
    gates, outs = [], []
    params = jnp.asarray(PARAMS)
    for k in range(4):
        gate, batch = gated(BATCH + k)
        gates.append(gate)
        outs.append(while_gated(jax.jit(loss), batch, params))
    copies = {id(s) for s in readers.by_source if type(s).__name__ == "Held"}
    assert len(copies) == 1  # one copy for the four, not four
    params.delete()
    for gate in reversed(gates):  # the last called lands first
        gate.release.set()
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(np.asarray(out), (BATCH + k) * PARAMS + 1)


@settings(
    max_examples=examples(12),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(1, 4),
    donate_after=st.integers(-1, 3),
    order=st.permutations(range(4)),
)
def test_readers_and_a_donation_in_any_landing_order(n, donate_after, order):
    # n programs read w (each with a pending batch); after the donate_after-th,
    # w is donated (jit's C++ fast path) and the rest read the new w. The
    # batches land in any order; each result is the same program on ready data.
    step = jax.jit(lambda b, w, k: b * w + k)
    update = warmed(jax.jit(lambda w: w * 3 - 1, donate_argnums=0), PARAMS)
    w = jnp.asarray(PARAMS)
    values = np.asarray(w)
    gates, outs, expected = [], [], []
    for k in range(n):
        gate, batch = gated(BATCH + k)
        gates.append(gate)
        outs.append(while_gated(step, batch, w, np.float32(k)))
        expected.append((BATCH + k) * values + k)
        if k == donate_after:
            w = update(w)
            values = values * 3 - 1
    for i in order:
        if i < n:
            gates[i].release.set()
    for out, want in zip(outs, expected, strict=True):
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_deleting_a_landed_async_array_leaves_an_earlier_pending_reader_right():
    # y reads the landed AsyncArray p and waits for the batch; p.delete() before the
    # batch lands must leave y as it was at the call.
    expected = np.asarray(jax.jit(loss)(BATCH, PARAMS))
    params = async_call(lambda: PARAMS, F4)
    params.block_until_ready()
    gate, batch = gated(BATCH)
    y = while_gated(jax.jit(loss), batch, params)
    params.delete()
    gate.release.set()
    np.testing.assert_array_equal(np.asarray(y), expected)
    assert params.is_deleted()


def test_a_held_back_program_keeps_an_alias_on_the_cpu_and_a_copy_elsewhere():
    # The CPU keeps a ready argument by an alias of its buffer (no copy without a
    # conflict); a later donation then copies (XLA's CPU client honours the
    # alias) and delete() frees nothing the alias reads. Accelerators, and
    # arrays over several devices, get a copy.
    params = jax.device_put(PARAMS)
    kept = alias_or_copy(params)
    on_cpu = next(iter(params.devices())).platform == "cpu"
    same = kept.unsafe_buffer_pointer() == params.unsafe_buffer_pointer()
    assert same == on_cpu
    assert kept.sharding == params.sharding and kept.dtype == params.dtype
    new = jax.jit(lambda p: p - 7, donate_argnums=0)(params)
    np.testing.assert_array_equal(np.asarray(new), PARAMS - 7)
    np.testing.assert_array_equal(np.asarray(kept), PARAMS)
    other = jnp.asarray(PARAMS)
    kept_other = alias_or_copy(other)
    other.delete()
    np.testing.assert_array_equal(np.asarray(kept_other), PARAMS)
    if jax.device_count() > 1:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
        spec = jax.sharding.PartitionSpec("d")
        spread = jax.device_put(PARAMS, jax.sharding.NamedSharding(mesh, spec))
        copy = alias_or_copy(spread)
        assert copy.sharding == spread.sharding
        np.testing.assert_array_equal(np.asarray(copy), PARAMS)
