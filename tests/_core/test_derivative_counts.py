"""How often each derivative runs a kernel's expensive part, against JAX's recipe.

One element of ``f(x, a) = exp(x) * a`` (x of ``d`` entries, a scalar): the
expensive part is ``exp`` (a factorization, in real kernels), counted per
element on the host. Ours: ``fwd`` computes it and returns it as a residual;
``defjvp(fwd, jvp, ...)`` and ``defvjp(fwd, bwd, ...)`` share it, and ``fwd``
has such rules of its own for the second order. JAX's recipe, for the same
transform: ``exp`` as a ``jax.custom_jvp`` function around ``jax.pure_callback``
(its rule calls it again, for any order), and for reverse mode also a
``jax.custom_vjp`` whose ``fwd`` keeps it. Each transform runs per element under
``jax.jit`` and two nested ``vmap`` s (``a`` not batched at the inner one), is
compared with ``jax.numpy``, and counts no more expensive calls per element than
the better recipe (docs/derivatives-residuals.md has the table).
"""

import dataclasses
import functools
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import kname, threadmap_eqns

import jax_threadmap
from jax_threadmap._core import lowering as _lowering
from jax_threadmap._jax import mlir as _mlir

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("x64")]

S = jax.ShapeDtypeStruct
F64 = jnp.float64
OUTER, INNER = 2, 3  # the two vmap levels' sizes


class Counter:
    """Elements whose expensive part ran (from any thread)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0

    def exp(self, x, d):
        with self.lock:
            self.count += x.size // d  # one per element of a chunk or batch
        return np.exp(x)


def ours(d, counter, vectorized=False, jvps=None):
    """The kernel, with rules that run ``exp`` in ``fwd`` only (at any order);
    with a ``jvps`` counter, its ``jvp`` takes the directions (and counts its
    elements)."""
    vec, res = S((d,), F64), (S((d,), F64), S((), F64))

    def kernel(result):
        return jax_threadmap.kernel(result, vectorized=vectorized)

    @kernel(vec)
    def f(x, a):
        return counter.exp(x, d) * a

    @kernel((vec, res))
    def fwd(x, a):
        e = counter.exp(x, d)
        return e * _col(a, e), (e, a)

    def jvp(res, tx, ta):
        e, a = res
        return e * (_col(a, e) * tx + _col(ta, e))

    @kernel((vec, S((), F64)))
    def bwd(res, ct):
        e, a = res
        return ct * e * _col(a, e), np.sum(ct * e, axis=-1)

    def fwd_fwd(x, a):
        out, res = fwd.fn(x, a)
        return (out, res), res

    def fwd_jvp(res, tx, ta):
        e, a = res
        return jvp(res, tx, ta), (e * tx, ta)

    @bwd.defjvp  # no expensive part: it has the residuals
    def bwd_jvp(res, ct, dres, dct):
        (e, a), (de, da) = res, dres
        return (
            (dct * e + ct * de) * _col(a, e) + ct * e * _col(da, e),
            np.sum(dct * e + ct * de, axis=-1),
        )

    def jvp_directions(res, tx, ta):
        e, a = res
        jvps.exp(e, d)  # counts the elements
        chunk, lead = e.shape[:-1], (1,) * (tx.ndim - e.ndim)  # directions' axes
        a = np.reshape(a, chunk + lead + (1,))
        return e.reshape(chunk + lead + (d,)) * (a * tx + np.asarray(ta)[..., None])

    fwd.defjvp(fwd_fwd, fwd_jvp, residuals=res)
    if jvps is None:
        f.defjvp(fwd, jvp, residuals=res)
    else:
        f.defjvp(fwd, jvp_directions, residuals=res, directions=True)
    f.defvjp(fwd, bwd, residuals=res)
    return f


def _col(a, like):
    """``a`` against ``like``'s last axis (a chunk's scalars as a column)."""
    return np.asarray(a)[..., None] if np.ndim(like) > np.ndim(a) else a


def callback_exp(d, counter):
    """``exp`` on the host, through ``jax.pure_callback`` (batched by vmap)."""
    return lambda x: jax.pure_callback(
        lambda x: counter.exp(x, d), S(x.shape, x.dtype), x, vmap_method="broadcast_all"
    )


def recipe_jvp(d, counter):
    """``exp`` as ``custom_jvp`` around ``pure_callback``, its rule calling it."""
    exp = jax.custom_jvp(callback_exp(d, counter))

    @exp.defjvp
    def exp_jvp(primals, tangents):
        e = exp(primals[0])
        return e, e * tangents[0]

    return lambda x, a: exp(x) * a


def recipe_vjp(d, counter):
    """``custom_vjp`` whose ``fwd`` keeps the callback's ``exp`` for ``bwd``."""
    exp = callback_exp(d, counter)

    @jax.custom_vjp
    def f(x, a):
        return exp(x) * a

    def f_fwd(x, a):
        e = exp(x)
        return e * a, (e, a)

    def f_bwd(res, ct):
        e, a = res
        return ct * e * a, jnp.sum(ct * e)

    f.defvjp(f_fwd, f_bwd)
    return f


