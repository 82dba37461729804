"""Tests of async_call and AsyncArray (jax_threadmap/_arrays/)."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cause_of, returns_within, run_script

import jax_threadmap as jtm
from jax_threadmap import AsyncArray, async_call
from jax_threadmap._arrays import async_pool as _async_pool

pytestmark = pytest.mark.timeout(60)

SDS = jax.ShapeDtypeStruct
WAIT = 30.0  # seconds a blocked test function waits at most, so nothing hangs


def _weights(n: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((n, n)).astype(np.float32),
        "b": rng.standard_normal(n).astype(np.float32),
        "step": np.array(seed, np.int32),
    }


def _shapes(n: int = 3) -> dict[str, SDS]:
    return {
        "w": SDS((n, n), jnp.float32),
        "b": SDS((n,), jnp.float32),
        "step": SDS((), jnp.int32),
    }


class Gate:
    """A test function that blocks until released, and records its calls."""

    def __init__(self, value):
        self.value = value
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls = 0
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            self.calls += 1
            self.threads.append(threading.current_thread())
        self.started.set()
        if not self.release.wait(WAIT):
            raise RuntimeError("the test never released the gate")
        return self.value


def _pool_threads() -> list[threading.Thread]:
    """The async pool's threads ("jax_threadmap-async-N" or "jax_threadmap-async
    (...)"), not the event loop's ("jax_threadmap-asyncio")."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(("jax_threadmap-async-", "jax_threadmap-async ("))
    ]


def _abandoned() -> int:
    """Threads of calls given up on (by other tests) that run on, out of the bound."""
    return len(jtm.async_pool_status().abandoned)


# --- the basics ----------------------------------------------------------------------


def test_structure_metadata_and_values():
    ref = _weights()
    out = async_call(_weights, _shapes())
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for key, leaf in out.items():
        assert isinstance(leaf, AsyncArray)
        assert leaf.shape == ref[key].shape
        assert leaf.dtype == ref[key].dtype
        assert leaf.ndim == ref[key].ndim
        assert leaf.size == ref[key].size
        value = leaf.result(timeout=WAIT)
        assert isinstance(value, jax.Array)
        np.testing.assert_array_equal(np.asarray(value), ref[key])
        assert leaf.done()


def test_fn_starts_at_once_and_runs_once_for_all_leaves():
    n_leaves = 50
    gate = Gate([np.full((2,), i, np.float32) for i in range(n_leaves)])
    out = async_call(gate, [SDS((2,), np.float32)] * n_leaves)
    # Started without any use of the arrays.
    assert gate.started.wait(WAIT)
    assert not any(leaf.done() for leaf in out)
    gate.release.set()
    for _ in range(3):
        for i, leaf in enumerate(out):
            np.testing.assert_array_equal(np.asarray(leaf), np.full((2,), i))
    assert gate.calls == 1
    assert len(gate.threads) == 1
    assert gate.threads[0] is not threading.current_thread()


def test_args_and_kwargs_reach_fn_and_device_is_reserved():
    seen = {}

    def fn(a, *, fn, result_shape_dtypes, scale):
        seen.update(a=a, fn=fn, rsd=result_shape_dtypes, scale=scale)
        return np.full((2,), a * scale, np.float32)

    out = async_call(
        fn, SDS((2,), np.float32), 3.0, fn="f", result_shape_dtypes="r", scale=2.0
    )
    np.testing.assert_array_equal(np.asarray(out), [6.0, 6.0])
    assert seen == {"a": 3.0, "fn": "f", "rsd": "r", "scale": 2.0}

    def takes_device(device=None):
        seen["device"] = device
        return np.zeros(1, np.float32)

    cpu = jax.devices()[0]
    async_call(takes_device, SDS((1,), np.float32), device=cpu).result(timeout=WAIT)
    assert seen["device"] is None  # reserved: it places the result instead
    bound = functools.partial(takes_device, device="through partial")
    async_call(bound, SDS((1,), np.float32)).result(timeout=WAIT)
    assert seen["device"] == "through partial"


