"""VJPs with residuals: ``kernel.defvjp(fwd, bwd, residuals=...)``.

``fwd`` returns residuals beside the output, ``bwd`` gets them instead of the
primals. Every derivative is compared with the same function in jax.numpy under
the same vmaps (and jit), and the kernels' calls are counted after the results
are awaited: reverse mode runs ``fwd`` once per element and never the kernel.
"""

import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from elementwise import (
    F64,
    FUNCTIONS,
    RESIDUALS,
    RTOL,
    S,
    assert_close,
    hvp,
    nestings,
    operands,
    reference,
    values,
)
from elementwise import residual_kernel as make_kernel
from helpers import count_eqns, examples, kname, nest, threadmap_eqns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_threadmap
from jax_threadmap import KernelError

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("x64")]

# --- first order: property test against jax.numpy --------------------------------


FIRST_ORDER = {
    "grad": lambda f: jax.grad(lambda x, a: jnp.sum(jnp.sin(f(x, a))), (0, 1)),
    "vjp": lambda f: lambda x, a: jax.vjp(f, x, a)[1](jnp.cos(f(x, a))),
    "jacrev": lambda f: jax.jacrev(f, (0, 1)),
    "jvp": lambda f: lambda x, a: jax.jvp(f, (x, a), (jnp.cos(x), jnp.sin(a))),
    "jacfwd": lambda f: jax.jacfwd(f, (0, 1)),
    "linearize": lambda f: lambda x, a: jax.linearize(f, x, a)[1](jnp.cos(x), a),
    # Directions of the tangents alone (folded for directions=True), with a
    # tangent the same for all; then transposed (grad in the tangents).
    "vmap(jvp)": lambda f: (
        lambda x, a: jax.vmap(lambda t: jax.jvp(f, (x, a), (t * jnp.cos(x), a))[1])(
            jnp.arange(1.0, 4.0)
        )
    ),
    "vmap(linearize)": lambda f: (
        lambda x, a: jax.vmap(jax.linearize(f, x, a)[1])(
            jnp.stack([jnp.cos(x), x]), jnp.stack([a, 2 * a])
        )
    ),
    "grad(vmap(jvp))": lambda f: (
        lambda x, a: jax.grad(
            lambda T: jnp.sum(
                jnp.sin(
                    jax.vmap(lambda t: jax.jvp(f, (x, a), (t, jnp.ones_like(a)))[1])(T)
                )
            )
        )(jnp.stack([jnp.cos(x), jnp.sin(x)]))
    ),
}
#: Per function: fwd/bwd alone (reverse mode), and with defjvp(fwd, jvp, ...),
#: with or without directions=True.
FORMS = {"fwd-bwd": False, "fwd-jvp": "residuals", "directions": "directions"}
KERNELS = {
    (name, form): make_kernel(name, jvp=jvp)
    for name in FUNCTIONS
    for form, jvp in FORMS.items()
}


@settings(
    max_examples=examples(24),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    nestings(),
    st.sampled_from(sorted(FUNCTIONS)),
    st.sampled_from(sorted(FIRST_ORDER)),
    st.booleans(),
    st.sampled_from(sorted(FORMS)),
    st.integers(0, 2**16),
)
def test_random_nestings_match_jax_numpy(nesting, name, transform, jit, form, seed):
    levels, sizes = nesting
    x, a = operands(levels, sizes, seed)
    make = FIRST_ORDER[transform]
    if form == "fwd-bwd" and transform not in ("grad", "vjp", "jacrev"):
        form = "fwd-jvp"
    got_fn = make(nest(KERNELS[name, form], levels))
    if jit:
        got_fn = jax.jit(got_fn)
    assert_close(got_fn(x, a), jax.jit(make(nest(reference(name), levels)))(x, a))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_reverse_mode_runs_fwd_once_per_element_and_never_the_kernel(jit):
    calls = []
    f = make_kernel(calls=calls)
    levels = [(0, None), (None, 0), (-1, 0)]  # three levels, a not batched at one
    x, a = operands(levels, [2, 3, 2], 4)
    grad = jax.grad(lambda x, a: jnp.sum(jnp.sin(nest(f, levels)(x, a))), (0, 1))
    got = (jax.jit(grad) if jit else grad)(x, a)
    jax.block_until_ready(got)
    assert sorted(calls) == ["bwd"] * 12 + ["fwd"] * 12  # 2 x 3 x 2 elements
    ref = jax.grad(
        lambda x, a: jnp.sum(jnp.sin(nest(reference(), levels)(x, a))), (0, 1)
    )
    assert_close(got, jax.jit(ref)(x, a))