def loss(f):
    return lambda x, a: jnp.sum(jnp.sin(f(x, a)))


def applied(make, n=5):
    """``make(f)(x, a)`` gives a linear function and its input: applied ``n``
    times, to ``n`` multiples of that input."""

    def run(f):
        def per_element(x, a):
            lin, arg = make(f)(x, a)
            return [lin(*(i * v for v in arg)) for i in range(1, n + 1)]

        return per_element

    return run


#: Per element: the transform of one element's f (x (d,), a ()).
TRANSFORMS = {
    "jvp": lambda f: lambda x, a: jax.jvp(f, (x, a), (jnp.cos(x), 0.5 * a)),
    "jacfwd": lambda f: jax.jacfwd(f),  # d directions: x's entries
    "linearize, 5 applications": applied(
        lambda f: lambda x, a: (jax.linearize(f, x, a)[1], (jnp.cos(x), a))
    ),
    "grad": lambda f: jax.grad(loss(f), (0, 1)),
    "vjp, 5 applications": applied(
        lambda f: lambda x, a: (jax.vjp(f, x, a)[1], (jnp.cos(x),))
    ),
    "hessian": lambda f: jax.hessian(loss(f), (0, 1)),
    "jvp of grad": lambda f: (
        lambda x, a: jax.jvp(jax.grad(loss(f), (0, 1)), (x, a), (jnp.cos(x), 0.5 * a))
    ),
    # A Gauss-Newton step's derivatives: both run fwd on the same operands.
    "jacfwd and grad": lambda f: (
        lambda x, a: (jax.jacfwd(f)(x, a), jax.grad(loss(f), (0, 1))(x, a))
    ),
}
#: The transforms a custom_vjp recipe supports (reverse mode, first order).
REVERSE = ("grad", "vjp, 5 applications")


def per_element_run(transform, f, d):
    """Under jit and two vmaps: the counts' inputs and the jitted transform."""
    fn = jax.vmap(jax.vmap(TRANSFORMS[transform](f), (0, None)), (0, 0))
    rng = np.random.default_rng(d)
    x = jnp.asarray(rng.uniform(-1, 1, (OUTER, INNER, d)))
    a = jnp.asarray(rng.uniform(0.5, 1.5, (OUTER,)))
    return jax.jit(fn), (x, a)


def count(transform, f, counter, d):
    run, args = per_element_run(transform, f, d)
    jax.block_until_ready(run(*args))  # compiles, runs once
    counter.count = 0
    got = jax.block_until_ready(run(*args))
    return counter.count / (OUTER * INNER), got


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@functools.cache
def recipe_counts(transform, d):
    """``(JAX's better recipe's expensive calls per element, jax.numpy's
    result)``: the same for every kernel of ours (per element or vectorized), so
    computed once per transform and ``d`` (three compiles each)."""
    counter = Counter()
    recipes = [recipe_jvp] + ([recipe_vjp] if transform in REVERSE else [])
    theirs = [count(transform, recipe(d, counter), counter, d)[0] for recipe in recipes]
    run, args = per_element_run(transform, lambda x, a: jnp.exp(x) * a, d)
    return min(theirs), jax.block_until_ready(run(*args))


