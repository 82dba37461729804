"""Fails loudly when JAX moves or changes the hooks that AsyncArray relies on.

`AsyncArray` is passed to `jit` without its data through three private tables
(see the "async arrays" section of jax_threadmap/_jax/hooks.py). These tests check
that each one is still where we expect it, and that it still behaves as we use
it: the abstract value is read while tracing, and the sharding handler is
called only when the compiled program runs, never while compiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap._arrays import leaves as _leaves
from jax_threadmap._jax import array_types as _array_types
from jax_threadmap._jax import avals as _avals
from jax_threadmap._jax import hooks as _compat
from jax_threadmap._jax import placement as _placement
from jax_threadmap._jax import program_runs as _program_runs

pytestmark = pytest.mark.timeout(60)

UPDATE = (
    "Update the 'async arrays' section of jax_threadmap/_jax/hooks.py (and pin jax "
    "below this version until then)."
)


ASYNC_HOOKS = [h for h in _compat.HOOKS if _compat.ASYNC_ARRAYS in h.features]


@pytest.mark.parametrize("hook", ASYNC_HOOKS, ids=lambda h: h.name)
def test_async_hook_is_still_where_we_expect_it(hook):
    value = _compat.RESOLVED[hook.name]
    assert not isinstance(value, _compat.Missing), (
        f"JAX {jax.__version__} no longer provides {hook.name}, which AsyncArray "
        f"needs ({value.reason}). {UPDATE}"
    )


def test_async_hooks_are_in_the_table():
    names = {h.name for h in ASYNC_HOOKS}
    assert {"pytype_aval_mappings", "canonicalize_value", "shard_arg_handlers"} <= names


class _Probe:
    """The smallest array-like registered as AsyncArray is: data on request."""

    def __init__(self, value: np.ndarray):
        self.value = value
        self.aval = jax.core.ShapedArray(value.shape, value.dtype)


_requests: list[int] = []


def _arrays_of(xs):
    _requests.append(len(xs))
    return [jnp.asarray(x.value) for x in xs]


_array_types.register_array_like(_Probe, lambda x: x.aval, _arrays_of)


def test_registered_type_is_abstract_until_the_program_runs():
    x = _Probe(np.arange(6.0, dtype=np.float32).reshape(2, 3))
    y = _Probe(np.ones(3, np.float32))
    assert jax.typeof(x) == jax.core.ShapedArray((2, 3), np.float32), (
        f"pytype_aval_mappings is no longer consulted by jax.typeof. {UPDATE}"
    )

    def f(a, b):
        return (a * b).sum(axis=0)

    _requests.clear()
    jaxpr = jax.make_jaxpr(f)(x, y)
    compiled = jax.jit(f).lower(x, y).compile()
    assert _requests == [], (
        "JAX asked for the data of a registered array-like while tracing or "
        f"compiling; AsyncArray would wait there. {UPDATE}"
    )
    assert [a.shape for a in jaxpr.in_avals] == [(2, 3), (3,)]

    expected = f(x.value, y.value)
    np.testing.assert_allclose(compiled(x, y), expected)
    assert sum(_requests) == 2, (
        f"shard_arg_handlers was not called at execution (got {_requests}). {UPDATE}"
    )
    np.testing.assert_allclose(jax.jit(f)(x, y), expected)  # jit's own path
    np.testing.assert_allclose(jax.jit(f)(x, y), expected)  # its C++ fast path
    np.testing.assert_allclose(jnp.sin(x), np.sin(x.value), rtol=1e-6)  # eager
    np.testing.assert_allclose(jax.device_put(y), y.value)


def test_jax_array_protocol_alone_is_still_not_enough():
    # Why the hooks exist: the protocol cannot defer the data to execution. Since
    # jax 0.8, `__jax_array__` is not honoured when jit abstracts its arguments;
    # before, it is (deprecated), so jit asks for the data while tracing. If the
    # first assertion starts failing, the hooks in _compat may be replaceable by
    # the protocol.
    calls = []

    class OnlyProtocol:
        shape, dtype = (2,), np.dtype(np.float32)

        def __jax_array__(self):
            calls.append(1)
            return jnp.zeros(2, jnp.float32)

    if _compat.JAX_VERSION >= (0, 8, 0):
        with pytest.raises((TypeError, ValueError)):
            jax.jit(lambda a: a + 1)(OnlyProtocol())
    else:
        with pytest.warns(DeprecationWarning, match="__jax_array__"):
            jax.jit(lambda a: a + 1).lower(OnlyProtocol())
        assert calls, "jit traced a __jax_array__ type without asking for its data"


# --- fast placement (the "fast placement" hooks) -------------------------------------


def test_fast_placement_is_jax_device_put_without_its_overhead():
    # The results of background calls are placed with JAX's batched placement;
    # it must give what jax.device_put gives: the default device, uncommitted,
    # the same abstract value, values and behaviour under jit.
    for name in ("batched_device_put",):
        value = _compat.RESOLVED[name]
        assert not isinstance(value, _compat.Missing), (
            f"JAX {jax.__version__} no longer provides {name} ({value.reason}); "
            "async calls place their results with jax.device_put (slower). "
            "Update the 'fast placement' entries of HOOKS in "
            "jax_threadmap/_jax/hooks.py."
        )
    for x in (np.arange(6, dtype=np.float32).reshape(2, 3), np.int8(3), np.zeros(0)):
        x = np.asarray(x)
        aval = _avals.typeof(jax.ShapeDtypeStruct(x.shape, x.dtype))
        fast = _placement.put_on_device(aval, x, None)
        slow = jax.device_put(x)
        assert isinstance(fast, jax.Array) and fast.is_fully_replicated
        assert fast.sharding == slow.sharding
        assert fast.committed is slow.committed is False
        assert _avals.typeof(fast) == _avals.typeof(slow)
        np.testing.assert_array_equal(np.asarray(fast), x)
        np.testing.assert_array_equal(jax.jit(lambda a: a * 2)(fast), x * 2)
    with jax.default_device(jax.devices()[-1]):  # jax_default_device is read
        fast = _placement.put_on_device(aval, x, None)
        assert fast.devices() == jax.device_put(x).devices()


# --- async dispatch (the "async dispatch" section of _compat) -----------------------


DISPATCH_HOOKS = [h for h in _compat.HOOKS if _compat.ASYNC_DISPATCH in h.features]


@pytest.mark.parametrize("hook", DISPATCH_HOOKS, ids=lambda h: h.name)
def test_async_dispatch_hook_is_still_where_we_expect_it(hook):
    value = _compat.RESOLVED[hook.name]
    assert not isinstance(value, _compat.Missing), (
        f"JAX {jax.__version__} no longer provides {hook.name} ({value.reason}); "
        "jitted calls with pending AsyncArrays fall back to blocking dispatch. "
        "Update the 'async dispatch' entries of HOOKS in jax_threadmap/_jax/hooks.py."
    )
    assert _program_runs.runs_unavailable() is None


# --- the wrapped program runs (the "async dispatch" section of _compat) -----------


def test_argument_handlers_run_inside_the_wrapped_run_of_the_program():
    # Deferred dispatch sees a run in the wrapped ExecuteReplicated.__call__
    # before its argument handlers wait for the data, and a blocking run notes
    # the arrays the handlers hand it (donation): the handler must run inside
    # the wrapped run, for every way a jitted program runs from Python, and
    # ordinary calls on the C++ fast path must never reach the wrapper (it
    # costs them nothing).
    if _program_runs.runs_unavailable() is not None:
        pytest.skip(_program_runs.runs_unavailable())
    from jax.experimental import io_callback

    from jax_threadmap._arrays import async_array as _async_array
    from jax_threadmap._arrays import dispatch as _dispatch

    real_around = _async_array._around
    _dispatch.mechanism.prepare(real_around)  # as the first async_call does
    runs, inside, depth = [], [], [0]
    wrapper = _compat.get("ExecuteReplicated").__call__
    assert hasattr(wrapper, "__jax_threadmap_original__")
    assert _program_runs.RUNS.around == real_around

    def handler(xs):
        inside.append(depth[0])
        return [jnp.asarray(x.value) for x in xs]

    class Other(_Probe):
        pass

    _array_types.register_array_like(Other, lambda x: x.aval, handler)

    def counting(run, program, args, effects):
        runs.append(list(effects))
        depth[0] += 1
        try:
            return real_around(run, program, args, effects)
        finally:
            depth[0] -= 1

    try:
        _program_runs.RUNS.install(counting)
        x = Other(np.arange(3.0, dtype=np.float32))
        f = jax.jit(lambda a: a * 2)
        f(x), f(x)  # the first call compiles; the second is a plain Python call
        jax.jit(lambda a: a + 1).lower(x).compile()(x)
        jnp.sin(x)  # eager
        assert inside == [1, 1, 1, 1], (
            f"an argument handler ran outside the wrapped run ({inside}). {UPDATE}"
        )
        jax.device_put(x)  # no program runs: the handler is outside any
        assert inside[-1] == 0
        g = jax.jit(lambda a: a + 1)
        a = jnp.ones(3)
        g(a).block_until_ready()
        runs.clear()
        for _ in range(5):
            g(a)
        assert runs == [], "ordinary calls on the C++ fast path reached the wrapper"
        h = jax.jit(lambda a: (io_callback(lambda v: None, None, a, ordered=True), a))
        h(a)
        assert runs and runs[-1], (
            "ExecuteReplicated no longer reports ordered_effects; programs with "
            f"ordered effects would be dispatched on pending data. {UPDATE}"
        )
    finally:
        _program_runs.RUNS.install(real_around)


def test_a_compiled_program_still_tells_what_deferred_dispatch_reads():
    # Deferred dispatch (_arrays/dispatch.py) reads, of JAX's
    # ExecuteReplicated: its devices, its jax.Ref mutations, its outputs' avals and
    # shardings, and its name. If JAX moves one, deferred dispatch must be updated.
    from jax_threadmap._arrays import dispatch as _dispatch

    if _program_runs.runs_unavailable() is not None:
        pytest.skip(_program_runs.runs_unavailable())
    seen = []
    real = _program_runs.RUNS.around

    def spy(run, program, args, effects):
        seen.append(program)
        return run(program, *args)

    try:
        _program_runs.RUNS.install(spy)
        f = jax.jit(lambda a: {"x": a * 2, "n": jnp.sum(a > 0)}, keep_unused=True)
        f(np.ones(3, np.float32))  # a Python-path run (the first call)
    finally:
        _program_runs.RUNS.around = real
    assert seen, f"the wrapper saw no run. {UPDATE}"
    program = seen[0]
    assert list(program._local_devices) == [jax.devices()[0]], UPDATE
    assert program.mut is None and program.name.startswith("jit("), UPDATE
    assert _dispatch.deferrable(program), UPDATE
    specs = _leaves.output_specs(program.out_handler)
    assert sorted((s.shape, str(s.dtype)) for s in specs) == [
        ((), "int32"),
        ((3,), "float32"),
    ], UPDATE
    assert all(isinstance(s.sharding, jax.sharding.Sharding) for s in specs), UPDATE
