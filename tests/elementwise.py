"""Elementwise kernels ``f(x, a) = g(x) * a`` (x (3,), a () per element) and
what the derivative tests share about them: the functions ``g`` with ``g'`` and
``g''`` in NumPy and jax.numpy, the references, operands under random vmap
nestings, and the kernel whose rules keep residuals (``fwd`` with ``bwd`` and,
optionally, ``jvp``) at first and second order.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import jax_threadmap

S = jax.ShapeDtypeStruct
F64 = jnp.float64
RTOL, ATOL = 1e-11, 1e-12

#: Elementwise g with g' and g'', in NumPy and in jax.numpy.
FUNCTIONS = {
    "sin": ((np.sin, np.cos, lambda x: -np.sin(x)), jnp.sin),
    "exp": ((np.exp, np.exp, np.exp), jnp.exp),
    "cube": ((lambda x: x**3, lambda x: 3 * x**2, lambda x: 6 * x), lambda x: x**3),
}

#: The residuals of f(x, a) = g(x) * a: g'(x) * a and g(x), one element's each.
RESIDUALS = (S((3,), F64), S((3,), F64))


def residual_kernel(name="sin", *, second=False, jvp=False, calls=None):
    """``f(x, a) = g(x) * a`` for one element (x (3,), a ()), its VJP given as
    ``fwd``/``bwd`` with residuals ``(g'(x) * a, g(x))``.

    ``second``: ``fwd`` and ``bwd`` are kernels with rules of their own (for
    the second order); ``jvp``: ``f`` also has a JVP kernel, with rules; or
    ``jvp="residuals"``: ``defjvp(fwd, jvp, ...)`` over the same residuals
    (a kernel with rules, when ``second``); ``jvp="directions"``: the same
    with ``directions=True`` (its tangents may have leading direction axes).
    """
    (g, g1, g2), _ = FUNCTIONS[name]

    def record(tag):
        if calls is not None:
            calls.append(tag)

    @jax_threadmap.kernel(S((3,), F64))
    def f(x, a):
        record("f")
        return g(x) * a

    def fwd(x, a):
        record("fwd")
        return g(x) * a, (g1(x) * a, g(x))

    def bwd(res, ct):
        record("bwd")
        d, v = res
        return ct * d, np.sum(ct * v)

    if second:
        fwd = jax_threadmap.kernel((S((3,), F64), RESIDUALS))(fwd)
        bwd = jax_threadmap.kernel((S((3,), F64), S((), F64)))(bwd)

        @fwd.defjvp
        def fwd_jvp(x, a, dx, da):
            record("fwd_jvp")
            dv = g1(x) * dx
            return g(x) * da + a * dv, (g2(x) * a * dx + g1(x) * da, dv)

        @fwd.defvjp
        def fwd_vjp(x, a, c):
            record("fwd_vjp")
            c_out, (c_d, c_v) = c
            return (
                c_out * g1(x) * a + c_d * g2(x) * a + c_v * g1(x),
                np.sum(c_out * g(x) + c_d * g1(x)),
            )

        @bwd.defjvp
        def bwd_jvp(res, ct, dres, dct):
            record("bwd_jvp")
            (d, v), (dd, dv) = res, dres
            return dct * d + ct * dd, np.sum(dct * v + ct * dv)

        @bwd.defvjp
        def bwd_vjp(res, ct, c):
            record("bwd_vjp")
            d, v = res
            c_x, c_a = c
            return (c_x * ct, c_a * ct), c_x * d + c_a * v

    if jvp in ("residuals", "directions"):

        def f_jvp_res(res, tx, ta):
            record("f_jvp_res")
            d, v = res
            return d * tx + v * np.asarray(ta)[..., None]

        if second:
            f_jvp_res = jax_threadmap.kernel(S((3,), F64))(f_jvp_res)

            @f_jvp_res.defjvp
            def f_jvp_res_jvp(res, tx, ta, dres, dtx, dta):
                record("f_jvp_res_jvp")
                (d, v), (dd, dv) = res, dres
                return dd * tx + d * dtx + dv * ta + v * dta

            @f_jvp_res.defvjp
            def f_jvp_res_vjp(res, tx, ta, ct):
                record("f_jvp_res_vjp")
                d, v = res
                return (ct * tx, ct * ta), ct * d, np.sum(ct * v)

        f.defjvp(fwd, f_jvp_res, residuals=RESIDUALS, directions=jvp == "directions")
    elif jvp:

        @jax_threadmap.kernel(S((3,), F64))
        def f_jvp(x, a, tx, ta):
            record("f_jvp")
            return g1(x) * a * tx + g(x) * ta

        @f_jvp.defjvp
        def f_jvp_jvp(x, a, tx, ta, dx, da, dtx, dta):
            record("f_jvp_jvp")
            return (
                g2(x) * dx * a * tx + g1(x) * (da * tx + a * dtx + dx * ta) + g(x) * dta
            )

        @f_jvp.defvjp
        def f_jvp_vjp(x, a, tx, ta, ct):
            record("f_jvp_vjp")
            return (
                ct * (g2(x) * a * tx + g1(x) * ta),
                np.sum(ct * g1(x) * tx),
                ct * g1(x) * a,
                np.sum(ct * g(x)),
            )

        f.defjvp(f_jvp)
    f.defvjp(fwd, bwd, residuals=RESIDUALS)
    return f


def reference(name="sin"):
    _, g = FUNCTIONS[name]
    return lambda x, a: g(x) * a


def values(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).uniform(-1.5, 1.5, shape))


def assert_close(got, want, dtype=None):
    """``got`` is ``want`` to round-off: the same trees, shapes, dtypes (and
    ``dtype``, when given)."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert dtype is None or g.dtype == dtype
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def operands(levels, sizes, seed):
    """x and a for ``levels`` (in_axes of (x, a) per level, innermost first)."""
    shapes = [[3], []]
    for axes, size in zip(levels, sizes, strict=True):
        for k, ax in enumerate(axes):
            if ax is not None:
                shapes[k].insert(ax % (len(shapes[k]) + 1), size)
    return values(tuple(shapes[0]), seed), values(tuple(shapes[1]), seed + 1)


@st.composite
def nestings(draw, max_depth=3):
    """One to ``max_depth`` vmap levels over (x, a), at random axes."""
    depth = draw(st.integers(1, max_depth))
    levels, ndims = [], [1, 0]
    for _ in range(depth):  # innermost first
        axes = [draw(st.none() | st.integers(-(n + 1), n)) for n in ndims]
        if axes[0] is None and axes[1] is None:
            axes[0] = 0
        levels.append(tuple(axes))
        ndims = [n + (ax is not None) for n, ax in zip(ndims, axes, strict=True)]
    return levels, [draw(st.integers(1, 3)) for _ in levels]


def hvp(loss):
    def run(x, a):
        v = (jnp.cos(x), 0.7 * jnp.cos(a))
        return jax.jvp(jax.grad(loss, (0, 1)), (x, a), v)[1]

    return run