def test_repr_never_blocks_and_shows_state():
    gate = Gate(np.zeros(3, np.float32))
    x = async_call(gate, SDS((3,), np.float32))
    # The gate stays closed until repr has returned: a repr that waited for the
    # value would fail here, at WAIT.
    text = returns_within(repr, x, limit=WAIT, what="return while the call ran")
    assert not gate.release.is_set()
    assert "pending" in text and "(3,)" in text and "float32" in text
    assert str(x) == text
    gate.release.set()
    x.block_until_ready()  # landed: as the jax.Array it stands for
    assert repr(x) == repr(x.result()) and str(x) == str(x.result())
    # Deleted, or donated to a jitted call: repr raises, as jax.Array's does
    # (JAX's own test_devicearray_delete), and so does using the value.
    x.delete()
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        repr(x)
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(x)
    y = async_call(lambda: np.ones(2, np.float32), SDS((2,), np.float32))
    z = jax.jit(lambda v: v * 2, donate_argnums=0)(y)
    np.testing.assert_array_equal(np.asarray(z), [2.0, 2.0])
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        repr(y)


def test_cannot_be_constructed_directly():
    with pytest.raises(TypeError, match="async_call"):
        AsyncArray()


def test_block_until_ready_returns_self_and_tree_helper_works():
    out = async_call(_weights, _shapes())
    assert out["w"].block_until_ready() is out["w"]
    done = jax.block_until_ready(out)
    assert all(leaf.done() for leaf in done.values())


def test_x64_off_canonicalises_declared_float64():
    x = async_call(lambda: np.arange(3.0), SDS((3,), np.float64))
    assert x.dtype == np.float32
    assert x.result(timeout=WAIT).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(x), np.arange(3.0))


@pytest.mark.parametrize(
    "returned, declared, fragment",
    [
        (
            np.array([1.0, 1e300]),
            np.float32,
            r"at <root>: an array whose element \[1\] is 1e\+300 \(float64\), "
            r"declared float32 \(float32 on device\); float32 cannot hold it",
        ),
        (
            np.array([1.0, 1e300]),
            np.float64,
            r"declared float64 \(float32 on device\); float32 cannot hold it",
        ),
        (
            np.array([5, 2**40]),
            np.int32,
            r"element \[1\] is 1099511627776 \(int64\), declared int32 .*"
            r"its range is -2147483648 to 2147483647",
        ),
    ],
    ids=["float64-as-float32", "declared-float64", "int64-as-int32"],
)
def test_x64_off_values_that_do_not_fit_fail_instead_of_wrapping(
    returned, declared, fragment
):
    # device_put would cast them to 32 bits: inf, and 0 for 2**40.
    x = async_call(lambda: returned, SDS((2,), declared))
    with pytest.raises(ValueError, match=fragment):
        x.result(timeout=WAIT)
    kept = np.array([1.5, np.inf, -np.nan, 3e38])
    y = async_call(lambda: kept, SDS((4,), np.float32))
    np.testing.assert_array_equal(np.asarray(y), kept.astype(np.float32))


def test_x64_on_keeps_float64(x64):
    del x64
    x = async_call(lambda: np.arange(3.0), SDS((3,), np.float64))
    assert x.dtype == np.float64
    assert x.result(timeout=WAIT).dtype == np.float64


# --- jit -----------------------------------------------------------------------------


def _model(p, x):
    return jnp.tanh(p["w"] @ x + p["b"]) * p["step"]


