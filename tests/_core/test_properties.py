"""Property test: every path that stores, sums or differentiates, against jax.numpy.

Hypothesis draws a nested vmap layout (1-4 levels, ``in_axes`` ``None`` or
negative, ``out_axes``), an operand pytree (empty tuples, lists and dicts, with or
without a leaf), whether the kernel is vectorized (and its chunk length), the
executor (the shared pool, pools of 1 and 2 threads, a process pool, which ships
chunks to other processes) and ``jit``. For each draw it checks the values,
``jax.grad`` through a kernel with ``defvjp`` (also under one more vmap, as
per-example gradients are) and ``jax.jvp`` through its
``defjvp``, bit for bit against the same function in ``jax.numpy`` under the same
vmaps. Every value is a small integer, so every sum is exact in float32 and the
order in which the host sums does not change a bit.

It draws 120 examples in CI (``JAX_THREADMAP_TEST_EXAMPLES=full``) and 30 otherwise,
from the seed the run prints; ``JAX_THREADMAP_TEST_PROPERTY_EXAMPLES=N`` runs N, and
``--hypothesis-seed=S`` draws other ones.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import worker_kernels as wk
from helpers import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_threadmap

_EXAMPLES = int(os.environ.get("JAX_THREADMAP_TEST_PROPERTY_EXAMPLES", "0"))
_SETTINGS = settings(
    max_examples=_EXAMPLES or examples(120),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

OUT = (
    jax.ShapeDtypeStruct((2,), jnp.float32),
    jax.ShapeDtypeStruct((), jnp.float32),
)
CORES = ((2,), (), (3,))  # x, w, y: one element's shapes

#: Operand pytrees for ``extra``: a function of y (3,) -> the pytree.
EXTRAS = {
    "()": lambda y: (),
    "[]": lambda y: [],
    "{}": lambda y: {},
    "[()]": lambda y: [()],
    "{e: (), f: []}": lambda y: {"e": (), "f": []},
    "{y, e: ()}": lambda y: {"y": y, "e": ()},
    "((), [y])": lambda y: ((), [y]),
}
WITH_Y = {"{y, e: ()}", "((), [y])"}


def reference(x, w, extra):
    """The kernel in jax.numpy, for one element."""
    ys = jax.tree_util.tree_leaves(extra)
    s = ys[0].sum() if ys else 0.0
    return x * w + s, (x * x).sum() * w


@st.composite
def layouts(draw):
    """``(sizes, levels)``: the vmap levels outermost first, each
    ``(in_axes of x, w, y; out_axes of a, b)``."""
    depth = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 3)) for _ in range(depth)]
    ndims = [len(c) for c in CORES]
    out_ndims = [1, 0]
    levels = []
    for _ in range(depth):  # innermost first
        ins = tuple(draw(st.none() | st.integers(-(n + 1), n)) for n in ndims)
        outs = tuple(draw(st.integers(-(m + 1), m)) for m in out_ndims)
        levels.append((ins, outs))
        ndims = [n + (a is not None) for n, a in zip(ndims, ins, strict=True)]
        out_ndims = [m + 1 for m in out_ndims]
    return sizes, levels[::-1]


def nest(fn, sizes, levels):
    for size, (ins, outs) in zip(sizes[::-1], levels[::-1], strict=True):
        fn = jax.vmap(
            fn, in_axes=ins, out_axes=outs, axis_size=size
        )  # innermost level first
    return fn


def operand_shapes(sizes, levels):
    shapes = [list(c) for c in CORES]
    for size, (ins, _) in zip(sizes[::-1], levels[::-1], strict=True):
        for k, a in enumerate(ins):
            if a is not None:
                shapes[k].insert(a % (len(shapes[k]) + 1), size)
    return [tuple(s) for s in shapes]


def small_ints(rng, shape):
    return rng.integers(-3, 4, shape).astype(np.float32)


def make_kernel(vectorized, executor):
    if vectorized is False:
        fn, jvp, vjp = wk.prop_kernel, wk.prop_jvp, wk.prop_vjp
    else:
        fn, jvp, vjp = wk.prop_kernel_chunk, wk.prop_jvp_chunk, wk.prop_vjp_chunk
    k = jax_threadmap.kernel(OUT, vectorized=vectorized, executor=executor)(fn)
    k.defjvp(jvp)
    k.defvjp(vjp)
    return k


def assert_exact(got, want):
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def executors(spawn_pool):
    return {"shared": None, "1": 1, "2": 2, "process pool": spawn_pool}


@pytest.mark.long
@pytest.mark.timeout(900)  # ~1 min on 2 quiet cores; much more on a loaded machine
@_SETTINGS
@given(
    layout=layouts(),
    extra=st.sampled_from(sorted(EXTRAS)),
    vectorized=st.sampled_from([False, True, 1, 2, 3]),
    executor=st.sampled_from(["shared", "1", "2", "process pool"]),
    jit=st.sampled_from([True, True, True, False]),  # eager: fewer, costs compiles
    per_example=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_values_grad_and_jvp_match_jax_numpy(
    executors, layout, extra, vectorized, executor, jit, per_example, seed
):
    sizes, levels = layout
    # y's in_axes apply to the whole of ``extra`` (only y, where it has one).
    kern = make_kernel(vectorized, executors[executor])
    rng = np.random.default_rng(seed)
    sx, sw, sy = operand_shapes(sizes, levels)
    args = (
        small_ints(rng, sx),
        small_ints(rng, sw),
        EXTRAS[extra](small_ints(rng, sy)),
    )
    tangents = jax.tree_util.tree_map(lambda a: small_ints(rng, np.shape(a)), args)
    out_shapes = [
        np.shape(o) for o in jax.eval_shape(nest(reference, sizes, levels), *args)
    ]
    cts = [small_ints(rng, s) for s in out_shapes]
    argnums = (0, 1, 2) if extra in WITH_Y else (0, 1)

    def checks(fn):
        """Values, the gradient of a loss that weighs every output, and a JVP."""

        def loss(*a):
            out_a, out_b = fn(*a)
            return (out_a * cts[0]).sum() + (out_b * cts[1]).sum()

        grad = jax.grad(loss, argnums)
        if per_example:  # a vmap around the gradient: one more level, not summed
            grad = jax.vmap(grad, in_axes=(0, None, None))

        def run(args, tangents):
            x, w, e = args
            return (
                fn(*args),
                grad(jnp.stack([x, x[::-1] - 1]) if per_example else x, w, e),
                jax.jvp(fn, args, tangents),
            )

        return run

    want_fn = checks(nest(reference, sizes, levels))
    got_fn = checks(nest(kern, sizes, levels))
    # One program for all the checks (and the reference, under jit): each jit
    # costs a compile, the most expensive part of an example.
    if jit:
        got, want = jax.jit(lambda *a: (got_fn(*a), want_fn(*a)))(args, tangents)
    else:
        want = jax.jit(want_fn)(args, tangents)
        got = got_fn(args, tangents)
    assert_exact(got, want)


@pytest.mark.parametrize("vectorized", [True, 2])
@pytest.mark.parametrize("executor", [None, 1, 2])
def test_vectorized_vjp_sums_over_levels_outside_the_chunk(vectorized, executor):
    """Issue 16: cotangents summed over a level that a chunk holds fixed were
    assigned, not added, so each chunk overwrote the last one's share."""

    @jax_threadmap.kernel(
        jax.ShapeDtypeStruct((), jnp.float32), vectorized=vectorized, executor=executor
    )
    def mul(x, y):
        return x * y

    @mul.defvjp
    def mul_vjp(x, y, ct):
        return ct * y, ct * x

    def nest4(fn):  # outer first: x batched at levels 0, 2, 3; y at level 1 only
        for ax in reversed([(0, None), (None, 0), (0, None), (0, None)]):
            fn = jax.vmap(fn, in_axes=ax)
        return fn

    x, y = jnp.ones((2, 2, 2)), jnp.arange(1.0, 4.0)
    for argnums in (0, 1):
        got = jax.grad(lambda x, y: nest4(mul)(x, y).sum(), argnums)(x, y)
        want = jax.grad(lambda x, y: nest4(jnp.multiply)(x, y).sum(), argnums)(x, y)
        assert_exact(got, want)


@pytest.mark.parametrize(
    "extra", [(), [], {}, [()], {"e": ()}], ids=["()", "[]", "{}", "[()]", "{e: ()}"]
)
@pytest.mark.parametrize("vmapped", [False, True])
def test_empty_containers_among_operands(extra, vmapped):
    """Issue 16: an empty tuple among the operands made the generated element loop
    a SyntaxError."""
    out = jax.ShapeDtypeStruct((), jnp.float32)
    seen = []

    def kern(x, e):
        seen.append(e)
        return x + 1

    def f(x):
        return jax_threadmap.threadmap(kern, out, x, extra)

    x = jnp.arange(3.0)
    got = jax.vmap(f)(x) if vmapped else f(x[1])
    np.testing.assert_array_equal(got, (x + 1) if vmapped else x[1] + 1)
    assert seen and all(e == extra and type(e) is type(extra) for e in seen)
