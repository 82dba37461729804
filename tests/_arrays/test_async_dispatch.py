"""Async dispatch: jitted calls with pending AsyncArrays return before the data.

Each test holds the background call on a gate (an Event it releases itself), so
"returned before the data" is checked without timing: the dispatch runs in a
helper thread, which must finish while the gate is still closed. Values are
compared with the same program run on the data. (Deferred dispatch's own
contract, chains and failures: tests/_arrays/test_deferred_dispatch.py.)
"""

from __future__ import annotations

import logging
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import returns_within, run_script
from jax.experimental import io_callback

import jax_threadmap as jtm
from jax_threadmap import AsyncArray, async_call
from jax_threadmap._arrays import async_pool as _async_pool
from jax_threadmap._arrays import dispatch as _dispatch

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        _dispatch.mechanism.status() is not None,
        reason=f"async dispatch is off here: {_dispatch.mechanism.status()}",
    ),
]

SDS = jax.ShapeDtypeStruct
WAIT = 30.0


class Gate:
    """A background function that returns (or raises) only when released."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value = value
        self.error = error
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls = 0
        self.threads: list[threading.Thread] = []

    def __call__(self):
        self.calls += 1
        self.threads.append(threading.current_thread())
        self.started.set()
        if not self.release.wait(WAIT):
            raise RuntimeError("the test never released the gate")
        if self.error is not None:
            raise self.error
        return self.value


def returns_while_gated(fn, *args, limit: float = 20.0):
    """Runs fn(*args) in a thread; fails unless it returns within ``limit`` s."""
    return returns_within(
        fn, *args, limit=limit, what="return while the data was missing"
    )


def _model(p, x):
    return jnp.tanh(p["w"] @ x + p["b"]) * p["step"]


def _weights(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((n, n)).astype(np.float32),
        "b": rng.standard_normal(n).astype(np.float32),
        "step": np.array(seed + 1, np.int32),
    }


def _shapes(n=3):
    return {
        "w": SDS((n, n), jnp.float32),
        "b": SDS((n,), jnp.float32),
        "step": SDS((), jnp.int32),
    }


def _reference(f, *args):
    return np.asarray(f(*jax.tree.map(jnp.asarray, args)))


# --- the value arrives after dispatch --------------------------------------------


def test_dispatch_returns_before_the_data_and_the_value_is_right():
    ref = _weights(seed=3)
    gate = Gate(ref)
    params = async_call(gate, _shapes())
    x = jnp.arange(3.0, dtype=jnp.float32)
    f = jax.jit(_model)
    g = jax.jit(lambda y: jnp.cumsum(y) * 2)
    y = returns_while_gated(f, params, x)
    z = returns_while_gated(g, y)  # JAX orders the dependents
    # The kind of a result follows its arguments' (AsyncArray in, AsyncArray
    # out), never the timing; here each is a deferred program, not run yet.
    assert isinstance(y, AsyncArray) and isinstance(z, AsyncArray)
    assert not gate.release.is_set() and not params["w"].done()
    assert not y.is_ready() and not z.is_ready()
    assert not y.done() and not z.done()
    gate.release.set()
    expected = _reference(_model, ref, x)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(z), np.cumsum(expected) * 2, rtol=1e-5)
    # The AsyncArray API is as before, and later calls use the loaded value.
    np.testing.assert_array_equal(np.asarray(params["w"].result()), ref["w"])
    assert params["w"].done() and repr(params["w"]) == repr(params["w"].result())
    np.testing.assert_allclose(f(params, x), expected, rtol=1e-6)
    assert gate.calls == 1


def test_eager_ops_dispatch_too_and_mixed_ready_and_pending_arguments():
    ref = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    gate = Gate(ref.copy())
    a = async_call(gate, SDS((3, 4), np.float32))
    ready = async_call(lambda: np.ones((3, 4), np.float32), SDS((3, 4), np.float32))
    ready.block_until_ready()
    s = returns_while_gated(jnp.sin, a)
    both = returns_while_gated(jax.jit(lambda u, v, w: u * v + w), a, ready, a)
    gate.release.set()
    np.testing.assert_allclose(s, np.sin(ref), rtol=1e-6)
    np.testing.assert_allclose(both, ref * 1.0 + ref, rtol=1e-6)


def test_seed_example_square_returns_before_slow_finishes():
    gate = Gate(np.arange(4, dtype=np.int32))
    x = async_call(gate, SDS((4,), np.int32))
    square = jax.jit(lambda v: v * v)
    y = returns_while_gated(square, x)
    assert not y.is_ready()
    gate.release.set()
    assert np.asarray(y).tolist() == [0, 1, 4, 9]


# --- failures --------------------------------------------------------------------


class LoadError(Exception):
    pass


def _load_error() -> LoadError:
    try:
        try:
            raise ConnectionError("socket closed")
        except ConnectionError as e:
            raise LoadError("could not fetch weights.bin") from e
    except LoadError as e:
        return e


def test_failure_after_dispatch_reaches_every_dependent(caplog):
    gate = Gate(error=_load_error())
    gate.__name__ = "fetch_weights"
    gate.__qualname__ = "fetch_weights"
    params = async_call(gate, _shapes())
    x = jnp.ones(3, jnp.float32)
    y = returns_while_gated(jax.jit(_model), params, x)
    z = returns_while_gated(jax.jit(lambda v: v + 1), y)
    s = returns_while_gated(jnp.sum, params["b"])
    with caplog.at_level(logging.WARNING, logger="jax_threadmap"):
        gate.release.set()
        with pytest.raises(LoadError, match="could not fetch weights.bin") as info:
            params["w"].result(timeout=WAIT)  # the array's own uses: as before
    assert isinstance(info.value.__cause__, ConnectionError)
    for dependent in (y, z, s, y, z):  # every use, every time, never a value
        with pytest.raises(jax.errors.JaxRuntimeError) as info:
            np.asarray(dependent)
        text = str(info.value)
        assert "LoadError: could not fetch weights.bin" in text, text
        assert "`fetch_weights`" in text and "async_call" in text, text
    with pytest.raises(jax.errors.JaxRuntimeError, match="could not fetch"):
        z.block_until_ready()
    warnings = [r for r in caplog.records if "fetch_weights" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "LoadError: could not fetch weights.bin" in warnings[0].getMessage()
    # JAX's own "pure_callback failed" log of the gate program is left out.
    assert not [r for r in caplog.records if "pure_callback" in r.getMessage()]
    with pytest.raises(LoadError):  # later dispatches raise the original
        jax.jit(_model)(params, x)


def test_wrong_result_after_dispatch_fails_dependents_with_the_message():
    gate = Gate(np.zeros((2, 2), np.float32))
    a = async_call(gate, SDS((3,), np.float32))
    y = returns_while_gated(jax.jit(lambda v: v * 2), a)
    gate.release.set()
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        np.asarray(y)
    assert r"shape (2, 2) and dtype float32 (expected shape (3,)" in str(info.value)
    with pytest.raises(ValueError, match="do not match result_shape_dtypes"):
        a.result()


# --- placement, pytrees, devices -------------------------------------------------


@pytest.mark.parametrize("kind", ["device", "named_sharding", "leaf_sharding"])
def test_device_and_shardings(kind):
    dev = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([dev]), ("x",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    shapes, kwargs = _shapes(4), {}
    if kind == "device":
        kwargs["device"] = dev
    elif kind == "named_sharding":
        kwargs["device"] = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()
        )
    else:
        shapes["w"] = SDS((4, 4), np.float32, sharding=rows)
    ref = _weights(4, seed=1)
    gate = Gate(ref)
    out = async_call(gate, shapes, **kwargs)

    def body(p):
        return p["w"].sum(axis=0) + p["b"] * p["step"]

    y = returns_while_gated(jax.jit(body), out)
    gate.release.set()
    np.testing.assert_allclose(y, _reference(body, ref), rtol=1e-5)
    value = out["w"].result()
    assert value.committed
    assert value.sharding.is_equivalent_to(out["w"].sharding, 2)
    np.testing.assert_array_equal(np.asarray(value), ref["w"])


def test_four_devices_in_a_subprocess():
    script = textwrap.dedent(
        """
        import os, threading
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
            + " --xla_force_host_platform_device_count=4")
        import jax, jax.numpy as jnp, numpy as np
        import jax_threadmap as jtm
        assert jax.device_count() == 4, jax.devices()
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        P = jax.sharding.PartitionSpec
        specs = [P("x"), P(), P(None, "x")]
        ref = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
        release = threading.Event()
        def load():
            assert release.wait(30)
            return ref
        for spec in specs:
            sh = jax.sharding.NamedSharding(mesh, spec)
            release.clear()
            x = jtm.async_call(load, jax.ShapeDtypeStruct((8, 4), np.float32),
                               device=sh)
            f = jax.jit(lambda a: (a * 2).sum(axis=1))
            box = {}
            t = threading.Thread(target=lambda: box.update(y=f(x)))
            t.start(); t.join(20)
            assert not t.is_alive() and not box["y"].is_ready(), spec
            release.set()
            np.testing.assert_allclose(box["y"], (ref * 2).sum(axis=1))
            assert x.result().sharding == sh
            print("ok", spec)
        print("all device checks passed")
        """
    )
    proc = run_script(script, timeout=100, forked=True)
    assert "all device checks passed" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# --- many pending arrays --------------------------------------------


def test_200_pending_arrays_in_one_call():
    n = 200
    release = threading.Event()

    def load(i):
        assert release.wait(WAIT)
        return np.full((2,), i, np.float32)

    arrays = [async_call(load, SDS((2,), np.float32), i) for i in range(n)]
    f = jax.jit(lambda xs: jnp.stack(xs) * 2)
    y = returns_while_gated(f, arrays)
    assert not y.is_ready()
    release.set()
    # About a second; the program waits for its 200 inputs once each: a hang
    # bound, not a timing.
    np.testing.assert_array_equal(
        returns_within(np.asarray, y, limit=WAIT),
        2 * np.repeat(np.arange(n, dtype=np.float32)[:, None], 2, 1),
    )


# --- ordered effects -------------------------------------------------------------


def _with_ordered_effect(kind: str, seen: list):
    """A jitted ``v * 2`` that records ``v`` through an ordered effect."""

    def record(v):
        seen.append(np.asarray(v).tolist())

    def g(v):
        if kind == "io_callback":
            io_callback(record, None, v, ordered=True)
        else:
            jax.debug.callback(record, v, ordered=True)
        return v * 2

    return jax.jit(g)


@pytest.mark.parametrize("kind", ["io_callback", "debug_callback"])
def test_a_program_with_ordered_effects_waits_for_its_data_at_dispatch(kind):
    # JAX dispatches the next program with that effect only once this one ran:
    # it waits here, in Python, rather than in the next dispatch, inside JAX.
    seen: list = []
    h = _with_ordered_effect(kind, seen)
    h(jnp.zeros(2)).block_until_ready()
    seen.clear()
    gate = Gate(np.ones(2, np.float32))
    x = async_call(gate, SDS((2,), np.float32))
    box: dict = {}
    waits = threading.Thread(target=lambda: box.update(a=h(x)), daemon=True)
    waits.start()
    waits.join(0.5)
    assert waits.is_alive() and not gate.release.is_set()
    gate.release.set()
    waits.join(WAIT)
    assert not waits.is_alive()
    b = returns_while_gated(h, jnp.full(2, 3.0, jnp.float32))
    np.testing.assert_array_equal(np.asarray(box["a"]), [2.0, 2.0])
    np.testing.assert_array_equal(np.asarray(b), [6.0, 6.0])
    jax.effects_barrier()
    assert seen == [[1.0, 1.0], [3.0, 3.0]]


def test_a_failed_load_under_an_ordered_effect_fails_only_its_dispatch():
    # Had the program been dispatched, its failure would fail every later
    # program with the effect (JAX before 0.12) and JAX's exit handler too.
    seen: list = []
    h = _with_ordered_effect("io_callback", seen)
    gate = Gate(error=LoadError("gone"))
    x = async_call(gate, SDS((2,), np.float32))
    assert gate.started.wait(WAIT)
    threading.Timer(0.1, gate.release.set).start()  # while h(x) waits, usually
    with pytest.raises(LoadError, match="gone"):
        returns_while_gated(h, x, limit=WAIT)
    np.testing.assert_array_equal(np.asarray(h(jnp.ones(2))), [2.0, 2.0])
    jax.effects_barrier()
    assert seen == [[1.0, 1.0]]


# --- threadmap ------------------------------------------------------------------------


def test_threadmap_input():
    ref = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    gate = Gate(ref.copy())
    a = async_call(gate, SDS((4, 3), np.float32))

    def kernel(row):
        return np.sort(row)[::-1] * 2

    f = jax.jit(jax.vmap(lambda r: jtm.threadmap(kernel, SDS((3,), np.float32), r)))
    y = returns_while_gated(f, a)
    gate.release.set()
    np.testing.assert_array_equal(y, np.stack([kernel(r) for r in ref]))


def test_a_loader_that_uses_jax_while_a_dependent_waits():
    release = threading.Event()

    def load():
        assert release.wait(WAIT)
        # JAX work in the loader's thread is not queued behind the dependent.
        return np.asarray(jax.jit(lambda v: v * 10)(jnp.arange(4.0)))

    a = async_call(load, SDS((4,), np.float32))
    y = returns_while_gated(jax.jit(lambda v: v + 1), a)
    release.set()
    np.testing.assert_array_equal(np.asarray(y), np.arange(4.0) * 10 + 1)


def test_dispatch_inside_a_pool_call_still_waits_for_its_data():
    # A call run by the pool that jits with another call's arrays waits for them
    # there (running the other call itself if it has not started), so a full
    # pool cannot deadlock.
    bound = _async_pool.default_async_threads()

    def inner(i):
        return np.full((1,), i, np.float32)

    def outer(i):
        b = async_call(inner, SDS((1,), np.float32), i)
        return np.asarray(jax.jit(lambda v: v * 2)(b))

    arrays = [async_call(outer, SDS((1,), np.float32), i) for i in range(2 * bound)]
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(np.asarray(a.result(timeout=WAIT)), [2.0 * i])


# --- the switch --------------------------------------------------------------------


def test_switch_off_gives_blocking_dispatch(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_ASYNC_DISPATCH, "0")
    assert _dispatch.mechanism.status().startswith("disabled by")
    gate = Gate(np.ones(2, np.float32))
    a = async_call(gate, SDS((2,), np.float32))
    box = {}
    t = threading.Thread(target=lambda: box.update(y=jax.jit(lambda v: -v)(a)))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # waits for the data, as before
    gate.release.set()
    t.join(WAIT)
    np.testing.assert_array_equal(box["y"], [-1.0, -1.0])
    monkeypatch.setenv(_dispatch.ENV_ASYNC_DISPATCH, "maybe")
    with pytest.raises(ValueError, match="JAX_THREADMAP_ASYNC_DISPATCH='maybe'"):
        _dispatch.async_dispatch_mode()


# --- exit ----------------------------------------------------------------------------

_EXIT_SCRIPT = """
import time, jax, numpy as np
import jax_threadmap as jtm