def counts(transform, d, vectorized=False):
    """``(ours, JAX's recipe)`` expensive calls per element, the results checked."""
    counter = Counter()
    mine, got = count(transform, ours(d, counter, vectorized), counter, d)
    theirs, want = recipe_counts(transform, d)
    assert_close(got, want)
    return mine, theirs


CASES = [(t, 3) for t in TRANSFORMS] + [("jacfwd", 16)]


@pytest.mark.parametrize("vectorized", [False, True], ids=["per-element", "vectorized"])
@pytest.mark.parametrize(
    "transform, d", CASES, ids=[f"{t}-{d}" if d != 3 else t for t, d in CASES]
)
def test_expensive_calls_per_element_at_most_jax_recipe(transform, d, vectorized):
    mine, theirs = counts(transform, d, vectorized)
    assert mine <= theirs, (transform, mine, theirs)
    assert mine == 1  # fwd once per element, whatever the transform


@pytest.mark.parametrize("vectorized", [False, True], ids=["per-element", "vectorized"])
@pytest.mark.parametrize("d", [3, 16])
def test_directions_reach_jvp_in_one_call_per_element(d, vectorized):
    """``defjvp(..., directions=True)``: jacfwd's ``d`` directions reach
    ``jvp`` as a leading axis, one call per element (each element in one
    chunk, vectorized); ``fwd`` runs once per element too."""
    counter, jvps = Counter(), Counter()
    run, args = per_element_run("jacfwd", ours(d, counter, vectorized, jvps), d)
    jax.block_until_ready(run(*args))
    counter.count = jvps.count = 0
    got = jax.block_until_ready(run(*args))
    reference = per_element_run("jacfwd", lambda x, a: jnp.exp(x) * a, d)[0]
    assert_close(got, reference(*args))
    assert (counter.count, jvps.count) == (OUTER * INNER, OUTER * INNER)


def test_identical_equations_in_one_block_run_once():
    """Under jit, an equation with the same kernel, params and operands as one
    before it in the same block reuses its results (one map); other operands,
    or another block (a cond branch), run their own."""
    calls = Counter()
    # The modules lowered before: other tests' programs may still be alive.
    before = {id(m) for m in list(_lowering._LOWERED.keys())}

    @jax_threadmap.kernel(S((3,), F64))
    def f(x):
        return calls.exp(x, 3)

    def program(x, y):
        fs = jax.vmap(f)
        twice = fs(x) + 2 * fs(x)  # one map
        other = fs(y)  # another
        branch = jax.lax.cond(x[0, 0] > -2, lambda: fs(x), lambda: x)
        return twice, other, branch

    x, y = jnp.linspace(-1, 1, 12).reshape(4, 3), jnp.ones((4, 3))
    run = jax.jit(program)
    got = jax.block_until_ready(run(x, y))  # compiles, runs once
    calls.count = 0
    got = jax.block_until_ready(run(x, y))
    assert calls.count == 3 * 4  # f(x), f(y), and f(x) in the branch
    assert_close(got, (3 * jnp.exp(x), jnp.exp(y), jnp.exp(x)))
    # What the lowering kept to find them goes with the program's module.
    ours = [
        weakref.ref(m) for m in list(_lowering._LOWERED.keys()) if id(m) not in before
    ]
    assert ours
    del run
    jax.clear_caches()
    gc.collect()
    assert [r for r in ours if r() is not None] == []


