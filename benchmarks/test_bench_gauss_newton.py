"""A Gauss-Newton step through a host solver, as docs/derivatives-residuals.md
teaches it, against JAX's ``custom_jvp`` + ``pure_callback`` recipe (issue 57).

The programs are the page's own: its Gauss-Newton blocks are read from the page
and run here with systems of ``M x M`` (the page's ``M = 4`` line set to each
size), so what is measured is what the page teaches. Per element an SPD system
``M_i(p) x_i = b_i``, ``M_i(p) = A_i + p_0 I + p_1 W_i + p_2 U_i``, float64,
factorized by Cholesky on the host; one step, in one ``jax.jit``: the residual,
its Jacobian by ``jax.jacfwd`` (3 directions), the gradient by ``jax.grad``.
Sides, each on the page's ``inverse`` and ``solve_fwd``:

- ``solve(m, b)``: the page's kernel of ``m`` (built from ``p`` in
  ``jax.numpy``) and ``b``, with per-element ``fwd``/``jvp``/``bwd``.
- ``solve_p(p)``: the page's kernel of the parameters, the data as keywords.
- ``recipe``: ``solve(m, b)`` as a ``jax.custom_jvp`` around one
  ``jax.pure_callback(..., vmap_method="broadcast_all")`` whose host function
  loops over the elements, its rule a second such callback (``solve_fwd``),
  the tangent from the same residuals in ``jax.numpy``.

Each side's best wall and CPU time of ``REPS`` reps, sides alternated rep by
rep, the factorizations per element per step, and each kernel side / recipe.

Run:
    python benchmarks/test_bench_gauss_newton.py    # docs/derivatives-residuals.md
    SIZES=128x4,4096x32 REPS=9 python benchmarks/test_bench_gauss_newton.py
    pytest benchmarks/test_bench_gauss_newton.py --benchmark-only
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import page_script  # noqa: E402  (the docs test reads the pages with it too)

DOC = ROOT / "docs" / "derivatives-residuals.md"
SECTION = "### Gauss-Newton steps through a host solver"
SIZE_LINE = "\nM = 4  #"  # the page's size, set to each system's size here
SIZES = [
    tuple(int(v) for v in size.split("x"))
    for size in os.environ.get("SIZES", "128x4,128x32,4096x4,4096x32").split(",")
]
REPS = int(os.environ.get("REPS", "7"))
S = jax.ShapeDtypeStruct


@functools.cache
def docs_program(m: int) -> dict[str, Any]:
    """The names that the page's Gauss-Newton blocks define, with ``M = m``
    (their own example run as they do, its output dropped)."""
    text = DOC.read_text()
    blocks = page_script.blocks(text[text.index(SECTION) :])
    code = "\n".join(b["code"] for b in blocks if page_script.is_python(b))
    assert code.count(SIZE_LINE) == 1, f"{DOC} has no line {SIZE_LINE!r}"
    names: dict[str, Any] = {"__name__": "gauss_newton_docs"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code.replace(SIZE_LINE, f"\nM = {m}  #"), str(DOC), "exec"), names)
    return names


def _per_element(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A host function looping ``fn(m_i, b_i) -> arrays`` over a batch."""

    def host(m: Any, b: Any) -> tuple[np.ndarray, ...]:
        m, b = np.asarray(m), np.asarray(b)  # JAX may pass jax.Arrays
        batch = b.shape[:-1]
        outs: list[np.ndarray] | None = None
        for i in np.ndindex(batch):
            got = fn(m[i], b[i])
            if outs is None:
                outs = [np.empty(batch + np.shape(g)) for g in got]
            for out, g in zip(outs, got, strict=True):
                out[i] = g
        assert outs is not None
        return tuple(outs)

    return host


