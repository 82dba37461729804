"""A Newton-CG step through a 3 x 3 solve kernel: derivative kernels with and
without residuals (``defvjp(fwd, bwd, residuals=...)``).

The problem: ``N`` elements, each a 3 x 3 matrix ``A_i`` and a vector ``b_i``;
the loss ``sum_i |solve(A_i, b_i) - y_i|^2 / 2`` as a function of the matrices
(plus a ridge term, so that the Hessian is positive definite).
One Newton-CG step: the gradient, then ``CG_ITERS`` conjugate-gradient
iterations on Hessian-vector products (forward over reverse), then the update,
all in one ``jax.jit``. The solve kernel inverts its matrix (``np.linalg.inv``,
counted as one factorization) and each side gives it the rules forward over
reverse needs:

- ``rules``: a JVP kernel, and a VJP kernel with a JVP kernel of its own; each
  of the four factorizes (the kernel, its JVP, its VJP, the VJP's JVP);
- ``residuals``: ``defvjp(fwd, bwd, residuals=(inverse, x))``, ``fwd`` and
  ``bwd`` each with a JVP kernel: ``fwd`` and its JVP factorize, ``bwd`` and its
  JVP use the inverse that ``fwd`` returned.

Two ways to get the products: ``jvp``, ``jax.jvp(jax.grad(loss), ...)`` in each
iteration (the gradient's kernels run again per product), and ``linearize``,
``jax.linearize(jax.grad(loss), A)`` once per step (per product only the linear
part runs). Per side: factorizations per element per step (counted, after the
step is awaited), and the best wall time and CPU time (the process's, every
thread) of ``REPS`` reps, sides alternated rep by rep, as ratios to ``rules``.

Run (after the README's set-up and ``.venv/bin/pip install -q ".[bench]"``):
    .venv/bin/python benchmarks/test_bench_residuals.py  # the docs' table
    N=4096 REPS=9 .venv/bin/python benchmarks/test_bench_residuals.py
    .venv/bin/python -m pytest benchmarks/test_bench_residuals.py --benchmark-only
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_threadmap
from jax_threadmap._support.cpus import available_cpus

N = int(os.environ.get("N", "1024"))
CG_ITERS = int(os.environ.get("CG_ITERS", "8"))
REPS = int(os.environ.get("REPS", "7"))

S = jax.ShapeDtypeStruct
F32 = jnp.float32
VEC, MAT = S((3,), F32), S((3, 3), F32)


class Factorizations:
    """Counts ``np.linalg.inv`` calls of the kernels (from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def inv(self, a: np.ndarray) -> np.ndarray:
        with self._lock:
            self.count += 1
        return np.linalg.inv(a)


def solve_with_rules(counter: Factorizations) -> jax_threadmap.KernelFunction:
    """The solve kernel with a JVP kernel and a VJP kernel (with its JVP)."""
    inv = counter.inv

    @jax_threadmap.kernel(VEC)
    def solve(a, b):
        return inv(a) @ b

    @jax_threadmap.kernel(VEC)
    def solve_jvp(a, b, da, db):
        m = inv(a)
        return m @ (db - da @ (m @ b))

    @jax_threadmap.kernel((MAT, VEC))
    def solve_vjp(a, b, ct):
        m = inv(a)
        y = m.T @ ct
        return -np.outer(y, m @ b), y

    @solve_vjp.defjvp
    def solve_vjp_jvp(a, b, ct, da, db, dct):
        m = inv(a)
        x = m @ b
        dx = m @ (db - da @ x)
        y = m.T @ ct
        dy = -(m @ da @ m).T @ ct + m.T @ dct
        return -np.outer(dy, x) - np.outer(y, dx), dy

    solve.defjvp(solve_jvp)
    solve.defvjp(solve_vjp)
    return solve


def solve_with_residuals(counter: Factorizations) -> jax_threadmap.KernelFunction:
    """The solve kernel with ``fwd``/``bwd``: residuals ``(inverse, x)``."""
    inv = counter.inv

    @jax_threadmap.kernel(VEC)
    def solve(a, b):
        return inv(a) @ b

    @jax_threadmap.kernel((VEC, (MAT, VEC)))
    def solve_fwd(a, b):
        m = inv(a)
        x = m @ b
        return x, (m, x)

    @solve_fwd.defjvp
    def solve_fwd_jvp(a, b, da, db):
        m = inv(a)
        dx = m @ (db - da @ (m @ b))
        return dx, (-m @ da @ m, dx)

    @jax_threadmap.kernel((MAT, VEC))
    def solve_bwd(res, ct):
        m, x = res
        y = m.T @ ct
        return -np.outer(y, x), y

    @solve_bwd.defjvp
    def solve_bwd_jvp(res, ct, dres, dct):
        (m, x), (dm, dx) = res, dres
        y = m.T @ ct
        dy = dm.T @ ct + m.T @ dct
        return -np.outer(dy, x) - np.outer(y, dx), dy

    solve.defvjp(solve_fwd, solve_bwd, residuals=(MAT, VEC))
    return solve


KERNELS = {"rules": solve_with_rules, "residuals": solve_with_residuals}


def problem(n: int = N, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Matrices, right-hand sides, and targets: the solutions for matrices a
    little off, so that the loss is near its minimum (its Hessian positive)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, 3, 3)) + 4 * np.eye(3)
    b = rng.standard_normal((n, 3))
    y = np.linalg.solve(a + 0.1 * rng.standard_normal((n, 3, 3)), b[..., None])
    return tuple(jnp.asarray(v, F32) for v in (a, b, y[..., 0]))  # type: ignore[return-value]


