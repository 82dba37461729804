"""Derivatives: threaded JVP/VJP kernels against the same functions in jax.numpy."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_eqns, examples, kname, nest, threadmap_eqns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import jax_threadmap
from jax_threadmap import KernelError, threadmap

pytestmark = pytest.mark.timeout(120)

TOL = {np.dtype("float32"): 2e-2, np.dtype("float64"): 1e-5}


# --- a kernel with both rules: x (3,), a () -> (3,) ---------------------------------


def make_scaled_sin(dtype, *, jvp=True, vjp=True, calls=None):
    @jax_threadmap.kernel(jax.ShapeDtypeStruct((3,), dtype))
    def scaled_sin(x, a):
        assert x.shape == (3,) and a.shape == ()
        return np.sin(x) * a

    if jvp:

        @scaled_sin.defjvp
        def scaled_sin_jvp(x, a, tx, ta):
            assert tx.shape == (3,) and ta.shape == ()
            if calls is not None:
                calls.append("jvp")
            return np.cos(x) * a * tx + np.sin(x) * ta

    if vjp:

        @scaled_sin.defvjp
        def scaled_sin_vjp(x, a, ct):
            assert ct.shape == (3,)
            if calls is not None:
                calls.append("vjp")
            return ct * np.cos(x) * a, np.sum(ct * np.sin(x))

    return scaled_sin


def scaled_sin_ref(x, a):
    return jnp.sin(x) * a


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    if request.param == "float64":
        prev = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
        yield np.dtype("float64")
        jax.config.update("jax_enable_x64", prev)
    else:
        yield np.dtype("float32")


def values(shape, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).uniform(-2, 2, shape).astype(dtype))


# in_axes of (x, a) per vmap level (innermost first), and the batch sizes.
NESTINGS = {
    "unbatched": ([], []),
    "x": ([(0, None)], [4]),
    "a": ([(None, 0)], [4]),
    "x-a": ([(0, None), (None, 0)], [3, 2]),
    "both-a": ([(1, 0), (0, None)], [3, 2]),
    "depth3": ([(0, None), (None, 0), (-1, 0)], [2, 3, 2]),
}


def operand_shapes(levels, sizes):
    """Shapes of x and a for the given nesting (axes listed innermost first)."""
    shapes = [[3], []]
    for axes, size in zip(levels, sizes, strict=True):
        for k, ax in enumerate(axes):
            if ax is not None:
                pos = ax % (len(shapes[k]) + 1)
                shapes[k].insert(pos, size)
    return tuple(shapes[0]), tuple(shapes[1])


@pytest.mark.parametrize("name", list(NESTINGS))
@pytest.mark.parametrize("jit", [False, True])
def test_check_grads_fwd_and_rev(name, jit, dtype):
    levels, sizes = NESTINGS[name]
    f = nest(make_scaled_sin(dtype), levels)
    ref = nest(scaled_sin_ref, levels)
    xs, as_ = operand_shapes(levels, sizes)
    x, a = values(xs, dtype, 1), values(as_, dtype, 2)
    if jit:
        f = jax.jit(f)
    tol = TOL[dtype]
    t = (values(xs, dtype, 3), values(as_, dtype, 4))
    ct = values(jax.eval_shape(ref, x, a).shape, dtype, 5)
    # The jax.numpy version's value, JVP and VJP in one jitted program: one
    # compile, not one per eager operation.
    ref_out, ref_t, ref_vjp = jax.jit(
        lambda x, a, t, ct: (
            ref(x, a),
            jax.jvp(ref, (x, a), t)[1],
            jax.vjp(ref, x, a)[1](ct),
        )
    )(x, a, t, ct)
    np.testing.assert_allclose(f(x, a), ref_out, rtol=tol, atol=tol)
    eps = 1e-3 if dtype == np.float32 else 1e-6
    check_grads(f, (x, a), order=1, modes=("fwd", "rev"), atol=tol, rtol=tol, eps=eps)
    # And exactly the derivatives of the jax.numpy version.
    _, out_t = jax.jvp(f, (x, a), t)
    np.testing.assert_allclose(out_t, ref_t, rtol=tol, atol=tol)
    for got, want in zip(jax.vjp(f, x, a)[1](ct), ref_vjp, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "transform",
    [jax.jacfwd, jax.jacrev, lambda f: jax.jit(jax.jacrev(f, argnums=(0, 1)))],
)
def test_jacobians_match_jax_numpy(transform):
    f = jax.vmap(make_scaled_sin(np.float32), (0, None))
    x, a = values((4, 3), np.float32), jnp.float32(1.5)
    got = transform(f)(x, a)
    want = transform(jax.vmap(scaled_sin_ref, (0, None)))(x, a)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_linearize_runs_the_jvp_kernel():
    calls = []
    f = jax.vmap(make_scaled_sin(np.float32, calls=calls), (0, None))
    x, a = values((4, 3), np.float32), jnp.float32(1.5)
    y, f_lin = jax.linearize(f, x, a)
    tx = jnp.ones_like(x)
    np.testing.assert_allclose(
        f_lin(tx, jnp.float32(0)),
        jax.jvp(jax.vmap(scaled_sin_ref, (0, None)), (x, a), (tx, 0.0))[1],
        rtol=1e-5,
    )
    assert set(calls) == {"jvp"}


def test_reverse_mode_through_scan_checkpoint_and_cond_with_vjp_only():
    f = make_scaled_sin(np.float32, jvp=False)
    x, a = values((3,), np.float32), jnp.float32(1.3)

    def loss(f):
        def body(c, _):
            c = jax.checkpoint(f)(c, a)
            return jax.lax.cond(c[0] > -5, lambda c: f(c, a), lambda c: c, c), None

        return lambda x: jax.lax.scan(body, x, None, length=2)[0].sum()

    np.testing.assert_allclose(
        jax.jit(jax.grad(loss(f)))(x),
        jax.jit(jax.grad(loss(scaled_sin_ref)))(x),
        rtol=1e-5,
    )


def test_jvp_equation_is_linear_in_its_tangents():
    f = make_scaled_sin(np.float32)
    x, a = values((3,), np.float32), jnp.float32(1.3)
    t = values((3,), np.float32, 1)

    def tangent(f):
        return lambda t: jax.jvp(lambda x: f(x, a), (x,), (t,))[1]

    # grad with respect to the tangent transposes the JVP equation (VJP kernel).
    np.testing.assert_allclose(
        jax.grad(lambda t: tangent(f)(t).sum())(t),
        jax.grad(lambda t: tangent(scaled_sin_ref)(t).sum())(t),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        jax.jvp(tangent(f), (t,), (2 * t,))[1],
        jax.jvp(tangent(scaled_sin_ref), (t,), (2 * t,))[1],
        rtol=1e-5,
    )
    (ct,) = jax.linear_transpose(tangent(f), t)(t)
    (want,) = jax.linear_transpose(tangent(scaled_sin_ref), t)(t)
    np.testing.assert_allclose(ct, want, rtol=1e-5)


# --- the jaxprs: derivative kernels are threadmap equations, no loops ---------------


def _no_loops(jaxpr):
    return count_eqns(jaxpr, "scan") == 0 and count_eqns(jaxpr, "while") == 0


def test_grad_of_vmap_folds_and_does_not_tile_unbatched_operand():
    f = make_scaled_sin(np.float32)
    x, a = values((2, 5, 3), np.float32), jnp.float32(0.5)

    def loss(x, a):
        return jax.vmap(jax.vmap(f, (0, None)), (0, None))(x, a).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, a).jaxpr
    assert _no_loops(jaxpr)
    eqns = {kname(e): e for e in threadmap_eqns(jaxpr)}
    assert "scaled_sin_vjp" in eqns
    vjp = eqns["scaled_sin_vjp"]
    # `a` enters the VJP equation as its own scalar, unbatched at both levels.
    assert vjp.invars[1].aval.shape == ()
    assert vjp.params["spec"].in_axes[1] == (None, None)
    assert vjp.params["spec"].shape == (2, 5)
    # The host sums `a`'s per-element cotangents over both levels: its output is
    # a scalar (x's is batched at both levels), and the only reduce_sum left is
    # the loss's own `.sum()`.
    assert vjp.params["spec"].out_sum == ((), (0, 1))
    assert [v.aval.shape for v in vjp.outvars] == [(2, 5, 3), ()]
    assert [e.primitive.name for e in jaxpr.eqns].count("reduce_sum") == 1
    gx, ga = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, a)
    rx, ra = jax.grad(lambda x, a: scaled_sin_ref(x, a).sum(), argnums=(0, 1))(x, a)
    np.testing.assert_allclose(gx, rx, rtol=1e-5)
    np.testing.assert_allclose(ga, ra, rtol=1e-5)


def dot_loss(x, executor):
    """``w -> sum over a 2-level vmap of x @ w``, with ``w`` unbatched: its
    cotangent is a sum over both levels."""

    @jax_threadmap.kernel(jax.ShapeDtypeStruct((), jnp.float32), executor=executor)
    def dot(x, w):
        return np.float32(x @ w)

    @dot.defvjp
    def dot_vjp(x, w, ct):
        return ct * w, ct * x

    def loss(w):
        return jax.vmap(jax.vmap(dot, (0, None)), (0, None))(x, w).sum()

    return loss


@pytest.mark.parametrize("executor", [1, 3])
def test_host_summed_cotangents_are_deterministic(executor):
    x = values((6, 7, 50), np.float32)
    w = values((50,), np.float32, 1)
    loss = dot_loss(x, executor)

    g = jax.jit(jax.grad(loss))
    first = np.asarray(g(w))
    for _ in range(5):  # same chunk bounds every time: bitwise the same sum
        np.testing.assert_array_equal(np.asarray(g(w)), first)
    np.testing.assert_allclose(first, np.asarray(x).sum((0, 1)), rtol=1e-5)


def test_vmap_of_grad_of_vmap_keeps_outer_level_and_sums_inner():
    f = make_scaled_sin(np.float32)
    x = values((4, 5, 3), np.float32)
    a = values((4,), np.float32, 2)

    def grad_a(x, a):  # per outer element: d/da of the inner vmap's sum
        return jax.grad(lambda a: jax.vmap(f, (0, None))(x, a).sum())(a)

    g = jax.vmap(grad_a)
    jaxpr = jax.make_jaxpr(g)(x, a).jaxpr
    vjp = {kname(e): e for e in threadmap_eqns(jaxpr)}["scaled_sin_vjp"]
    # The outer vmap level came after the transpose: it is kept, the inner summed.
    assert vjp.params["spec"].shape == (4, 5)
    assert vjp.params["spec"].out_sum == ((1,),)
    ref = jax.vmap(lambda x, a: jax.grad(lambda a: scaled_sin_ref(x, a).sum())(a))(x, a)
    np.testing.assert_allclose(jax.jit(g)(x, a), ref, rtol=1e-5)


X243 = values((2, 4, 3), np.float32)
A24 = values((2, 4), np.float32, 1)


@pytest.mark.parametrize(
    "make, args",
    [
        (
            lambda f: jax.vmap(
                jax.vmap(jax.grad(lambda x, a: f(x, a).sum())), (0, None)
            ),
            (X243, A24[0]),
        ),
        (lambda f: jax.vmap(jax.jacfwd(f), (0, None)), (X243[:, 0], A24[0, 0])),
        (
            lambda f: jax.vmap(jax.jacrev(f, argnums=(0, 1)), (0, None)),
            (X243[:, 0], A24[0, 0]),
        ),
        (
            lambda f: jax.jit(
                jax.vmap(jax.vmap(lambda x, a: jax.jvp(f, (x, a), (x, a))[1]))
            ),
            (X243, A24),
        ),
    ],
    ids=["vmap-grad", "vmap-jacfwd", "vmap-jacrev", "jit-vmap-jvp"],
)
def test_transforms_of_derivatives_stay_threadmap_equations(make, args):
    f = make_scaled_sin(np.float32)
    jaxpr = jax.make_jaxpr(make(f))(*args).jaxpr
    assert _no_loops(jaxpr)
    kernels = {kname(e) for e in threadmap_eqns(jaxpr)}
    assert kernels & {"scaled_sin_jvp", "scaled_sin_vjp"}
    for got, want in zip(
        jax.tree.leaves(make(f)(*args)),
        jax.tree.leaves(make(scaled_sin_ref)(*args)),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_jacfwd_batches_tangents_only():
    f = jax.vmap(make_scaled_sin(np.float32), (0, None))
    x, a = values((4, 3), np.float32), jnp.float32(2.0)
    jaxpr = jax.make_jaxpr(jax.jacfwd(f))(x, a).jaxpr
    (jvp,) = [e for e in threadmap_eqns(jaxpr) if "jvp" in kname(e)]
    spec = jvp.params["spec"]
    # Outer level: the jacobian basis (tangents only); inner: the user's vmap.
    assert spec.shape == (12, 4)
    assert spec.in_axes[0] == (None, 0)  # primal x is never tiled
    assert spec.in_axes[2][0] is not None  # the tangent of x is batched


# --- pytrees, integer inputs and outputs, keyword arguments -------------------------

F32 = jnp.float32
TREE_OUT = {
    "y": jax.ShapeDtypeStruct((2,), F32),
    "count": jax.ShapeDtypeStruct((), jnp.int32),
}


def make_tree_kernel(seen=None):
    @jax_threadmap.kernel(TREE_OUT)
    def tree_kernel(p, n, *, w):
        return {"y": p["u"] * p["v"] ** 2 * w + n, "count": n + 1}

    @tree_kernel.defjvp
    def tree_kernel_jvp(p, n, tp, tn, *, w):
        if seen is not None:
            seen.append((tp["v"].dtype, tn.dtype, tn.shape))
        dy = (tp["u"] * p["v"] ** 2 + 2 * p["u"] * p["v"] * tp["v"]) * w
        return {"y": dy, "count": None}

    @tree_kernel.defvjp
    def tree_kernel_vjp(p, n, ct, *, w):
        if seen is not None:
            seen.append((ct["count"].dtype, ct["count"].shape))
        y = ct["y"] * w
        return {"u": y * p["v"] ** 2, "v": np.sum(y * 2 * p["u"] * p["v"])}, None

    return tree_kernel


def tree_ref(p, n, *, w):
    return {"y": p["u"] * p["v"] ** 2 * w + n, "count": n + 1}


def test_pytree_arguments_int_inputs_and_outputs():
    seen = []
    f = make_tree_kernel(seen)
    p = {"u": values((4, 2), np.float32), "v": values((4,), np.float32, 1)}
    n = jnp.arange(4, dtype=jnp.int32)
    w = jnp.float32(0.5)

    def loss(f):
        return lambda p, n: jax.vmap(lambda p, n: f(p, n, w=w))(p, n)["y"].sum()

    g = jax.grad(loss(f))(p, n)
    r = jax.jit(jax.grad(loss(tree_ref)))(p, n)  # one compile, not one per operation
    for k in "uv":
        np.testing.assert_allclose(g[k], r[k], rtol=1e-5)
    # The integer output's cotangent reaches the VJP kernel as float0 zeros.
    assert set(seen) == {(jax.dtypes.float0, ())}
    # Integer inputs get float0 cotangents, as for any JAX function.
    gp, gn = jax.grad(loss(f), argnums=(0, 1), allow_int=True)(p, n)
    assert gn.dtype == jax.dtypes.float0 and gn.shape == (4,)
    seen.clear()
    tp = jax.tree.map(jnp.ones_like, p)
    out, t = jax.jvp(lambda p: jax.vmap(lambda p, n: f(p, n, w=w))(p, n), (p,), (tp,))
    _, rt = jax.jit(
        lambda p, tp: jax.jvp(
            lambda p: jax.vmap(lambda p, n: tree_ref(p, n, w=w))(p, n), (p,), (tp,)
        )
    )(p, tp)
    np.testing.assert_allclose(t["y"], rt["y"], rtol=1e-5)
    # Integer outputs get float0 tangents; integer inputs float0 zeros in the kernel.
    assert t["count"].dtype == jax.dtypes.float0
    np.testing.assert_array_equal(out["count"], n + 1)
    assert set(seen) == {(np.dtype(np.float32), jax.dtypes.float0, ())}


def test_symbolic_zero_tangents_arrive_as_zeros():
    seen = []

    @jax_threadmap.kernel(jax.ShapeDtypeStruct((), F32))
    def mul(x, y):
        return x * y

    @mul.defjvp
    def mul_jvp(x, y, tx, ty):
        seen.append((float(tx), float(ty), tx.flags.writeable))
        return tx * y + x * ty

    x, y = jnp.float32(3.0), jnp.float32(5.0)
    _, t = jax.jvp(lambda x: mul(x, y), (x,), (jnp.float32(1.0),))
    assert float(t) == 5.0
    assert seen == [(1.0, 0.0, False)]


def test_keyword_arguments_are_not_differentiable():
    f = make_tree_kernel()
    p = {"u": jnp.ones(2), "v": jnp.float32(2.0)}
    n = jnp.int32(1)
    # Keywords reach the kernels and get no cotangent; closing over them is fine.
    g = jax.grad(lambda p: f(p, n, w=jnp.float32(3.0))["y"].sum())(p)
    np.testing.assert_allclose(g["u"], [12.0, 12.0])
    with pytest.raises(TypeError, match=r"keyword argument 'w' depends on"):
        jax.grad(lambda w: f(p, n, w=w)["y"].sum())(jnp.float32(3.0))
    # stop_gradient opts out explicitly.
    g = jax.grad(lambda w: f(p, n, w=jax.lax.stop_gradient(w))["y"].sum())(3.0)
    assert float(g) == 0.0


# --- property test: random nestings against jax.numpy --------------------------------


@st.composite
def nestings(draw):
    depth = draw(st.integers(1, 3))
    levels, sizes = [], []
    ndims = [1, 0]  # x, a inside the innermost level
    for _ in range(depth):
        axes = [draw(st.none() | st.integers(-(n + 1), n)) for n in ndims]
        if all(ax is None for ax in axes):
            axes[0] = 0
        levels.append(tuple(axes))
        sizes.append(draw(st.integers(1, 3)))
        ndims = [n + (ax is not None) for n, ax in zip(ndims, axes, strict=True)]
    return levels, sizes, draw(st.booleans())


F32_KERNEL = make_scaled_sin(np.float32)


@settings(max_examples=examples(12), suppress_health_check=[HealthCheck.too_slow])
@given(nestings())
def test_random_nestings_match_jax_numpy(case):
    levels, sizes, jit = case
    f, ref = nest(F32_KERNEL, levels), nest(scaled_sin_ref, levels)
    if jit:
        f = jax.jit(f)
    xs, as_ = operand_shapes(levels, sizes)
    x, a = values(xs, np.float32, 1), values(as_, np.float32, 2)
    t = (values(xs, np.float32, 3), values(as_, np.float32, 4))
    ct = values(jax.eval_shape(ref, x, a).shape, np.float32, 5)
    # The references in one jitted program: one compile, not one per eager operation.
    want_jvp, want_vjp = jax.jit(
        lambda x, a, t, ct: (jax.jvp(ref, (x, a), t)[1], jax.vjp(ref, x, a)[1](ct))
    )(x, a, t, ct)
    np.testing.assert_allclose(jax.jvp(f, (x, a), t)[1], want_jvp, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.vjp(f, x, a)[1](ct), want_vjp, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- caching --------------------------------------------------------------------------


def test_derivative_params_are_equal_across_traces(monkeypatch):
    from jax_threadmap._core import lowering as _lowering
    from jax_threadmap._jax import mlir as _mlir

    ran, lowerings = [], []

    host_map = _lowering.HostMap

    def RecordingHostMap(caller, *args):  # noqa: N802 - stands for the class
        ran.append(caller.name.rsplit(".", 1)[-1])
        return host_map(caller, *args)

    def counting_emit(*args, **kwargs):
        lowerings.append(1)
        return emit(*args, **kwargs)

    emit = _mlir.emit_python_callback
    monkeypatch.setattr(_lowering, "HostMap", RecordingHostMap)
    monkeypatch.setattr(_mlir, "emit_python_callback", counting_emit)
    f = jax.vmap(make_scaled_sin(np.float32), (0, None))
    x, a = values((4, 3), np.float32), jnp.float32(2.0)
    grad = jax.grad(lambda x: f(x, a).sum())
    grad(x)
    assert sorted(ran) == ["scaled_sin", "scaled_sin_vjp"]
    ran.clear()
    jax.jvp(lambda x: f(x, a), (x,), (x,))
    assert sorted(ran) == ["scaled_sin", "scaled_sin_jvp"]
    assert lowerings == []  # eager derivatives run on the host, nothing compiles
    j1, j2 = (jax.make_jaxpr(grad)(v) for v in (x, x + 1))
    assert [e.params for e in j1.eqns] == [e.params for e in j2.eqns]
    jitted = jax.jit(grad)
    jitted(x)
    jitted(x + 1)
    assert jitted._cache_size() == 1


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.grad(lambda x: f(x, 2.0).sum()),
        lambda f: jax.jacrev(lambda x: f(x, 2.0)),
        lambda f: jax.jit(lambda x: jax.vjp(lambda x: f(x, 2.0), x)[1](x)),
        # Forward over reverse: its VJP, which it lacks, is named, not a
        # derivative kernel "vjp(...)" to be given rules of its own.
        lambda f: jax.hessian(lambda x: f(x, 2.0).sum()),
    ],
)
def test_reverse_mode_without_vjp_names_defvjp(transform):
    f = make_scaled_sin(np.float32, vjp=False)
    with pytest.raises(TypeError, match=r"no VJP kernel.*scaled_sin\.defvjp"):
        transform(f)(jnp.ones(3))


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: lambda x: jax.jvp(lambda x: f(x, 2.0), (x,), (x,))[1],
        lambda f: jax.jit(lambda x: jax.jvp(lambda x: f(x, 2.0), (x,), (x,))[1]),
        lambda f: jax.jacfwd(lambda x: f(x, 2.0)),
        lambda f: lambda x: jax.linearize(lambda x: f(x, 2.0), x)[1](x),
        lambda f: jax.jacrev(jax.jacfwd(lambda x: f(x, 2.0))),  # reverse over it
    ],
)
def test_forward_mode_without_jvp_names_defjvp(transform):
    calls = []
    f = make_scaled_sin(np.float32, jvp=False, calls=calls)
    with pytest.raises(TypeError, match=r"no JVP kernel.*scaled_sin\.defjvp"):
        transform(f)(jnp.ones(3))
    assert calls == []


def test_kernel_without_rules_says_to_attach_them_not_to_wrap_it():
    # Was "Wrap the kernel with jax_threadmap.kernel(...)", about a kernel that
    # jax_threadmap.kernel had made already.
    f = make_scaled_sin(np.float32, jvp=False, vjp=False)
    for transform in (jax.grad, jax.jacfwd, jax.jacrev):
        with pytest.raises(TypeError) as info:
            transform(lambda x: f(x, 2.0).sum())(jnp.ones(3))
        msg = str(info.value)
        assert "scaled_sin' has no derivative rule" in msg
        assert " scaled_sin.defvjp(vjp_kernel) (for jax.grad" in msg
        assert " scaled_sin.defjvp(jvp_kernel) (for jax.jvp" in msg
        assert "Wrap the kernel" not in msg


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.hessian(lambda x: f(x, 2.0).sum()),
        lambda f: jax.grad(lambda x: jax.grad(lambda x: f(x, 2.0).sum())(x).sum()),
        lambda f: jax.jacfwd(jax.jacfwd(lambda x: f(x, 2.0))),
    ],
)
def test_second_order_of_plain_rules_names_the_rule_and_the_fix(transform):
    # Was "higher-order derivatives ... are not supported". A plain function as
    # a rule has no rules of its own: the message names it and how to give some
    # (tests/_core/test_second_order.py has the rest).
    f = make_scaled_sin(np.float32)
    with pytest.raises(TypeError) as info:
        transform(f)(jnp.ones(3))
    msg = str(info.value)
    rule = "scaled_sin_jvp" if "jvp" in msg.split("'")[1] else "scaled_sin_vjp"
    assert f"{rule} has no defjvp" in msg
    assert f"Make {rule} a jax_threadmap.kernel" in msg


def test_wrong_derivative_results_name_the_kernel_and_index():
    f = make_scaled_sin(np.float32, jvp=False, vjp=False)
    f.defvjp(lambda x, a, ct: ct)  # not a tuple
    f.defjvp(lambda x, a, tx, ta: (tx, ta))  # wrong structure
    g = jax.vmap(f, (0, None))
    x = jnp.ones((2, 3))
    with pytest.raises(KernelError, match="one cotangent per positional argument"):
        jax.grad(lambda x: g(x, 2.0).sum())(x)
    with pytest.raises(KernelError, match=r"batch index \(\d,\).*structure"):
        jax.jvp(lambda x: g(x, 2.0), (x,), (x,))


@pytest.mark.parametrize("form", ["jvp", "fwd-jvp"])
def test_a_tangent_of_the_wrong_structure_names_the_jvp_kernel(form):
    """A pytree output's tangent is flattened against the output's structure;
    one that does not fit names the JVP kernel (and its form) and the structure."""
    S = jax.ShapeDtypeStruct((), jnp.float32)

    @jax_threadmap.kernel((S, S))
    def pair(x):
        return x, 2 * x

    if form == "jvp":
        pair.defjvp(lambda x, tx: tx)  # one array, not a pair
        what = r"the JVP kernel must return"
    else:
        pair.defjvp(lambda x: ((x, 2 * x), ()), lambda res, tx: tx, residuals=())
        what = r"the JVP kernel \(of defjvp\(fwd, jvp, residuals=\.\.\.\)\) must"
    x = jnp.arange(3.0)
    with pytest.raises(KernelError, match=what + r" .*tangent of the output"):
        jax.jvp(jax.vmap(pair), (x,), (x,))


def test_derivative_results_that_do_not_fit_fail_naming_the_value():
    # Derivative kernels store through the same check as primal ones, the
    # host-summed cotangents of unbatched operands included.
    @jax_threadmap.kernel(jax.ShapeDtypeStruct((), jnp.float32))
    def mul(x, w):
        return x * w

    @mul.defjvp
    def mul_jvp(x, w, tx, tw):
        return np.float64(1e300) if x == 1 else np.float64(tx * w + x * tw)

    @mul.defvjp
    def mul_vjp(x, w, ct):
        big = np.float64(1e300) if x == 1 else np.float64(ct * x)
        return np.float64(ct * w), big

    g = jax.vmap(mul, (0, None))
    w = jnp.float32(3)
    ok = jnp.array([0.0, 2.0, 4.0])
    _, t = jax.jvp(lambda x: g(x, w), (ok,), (jnp.ones(3),))
    np.testing.assert_array_equal(t, np.full(3, 3, np.float32))
    np.testing.assert_array_equal(jax.grad(lambda w: g(ok, w).sum())(w), 6.0)
    bad = jnp.array([0.0, 1.0, 4.0])
    fragment = r"at batch index \(1,\) .*returned 1e\+300 \(float64\) for output 0"
    with pytest.raises(KernelError, match="mul_jvp' " + fragment):
        jax.jvp(lambda x: g(x, w), (bad,), (jnp.ones(3),))
    with pytest.raises(KernelError, match="mul_vjp' " + fragment):
        jax.grad(lambda w: g(bad, w).sum())(w)  # w's cotangent: summed on the host


def test_api_errors():
    with pytest.raises(TypeError, match="with parentheses"):
        jax_threadmap.kernel(np.sin)
    with pytest.raises(TypeError, match="executor"):
        jax_threadmap.kernel(jax.ShapeDtypeStruct((), F32), executor="x")
    f = make_scaled_sin(np.float32)
    with pytest.raises(TypeError, match="defjvp expects a callable"):
        f.defjvp(3)
    with pytest.raises(TypeError, match="'executor' is an option of"):
        f(jnp.ones(3), 2.0, executor=2)
    if "progress" not in jax_threadmap._core.api.RESERVED_KWARGS:
        with pytest.raises(TypeError, match="no progress option"):
            jax_threadmap.kernel(jax.ShapeDtypeStruct((), F32), progress=True)


def test_kernel_object_is_like_threadmap():
    f = make_scaled_sin(np.float32)
    assert f.__name__ == "scaled_sin"
    assert f.jvp.__name__ == "scaled_sin_jvp" and f.vjp.__name__ == "scaled_sin_vjp"
    assert "scaled_sin with jvp and vjp" in repr(f)
    x = values((4, 3), np.float32)
    g = jax.vmap(f, (0, None))
    h = jax.vmap(lambda x, a: threadmap(f.fn, f.result_shape_dtypes, x, a), (0, None))
    np.testing.assert_array_equal(g(x, 2.0), h(x, 2.0))
    (eqn,) = jax.make_jaxpr(g)(x, 2.0).eqns
    assert kname(eqn) == "scaled_sin"
    with CountingExecutor(2) as ex:
        k = jax_threadmap.kernel(jax.ShapeDtypeStruct((), F32), executor=ex)(np.sin)
        k.defvjp(lambda x, ct: (ct * np.cos(x),))
        np.testing.assert_allclose(
            jax.grad(lambda x: jax.vmap(k)(x).sum())(jnp.arange(3.0)),
            np.cos(np.arange(3.0)),
            rtol=1e-6,
        )
        assert ex.submitted > 0


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that counts submissions."""

    submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