def test_operands_computed_alike_run_once():
    """jax.jacfwd and jax.grad each build the operand ``m`` from ``p`` anew
    (two equal computations of the same values): under jit, ``fwd`` runs once
    for both, as on one operand (a Gauss-Newton step as users write it)."""
    n, d = 6, 3
    counter = Counter()

    @jax_threadmap.kernel(S((d,), F64))
    def solve(m, b):
        return np.linalg.solve(m, b)

    def fwd(m, b):
        inv = np.linalg.inv(m)
        counter.exp(b, d)  # counts the element
        return inv @ b, (inv, inv @ b)

    def jvp(res, dm, db):
        inv, x = res
        return inv @ (db - dm @ x)

    def bwd(res, ct):
        inv, x = res
        ct_b = inv.T @ ct
        return -np.outer(ct_b, x), ct_b

    res = (S((d, d), F64), S((d,), F64))
    solve.defjvp(fwd, jvp, residuals=res)
    solve.defvjp(fwd, bwd, residuals=res)
    rng = np.random.default_rng(0)
    A, W = (jnp.asarray(rng.normal(size=(n, d, d)) + 3 * np.eye(d)) for _ in "AW")
    b, y = (jnp.asarray(rng.normal(size=(n, d))) for _ in "by")

    def step(solve):
        def residual(p):
            m = A + p[0] * jnp.eye(d) + p[1] * W  # built anew by each transform
            return jax.vmap(solve)(m, b) - y

        return lambda p: (
            jax.jacfwd(residual)(p),
            jax.grad(lambda p: 0.5 * jnp.sum(residual(p) ** 2))(p),
        )

    p = jnp.array([0.5, 0.25])
    eqns = threadmap_eqns(jax.make_jaxpr(step(solve))(p).jaxpr)
    assert [kname(e) for e in eqns].count("fwd") == 2  # two equations...
    run = jax.jit(step(solve))
    jax.block_until_ready(run(p))  # compiles, runs once
    counter.count = 0
    got = jax.block_until_ready(run(p))
    assert counter.count == n  # ...that run as one
    # The reference jitted too: one compile, not one per eager operation.
    want = jax.jit(step(lambda m, b: jnp.linalg.solve(m, b[:, None])[:, 0]))(p)
    assert_close(got, want)


def test_operands_computed_otherwise_run_their_own():
    """Only equal operations of the same values make equal operands: other
    constants, other result types (a convert has no attribute to tell), other
    operations, and host calls (each its own values) run their own maps."""
    calls = Counter()

    @jax_threadmap.kernel(S((3,), F64))
    def f(x):
        return calls.exp(x, 3)

    def noise(x):
        return np.asarray(x) + np.random.default_rng().normal(size=x.shape)

    def program(x):
        fs = jax.vmap(f)
        host = [jax.pure_callback(noise, S(x.shape, F64), x) for _ in range(2)]
        return (
            *(fs(x + 1), fs(x + 1), fs(x + 2), fs(2 * x), fs(x + x)),
            *(fs(x.astype(t).astype(F64)) for t in (jnp.float32, jnp.float16)),
            *((fs(h), h) for h in host),
        )

    x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    run = jax.jit(program)
    jax.block_until_ready(run(x))
    calls.count = 0
    got = jax.block_until_ready(run(x))
    assert calls.count == 8 * 4  # x + 1 once
    want = [x + 1, x + 1, x + 2, 2 * x, 2 * x]
    want += [x.astype(t).astype(F64) for t in (jnp.float32, jnp.float16)]
    assert_close(got[:7], tuple(map(jnp.exp, want)))
    assert_close(got[7:], tuple((jnp.exp(h), h) for _, h in got[7:]))


def test_comparing_operands_is_bounded(monkeypatch):
    """The walk that compares two operands stops after ``_MOST_PAIRS`` pairs
    of values: beyond it, the operands are told apart (their own maps)."""
    monkeypatch.setattr(_mlir, "_MOST_PAIRS", 6)
    calls = Counter()

    @jax_threadmap.kernel(S((3,), F64))
    def f(x):
        return calls.exp(x, 3)

    def deep(x, depth):
        for _ in range(depth):
            x = jnp.sin(x) + 1.0  # sin, a constant, add: 3 pairs per step
        return x

    def program(x):
        fs = jax.vmap(f)
        return fs(deep(x, 1)), fs(deep(x, 1)), fs(deep(x, 3)), fs(deep(x, 3))

    x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    got = jax.block_until_ready(jax.jit(program)(x))
    assert calls.count == 3 * 4  # deep(x, 1) once; deep(x, 3) twice
    assert_close(got, tuple(jnp.exp(deep(x, d)) for d in (1, 1, 3, 3)))


