"""Second-order derivatives: kernels whose JVP and VJP kernels have rules of their own.

Every transform is compared with the same function in jax.numpy, in float64, under
the same vmaps (and jit), to round-off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from elementwise import (
    F64,
    FUNCTIONS,
    RTOL,
    S,
    hvp,
    nestings,
    operands,
    reference,
    residual_kernel,
    values,
)
from elementwise import assert_close as _assert_close
from helpers import count_eqns, examples, kname, threadmap_eqns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_threadmap

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("x64")]


def make_kernel(
    name="sin", *, levels=("jvp", "vjp"), second=("jvp", "vjp"), calls=None
):
    """``f(x, a) = g(x) * a`` for one element (x (3,), a ()), with the rules in
    ``levels``, each a ``jax_threadmap.kernel`` with the rules in ``second``."""
    (g, g1, g2), _ = FUNCTIONS[name]

    def record(tag):
        if calls is not None:
            calls.append(tag)

    @jax_threadmap.kernel(S((3,), F64))
    def f(x, a):
        record("f")
        return g(x) * a

    @jax_threadmap.kernel(S((3,), F64))
    def f_jvp(x, a, tx, ta):
        record("f_jvp")
        return g1(x) * a * tx + g(x) * ta

    @jax_threadmap.kernel((S((3,), F64), S((), F64)))
    def f_vjp(x, a, ct):
        record("f_vjp")
        return ct * g1(x) * a, np.sum(ct * g(x))

    if "jvp" in second:

        @f_jvp.defjvp
        def f_jvp_jvp(x, a, tx, ta, dx, da, dtx, dta):
            record("f_jvp_jvp")
            return (
                g2(x) * dx * a * tx + g1(x) * (da * tx + a * dtx + dx * ta) + g(x) * dta
            )

        @f_vjp.defjvp
        def f_vjp_jvp(x, a, ct, dx, da, dct):
            record("f_vjp_jvp")
            return (
                dct * g1(x) * a + ct * g2(x) * dx * a + ct * g1(x) * da,
                np.sum(dct * g(x) + ct * g1(x) * dx),
            )

    if "vjp" in second:

        @f_jvp.defvjp
        def f_jvp_vjp(x, a, tx, ta, ct):
            record("f_jvp_vjp")
            return (
                ct * (g2(x) * a * tx + g1(x) * ta),
                np.sum(ct * g1(x) * tx),
                ct * g1(x) * a,
                np.sum(ct * g(x)),
            )

        @f_vjp.defvjp
        def f_vjp_vjp(x, a, ct, c):
            record("f_vjp_vjp")
            cx, ca = c
            return (
                cx * ct * g2(x) * a + ca * ct * g1(x),
                np.sum(cx * ct * g1(x)),
                cx * g1(x) * a + ca * g(x),
            )

    if "jvp" in levels:
        f.defjvp(f_jvp)
    if "vjp" in levels:
        f.defvjp(f_vjp)
    return f


def nested_loss(f, x_axes=(0, 0)):
    """A loss through two nested vmaps: x batched at both levels, a at none."""

    def loss(x, a):
        g = f
        for ax in x_axes:
            g = jax.vmap(g, in_axes=(ax, None))
        y = g(x, a)
        return jnp.sum(y * jnp.cos(y)) + a * jnp.sum(y)

    return loss


TRANSFORMS = {
    "hessian": lambda loss: jax.hessian(loss, (0, 1)),
    "jacfwd(jacrev)": lambda loss: jax.jacfwd(jax.jacrev(loss, (0, 1)), (0, 1)),
    "jacfwd(jacfwd)": lambda loss: jax.jacfwd(jax.jacfwd(loss, (0, 1)), (0, 1)),
    "jacrev(jacfwd)": lambda loss: jax.jacrev(jax.jacfwd(loss, (0, 1)), (0, 1)),
    "jacrev(jacrev)": lambda loss: jax.jacrev(jax.jacrev(loss, (0, 1)), (0, 1)),
    "grad(grad)": lambda loss: jax.grad(
        lambda x, a: jnp.sum(jnp.sin(jax.grad(loss)(x, a))), (0, 1)
    ),
    "jvp(grad)": hvp,
}


def assert_close(got, want):
    _assert_close(got, want, np.float64)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_second_order_transforms_match_jax_numpy(transform, jit):
    x, a = values((2, 3, 3), 0), jnp.float64(0.8)
    make = TRANSFORMS[transform]
    got_fn = make(nested_loss(make_kernel()))
    if jit:
        got_fn = jax.jit(got_fn)
    assert_close(got_fn(x, a), make(nested_loss(reference()))(x, a))


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_second_order_jaxprs_are_threadmap_equations_without_tiling(transform):
    x, a = values((2, 3, 3), 0), jnp.float64(0.8)
    jaxpr = jax.make_jaxpr(TRANSFORMS[transform](nested_loss(make_kernel())))(x, a)
    assert count_eqns(jaxpr.jaxpr, "scan") == count_eqns(jaxpr.jaxpr, "while") == 0
    eqns = threadmap_eqns(jaxpr.jaxpr)
    names = {kname(e) for e in eqns}
    assert names & {"f_jvp_jvp", "f_jvp_vjp", "f_vjp_jvp", "f_vjp_vjp"}, names
    for eqn in eqns:
        # Operand 1 is always `a`, unbatched at both user levels: one scalar,
        # never tiled (the jacobian's own vmap level may batch its tangent).
        assert eqn.invars[1].aval.shape == ()
        assert eqn.params["spec"].in_axes[1] == (None,) * len(eqn.params["spec"].shape)


def test_unbatched_argument_second_order_cotangent_is_summed_on_the_host():
    x, a = values((2, 3, 3), 1), jnp.float64(-0.6)
    loss = nested_loss(make_kernel())
    # d/da of grad_x: reverse over reverse. `a`'s second-order cotangent comes out
    # of the VJP kernel's VJP kernel summed over both levels on the host.
    mixed = jax.grad(lambda a: jnp.sum(jnp.sin(jax.grad(loss)(x, a))))
    jaxpr = jax.make_jaxpr(mixed)(a).jaxpr
    (vv,) = [e for e in threadmap_eqns(jaxpr) if kname(e) == "f_vjp_vjp"]
    spec = vv.params["spec"]
    assert spec.shape == (2, 3)
    assert (0, 1) in spec.out_sum  # `a`'s cotangent: summed over both levels
    assert () in [tuple(v.aval.shape) for v in vv.outvars]
    # The only reduce_sums are the loss's own (over whole arrays): no cotangent
    # of `a` is tiled and then summed on the device.
    sums = [e for e in jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert all(e.params["axes"] == (0, 1, 2) for e in sums)
    ref = jax.grad(lambda a: jnp.sum(jnp.sin(jax.grad(nested_loss(reference()))(x, a))))
    np.testing.assert_allclose(jax.jit(mixed)(a), jax.jit(ref)(a), rtol=RTOL)


def test_per_example_hessians_under_two_vmaps():
    x, a = values((2, 3, 3), 2), values((2,), 3)
    f, ref = make_kernel("exp"), reference("exp")

    def per_example(f):
        h = jax.hessian(lambda x, a: jnp.sum(f(x, a) ** 2), (0, 1))
        return jax.jit(jax.vmap(jax.vmap(h, (0, None)), (0, 0)))

    assert_close(per_example(f)(x, a), per_example(ref)(x, a))


def test_hvp_runs_one_equation_per_kernel_and_counts_calls():
    calls = []
    f = make_kernel(calls=calls)
    x, a = values((4, 3), 4), jnp.float64(1.1)

    def loss(x):
        return jnp.sum(jax.vmap(f, (0, None))(x, a) ** 2)

    def hvp_fn(x, v):
        return jax.jvp(jax.grad(loss), (x,), (v,))[1]

    jaxpr = jax.make_jaxpr(jax.jit(hvp_fn))(x, x).jaxpr
    # primal, its tangent, the VJP kernel and the VJP kernel's JVP kernel; under
    # jit the gradient itself (not returned) is dropped before anything runs.
    names = sorted(kname(e) for e in threadmap_eqns(jaxpr))
    assert names == ["f", "f_jvp", "f_vjp", "f_vjp_jvp"]
    got = jax.jit(hvp_fn)(x, jnp.ones_like(x)).block_until_ready()  # then count
    assert sorted(set(calls)) == ["f", "f_jvp", "f_vjp_jvp"]
    assert len(calls) == 3 * 4  # one call per element per equation that runs
    ref = reference()
    want = jax.jvp(
        jax.grad(lambda x: jnp.sum(jax.vmap(ref, (0, None))(x, a) ** 2)),
        (x,),
        (jnp.ones_like(x),),
    )[1]
    np.testing.assert_allclose(got, want, rtol=RTOL)


@pytest.mark.parametrize("vectorized", [True, 2])
def test_vectorized_kernels_two_deep(vectorized):
    # Zeros built on the host for absent tangents carry the chunk axis.
    @jax_threadmap.kernel(S((), F64), vectorized=vectorized)
    def mul(x, y):
        return x * y * y

    @jax_threadmap.kernel(S((), F64))
    def mul_jvp(x, y, tx, ty):
        return tx * y * y + 2 * x * y * ty

    @jax_threadmap.kernel((S((), F64), S((), F64)))
    def mul_vjp(x, y, ct):
        return ct * y * y, 2 * ct * x * y

    @mul_vjp.defjvp
    def mul_vjp_jvp(x, y, ct, dx, dy, dct):
        return (
            dct * y * y + 2 * ct * y * dy,
            2 * (dct * x * y + ct * dx * y + ct * x * dy),
        )

    mul.defjvp(mul_jvp)
    mul.defvjp(mul_vjp)
    x, y = values((5,), 5), values((5,), 6)

    def loss(k):
        return lambda x, y: jnp.sum(jnp.sin(jax.vmap(k)(x, y)))

    for argnums in (0, 1, (0, 1)):
        got = jax.jit(jax.hessian(loss(mul), argnums))(x, y)
        want = jax.jit(jax.hessian(loss(lambda x, y: x * y * y), argnums))(x, y)
        assert_close(got, want)


def test_pytree_and_keyword_arguments_two_deep():
    @jax_threadmap.kernel({"y": S((2,), F64)})
    def k(p, *, w):
        return {"y": p["u"] * p["v"] ** 2 * w}

    @jax_threadmap.kernel(({"u": S((2,), F64), "v": S((), F64)},))
    def k_vjp(p, ct, *, w):
        y = ct["y"] * w
        return ({"u": y * p["v"] ** 2, "v": np.sum(y * 2 * p["u"] * p["v"])},)

    @k_vjp.defjvp
    def k_vjp_jvp(p, ct, dp, dct, *, w):
        u, v, du, dv = p["u"], p["v"], dp["u"], dp["v"]
        y, dy = ct["y"] * w, dct["y"] * w
        return (
            {
                "u": dy * v**2 + y * 2 * v * dv,
                "v": np.sum(2 * (dy * u * v + y * du * v + y * u * dv)),
            },
        )

    @jax_threadmap.kernel({"y": S((2,), F64)})
    def k_jvp(p, tp, *, w):
        return {"y": (tp["u"] * p["v"] ** 2 + 2 * p["u"] * p["v"] * tp["v"]) * w}

    k.defjvp(k_jvp)
    k.defvjp(k_vjp)
    p = {"u": values((3, 2), 7), "v": values((3,), 8)}
    w = jnp.float64(0.5)

    def loss(k):
        return lambda p: jnp.sum(jnp.cos(jax.vmap(lambda p: k(p, w=w))(p)["y"]))

    ref = lambda p, *, w: {"y": p["u"] * p["v"] ** 2 * w}  # noqa: E731
    # The reference jitted: one compile, not one per eager operation.
    assert_close(jax.hessian(loss(k))(p), jax.jit(jax.hessian(loss(ref)))(p))


# --- errors ------------------------------------------------------------------------


def _message(fn, *args):
    with pytest.raises(TypeError) as info:
        fn(*args)
    return str(info.value)


X = np.linspace(-1.0, 1.0, 3)


def _loss(f):
    return lambda x: jnp.sum(f(x, 0.5) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_missing_second_order_rule_names_its_kernel(jit):
    wrap = jax.jit if jit else (lambda g: g)
    only_vjp_of_vjp = make_kernel(second=("vjp",))
    msg = _message(wrap(jax.hessian(_loss(only_vjp_of_vjp))), X)
    if jit:  # forward over reverse needs the VJP kernel's JVP kernel
        assert "f_vjp has no defjvp" in msg
        assert "Attach it with f_vjp.defjvp(jvp_kernel)" in msg
    else:  # eager, JAX also computes the kernel's own tangent: first, say so
        assert "no JVP kernel" not in msg  # the kernel has one
        assert "f_vjp has no defjvp" in msg
    only_jvp_of_vjp = make_kernel(second=("jvp",))
    msg = _message(
        wrap(jax.grad(lambda x: jnp.sum(jax.grad(_loss(only_jvp_of_vjp))(x)))), X
    )
    assert "f_vjp has no defvjp" in msg and "f_vjp.defvjp(vjp_kernel)" in msg
    msg = _message(wrap(jax.jacfwd(jax.jacfwd(_loss(only_vjp_of_vjp)))), X)
    assert "f_jvp has no defjvp" in msg
    msg = _message(wrap(jax.jacrev(jax.jacfwd(_loss(only_jvp_of_vjp)))), X)
    assert "f_jvp has no defvjp" in msg


def test_hessian_with_only_defvjp_points_at_the_vjp_kernel():
    # The issue: "attach defjvp" first, then "not supported at all". Now every
    # message names what jax.hessian needs.
    @jax_threadmap.kernel(S((), F64))
    def cube(x):
        return x**3

    @cube.defvjp
    def cube_vjp(x, ct):
        return (3 * x**2 * ct,)

    loss = lambda x: jnp.sum(jax.vmap(cube)(x))  # noqa: E731
    x = jnp.arange(3.0)
    msg = _message(jax.jit(jax.hessian(loss)), x)
    assert "cube_vjp' (the VJP kernel of" in msg and "cube_vjp has no defjvp" in msg
    assert "Make cube_vjp a jax_threadmap.kernel" in msg
    assert "@jax_threadmap.kernel((ShapeDtypeStruct(shape=(), dtype=float64),))" in msg
    msg = _message(jax.hessian(loss), x)  # eager: the kernel's own tangent first
    assert "cube.defjvp" in msg and "cube_vjp needs a JVP kernel of its own" in msg
    # jax.jvp's message for such a kernel is the first-order one, with the hint.
    msg = _message(lambda x: jax.jvp(loss, (x,), (x,)), x)
    assert msg.startswith("threadmap kernel ")
    assert "has a VJP kernel but no JVP kernel" in msg

    @jax_threadmap.kernel((S((), F64),))
    def cube_vjp_kernel(x, ct):
        return (3 * x**2 * ct,)

    @cube_vjp_kernel.defjvp
    def cube_vjp_jvp(x, ct, dx, dct):
        return (6 * x * dx * ct + 3 * x**2 * dct,)

    cube.defvjp(cube_vjp_kernel)
    np.testing.assert_allclose(jax.jit(jax.hessian(loss))(x), np.diag(6 * x))
    msg = _message(jax.hessian(loss), x)
    assert "under jax.jit, cube_vjp_kernel.defjvp is enough" in msg


def test_plain_function_rules_still_work_at_first_order():
    f = make_kernel()
    plain = jax_threadmap.kernel(S((3,), F64))(f.fn)
    plain.defjvp(f.jvp.fn)
    plain.defvjp(f.vjp.fn)
    loss = _loss(plain)
    np.testing.assert_allclose(jax.grad(loss)(X), jax.grad(_loss(reference()))(X))
    msg = _message(jax.hessian(loss), X)
    assert "f_vjp has no defjvp" in msg and "Make f_vjp a jax_threadmap.kernel" in msg


def test_a_kernel_among_its_own_rules_is_refused():
    @jax_threadmap.kernel(S((), F64))
    def k(x, *rest):
        return x

    k.defjvp(k)
    with pytest.raises(
        TypeError, match=r"k is among its own derivative kernels \(.*k -> .*k\)"
    ):
        k(1.0)


# --- property test ---------------------------------------------------------------


@st.composite
def cases(draw):
    """A kernel (the rules of this file, or fwd/jvp/bwd over residuals), a
    nesting of one or two vmaps (in_axes of x, a), jit, and a second-order
    transform."""
    levels, sizes = draw(nestings(max_depth=2))
    return {
        "kernel": draw(st.sampled_from(sorted(FUNCTIONS))),
        "form": draw(st.sampled_from(["rules", "fwd-jvp"])),
        "levels": levels,
        "sizes": sizes,
        "jit": draw(st.booleans()),
        "transform": draw(st.sampled_from(["hessian", "jacfwd(jacrev)", "jvp(grad)"])),
        "seed": draw(st.integers(0, 2**16)),
    }


KERNELS = {
    (name, form): make_kernel(name)
    if form == "rules"
    else residual_kernel(name, second=True, jvp="residuals")
    for name in FUNCTIONS
    for form in ("rules", "fwd-jvp")
}


@pytest.mark.long
@settings(
    max_examples=examples(24),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(cases())
def test_random_second_order_nestings_match_jax_numpy(case):
    x, a = operands(case["levels"], case["sizes"], case["seed"])

    def loss(f):
        for axes in case["levels"]:
            f = jax.vmap(f, in_axes=axes)
        return lambda x, a: jnp.sum(jnp.sin(f(x, a)))

    make = TRANSFORMS[case["transform"]]
    got_fn = make(loss(KERNELS[case["kernel"], case["form"]]))
    if case["jit"]:
        got_fn = jax.jit(got_fn)
    want = jax.jit(make(loss(reference(case["kernel"]))))(x, a)
    assert_close(got_fn(x, a), want)