def test_jit_traces_and_compiles_without_waiting():
    ref = _weights(seed=4)
    gate = Gate(ref)
    params = async_call(gate, _shapes())
    x = jnp.arange(3.0, dtype=jnp.float32)
    f = jax.jit(_model)
    # The gate is closed: tracing, lowering and compiling must not wait for it.
    compiled = f.lower(params, x).compile()
    jaxpr = jax.make_jaxpr(_model)(params, x)
    assert jax.eval_shape(_model, params, x).shape == (3,)
    assert not gate.release.is_set() and not params["w"].done()
    assert len(jaxpr.in_avals) == 4
    gate.release.set()
    expected = _model(jax.tree.map(jnp.asarray, ref), x)
    np.testing.assert_allclose(compiled(params, x), expected, rtol=1e-6)
    np.testing.assert_allclose(f(params, x), expected, rtol=1e-6)
    # Again, through jit's C++ fast path, with new arrays.
    params2 = async_call(_weights, _shapes(), seed=4)
    np.testing.assert_allclose(f(params2, x), expected, rtol=1e-6)
    assert gate.calls == 1


def _slow_to_compile(n_ops: int):
    """A fresh function whose compilation takes a noticeable time."""

    def f(x):
        for i in range(n_ops):
            x = jnp.sin(x * (1.0 + i * 1e-3))[::-1] + jnp.float32(i * 1e-3)
            x = jnp.roll(x, 1)
        return x

    return f


# JAX reports each XLA compilation through jax.monitoring under this name (the
# same in jax 0.6.2 ... 0.12); the listener is registered once, for the module.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiled = threading.Event()


def _on_duration(event: str, duration: float, *args, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _compiled.set()


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def test_compile_hides_behind_load():
    # The load returns only once the program that uses its array has compiled,
    # so the call can only complete if compilation runs while the load is in
    # flight: no timing, so a busy machine cannot make it flaky.
    x_ref = np.linspace(0.0, 1.0, 16, dtype=np.float32)
    spec = SDS((16,), np.float32)
    _compiled.clear()
    jax.jit(_slow_to_compile(3)).lower(spec).compile()
    assert _compiled.is_set(), (
        f"JAX {jax.__version__} no longer reports compilations as "
        f"{BACKEND_COMPILE_EVENT!r}; find its new name to keep this test meaningful"
    )

    def load_after_compile():
        if not _compiled.wait(WAIT):
            raise TimeoutError("compilation never ran while the load was in flight")
        return x_ref

    f = _slow_to_compile(20)
    _compiled.clear()
    out = jax.jit(f)(async_call(load_after_compile, spec))
    np.testing.assert_allclose(out, jax.jit(f)(x_ref), rtol=1e-5)


def test_fn_that_uses_jax_while_the_caller_is_in_jit():
    def fn():
        y = jax.jit(lambda a: a * 2)(jnp.arange(4.0, dtype=jnp.float32))
        return {"y": np.asarray(y) + 1}

    out = jax.jit(lambda p: p["y"].sum())(async_call(fn, {"y": SDS((4,), np.float32)}))
    assert float(out) == float(np.sum(np.arange(4.0) * 2 + 1))


# --- other uses ----------------------------------------------------------------------

USES = {
    "jnp.sin": lambda a: jnp.sin(a),
    "jnp.asarray": lambda a: jnp.asarray(a),
    "jnp.matmul": lambda a: jnp.matmul(a, jnp.ones((4, 2))),
    "np.asarray": lambda a: np.asarray(a),
    "np.asarray_f64": lambda a: np.asarray(a, dtype=np.float64),
    "device_put": lambda a: jax.device_put(a),
    "device_put_dev": lambda a: jax.device_put(a, jax.devices()[0]),
    "add": lambda a: a + 1.5,
    "radd": lambda a: 1.5 + a,
    "rsub_ndarray": lambda a: np.ones((3, 4), np.float32) - a,
    "sub_jax_array": lambda a: jnp.ones((3, 4)) - a,
    "mul_self": lambda a: a * a,
    "pow": lambda a: a**2,
    "neg": lambda a: -a,
    "abs": lambda a: abs(a),
    "matmul": lambda a: a @ np.ones((4, 2), np.float32),
    "compare": lambda a: a > 0,
    "eq": lambda a: a == a,
    "getitem": lambda a: a[1, ::2],
    "iter": lambda a: np.stack([np.asarray(r) for r in a]),
    "jit_pytree": lambda a: jax.jit(lambda t: t[0]["k"] * t[1])(({"k": a}, 2.0)),
    "vmap": lambda a: jax.vmap(jnp.sum)(a),
    "grad": lambda a: jax.grad(lambda v: jnp.sum(v**2))(a),
    "tree_map": lambda a: jax.tree.map(lambda v: v * 3, [a])[0],
}


@pytest.mark.parametrize("use", sorted(USES))
def test_uses_match_the_same_use_of_the_value(use):
    ref = np.arange(12.0, dtype=np.float32).reshape(3, 4) - 5
    a = async_call(lambda: ref.copy(), SDS((3, 4), np.float32))
    got = USES[use](a)
    expected = USES[use](jnp.asarray(ref))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6)