def never_returns():
    time.sleep(10_000)
    return np.zeros(3, np.float32)

x = jtm.async_call(never_returns, jax.ShapeDtypeStruct((3,), np.float32))
{extra}
print("script ends", flush=True)
"""

_EXTRAS = {
    "no_use": "",
    "dispatched": "y = jax.jit(lambda v: v + 1)(x)",
    "threadmap_dispatched": (
        "y = jax.jit(lambda v: jtm.threadmap(lambda e: e * 2, "
        "jax.ShapeDtypeStruct((), np.float32), v))(x)"
    ),
}


@pytest.mark.parametrize("extra", sorted(_EXTRAS))
def test_a_call_that_never_returns_does_not_hold_the_exit(extra):
    script = _EXIT_SCRIPT.format(extra=_EXTRAS[extra])
    # The call sleeps 10,000 s: a hang fails here.
    proc = run_script(script, forked=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "script ends" in proc.stdout
    assert "`never_returns` (async_call)" in proc.stderr, proc.stderr[-3000:]
    assert "RuntimeWarning" in proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


def test_a_failed_call_with_dispatched_dependents_exits_cleanly():
    script = textwrap.dedent(
        """
        import threading
        import jax, numpy as np
        import jax_threadmap as jtm
        go = threading.Event()
        def broken():
            go.wait(30)
            raise OSError("disk gone")
        x = jtm.async_call(broken, jax.ShapeDtypeStruct((3,), np.float32))
        y = jax.jit(lambda v: v + 1)(x)
        go.set()  # fails after the dependent was dispatched
        try:
            y.block_until_ready()
        except Exception as e:
            print("caught", type(e).__name__, "disk gone" in str(e) or
                  isinstance(e, OSError))
        print("script ends", flush=True)
        """
    )
    proc = run_script(script, forked=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "caught" in proc.stdout and "True" in proc.stdout, proc.stdout
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


def test_a_call_that_returned_is_not_reported_at_exit_while_it_places_its_values():
    # The call copies its data to the device, here until the script has
    # ended: exit waits for that copy (and then dispatches its dependent)
    # instead of warning that the call has not returned.
    script = textwrap.dedent(
        """
        import atexit, threading
        import jax, numpy as np
        import jax_threadmap as jtm
        from jax_threadmap._arrays import task as _task

        place = _task.place
        placing, exiting = threading.Event(), threading.Event()
        def slow_place(task, flat):
            placing.set()
            assert exiting.wait(60)  # (a 1 s sleep lost the race under load)
            return place(task, flat)
        _task.place = slow_place
        atexit.register(exiting.set)  # runs before jax_threadmap's exit hook

        go = threading.Event()
        def slow():
            go.wait(30)
            return np.arange(4, dtype=np.int32)
        x = jtm.async_call(slow, jax.ShapeDtypeStruct((4,), np.int32))
        y = jax.jit(lambda v: v * v)(x)
        go.set()
        assert placing.wait(30)
        print(y.done(), x.done(), flush=True)
        """
    )
    proc = run_script(script, forked=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "False False\n"  # exit came while the copy ran
    assert proc.stderr == "", proc.stderr[-3000:]
