"""A Gauss-Newton step through a host solver: kernels with ``fwd`` residuals
against JAX's ``custom_jvp`` + ``pure_callback`` recipe (issue 49).

Per element ``i`` (``N`` of them, under two nested ``vmap`` s) an SPD system
``M_i(p) x_i = b_i`` with ``M_i(p) = A_i + p_0 I + p_1 W_i + p_2 U_i`` (``M`` x
``M``, float64), factorized by Cholesky on the host; three global parameters
``p``. One step, in one ``jax.jit``: the residual ``r(p) = x(p) - y``, its
Jacobian by ``jax.jacfwd`` (3 directions), the gradient of ``|r|^2 / 2`` by
``jax.grad``, and ``p - (J^T J)^-1 g``. Every side runs the same host function
``factor`` (which works on one element or on a batch) and the same algebra:

- ``kernels``: a ``jax_threadmap.kernel`` per element, ``fwd`` returning
  ``dx/dp`` as its residual, shared by ``defjvp(fwd, jvp, ...)`` and
  ``defvjp(fwd, bwd, ...)``; ``jvp`` and ``bwd`` multiply by it.
- ``vectorized``: the same kernels with ``vectorized=True`` (chunks of elements).
- ``recipe``: ``jax.custom_jvp`` whose rule calls ``factor`` per element, in a
  loop over the batch in one ``jax.pure_callback(...,
  vmap_method="broadcast_all")``, and computes the tangent from the same
  residual in ``jax.numpy`` (which JAX transposes for ``jax.grad``). (With
  ``vmap_method="sequential"`` instead, one callback per element, a step took
  10 times longer.)
- ``batched``: the same recipe, ``factor`` given the whole batch at once
  (batched NumPy).

Each side's best wall time of ``REPS`` reps, sides alternated rep by rep, with
ratios ``kernels / recipe`` and ``vectorized / batched``.

Run:
    python benchmarks/test_bench_gauss_newton.py    # docs/derivatives-residuals.md
    SIZES=128x4,4096x32 REPS=9 python benchmarks/test_bench_gauss_newton.py
    pytest benchmarks/test_bench_gauss_newton.py --benchmark-only
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_threadmap

jax.config.update("jax_enable_x64", True)

SIZES = [
    tuple(int(v) for v in size.split("x"))
    for size in os.environ.get("SIZES", "128x4,128x32,4096x4,4096x32").split(",")
]
REPS = int(os.environ.get("REPS", "7"))
S = jax.ShapeDtypeStruct
F64 = jnp.float64


def _system(p, A, W, U):
    """``M(p)`` for one element or a batch (NumPy or jax.numpy)."""
    eye = np.eye(A.shape[-1])
    p = p[..., None, None]
    return A + p[..., 0, :, :] * eye + p[..., 1, :, :] * W + p[..., 2, :, :] * U


def factor(p, A, W, U, b):
    """``(x, dx/dp)`` by Cholesky, for one element or a batch (leading axes):
    ``dx/dp_k = -M^-1 (dM/dp_k) x``, an ``M x 3`` matrix per element, which
    every side keeps as the residual of its tangents."""
    L = np.linalg.cholesky(_system(p, A, W, U))
    Linv = np.linalg.inv(L)
    Minv = np.swapaxes(Linv, -1, -2) @ Linv
    x = (Minv @ b[..., None])[..., 0]
    dM_x = np.stack([x, (W @ x[..., None])[..., 0], (U @ x[..., None])[..., 0]], -1)
    return x, -(Minv @ dM_x)


def kernels(m: int, vectorized: bool = False) -> Callable:
    vec, jac = S((m,), F64), S((m, 3), F64)

    @jax_threadmap.kernel(vec, vectorized=vectorized)
    def solve(p, *, A, W, U, b):
        return factor(p, A, W, U, b)[0]

    def fwd(p, *, A, W, U, b):
        return factor(p, A, W, U, b)  # (x, dx/dp)

    # The tangent algebra on a chunk of elements (as the recipe's XLA does it
    # batched): dx_dp (c, m, 3), tp (c, 3 directions, 3), ct (c, m).
    linear = jax_threadmap.kernel(vec, vectorized=True)

    @linear
    def jvp(dx_dp, tp, *, A, W, U, b):
        return tp @ np.swapaxes(dx_dp, -1, -2)

    @linear
    def bwd(dx_dp, ct, *, A, W, U, b):
        return ((ct[..., None, :] @ dx_dp)[..., 0, :],)

    solve.defjvp(fwd, jvp, residuals=jac, directions=True)
    solve.defvjp(fwd, bwd, residuals=jac)
    return lambda p, A, W, U, b: solve(p, A=A, W=W, U=U, b=b)


def per_element(p, A, W, U, b):
    """``factor`` called once per element of a batch (a loop on the host)."""
    p, A, W, U, b = map(np.asarray, (p, A, W, U, b))  # JAX may pass jax.Arrays
    x, dx_dp = np.empty(b.shape), np.empty((*b.shape, 3))
    for i in np.ndindex(b.shape[:-1]):
        x[i], dx_dp[i] = factor(p[i], A[i], W[i], U[i], b[i])
    return x, dx_dp


def recipe(m: int, host: Callable = per_element) -> Callable:
    @functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
    def solve(p, A, W, U, b):
        return _callback(p, A, W, U, b)[0]

    def _callback(p, A, W, U, b):
        out = (S(b.shape, F64), S((*b.shape, 3), F64))
        return jax.pure_callback(host, out, p, A, W, U, b, vmap_method="broadcast_all")

    @solve.defjvp
    def solve_jvp(A, W, U, b, primals, tangents):
        x, dx_dp = _callback(primals[0], A, W, U, b)
        return x, dx_dp @ tangents[0]

    return solve


SIDES = {
    "kernels": lambda m: kernels(m),
    "vectorized": lambda m: kernels(m, vectorized=True),
    "recipe": lambda m: recipe(m),
    "batched": lambda m: recipe(m, factor),
}
RATIOS = [("kernels", "recipe"), ("vectorized", "batched")]


def problem(n: int, m: int, seed: int = 0):
    """``(p, data, y)``: the data as ``(n1, n2, ...)`` for two vmaps, SPD
    ``A, W, U``, and targets ``y`` from parameters near ``p``."""
    rng = np.random.default_rng(seed)
    n1 = 2 ** (n.bit_length() // 2)  # 128: 8 x 16, 4096: 64 x 64
    shape = (n1, n // n1)

    def spd(scale):
        q = rng.standard_normal((*shape, m, m)) / np.sqrt(m)
        return q @ np.swapaxes(q, -1, -2) * scale + np.eye(m) * scale

    A, W, U = spd(1.0), spd(0.3), spd(0.2)
    b = rng.standard_normal((*shape, m))
    y = factor(np.array([0.4, 0.6, 0.5]), A, W, U, b)[0]
    p = np.array([0.5, 0.5, 0.5])
    return tuple(jnp.asarray(v) for v in (p, A, W, U, b, y))


def gauss_newton_step(solve: Callable) -> Callable:
    per_element = jax.vmap(jax.vmap(solve, (None, 0, 0, 0, 0)), (None, 0, 0, 0, 0))

    @jax.jit
    def step(p, A, W, U, b, y):
        def residual(p):
            return per_element(p, A, W, U, b) - y

        r = residual(p)
        J = jax.jacfwd(residual)(p).reshape(-1, 3)
        g = jax.grad(lambda p: 0.5 * jnp.sum(residual(p) ** 2))(p)
        return p - jnp.linalg.solve(J.T @ J, g), jnp.sum(r**2)

    return step


def runs(n: int, m: int) -> dict[str, Callable[[], jax.Array]]:
    """Per side, a thunk running one step to its end."""
    args = problem(n, m)
    out = {}
    for side, make in SIDES.items():
        step = gauss_newton_step(make(m))
        out[side] = functools.partial(
            lambda step: jax.block_until_ready(step(*args)), step
        )
    return out


def report(times: dict[tuple[int, int], dict[str, tuple[float, float]]]) -> str:
    lines = [
        f"float64, best of {REPS} reps, sides alternated, load average "
        f"{os.getloadavg()[0]:.1f}; ms per step (CPU ms)",
        "| elements | system | "
        + " | ".join(SIDES)
        + " | kernels / recipe (CPU) | vectorized / batched (CPU) |",
        "|---|---|" + "---|" * (len(SIDES) + 2),
    ]
    for (n, m), best in times.items():
        ms = " | ".join(
            f"{best[s][0] * 1e3:.1f} ({best[s][1] * 1e3:.0f})" for s in SIDES
        )
        ratios = " | ".join(
            f"{best[a][0] / best[b][0]:.2f} ({best[a][1] / best[b][1]:.2f})"
            for a, b in RATIOS
        )
        lines.append(f"| {n} | {m} x {m} | {ms} | {ratios} |")
    return "\n".join(lines)


# --- pytest ---------------------------------------------------------------------------


def test_sides_compute_the_same_step():
    args = problem(16, 4)
    reference = gauss_newton_step(lambda p, A, W, U, b: factor_jnp(p, A, W, U, b))(
        *args
    )
    for side, make in SIDES.items():
        got = gauss_newton_step(make(4))(*args)
        for g, w in zip(got, reference, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-9, err_msg=side)


def factor_jnp(p, A, W, U, b):
    """The solve in jax.numpy, which JAX differentiates (the reference)."""
    return jnp.linalg.solve(_system(p, A, W, U), b)


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("size", SIZES, ids=[f"{n}x{m}" for n, m in SIZES])
def test_gauss_newton_step(benchmark, side, size):
    run = runs(*size)[side]
    run()
    benchmark.group = f"Gauss-Newton step: {size[0]} elements, {size[1]} x {size[1]}"
    benchmark.pedantic(run, rounds=REPS, warmup_rounds=1, iterations=1)


if __name__ == "__main__":
    print(report({size: harness.alternate(runs(*size), REPS) for size in SIZES}))