class _ForeignExecutor(concurrent.futures.Executor):
    """Stands for an executor in other processes: not a ThreadPoolExecutor."""

    def __init__(self):
        self._inner = concurrent.futures.ThreadPoolExecutor(2)

    def submit(self, fn, /, *args, **kwargs):
        return self._inner.submit(fn, *args, **kwargs)


def _without_executor(jaxpr):
    # Each dot_loss call defines its own kernel functions: compare their names.
    return [
        (e.primitive.name, {k: str(v) for k, v in e.params.items() if k != "executor"})
        for e in jaxpr.eqns
    ]


def test_grad_jaxpr_is_the_same_whatever_the_executor():
    ex = _ForeignExecutor()  # takes the path of executors in other processes
    x = values((4, 6, 5), np.float32)
    w = values((5,), np.float32, 1)
    jaxprs = [
        jax.make_jaxpr(jax.grad(dot_loss(x, executor)))(w).jaxpr
        for executor in (None, 2, ex)
    ]
    assert _without_executor(jaxprs[0]) == _without_executor(jaxprs[1])
    assert _without_executor(jaxprs[0]) == _without_executor(jaxprs[2])
    vjp = {kname(e): e for e in threadmap_eqns(jaxprs[2])}["dot_vjp"]
    assert vjp.params["spec"].out_sum == ((0, 1),)  # summed on the host
    for executor in (None, ex):
        g = jax.jit(jax.grad(dot_loss(x, executor)))(w)
        np.testing.assert_allclose(g, np.asarray(x).sum((0, 1)), rtol=1e-5)
    ex._inner.shutdown()


def test_jax_shaped_derivative_rules_show_the_expected_signature():
    # Were "takes 2 positional arguments but 3 were given" for defvjp(fwd, bwd), and
    # "iteration over a 0-d array" at run time for a custom_jvp-style rule.
    f = make_scaled_sin(np.float32, jvp=False, vjp=False)

    def fwd(x, a):
        return f(x, a), (x, a)

    def bwd(res, g):
        return g, g

    with pytest.raises(TypeError) as info:
        f.defvjp(fwd, bwd)
    msg = str(info.value)
    assert "vjp(x, a, ct_out, **kwargs) -> (ct_x, ct_a)" in msg
    assert "defvjp(fwd, bwd)" in msg
    assert f.vjp is None

    def jax_jvp(primals, tangents):
        (x, a), (tx, ta) = primals, tangents
        return f(x, a), np.cos(x) * a * tx + np.sin(x) * ta

    with pytest.raises(TypeError) as info:
        f.defjvp(jax_jvp)
    msg = str(info.value)
    assert "jax.custom_jvp rule" in msg
    assert "jvp(x, a, x_dot, a_dot, **kwargs) -> tangent_out" in msg
    assert f.jvp is None