def test_scalar_conversions_and_len():
    a = async_call(lambda: np.array([2.5, 3.0], np.float32), SDS((2,), np.float32))
    assert len(a) == 2
    assert float(a[0]) == 2.5 and int(a[1]) == 3 and bool(a[1])
    s = async_call(lambda: np.array(7, np.int32), SDS((), np.int32))
    assert list(range(10))[s] == 7  # __index__
    with pytest.raises(TypeError, match="unsized"):
        len(s)


def test_unhashable_like_jax_array():
    a = async_call(lambda: np.zeros(1, np.float32), SDS((1,), np.float32))
    with pytest.raises(TypeError):
        hash(a)


def test_as_threadmap_input():
    from jax_threadmap import threadmap

    ref = np.arange(12.0, dtype=np.float32).reshape(4, 3)

    def kernel(row):
        return np.sort(row)[::-1] * 2

    def f(x):
        return threadmap(kernel, SDS((3,), np.float32), x)

    expected = np.stack([kernel(r) for r in ref])
    a = async_call(lambda: ref.copy(), SDS((4, 3), np.float32))
    np.testing.assert_array_equal(jax.jit(jax.vmap(f))(a), expected)
    b = async_call(lambda: ref.copy(), SDS((4, 3), np.float32))
    np.testing.assert_array_equal(jax.vmap(f)(b), expected)


# --- placement -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["device", "single_sharding", "named_sharding", "explicit_mesh"]
)
def test_device_option_commits_to_target(kind):
    dev = jax.devices()[0]
    target = {
        "device": dev,
        "single_sharding": jax.sharding.SingleDeviceSharding(dev),
        "named_sharding": jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array([dev]), ("x",)), jax.sharding.PartitionSpec()
        ),
        "explicit_mesh": jax.NamedSharding(
            jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)),
            jax.sharding.PartitionSpec(),
        ),
    }[kind]
    ref = _weights(n=4)
    out = async_call(_weights, _shapes(4), 4, device=target)
    w = out["w"]
    assert w.sharding is not None and w.sharding.device_set == {dev}
    value = w.result(timeout=WAIT)
    assert value.committed
    assert value.sharding.is_equivalent_to(w.sharding, w.ndim)
    assert jax.typeof(value) == jax.typeof(w)
    np.testing.assert_array_equal(np.asarray(value), ref["w"])
    y = jax.jit(lambda p: p["w"].sum() + p["b"].sum())(out)
    np.testing.assert_allclose(y, ref["w"].sum() + ref["b"].sum(), rtol=1e-5)


def test_default_is_uncommitted_on_default_device():
    x = async_call(lambda: np.ones(2, np.float32), SDS((2,), np.float32))
    assert x.sharding is None
    value = x.result(timeout=WAIT)
    assert not value.committed
    assert value.devices() == {jax.devices()[0]}


