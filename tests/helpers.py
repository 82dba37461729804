"""Helpers shared by the tests (fixtures live in conftest.py)."""

import jax
import jax.extend
import numpy as np
from hypothesis import strategies as st

#: One element's core shapes of x and z in the nested-vmap property tests.
X_CORE, Z_CORE = (2,), (3,)


def count_eqns(jaxpr, name: str) -> int:
    """Counts equations of primitive ``name``, sub-jaxprs included."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count_eqns(sub, name)
    return n


def random_values(rng, shape, dtype):
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype == "int32":
        return rng.integers(-50, 50, shape).astype(np.int32)
    if dtype == "complex64":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(
            np.complex64
        )
    return rng.standard_normal(shape).astype(dtype)


@st.composite
def nestings(draw, max_depth=4):
    depth = draw(st.integers(1, max_depth))
    sizes = [draw(st.integers(1, 4)) for _ in range(depth)]
    # ndims of x, y["a"], z inside the innermost level; grows outward as axes are added.
    ndims = [len(X_CORE), 0, len(Z_CORE)]
    out_ndims = [len(X_CORE), 0]
    in_axes, out_axes = [], []
    for _level in reversed(range(depth)):
        axes = [draw(st.none() | st.integers(-(n + 1), n)) for n in ndims]
        if all(a is None for a in axes):
            k = draw(st.integers(0, 2))
            axes[k] = draw(st.integers(-(ndims[k] + 1), ndims[k]))
        outs = [draw(st.integers(-(m + 1), m)) for m in out_ndims]
        in_axes.append(axes)
        out_axes.append(outs)
        ndims = [n + (a is not None) for n, a in zip(ndims, axes, strict=True)]
        out_ndims = [m + 1 for m in out_ndims]
    # in_axes/out_axes are listed innermost level first.
    return sizes, in_axes, out_axes


def build(fn, sizes, in_axes, out_axes):
    depth = len(sizes)
    for level in range(depth):  # innermost first
        ax_x, ax_y, ax_z = in_axes[level]
        o1, o2 = out_axes[level]
        fn = jax.vmap(
            fn,
            in_axes=(ax_x, {"a": ax_y}, ax_z),
            out_axes=(o1, {"s": o2}),
            axis_size=sizes[depth - 1 - level],
        )
    return fn


def make_inputs(rng, sizes, in_axes, dtype):
    depth = len(sizes)
    shapes = [list(X_CORE), [], list(Z_CORE)]
    for level in range(depth):  # innermost first: insert its axis
        size = sizes[depth - 1 - level]
        for k, a in enumerate(in_axes[level]):
            if a is not None:
                n = len(shapes[k]) + 1
                shapes[k].insert(a % n, size)
    x, ya, z = (random_values(rng, tuple(s), dtype) for s in shapes)
    return x, {"a": ya}, z


def assert_trees_close(actual, expected, dtype):
    la, ta = jax.tree_util.tree_flatten(actual)
    le, te = jax.tree_util.tree_flatten(expected)
    assert ta == te
    for a, e in zip(la, le, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape)
        if dtype in ("int32", "bool"):
            np.testing.assert_array_equal(a, e)
        else:
            np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