def test_grad_jaxpr_is_fwd_then_bwd_on_its_residuals_under_three_vmaps():
    f = make_kernel()
    levels = [(0, None), (None, 0), (-1, 0)]
    x, a = operands(levels, [2, 3, 2], 5)

    def loss(x, a):
        return jnp.sum(jnp.sin(nest(f, levels)(x, a)))

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, a).jaxpr
    assert count_eqns(jaxpr, "scan") == count_eqns(jaxpr, "while") == 0
    fwd, bwd = threadmap_eqns(jaxpr)  # one equation each, for every level
    assert (kname(fwd), kname(bwd)) == ("fwd", "bwd")
    spec = fwd.params["spec"]
    assert spec.shape == (2, 3, 2)
    # The residuals are outputs of the fwd equation, batched like its output...
    assert [v.aval.shape for v in fwd.outvars] == [(2, 3, 2, 3)] * 3
    # ...and all that the bwd equation takes besides the cotangent: no primal.
    assert bwd.invars[:2] == fwd.outvars[1:]
    assert len(bwd.invars) == 3
    # Each cotangent is summed on the host over the level at which its operand
    # is not batched (x: the middle one, 1; a: the innermost, 2), never tiled.
    assert bwd.params["spec"].out_sum == ((1,), (2,))
    assert [v.aval.shape for v in bwd.outvars] == [(2, 2, 3), (2, 3)]


def test_vmap_of_grad_keeps_the_outer_level():
    calls = []
    f = make_kernel(calls=calls)
    x, a = values((4, 5, 3), 1), values((4,), 2)

    def grad_a(x, a):  # per outer element: d/da of the inner vmap's sum
        return jax.grad(lambda a: jnp.sum(jnp.cos(jax.vmap(f, (0, None))(x, a))))(a)

    got = jax.jit(jax.vmap(grad_a))(x, a)
    ref = jax.vmap(
        lambda x, a: jax.grad(
            lambda a: jnp.sum(jnp.cos(jax.vmap(reference(), (0, None))(x, a)))
        )(a)
    )(x, a)
    assert_close(got, ref)
    assert sorted(set(calls)) == ["bwd", "fwd"] and calls.count("fwd") == 20


# --- a 3 x 3 solve: fwd factorizes once per element, bwd uses the factor -------------


class Factorizations:
    """Counts the factorizations of the solve kernels (one per np.linalg.inv)."""

    def __init__(self):
        self.count = 0
        self.seen = []

    def inv(self, m):
        self.count += 1
        return np.linalg.inv(m)


def make_solve(counter, *, residuals=True):
    res = (S((3, 3), F64), S((3,), F64))

    @jax_threadmap.kernel(S((3,), F64))
    def solve(m, b):
        return counter.inv(m) @ b

    def solve_fwd(m, b):
        inv = counter.inv(m)
        x = inv @ b
        return x, (inv, x)

    def solve_bwd(res, ct):
        inv, x = res
        counter.seen.append(np.array(inv))
        ct_b = inv.T @ ct
        return -np.outer(ct_b, x), ct_b

    def solve_vjp(m, b, ct):  # the same, without residuals: factorizes again
        inv = counter.inv(m)
        ct_b = inv.T @ ct
        return -np.outer(ct_b, inv @ b), ct_b

    if residuals:
        solve.defvjp(solve_fwd, solve_bwd, residuals=res)
    else:
        solve.defvjp(solve_vjp)
    return solve


def matrices(n, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(n, 3, 3)) + 4 * np.eye(3)), jnp.asarray(
        rng.normal(size=(n, 3))
    )


@pytest.mark.parametrize("residuals", [True, False], ids=["fwd-bwd", "vjp"])
def test_jit_grad_of_a_solve_factorizes_once_per_element(residuals):
    counter = Factorizations()
    solve = make_solve(counter, residuals=residuals)
    m, b = matrices(6, 0)

    def loss(solve):
        return lambda m, b: jnp.sum(jnp.sin(jax.vmap(solve)(m, b)))

    got = jax.jit(jax.grad(loss(solve), (0, 1)))(m, b)
    jax.block_until_ready(got)
    # With residuals: fwd's six inverses and none in bwd; without: the primal's
    # and the VJP kernel's.
    assert counter.count == (6 if residuals else 12)
    if residuals:  # bwd received each element's own factor
        np.testing.assert_allclose(
            np.stack(sorted(counter.seen, key=lambda inv: inv[0, 0])),
            np.stack(sorted(np.linalg.inv(np.asarray(m)), key=lambda v: v[0, 0])),
            rtol=RTOL,
        )
    # The reference, on the host: x = m^-1 b, ct_b = m^-T cos(x), ct_m = -ct_b x^T.
    inv = np.linalg.inv(np.asarray(m))
    x = np.einsum("nij,nj->ni", inv, np.asarray(b))
    ct_b = np.einsum("nji,nj->ni", inv, np.cos(x))
    assert_close(got, (-np.einsum("ni,nj->nij", ct_b, x), ct_b))