def test_shape_dtype_struct_sharding_is_honoured():
    dev = jax.devices()[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    x = async_call(lambda: np.ones(2, np.float32), SDS((2,), np.float32, sharding=s))
    assert x.sharding == s
    assert x.result(timeout=WAIT).committed


def test_per_leaf_shardings_from_shape_dtype_structs():
    dev = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([dev]), ("x",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    shapes = _shapes(4)
    shapes["w"] = SDS((4, 4), np.float32, sharding=rows)
    out = async_call(_weights, shapes, 4)
    assert out["w"].sharding == rows and out["b"].sharding is None
    assert out["w"].result(timeout=WAIT).sharding.is_equivalent_to(rows, 2)
    assert not out["b"].result(timeout=WAIT).committed
    np.testing.assert_array_equal(np.asarray(out["w"]), _weights(4)["w"])


def test_sharding_that_cannot_hold_the_shape_fails_at_the_call():
    dev = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([dev]), ("x",))
    bad = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    fn_ran = []
    with pytest.raises(ValueError, match=r"cannot hold the array of shape \(3,\)"):
        async_call(lambda: fn_ran.append(1), SDS((3,), np.float32), device=bad)
    assert not fn_ran


# --- errors --------------------------------------------------------------------------


class LoadError(Exception):
    pass


def _failing_load():
    try:
        raise ConnectionError("socket closed")
    except ConnectionError as e:
        raise LoadError("could not fetch weights.bin") from e


FAILING_USES = {
    "result": lambda p: p["w"].result(timeout=WAIT),
    "other_leaf": lambda p: p["b"].result(),
    "block_until_ready": lambda p: p["w"].block_until_ready(),
    "jit": lambda p: jax.jit(_model)(p, jnp.ones(3)),
    "jit_twice": lambda p: [jax.jit(lambda q: q["b"] + 1)(p) for _ in range(2)],
    "operator": lambda p: p["b"] + 1,
    "np.asarray": lambda p: np.asarray(p["b"]),
    "jnp": lambda p: jnp.sum(p["b"]),
    "device_put": lambda p: jax.device_put(p["b"]),
    "float": lambda p: float(p["step"]),
}


@pytest.mark.parametrize("use", sorted(FAILING_USES))
def test_fn_error_is_raised_at_every_use(use):
    params = async_call(_failing_load, _shapes())
    # Once the failure is known, every use raises it. (A jitted program
    # dispatched while the call still runs raises it in a JaxRuntimeError when
    # its results are used: tests/_arrays/test_async_dispatch.py.)
    concurrent.futures.wait([params["w"]._task.future], timeout=WAIT)
    for _ in range(2):  # and again: the arrays keep failing the same way
        with pytest.raises(LoadError, match="could not fetch weights.bin") as info:
            FAILING_USES[use](params)
        assert isinstance(cause_of(info.value), ConnectionError)
        assert str(cause_of(info.value)) == "socket closed"
        notes = getattr(info.value, "__notes__", [])
        if hasattr(info.value, "add_note"):
            assert sum("_failing_load" in n for n in notes) == 1
    assert "failed: LoadError: could not fetch weights.bin" in repr(params["w"])
    assert params["w"].done()


@pytest.mark.parametrize(
    "returned, pattern",
    [
        (
            {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)},
            r"at \['w'\]: shape \(3, 2\) and dtype float32 "
            r"\(expected shape \(3, 3\) and dtype float32\)",
        ),
        (
            {"w": np.zeros((3, 3), np.complex64), "b": np.zeros(3, np.float32)},
            r"at \['w'\]: dtype complex64, declared float32 \(float32 on device\); "
            r"complex64 does not convert to float32 without changing kind",
        ),
        (
            {"w": [1.0], "b": np.zeros(3, np.float32)},
            r"returned a value of structure .*but result_shape_dtypes declares",
        ),
        (
            (np.zeros((3, 3), np.float32), np.zeros(3, np.float32)),
            r"returned a value of structure .*but result_shape_dtypes declares",
        ),
        (
            {"w": "not an array", "b": np.zeros(3, np.float32)},
            r"at \['w'\]: a str without shape and dtype",
        ),
    ],
    ids=["shape", "dtype", "nested_structure", "tuple_for_dict", "not_array"],
)
def test_wrong_result_names_expected_and_actual(returned, pattern):
    shapes = {"w": SDS((3, 3), np.float32), "b": SDS((3,), np.float32)}
    out = async_call(lambda: returned, shapes)
    for leaf in out.values():
        with pytest.raises(ValueError, match=pattern) as info:
            leaf.result(timeout=WAIT)
        assert "<lambda>" in str(info.value)
        assert "result_shape_dtypes" in str(info.value)
    with pytest.raises(ValueError, match=pattern):
        jax.jit(lambda p: p["b"] * 2)(out)