#: The weight of ``|A - A_0|^2 / 2`` in the loss: it keeps the Hessian positive
#: definite (each element's 9 entries fit 3 values).
RIDGE = 0.1


def newton_step(solve: Callable, form: str) -> Callable:
    """One jitted Newton-CG step ``A -> A + p`` with ``H p = -g`` solved by
    ``CG_ITERS`` conjugate-gradient iterations (no early stop)."""

    @jax.jit
    def step(a, b, y):
        def loss(x):
            misfit = jnp.sum((jax.vmap(solve)(x, b) - y) ** 2)
            return 0.5 * (misfit + RIDGE * jnp.sum((x - a) ** 2))

        if form == "linearize":
            g, hvp = jax.linearize(jax.grad(loss), a)
        else:
            g = jax.grad(loss)(a)
            hvp = lambda v: jax.jvp(jax.grad(loss), (a,), (v,))[1]  # noqa: E731

        def cg(_, state):
            p, r, d, rr = state
            hd = hvp(d)
            alpha = rr / jnp.vdot(d, hd)
            p, r = p + alpha * d, r - alpha * hd
            rr_new = jnp.vdot(r, r)
            return p, r, r + (rr_new / rr) * d, rr_new

        r = -g
        p, *_ = jax.lax.fori_loop(
            0, CG_ITERS, cg, (jnp.zeros_like(a), r, r, jnp.vdot(r, r))
        )
        return a + p

    return step


def reference_step(form: str) -> Callable:
    """The same step with ``jnp.linalg.solve``, which JAX differentiates."""
    return newton_step(lambda a, b: jnp.linalg.solve(a, b[:, None])[:, 0], form)


SIDES = [(kind, form) for form in ("jvp", "linearize") for kind in KERNELS]


def runs(n: int = N) -> dict[tuple[str, str], tuple[Callable, Factorizations]]:
    """Per side, a thunk running one step to its end, and its counter."""
    a, b, y = problem(n)
    out = {}
    for kind, form in SIDES:
        counter = Factorizations()
        step = newton_step(KERNELS[kind](counter), form)

        def run(step: Callable = step) -> jax.Array:
            return jax.block_until_ready(step(a, b, y))

        out[kind, form] = (run, counter)
    return out


def factorizations_per_element(n: int = N) -> dict[tuple[str, str], float]:
    """Per side, factorizations per element in one step (counted after it ends)."""
    result = {}
    for side, (run, counter) in runs(n).items():
        run()  # compile (tracing and compiling run no kernel)
        counter.count = 0
        run()
        result[side] = counter.count / n
    return result


def report(counts: dict, times: dict) -> str:
    lines = [
        f"{N} elements, {CG_ITERS} CG iterations, float32, {available_cpus()} CPUs, "
        f"best of {REPS} reps, sides alternated",
        "| products | kernel rules | factorizations per element per step "
        "| ms per step (CPU ms) | / rules (CPU) |",
        "|---|---|---|---|---|",
    ]
    for kind, form in SIDES:
        (wall, cpu), (wall0, cpu0) = times[kind, form], times["rules", form]
        lines.append(
            f"| `{form}` | {kind} | {counts[kind, form]:g} | "
            f"{wall * 1e3:.0f} ({cpu * 1e3:.0f}) | {wall / wall0:.2f} "
            f"({cpu / cpu0:.2f}) |"
        )
    return "\n".join(lines)


# --- pytest ---------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["jvp", "linearize"])
def test_sides_compute_the_same_step(form):
    a, b, y = problem(64)
    want = np.asarray(reference_step(form)(a, b, y))
    for kind in KERNELS:
        got = newton_step(KERNELS[kind](Factorizations()), form)(a, b, y)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=kind)


def test_residuals_factorize_less():
    a, b, y = problem(64)
    for kind, per_product in (("rules", 3), ("residuals", 2)):
        # One product alone: the kernel (or fwd) and its JVP, and the VJP's (or
        # bwd's) JVP; only the rules' VJP's JVP factorizes again.
        counter = Factorizations()
        solve = KERNELS[kind](counter)

        def hvp(x, v, solve=solve):
            grad = jax.grad(lambda x: jnp.sum(jax.vmap(solve)(x, b) ** 2))
            return jax.jvp(grad, (x,), (v,))[1]

        jax.block_until_ready(jax.jit(hvp)(a, a))
        assert counter.count == per_product * 64, kind
    # A step that linearizes once: the gradient's kernels once, then per product
    # the JVP kernels, of which the residuals' bwd JVP does not factorize.
    counts = factorizations_per_element(64)
    assert counts["rules", "linearize"] == 2 + 2 * CG_ITERS
    assert counts["residuals", "linearize"] == 1 + CG_ITERS
    assert counts["residuals", "jvp"] < counts["rules", "jvp"]


@pytest.mark.parametrize("side", SIDES, ids=[f"{k}-{f}" for k, f in SIDES])
def test_newton_step(benchmark, side):
    run, _ = runs()[side]
    run()
    benchmark.group = f"Newton-CG step: {side[1]}"
    benchmark.pedantic(run, rounds=REPS, warmup_rounds=1, iterations=1)


if __name__ == "__main__":
    counts = factorizations_per_element()
    times = harness.alternate({side: run for side, (run, _) in runs(N).items()}, REPS)
    print(report(counts, times))
    print(f"load average {os.getloadavg()}")