# --- forward mode -------------------------------------------------------------------


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.jit(lambda x: jax.jvp(lambda x: f(x, 0.5), (x,), (x,))[1]),
        lambda f: jax.jit(jax.jacfwd(lambda x: f(x, 0.5))),
        lambda f: jax.jit(lambda x: jax.linearize(lambda x: f(x, 0.5), x)[1](x)),
    ],
    ids=["jvp", "jacfwd", "linearize"],
)
def test_forward_mode_without_defjvp_says_so_before_anything_runs(transform):
    # As jax.custom_vjp: fwd and bwd give reverse mode only.
    calls = []
    f = make_kernel(calls=calls)
    with pytest.raises(TypeError) as info:
        transform(f)(values((3,), 0))
    msg = str(info.value)
    assert "has fwd and bwd kernels" in msg and "but no JVP kernel" in msg
    assert "f.defjvp(jvp_kernel)" in msg and "as for jax.custom_vjp" in msg
    assert calls == []  # under jit: refused while compiling


def test_forward_mode_with_defjvp_runs_the_jvp_kernel():
    calls = []
    f = make_kernel(jvp=True, calls=calls)
    x, a = values((4, 3), 2), values((4,), 3)
    t = (jnp.cos(x), jnp.sin(a))
    got = jax.jit(lambda x, a: jax.jvp(jax.vmap(f), (x, a), t))(x, a)
    jax.block_until_ready(got)
    assert_close(got, jax.jvp(jax.vmap(reference()), (x, a), t))
    # fwd gives the output (its residuals wait for a transpose that never comes).
    assert sorted(set(calls)) == ["f_jvp", "fwd"] and len(calls) == 8
    # jax.linear_transpose of that JVP is bwd, on fwd's residuals.
    calls.clear()
    lin = jax.linear_transpose(lambda *t: jax.jvp(jax.vmap(f), (x, a), t)[1], x, a)
    ref = jax.linear_transpose(
        lambda *t: jax.jvp(jax.vmap(reference()), (x, a), t)[1], x, a
    )
    assert_close(lin(jnp.cos(x)), ref(jnp.cos(x)))
    assert sorted(set(calls)) == ["bwd", "fwd"]


# --- second order: fwd and bwd with rules of their own ------------------------------


SECOND_ORDER = {
    "hessian": lambda loss: jax.hessian(loss, (0, 1)),
    "jvp(grad)": hvp,
    "grad(grad)": lambda loss: jax.grad(
        lambda x, a: jnp.sum(jnp.sin(jax.grad(loss)(x, a))), (0, 1)
    ),
    "jacrev(jacrev)": lambda loss: jax.jacrev(jax.jacrev(loss, (0, 1)), (0, 1)),
    # Forward first: fwd gives the output, so it is differentiated too.
    "jacfwd(jacfwd)": lambda loss: jax.jacfwd(jax.jacfwd(loss, (0, 1)), (0, 1)),
    "jacrev(jacfwd)": lambda loss: jax.jacrev(jax.jacfwd(loss, (0, 1)), (0, 1)),
}
#: Per function and JVP form (a JVP kernel on the primals, or over fwd's
#: residuals), the kernel with rules for the second order.
SECOND = {
    (name, form): make_kernel(name, second=True, jvp=FORMS.get(form, True))
    for name in FUNCTIONS
    for form in ("jvp", "fwd-jvp", "directions")
}


def nested_loss(f, levels):
    def loss(x, a):
        y = nest(f, levels)(x, a)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(a) * jnp.sum(y)

    return loss


#: Every transform under jit; eager, those that might run a rule jit drops.
SECOND_ORDER_CASES = [(t, True) for t in SECOND_ORDER] + [
    ("hessian", False),
    ("grad(grad)", False),
    ("jacfwd(jacfwd)", False),
]


@pytest.mark.parametrize("form", ["jvp", "fwd-jvp", "directions"])
@pytest.mark.parametrize(
    "transform, jit",
    SECOND_ORDER_CASES,
    ids=[f"{t}-{'jit' if j else 'eager'}" for t, j in SECOND_ORDER_CASES],
)
def test_second_order_transforms_match_jax_numpy(transform, jit, form):
    levels = [(0, None), (0, None)]
    x, a = values((2, 3, 3), 0), jnp.float64(0.8)
    make = SECOND_ORDER[transform]
    got_fn = make(nested_loss(SECOND["sin", form], levels))
    if jit:
        got_fn = jax.jit(got_fn)
    assert_close(got_fn(x, a), second_order_reference(transform))