def test_timeout_raises_and_the_array_stays_usable():
    gate = Gate(np.arange(3, dtype=np.float32))
    x = async_call(gate, SDS((3,), np.float32))
    with pytest.raises(TimeoutError, match="not ready within timeout=0.2 s"):
        x.result(timeout=0.2)
    with pytest.raises(TimeoutError, match="not ready within timeout=0 s"):
        x.result(timeout=0)  # looks without waiting
    assert not gate.release.is_set()  # it raised while the call ran
    assert not x.done() and "pending" in repr(x)
    gate.release.set()
    np.testing.assert_array_equal(np.asarray(x.result(timeout=WAIT)), [0, 1, 2])
    np.testing.assert_array_equal(x + 1, [1, 2, 3])
    assert gate.calls == 1


def test_a_timeout_error_of_fn_is_its_own():
    def fn():
        raise TimeoutError("the server did not answer")

    x = async_call(fn, SDS((1,), np.float32))
    with pytest.raises(TimeoutError, match="the server did not answer"):
        x.result(timeout=WAIT)


@pytest.mark.parametrize(
    "args, kwargs, exc, pattern",
    [
        (("nope", SDS((1,), np.float32)), {}, TypeError, "fn must be callable"),
        (
            (np.ones, {"a": 3}),
            {},
            TypeError,
            r"result_shape_dtypes\['a'\] must have .shape and .dtype"
            r".*Got 3 of type int",
        ),
        ((np.ones, {}), {}, ValueError, "no array leaves"),
        ((np.ones, SDS((1,), np.float32)), {"device": "cpu"}, TypeError, "device="),
    ],
    ids=["fn", "leaf", "empty", "device"],
)
def test_bad_arguments_fail_at_the_call(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        async_call(*args, **kwargs)


# --- threads -------------------------------------------------------------------------


def test_hundreds_of_pending_arrays_use_a_bounded_pool():
    n = 300
    bound = _async_pool.default_async_threads()
    assert bound < n
    baseline = threading.active_count()
    release = threading.Event()
    started = threading.Semaphore(0)
    running = []
    lock = threading.Lock()
    peak = [0]

    def fn(i):
        with lock:
            running.append(i)
            peak[0] = max(peak[0], len(running))
        started.release()
        try:
            release.wait(WAIT)
            return np.full((2,), i, np.int32)
        finally:
            with lock:
                running.remove(i)

    try:
        arrays = [async_call(fn, SDS((2,), np.int32), i) for i in range(n)]
        for _ in range(bound):
            assert started.acquire(timeout=WAIT)
        assert len(running) == bound  # the pool is full ...
        # ... and the rest wait in its queue: no thread was started for them (the
        # pool counts a thread when it starts one, in async_call itself).
        status = jtm.async_pool_status()
        assert (status.running, status.queued) == (bound, n - bound), status
        assert threading.active_count() - baseline <= bound
        assert len(_pool_threads()) <= bound + _abandoned()
        assert sum(a.done() for a in arrays) == 0
    finally:
        release.set()
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(np.asarray(a), [i, i])
    assert peak[0] <= bound
    assert len(_pool_threads()) <= bound + _abandoned()


def test_value_needed_behind_a_full_pool_runs_in_the_caller():
    bound = _async_pool.default_async_threads()
    gates = [Gate(np.zeros(1, np.float32)) for _ in range(bound)]
    try:
        blockers = [async_call(g, SDS((1,), np.float32)) for g in gates]
        for g in gates:
            assert g.started.wait(WAIT)
        queued = Gate(np.ones(1, np.float32))
        queued.release.set()
        x = async_call(queued, SDS((1,), np.float32))
        np.testing.assert_array_equal(np.asarray(x.result()), [1.0])
        assert queued.threads == [threading.current_thread()]
    finally:
        for g in gates:
            g.release.set()
    for b in blockers:
        b.block_until_ready()
    assert queued.calls == 1


def test_nested_calls_do_not_deadlock_a_full_pool():
    bound = _async_pool.default_async_threads()

    def inner(i):
        return np.full((1,), i, np.float32)

    def outer(i):
        # Every worker waits on a call queued behind all the outer ones.
        return async_call(inner, SDS((1,), np.float32), i).result() * 2

    arrays = [async_call(outer, SDS((1,), np.float32), i) for i in range(2 * bound)]
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(np.asarray(a.result(timeout=WAIT)), [2.0 * i])


def test_async_threads_env_var(monkeypatch):
    monkeypatch.setenv(_async_pool.ENV_ASYNC_THREADS, "3")
    assert _async_pool.default_async_threads() == 3
    monkeypatch.setenv(_async_pool.ENV_ASYNC_THREADS, "zero")
    with pytest.raises(ValueError, match="JAX_THREADMAP_ASYNC_THREADS='zero'"):
        _async_pool.default_async_threads()
    monkeypatch.delenv(_async_pool.ENV_ASYNC_THREADS)
    assert _async_pool.default_async_threads() >= 1


# --- copies, pickling, fork ----------------------------------------------------------


def test_copies_are_copies_and_pickle_waits_for_the_value():
    # As for a jax.Array: copy.copy and deepcopy are (deferred) copies of the
    # values; pickling waits for the value and unpickles as a jax.Array.
    import copy
    import pickle

    gate = Gate(np.arange(2, dtype=np.float32))
    x = async_call(gate, SDS((2,), np.float32))
    shallow, deep = copy.copy(x), copy.deepcopy({"x": x})["x"]
    assert not gate.release.is_set()  # the copies did not wait
    gate.release.set()
    for y in (shallow, deep, pickle.loads(pickle.dumps(x))):
        np.testing.assert_array_equal(np.asarray(y), [0, 1])
    assert isinstance(pickle.loads(pickle.dumps(x)), jax.Array)


_FORK_SCRIPT = """
import os, sys, threading
import jax, numpy as np
import jax_threadmap as jtm
started, release = threading.Event(), threading.Event()
def load():
    started.set()
    release.wait(30)
    return np.ones(2, np.float32)
x = jtm.async_call(load, jax.ShapeDtypeStruct((2,), np.float32))
assert started.wait(30)
pid = os.fork()
if pid == 0:
    try:
        x.result()
        code = 1
    except RuntimeError as e:
        code = 0 if "forked" in str(e) else 2
    os._exit(code)
_, status = os.waitpid(pid, 0)
release.set()
assert np.asarray(x).tolist() == [1.0, 1.0]
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_call_running_at_fork_fails_clearly_in_the_child():
    ran = run_script(_FORK_SCRIPT, flags=("-W", "ignore"), timeout=50)
    assert ran.returncode == 0, ran.report


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_the_set_of_live_calls_is_unlocked_in_a_forked_child():

    with _async_pool.live_lock:  # held by this thread at the fork
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(0 if _async_pool.live_lock.acquire(timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_what_deferred_programs_read_is_unlocked_in_a_forked_child():
    from jax_threadmap._arrays import dispatch as _dispatch

    with _dispatch.mechanism.readers._lock:  # held by this thread at the fork
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            lock = _dispatch.mechanism.readers._lock
            os._exit(0 if lock.acquire(timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