@dataclasses.dataclass(frozen=True)
class Reciprocal:
    """``1 / (x * scale)``: ``Reciprocal(0.0) == Reciprocal(-0.0)``, and they
    compute ``inf`` and ``-inf``."""

    scale: float

    def __call__(self, x):
        with np.errstate(divide="ignore"):
            return 1.0 / (x * self.scale)


def test_kernels_that_compare_equal_are_told_apart_by_identity():
    """As docs/faq.md says, kernels are compared by identity: two that compare
    equal on the same operand in one jit run their own maps."""
    pos, neg = Reciprocal(0.0), Reciprocal(-0.0)
    assert pos == neg and hash(pos) == hash(neg)
    kernels = [jax_threadmap.kernel(S((), F64))(k) for k in (pos, neg)]

    def program(x):
        def bare(e):
            return [jax_threadmap.threadmap(k, S((), F64), e) for k in (pos, neg)]

        return (*jax.vmap(bare)(x), *(jax.vmap(k)(x) for k in kernels))

    x, inf = jnp.ones(4), np.full(4, np.inf)
    for run in (program, jax.jit(program)):
        np.testing.assert_array_equal(jnp.stack(run(x)), [inf, -inf, inf, -inf])


def test_reuse_leaves_checkpoint_recomputing():
    """``jax.checkpoint``'s recomputation is no identical equation (its operands
    pass an optimization barrier): under ``jax.value_and_grad``, ``fwd`` runs in
    the forward pass and again in the backward one; without it, once."""
    counter = Counter()
    fs = jax.vmap(ours(3, counter))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(-1, 1, (OUTER, 3)))
    a = jnp.asarray(rng.uniform(0.5, 1.5, (OUTER,)))
    want = jax.value_and_grad(loss(lambda x, a: jnp.exp(x) * a[:, None]), (0, 1))(x, a)
    for per_element, g in ((1, loss(fs)), (2, jax.checkpoint(loss(fs)))):
        run = jax.jit(jax.value_and_grad(g, (0, 1)))
        jax.block_until_ready(run(x, a))  # compiles, runs once
        counter.count = 0
        got = jax.block_until_ready(run(x, a))
        assert counter.count == per_element * OUTER
        assert_close(got, want)


def test_programs_lowered_at_once_in_two_threads_share_nothing(monkeypatch):
    """Two threads lowering their programs at the same time (both inside a
    lowering before either goes on): each finds its own block, and reuses only
    its own program's results (one map for its two identical equations)."""
    both_inside = threading.Barrier(2, timeout=120)
    waited = set()
    lower = _lowering._lower

    def paused(*args, **params):
        if threading.current_thread() not in waited:
            waited.add(threading.current_thread())
            both_inside.wait()
        return lower(*args, **params)

    monkeypatch.setattr(_lowering, "_lower", paused)
    counters, got, errors = [Counter(), Counter()], {}, []

    def run(k, x):
        def exp(v):
            return counters[k].exp(v, 3)

        kernel = jax.vmap(lambda e: jax_threadmap.threadmap(exp, S((3,), F64), e))
        try:
            f = jax.jit(lambda x: (kernel(x), kernel(x + 1), kernel(x)))
            got[k] = jax.block_until_ready(f(x))  # (counted once run)
        except Exception as e:  # reported below
            errors.append(e)

    xs = [jnp.linspace(-1, 1, 12).reshape(4, 3), jnp.ones((4, 3))]
    threads = [threading.Thread(target=run, args=(k, x)) for k, x in enumerate(xs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, x in enumerate(xs):
        assert counters[k].count == 2 * 4  # x and x + 1: two maps of 4
        assert_close(got[k], (jnp.exp(x), jnp.exp(x + 1), jnp.exp(x)))


if __name__ == "__main__":  # the table of docs/derivatives-residuals.md
    jax.config.update("jax_enable_x64", True)
    print("| Transform (per element) | ours | JAX's recipe |\n|---|---|---|")
    for transform, d in CASES:
        name = f"`{transform}`" + (
            f" ({d} directions)" if "jacfwd" in transform else ""
        )
        print("| {} | {:g} | {:g} |".format(name, *counts(transform, d)))