@functools.cache
def second_order_reference(transform):
    """The transform of the loss in jax.numpy at the operands above: the same
    for every form and mode, so one compile per transform (not one eager run,
    with a compile per new operation, per case)."""
    levels = [(0, None), (0, None)]
    x, a = values((2, 3, 3), 0), jnp.float64(0.8)
    loss = nested_loss(reference(), levels)
    return jax.block_until_ready(jax.jit(SECOND_ORDER[transform](loss))(x, a))


@settings(
    max_examples=examples(16),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    nestings(max_depth=2),
    st.sampled_from(sorted(FUNCTIONS)),
    st.sampled_from(["hessian", "jvp(grad)", "grad(grad)", "jacfwd(jacfwd)"]),
    st.sampled_from(["jvp", "fwd-jvp", "directions"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_random_second_order_nestings_match_jax_numpy(
    nesting, name, transform, form, jit, seed
):
    levels, sizes = nesting
    x, a = operands(levels, sizes, seed)
    make = SECOND_ORDER[transform]
    got_fn = make(nested_loss(SECOND[name, form], levels))
    if jit:
        got_fn = jax.jit(got_fn)
    want = jax.jit(make(nested_loss(reference(name), levels)))(x, a)
    assert_close(got_fn(x, a), want)


def test_hvp_runs_fwd_its_jvp_and_bwds_jvp_once_per_element():
    calls = []
    f = make_kernel(second=True, calls=calls)
    x, a = values((4, 3), 4), jnp.float64(1.1)

    def loss(f):
        return lambda x: jnp.sum(jax.vmap(f, (0, None))(x, a) ** 2)

    def hvp_fn(f):
        return lambda x, v: jax.jvp(jax.grad(loss(f)), (x,), (v,))[1]

    jaxpr = jax.make_jaxpr(jax.jit(hvp_fn(f)))(x, x).jaxpr
    assert sorted(kname(e) for e in threadmap_eqns(jaxpr)) == [
        "bwd",
        "bwd_jvp",
        "fwd",
        "fwd_jvp",
    ]
    got = jax.jit(hvp_fn(f))(x, jnp.cos(x))
    jax.block_until_ready(got)
    # Under jit the gradient itself (bwd) is not returned: dropped unrun.
    assert sorted(calls) == ["bwd_jvp"] * 4 + ["fwd"] * 4 + ["fwd_jvp"] * 4
    assert_close(got, jax.jit(hvp_fn(reference()))(x, jnp.cos(x)))


@pytest.mark.parametrize("residual_vjp", [False, True], ids=["vjp", "fwd-bwd"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_reverse_over_reverse_in_the_cotangent_alone(jit, residual_vjp):
    # The outer derivative reaches bwd through its cotangent only: by linearity
    # the transpose is the cotangent's part of bwd's own VJP (here also given as
    # fwd/bwd with residuals), at any cotangent.
    calls = []
    f = make_kernel(second=True, calls=calls)
    if residual_vjp:
        bwd = f.bwd

        @jax_threadmap.kernel(((S((3,), F64), S((), F64)), RESIDUALS))
        def bwd_fwd(res, ct):
            calls.append("bwd_fwd")
            return bwd.fn(res, ct), res

        def bwd_bwd(res, c):
            calls.append("bwd_bwd")
            (d, v), (c_x, c_a) = res, c
            return (np.zeros(3), np.zeros(3)), c_x * d + c_a * v

        bwd.defvjp(bwd_fwd, bwd_bwd, residuals=RESIDUALS)
    x, a = values((4, 3), 6), jnp.float64(0.9)

    def outer(f):
        def inner(s):  # s scales the cotangent, not the kernel's arguments
            return jax.grad(lambda x: jnp.sum(s * jax.vmap(f, (0, None))(x, a)))(x)

        return jax.grad(lambda s: jnp.sum(jnp.sin(inner(s))))

    s = values((4, 3), 7)
    got = (jax.jit(outer(f)) if jit else outer(f))(s)
    assert_close(got, jax.jit(outer(reference()))(s))
    assert ("bwd_bwd" if residual_vjp else "bwd_vjp") in calls


# --- defvjp's forms, and their errors -----------------------------------------------


def test_defvjp_with_one_kernel_replaces_fwd_and_bwd_and_back():
    calls = []
    f = make_kernel(calls=calls)
    fwd, bwd = f.fwd, f.bwd
    assert "f with fwd/bwd" in repr(f) and f.vjp is None

    @f.defvjp
    def f_vjp(x, a, ct):
        calls.append("vjp")
        return ct * np.cos(x) * a, np.sum(ct * np.sin(x))

    assert f.fwd is f.bwd is f.residuals is None and f.vjp is f_vjp
    x, a = values((3, 3), 1), jnp.float64(0.7)
    loss = lambda f: lambda x: jnp.sum(jax.vmap(f, (0, None))(x, a))  # noqa: E731
    want = jax.grad(loss(reference()))(x)
    assert_close(jax.jit(jax.grad(loss(f)))(x), want)
    assert calls == ["vjp"] * 3  # under jit the unused primal is dropped
    calls.clear()
    assert f.defvjp(fwd, bwd, residuals=RESIDUALS) is None
    assert f.vjp is None and f.fwd is fwd
    assert_close(jax.jit(jax.grad(loss(f)))(x), want)
    assert sorted(calls) == ["bwd"] * 3 + ["fwd"] * 3


def test_defvjp_refuses_what_it_cannot_take():
    f = make_kernel()
    fwd, bwd = f.fwd, f.bwd
    with pytest.raises(TypeError) as info:
        f.defvjp(fwd, bwd)
    msg = str(info.value)
    assert msg.startswith("defvjp(fwd, bwd) needs residuals=")
    assert "fwd(x, a, **kwargs) -> (out, residuals)" in msg
    assert "bwd(residuals, ct_out, **kwargs) -> (ct_x, ct_a)" in msg
    with pytest.raises(TypeError, match=r"residuals= goes with a forward and a b"):
        f.defvjp(fwd, residuals=RESIDUALS)
    with pytest.raises(TypeError, match="takes from 2 to 3 positional arguments"):
        f.defvjp(fwd, bwd, bwd, residuals=RESIDUALS)
    with pytest.raises(TypeError, match=r"residuals\[1\] must have .shape and .dtype"):
        f.defvjp(fwd, bwd, residuals=(RESIDUALS[0], 3))
    with pytest.raises(TypeError, match=r"Got bwd=3 of type int"):
        f.defvjp(fwd, 3, residuals=RESIDUALS)
    assert f.fwd is fwd and f.bwd is bwd  # a refused call changes nothing
    f32 = jax.ShapeDtypeStruct((3,), jnp.float32)
    g = jax_threadmap.kernel(f32)(lambda x: x)
    g.defvjp(lambda x: (x, x), lambda r, ct: (ct,), residuals=f32)
    g.defvjp(lambda x: (x, x), lambda r, ct: (ct,), residuals=S((3,), F64))
    jax.config.update("jax_enable_x64", False)  # the x64 fixture restores it
    with pytest.raises(ValueError, match=r"residuals asks for dtype float64"):
        jax.grad(lambda x: g(x).sum())(jnp.ones(3, jnp.float32))


def bad_kernel(kind):
    """A kernel whose fwd returns residuals that are not as declared."""

    @jax_threadmap.kernel(S((), F64))
    def k(x):
        return x

    def fwd(x):
        lu, piv = np.zeros((2, 2)), np.int32(1)
        if kind == "shape":
            lu = np.zeros((2, 3))
        if kind == "dtype":
            piv = np.float64(1.5)
        if kind == "structure":
            return x, (lu,)
        if kind == "pair":
            return x
        return x, (lu, {"piv": piv})

    k.defvjp(
        fwd,
        lambda res, ct: (ct,),
        residuals=(S((2, 2), F64), {"piv": S((), jnp.int32)}),
    )
    return k


@pytest.mark.parametrize(
    "kind, fragment",
    [
        (
            "shape",
            r"returned residuals\[0\] of shape \(2, 3\), but residuals= declares "
            r"jax.ShapeDtypeStruct\(\(2, 2\), float64\)\. Return one element's",
        ),
        (
            "dtype",
            r"returned residuals\[1\]\['piv'\] as dtype float64, but residuals= "
            r"declares jax.ShapeDtypeStruct\(\(\), int32\); .*Declare the dtype",
        ),
        ("structure", r"returned residuals \(the second of its pair\) of structure"),
        ("pair", r"must return a pair \(out, residuals\)"),
    ],
)
def test_residuals_not_as_declared_are_named_with_the_batch_index(kind, fragment):
    g = jax.grad(lambda x: jax.vmap(bad_kernel(kind))(x).sum())
    with pytest.raises(KernelError, match=r"'bad_kernel.<locals>.fwd' at batch index"):
        g(jnp.arange(3.0))
    with pytest.raises(KernelError, match=fragment):
        g(jnp.arange(3.0))
    with pytest.raises(Exception, match=fragment):  # under jit, in JAX's error
        jax.block_until_ready(jax.jit(g)(jnp.arange(3.0)))


def forward_kernel(kind):
    """A kernel with ``defjvp(fwd, jvp, ...)`` that returns something wrong."""

    @jax_threadmap.kernel(S((3,), F64))
    def k(x):
        return np.sin(x)

    def fwd(x):
        return np.sin(x), (np.zeros((2, 3)) if kind == "residual" else np.cos(x))

    def jvp(c, tx):
        if kind == "shape":
            return (c * tx)[:2]
        if kind == "dtype":
            return c * tx + 1j
        if kind == "directions":  # one direction: the first
            return c * tx.reshape(-1, 3)[0]
        return c * tx

    k.defjvp(fwd, jvp, residuals=S((3,), F64), directions=kind == "directions")
    return k


@pytest.mark.parametrize(
    "kind, fragment",
    [
        (
            "residual",
            r"'forward_kernel.<locals>.fwd' at batch index \([\d, ]+\).*returned "
            r"residuals of shape \(2, 3\), but residuals= declares "
            r"jax.ShapeDtypeStruct\(\(3,\), float64\)\. Return one element's "
            r"residual, .* \(jvp receives it as declared\)",
        ),
        (
            "shape",
            r"'forward_kernel.<locals>.jvp' at batch index \([\d, ]+\).*returned shape "
            r"\(2,\) for output 0, expected \(3,\) .*Return one element's result",
        ),
        (
            "dtype",
            r"'forward_kernel.<locals>.jvp' at batch index \([\d, ]+\).*returned dtype "
            r"complex128 for output 0, expected float64.*Cast the result",
        ),
        (
            "directions",
            r"'forward_kernel.<locals>.jvp' at batch index \([\d, ]+\).*the JVP kernel "
            r"of defjvp\(fwd, jvp, residuals=\.\.\., directions=True\) returned the "
            r"tangent of output 0 with shape \(3,\), expected \(3, 3\): its tangents "
            r"came with 1 leading axes of directions \(3,\).*Compute it for every "
            r"direction .*or drop directions=True",
        ),
    ],
)
def test_forward_residuals_and_tangents_not_as_declared_are_named(kind, fragment):
    k = jax.vmap(forward_kernel(kind))
    x = values((4, 3), 0)
    if kind == "directions":  # three directions (jacfwd's would be 12)
        f = jax.vmap(lambda t: jax.jvp(k, (x,), (t,))[1])
    else:
        f = jax.jacfwd(k)
    with pytest.raises(KernelError, match=fragment):
        f(jnp.stack([x, 2 * x, 3 * x]) if kind == "directions" else x)
    with pytest.raises(Exception, match=fragment):  # under jit, in JAX's error
        jax.block_until_ready(
            jax.jit(f)(jnp.stack([x, x, x]) if kind == "directions" else x)
        )


def test_defjvp_with_residuals_shares_fwd_with_defvjp():
    f = make_kernel(jvp="residuals")
    fwd, jvp, bwd = f.fwd, f.jvp, f.bwd
    assert "f with fwd/jvp and fwd/bwd" in repr(f)
    with pytest.raises(TypeError) as info:
        f.defjvp(lambda x, a: fwd(x, a), jvp, residuals=RESIDUALS)
    msg = str(info.value)
    assert "already has defvjp(fwd, bwd, residuals=...) with fwd=" in msg
    assert "Pass the same fwd and residuals to both" in msg
    with pytest.raises(TypeError, match="must share it"):
        f.defvjp(fwd, bwd, residuals=RESIDUALS[:1])
    with pytest.raises(TypeError, match=r"not by a VJP kernel on the primals"):
        f.defvjp(lambda x, a, ct: (ct, None))
    with pytest.raises(TypeError) as info:
        f.defjvp(fwd, jvp)
    msg = str(info.value)
    assert msg.startswith("defjvp(fwd, jvp) needs residuals=")
    assert "jvp(residuals, x_dot, a_dot, **kwargs) -> tangent_out" in msg
    assert "not jax.custom_jvp's defjvps" in msg
    with pytest.raises(TypeError, match=r"^defjvp: directions=True goes with defjvp\("):
        f.defjvp(jvp, directions=True)
    assert (f.fwd, f.jvp, f.bwd) == (fwd, jvp, bwd)  # refused calls change nothing


def test_forward_mode_alone_over_residuals():
    @jax_threadmap.kernel(S((3,), F64))
    def h(x, a):
        return np.sin(x) * a

    def h_fwd(x, a):
        return np.sin(x) * a, (np.cos(x) * a, np.sin(x))

    h.defjvp(h_fwd, lambda res, tx, ta: res[0] * tx + res[1] * ta, residuals=RESIDUALS)
    x, a = values((2, 3), 1), jnp.float64(0.5)

    def loss(h):
        return lambda x: jnp.sum(jax.vmap(h, (0, None))(x, a))

    # The jax.numpy JVP and Jacobian in one jitted program (one compile).
    want_jvp, want_jac = jax.jit(
        lambda x: (
            jax.jvp(loss(reference()), (x,), (x,)),
            jax.jacfwd(loss(reference()))(x),
        )
    )(x)
    assert_close(jax.jvp(loss(h), (x,), (x,)), want_jvp)
    assert_close(jax.jit(jax.jacfwd(loss(h)))(x), want_jac)
    with pytest.raises(TypeError) as info:  # reverse mode names what is missing
        jax.jit(jax.grad(loss(h)))(x)
    msg = str(info.value)
    assert "has fwd and jvp kernels (defjvp(fwd, jvp, residuals=...)) but no bwd" in msg
    assert ".h.defvjp(fwd, bwd, residuals=...), the same fwd" in msg
    # A JVP kernel on the primals replaces the form, and fwd goes with it.
    h.defjvp(lambda x, a, tx, ta: np.cos(x) * a * tx + np.sin(x) * ta)
    assert h.fwd is None and repr(h).endswith("h with jvp>")
    assert_close(jax.jvp(loss(h), (x,), (x,)), want_jvp)


def test_second_order_without_rules_of_fwd_names_fwd():
    f = make_kernel()
    loss = lambda x: jnp.sum(jnp.sin(jax.vmap(f, (0, None))(x, 0.5)))  # noqa: E731
    with pytest.raises(TypeError) as info:
        jax.jit(jax.hessian(loss))(values((2, 3), 0))
    msg = str(info.value)
    assert "'residual_kernel.<locals>.fwd' (the fwd kernel of" in msg
    assert "Make fwd a jax_threadmap.kernel" in msg
    assert "@jax_threadmap.kernel((ShapeDtypeStruct(shape=(3,)" in msg


def test_second_order_of_forward_mode_alone_names_defjvp():
    """A kernel with only defjvp(fwd, jvp, ...) under jacfwd(jacfwd): its fwd
    comes from defjvp, and the message says so (not defvjp, never given)."""

    @jax_threadmap.kernel(S((3,), F64))
    def h(x, a):
        return np.sin(x) * a

    def fwd(x, a):
        return np.sin(x) * a, (np.cos(x) * a, np.sin(x))

    h.defjvp(fwd, lambda res, tx, ta: res[0] * tx + res[1] * ta, residuals=RESIDUALS)
    loss = lambda x: jax.vmap(h, (0, None))(x, 0.5)  # noqa: E731
    for transform in (jax.jacfwd(jax.jacfwd(loss)), jax.hessian(loss)):
        with pytest.raises(TypeError) as info:
            jax.jit(transform)(values((2, 3), 0))
        msg = str(info.value)
        assert "(the fwd kernel of " in msg
        assert "from defjvp(fwd, jvp, residuals=...)) has no" in msg
        assert "defvjp(fwd, bwd" not in msg
        assert "Make fwd a jax_threadmap.kernel" in msg
    # Both forms with one fwd: both named.
    f = make_kernel(jvp="residuals")
    with pytest.raises(TypeError) as info:
        jax.jit(jax.jacfwd(jax.jacfwd(lambda x: jax.vmap(f, (0, None))(x, 0.5))))(
            values((2, 3), 0)
        )
    assert (
        "from defjvp(fwd, jvp, residuals=...) and defvjp(fwd, bwd, residuals=...))"
        in str(info.value)
    )


# --- other kernels: vectorized, async def, keywords, integers, no residuals ---------


def test_vectorized_fwd_and_bwd_take_chunks():
    @jax_threadmap.kernel(S((), F64), vectorized=2)
    def k(x, w):
        return np.sin(x) * w

    def k_fwd(x, w):
        assert x.shape == w.shape == (len(x),) and len(x) <= 2
        return np.sin(x) * w, np.cos(x) * w

    def k_bwd(d, ct):
        assert d.shape == ct.shape and len(d) <= 2
        return d * ct, None

    k.defvjp(k_fwd, k_bwd, residuals=S((), F64))
    x = values((5,), 1)
    got = jax.jit(jax.grad(lambda x: jax.vmap(k, (0, None))(x, 2.0).sum()))(x)
    assert_close(got, 2 * jnp.cos(x))


@pytest.mark.parametrize("directions", [False, True])
def test_vectorized_rule_kernels_of_a_per_element_kernel_take_chunks(directions):
    """fwd per element; jvp and bwd jax_threadmap.kernel(..., vectorized=3):
    chunks of at most 3 elements (the directions' axis after the chunk's)."""
    seen = {"fwd": set(), "jvp": set(), "bwd": set()}

    @jax_threadmap.kernel(S((2,), F64))
    def k(x):
        return 2 * np.sin(x)

    def k_fwd(x):
        seen["fwd"].add(x.shape)
        return 2 * np.sin(x), 2 * np.cos(x)

    chunks = jax_threadmap.kernel(S((2,), F64), vectorized=3)

    @chunks
    def k_jvp(d, tx):
        seen["jvp"].add(tx.shape)
        return d.reshape(d.shape[:1] + (1,) * (tx.ndim - d.ndim) + d.shape[1:]) * tx

    @chunks
    def k_bwd(d, ct):
        seen["bwd"].add(ct.shape)
        return (d * ct,)

    k.defjvp(k_fwd, k_jvp, residuals=S((2,), F64), directions=directions)
    k.defvjp(k_fwd, k_bwd, residuals=S((2,), F64))
    f, ref = jax.vmap(jax.vmap(k)), lambda x: 2 * jnp.sin(x)
    x, tangents = values((4, 5, 2), 1), values((3, 4, 5, 2), 2)
    for make in (
        lambda f: jax.vmap(lambda t: jax.jvp(f, (x,), (t,))[1])(tangents),
        lambda f: jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x),
    ):
        assert_close(jax.jit(functools.partial(make, f))(), make(ref))
    assert seen["fwd"] == {(2,)}
    assert {s[0] for s in seen["jvp"] | seen["bwd"]} <= {1, 2, 3}
    assert {s[1:] for s in seen["jvp"]} == ({(3, 2)} if directions else {(2,)})


def test_async_def_fwd_and_bwd_with_keyword_arguments():
    @jax_threadmap.kernel(S((), F64))
    async def k(x, *, w):
        return np.sin(x) * w

    async def k_fwd(x, *, w):
        await asyncio.sleep(0.001)
        return np.sin(x) * w, np.cos(x)

    async def k_bwd(c, ct, *, w):  # keyword arguments reach bwd too
        await asyncio.sleep(0.001)
        return (c * w * ct,)

    k.defvjp(k_fwd, k_bwd, residuals=S((), F64))
    x, w = values((6,), 2), jnp.float64(1.5)
    got = jax.jit(jax.grad(lambda x: jax.vmap(lambda x: k(x, w=w))(x).sum()))(x)
    assert_close(got, w * jnp.cos(x))


def test_integer_residuals_and_none_at_all():
    @jax_threadmap.kernel(S((3,), F64))
    def sort(x):
        return np.sort(x)

    def sort_bwd(order, ct):
        out = np.zeros(3)
        out[order] = ct
        return (out,)

    sort.defvjp(
        lambda x: (np.sort(x), np.argsort(x)), sort_bwd, residuals=S((3,), jnp.int64)
    )
    x = values((4, 3), 3)
    w = jnp.arange(1.0, 4.0)
    got = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(sort)(x) * w)))(x)
    assert_close(got, jax.grad(lambda x: jnp.sum(jnp.sort(x) * w))(x))

    @jax_threadmap.kernel(S((), F64))
    def double(x):
        return 2 * x

    double.defvjp(lambda x: (2 * x, ()), lambda res, ct: (2 * ct,), residuals=())
    assert_close(jax.grad(lambda x: jax.vmap(double)(x).sum())(x[0]), 2 + 0 * x[0])


def test_derivative_params_of_repeated_traces_are_equal_and_cached():
    # The params (the jit cache key) compare and hash alike per trace; what the
    # host calls per element is built from them per lowering, not stored in them.
    f = make_kernel(jvp="residuals")
    x, a = values((4, 3), 2), jnp.float64(0.5)

    def jvp_and_grad(x, a):
        tangent = jax.jvp(jax.vmap(f, (0, None)), (x, a), (x, a))[1]
        return tangent, jax.grad(lambda x: jnp.sum(jax.vmap(f, (0, None))(x, a)))(x)

    first, second = (
        [e.params for e in threadmap_eqns(jax.make_jaxpr(jvp_and_grad)(x, a).jaxpr)]
        for _ in range(2)
    )
    assert len(first) == 4 and first == second  # fwd, jvp; fwd, bwd
    assert [hash(tuple(sorted(p.items()))) for p in first] == [
        hash(tuple(sorted(p.items()))) for p in second
    ]
    jitted = jax.jit(jvp_and_grad)
    jitted(x, a)
    jitted(x + 1, a)
    assert jitted._cache_size() == 1


@pytest.mark.parametrize("jit", [False, True])
def test_directions_fold_a_python_scalar_tangent(jit):
    """A tangent given as a Python number (a literal in the jaxpr, the same
    for every direction) is repeated over the folded directions."""
    f = make_kernel(jvp="directions")
    x, T = values((3,), 0), values((4, 3), 1)

    def directions(f):
        return lambda x, T: jax.vmap(lambda t: jax.jvp(f, (x, 2.0), (t, 0.5))[1])(T)

    got = (jax.jit if jit else lambda h: h)(directions(f))(x, T)
    assert_close(got, jax.jit(directions(reference()))(x, T))