def recipe(docs: dict[str, Any]) -> Callable[..., Any]:
    """The page's ``residual_m`` with JAX's recipe for ``solve(m, b)``."""
    inverse, solve_fwd, system = docs["inverse"], docs["solve_fwd"], docs["system"]

    def fwd(m, b):  # x and M^-1: the residuals the tangent needs
        x, (m_inv, _) = solve_fwd(m, b)
        return x, m_inv

    host_solve, host_fwd = (
        _per_element(lambda m, b: (inverse(m) @ b,)),
        _per_element(fwd),
    )

    @jax.custom_jvp
    def solve(m, b):
        out = S(b.shape, jnp.float64)
        return jax.pure_callback(host_solve, (out,), m, b, vmap_method="broadcast_all")[
            0
        ]

    @solve.defjvp
    def solve_jvp(primals, tangents):
        (m, b), (dm, db) = primals, tangents
        outs = (S(b.shape, jnp.float64), S(m.shape, jnp.float64))
        x, m_inv = jax.pure_callback(host_fwd, outs, m, b, vmap_method="broadcast_all")
        return x, jnp.einsum(
            "...ij,...j->...i", m_inv, db - jnp.einsum("...ij,...j->...i", dm, x)
        )

    def residual(p, A, W, U, b, y):
        m = jax.vmap(system, (None, 0, 0, 0))(p, A, W, U)
        return jax.vmap(solve)(m, b) - y

    return residual


SIDES: dict[str, Callable[[dict[str, Any]], Callable[..., Any]]] = {
    "solve(m, b)": lambda docs: docs["residual_m"],
    "solve_p(p)": lambda docs: docs["residual_p"],
    "recipe": recipe,
}
KERNEL_SIDES = ("solve(m, b)", "solve_p(p)")


def runs(n: int, m: int) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    """Per side, a thunk running one step to its end; and its factorizations
    per element per step."""
    docs = docs_program(m)
    data, p = docs["problem"](n), jnp.array([0.5, 0.5, 0.5])
    thunks, factorizations = {}, {}
    for side, make in SIDES.items():
        step = docs["gauss_newton"](make(docs))
        thunks[side] = functools.partial(
            lambda step: jax.block_until_ready(step(p, data)), step
        )
        thunks[side]()  # compiles
        docs["factorized"].clear()
        thunks[side]()
        factorizations[side] = len(docs["factorized"]) / n
    return thunks, factorizations


def report(times: dict[tuple[int, int], tuple[dict, dict]]) -> str:
    lines = [
        f"float64, best of {REPS} reps, sides alternated, load average "
        f"{os.getloadavg()[0]:.1f}; ms per step (CPU ms) [factorizations per "
        "element per step]",
        "| elements | system | "
        + " | ".join(f"`{s}`" for s in SIDES)
        + " | "
        + " | ".join(f"`{s}` / recipe (CPU)" for s in KERNEL_SIDES)
        + " |",
        "|---|---|" + "---|" * (len(SIDES) + len(KERNEL_SIDES)),
    ]
    for (n, m), (best, count) in times.items():
        ms = " | ".join(
            f"{best[s][0] * 1e3:.1f} ({best[s][1] * 1e3:.0f}) [{count[s]:g}]"
            for s in SIDES
        )
        ratios = " | ".join(
            f"{best[s][0] / best['recipe'][0]:.2f} "
            f"({best[s][1] / best['recipe'][1]:.2f})"
            for s in KERNEL_SIDES
        )
        lines.append(f"| {n} | {m} x {m} | {ms} | {ratios} |")
    return "\n".join(lines)


def measure(n: int, m: int) -> tuple[dict, dict]:
    thunks, factorizations = runs(n, m)
    return harness.alternate(thunks, REPS), factorizations


# --- pytest ---------------------------------------------------------------------------


def test_sides_compute_the_same_step():
    docs = docs_program(4)
    data, p = docs["problem"](16), jnp.array([0.5, 0.5, 0.5])
    want = docs["gauss_newton"](docs["residual_jnp"])(p, data)
    for side, make in SIDES.items():
        got = docs["gauss_newton"](make(docs))(p, data)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-9, err_msg=side)
    counts = runs(16, 4)[1]
    assert counts == {"solve(m, b)": 2, "solve_p(p)": 2, "recipe": 3}


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("size", SIZES, ids=[f"{n}x{m}" for n, m in SIZES])
def test_gauss_newton_step(benchmark, side, size):
    run = runs(*size)[0][side]
    benchmark.group = f"Gauss-Newton step: {size[0]} elements, {size[1]} x {size[1]}"
    benchmark.pedantic(run, rounds=REPS, warmup_rounds=1, iterations=1)


if __name__ == "__main__":
    print(report({size: measure(*size) for size in SIZES}))
