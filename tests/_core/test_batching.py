"""Property tests: any nesting of vmap folds into one equation and matches jax.numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    X_CORE,
    Z_CORE,
    assert_trees_close,
    build,
    count_eqns,
    examples,
    make_inputs,
    nestings,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_threadmap import KernelError, threadmap

DTYPES = ["float32", "float64", "int32", "bool", "complex64"]


def kernel(x, y, *, z):
    # One element: x (2,), y {"a": ()}, z (3,). Same ops as `reference` below.
    assert isinstance(x, np.ndarray) and x.shape == X_CORE
    assert isinstance(y["a"], np.ndarray) and y["a"].shape == ()
    assert isinstance(z, np.ndarray) and z.shape == Z_CORE
    assert not x.flags.writeable
    return np.add(x, y["a"]), {"s": np.multiply(x[0], z[1])}


def reference(x, y, *, z):
    return jnp.add(x, y["a"]), {"s": jnp.multiply(x[0], z[1])}


def with_threadmap(x, y, z):
    out = (
        jax.ShapeDtypeStruct(X_CORE, x.dtype),
        {"s": jax.ShapeDtypeStruct((), x.dtype)},
    )
    return threadmap(kernel, out, x, y, z=z)


def with_jnp(x, y, z):
    return reference(x, y, z=z)


@settings(
    max_examples=examples(40),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    nesting=nestings(),
    dtype=st.sampled_from(DTYPES),
    jit=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_nested_vmap_matches_jnp(nesting, dtype, jit, seed):
    sizes, in_axes, out_axes = nesting
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", dtype == "float64")
    try:
        args = make_inputs(np.random.default_rng(seed), sizes, in_axes, dtype)
        f = build(with_threadmap, sizes, in_axes, out_axes)
        g = build(with_jnp, sizes, in_axes, out_axes)
        if jit:
            f = jax.jit(f)
        jaxpr = jax.make_jaxpr(f)(*args)
        assert count_eqns(jaxpr.jaxpr, "threadmap") == 1
        # The unbatched operands are never broadcast in the jaxpr.
        assert count_eqns(jaxpr.jaxpr, "broadcast_in_dim") == 0
        # The reference jitted: one compile, not one per eager operation.
        assert_trees_close(f(*args), jax.jit(g)(*args), dtype)
    finally:
        jax.config.update("jax_enable_x64", prev)


@pytest.mark.parametrize("jit", [True, False])
def test_eight_levels_fold_into_one_equation(jit):
    sizes = (2,) * 8

    def f(x, y):
        return threadmap(lambda a, b: a * b, jax.ShapeDtypeStruct((), x.dtype), x, y)

    fn = f
    # Alternate which argument is mapped, and use negative axes.
    for level in range(8):
        fn = jax.vmap(fn, in_axes=(-1, None) if level % 2 else (0, -1))
    x = np.random.default_rng(0).standard_normal(sizes).astype(np.float32)
    y = np.arange(16, dtype=np.float32).reshape(2, 2, 2, 2)
    g = jax.jit(fn) if jit else fn
    text = str(jax.make_jaxpr(g)(x, y))
    assert text.count("threadmap[") == 1
    for forbidden in ("scan", "while", "pure_callback", "broadcast_in_dim"):
        assert forbidden not in text
    h = lambda a, b: a * b  # noqa: E731
    for level in range(8):
        h = jax.vmap(h, in_axes=(-1, None) if level % 2 else (0, -1))
    expected = h(x, y)
    np.testing.assert_allclose(np.asarray(g(x, y)), np.asarray(expected))


def test_in_axes_out_axes_axis_size():
    def f(x, c):
        return threadmap(
            lambda a, b: np.cumsum(a) + b, jax.ShapeDtypeStruct(a_shape, x.dtype), x, c
        )

    a_shape = (3,)
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # batch axes 0 and 2
    c = np.float32(10.0)
    fn = jax.vmap(jax.vmap(f, in_axes=(1, None), out_axes=1), in_axes=(0, None))
    out = jax.jit(fn)(x, c)
    ref = jax.vmap(
        jax.vmap(lambda a, b: jnp.cumsum(a) + b, in_axes=(1, None), out_axes=1),
        in_axes=(0, None),
    )(x, c)
    np.testing.assert_allclose(out, ref)
    # axis_size with every argument unbatched at that level: vmap broadcasts outside.
    h = jax.vmap(lambda c: f(x[0, :, 0], c), in_axes=None, axis_size=5)
    np.testing.assert_allclose(h(c), np.broadcast_to(np.cumsum(x[0, :, 0]) + c, (5, 3)))


def test_scan_and_cond_around_vmapped_threadmap():
    def step(carry, x):
        y = jax.vmap(
            lambda v: threadmap(np.tanh, jax.ShapeDtypeStruct((), v.dtype), v)
        )(x + carry)
        return carry + y.sum(), y

    xs = np.linspace(-1, 1, 5 * 3, dtype=np.float32).reshape(5, 3)
    carry, ys = jax.jit(lambda xs: jax.lax.scan(step, 0.0, xs))(xs)

    # The reference runs on the host, as the kernel does (an accelerator's
    # jnp.tanh differs from NumPy's in the last digits).
    rc, rys = np.float32(0.0), []
    for x in xs:
        rys.append(np.tanh(x + rc))
        rc = np.float32(rc + rys[-1].sum())
    np.testing.assert_allclose(ys, np.stack(rys), rtol=1e-5)
    np.testing.assert_allclose(carry, rc, rtol=1e-5)

    def branchy(p, x):
        return jax.lax.cond(
            p,
            lambda x: jax.vmap(
                lambda v: threadmap(np.exp, jax.ShapeDtypeStruct((), v.dtype), v)
            )(x),
            lambda x: -x,
            x,
        )

    g = jax.jit(branchy)
    np.testing.assert_allclose(g(True, xs[0]), np.exp(xs[0]), rtol=1e-6)
    np.testing.assert_allclose(g(False, xs[0]), -xs[0])
    # cond under vmap turns into select: both branches run, still one threadmap.
    v = jax.jit(jax.vmap(branchy))(np.array([True, False, True]), xs[:3])
    np.testing.assert_allclose(v[0], np.exp(xs[0]), rtol=1e-6)
    np.testing.assert_allclose(v[1], -xs[1])


def test_zero_size_batch_never_calls_kernel():
    calls = []

    def k(x):
        calls.append(x)
        return x

    f = jax.vmap(
        jax.vmap(lambda x: threadmap(k, jax.ShapeDtypeStruct((2,), x.dtype), x))
    )
    for shape in [(0, 3, 2), (3, 0, 2)]:
        out = jax.jit(f)(np.zeros(shape, np.float32))
        assert out.shape == shape
        out = f(np.zeros(shape, np.float32))
        assert out.shape == shape
    assert calls == []


@pytest.fixture
def callbacks(monkeypatch):
    """The operand and result shapes of each host callback lowered meanwhile (as
    the lowering hands them to JAX, on every platform)."""
    from jax_threadmap._jax import mlir as _mlir

    seen = []
    emit = _mlir.emit_python_callback

    def recording(ctx, callback, token, operands, operand_avals, result_avals, **kw):
        seen.append(
            [tuple(a.shape) for a in operand_avals]
            + [tuple(a.shape) for a in result_avals]
        )
        return emit(ctx, callback, token, operands, operand_avals, result_avals, **kw)

    monkeypatch.setattr(_mlir, "emit_python_callback", recording)
    return seen


def _kernel_with_empty_parts(x, e):
    # One element: x (2,), e (0,) -> a sum, an empty row, a scaled copy of x.
    return x.sum() + e.size, np.zeros((0,), x.dtype), x * 2


EMPTY_PARTS_OUT = (
    jax.ShapeDtypeStruct((), np.float32),
    jax.ShapeDtypeStruct((0,), np.float32),
    jax.ShapeDtypeStruct((2,), np.float32),
)


@pytest.mark.parametrize(
    "batch", [(0, 3), (3, 0), (2, 3), (0,), (4,)], ids=lambda b: "x".join(map(str, b))
)
def test_no_host_callback_holds_a_0_size_operand_or_result(batch, callbacks):
    # An accelerator's runtime aborts the process on a host callback with 0-size
    # data (libtpu: "HostCommand byte_offset -1 ... not aligned"): such results
    # are lowered as zeros and such operands rebuilt on the host, and an empty
    # batch emits no callback at all.
    calls = []

    def k(x, e):
        calls.append(1)
        return _kernel_with_empty_parts(x, e)

    def one(x, e):
        return threadmap(k, EMPTY_PARTS_OUT, x, e)

    f = one
    for _ in batch:
        f = jax.vmap(f, in_axes=(0, None))
    x = np.arange(math.prod(batch) * 2, dtype=np.float32).reshape(*batch, 2)
    e = np.zeros((0,), np.float32)
    got = jax.block_until_ready(jax.jit(f)(x, e))
    assert len(callbacks) == (0 if 0 in batch else 1), callbacks
    for shapes in callbacks:
        assert all(0 not in s for s in shapes), callbacks
    assert len(calls) == math.prod(batch)
    flat = x.reshape(-1, 2)
    want = [_kernel_with_empty_parts(row, e) for row in flat]
    np.testing.assert_array_equal(
        np.asarray(got[0]).reshape(-1), np.array([w[0] for w in want]).reshape(-1)
    )
    assert got[1].shape == (*batch, 0)
    np.testing.assert_array_equal(np.asarray(got[2]), x * 2)


def test_a_map_whose_results_all_hold_no_data_emits_no_callback(callbacks):
    def k(x):
        return np.zeros((0,), x.dtype)

    f = jax.vmap(lambda x: threadmap(k, jax.ShapeDtypeStruct((0,), x.dtype), x))
    x = np.ones((3, 2), np.float32)
    assert jax.jit(f)(x).shape == (3, 0)
    assert callbacks == []


@pytest.mark.parametrize("executor", [1, 3])
@pytest.mark.parametrize("sizes", [(5, 20), (3, 17, 18)])
def test_unmergeable_layouts_with_long_rows(sizes, executor):
    # An outer product: each operand is batched at different levels, so the batch
    # dims cannot be merged and the map runs row by row.
    def f(*vs):
        return threadmap(
            lambda *a: sum(a[1:], a[0]) * 2,
            jax.ShapeDtypeStruct((), jnp.float32),
            *vs,
            executor=executor,
        )

    vs = [np.arange(n, dtype=np.float32) * 10**k for k, n in enumerate(sizes)]
    fn = f
    for level in reversed(range(len(sizes))):
        fn = jax.vmap(
            fn, in_axes=tuple(0 if k == level else None for k in range(len(sizes)))
        )
    out = np.asarray(jax.jit(fn)(*vs))
    grids = np.meshgrid(*vs, indexing="ij")
    np.testing.assert_array_equal(out, sum(grids[1:], grids[0]) * 2)

    def bad(*a):
        middle_zero = all(float(m) == 0 for m in a[1:-1])
        if (
            float(a[0]) == 1
            and middle_zero
            and float(a[-1]) == 10 ** (len(sizes) - 1) * 17
        ):
            raise ValueError("this one")
        return a[0]

    def g(*vs):
        return threadmap(
            bad, jax.ShapeDtypeStruct((), jnp.float32), *vs, executor=executor
        )

    for level in reversed(range(len(sizes))):
        g = jax.vmap(
            g, in_axes=tuple(0 if k == level else None for k in range(len(sizes)))
        )
    with pytest.raises(KernelError) as info:
        g(*vs)
    assert info.value.index == (1, *[0] * (len(sizes) - 2), 17)
