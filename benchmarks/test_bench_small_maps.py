"""Small maps against one host callback that loops over the same elements.

Inside ``jax.jit``, a map of ``n`` elements (16, 128 and 1,024) of a Cholesky
solve of a 4 x 4 SPD system per element, ``jit(vmap(threadmap(solve)))`` on the
default pool, against JAX's recipe for a host function on a small batch: one
``jax.pure_callback`` (no ``vmap``) whose callback loops over the elements on
NumPy views, writing into a preallocated result (issue 57: "small maps at the
floor"). The kernel is the same Python function on both sides and holds the GIL
for most of its ~10 us, so threads cannot make it faster: what a map adds to a
loop is its own cost. The sides alternate round by round; each round is the
best of ``BEST_OF`` runs, and each side reports its best round, as seconds per
element in ``extra_info`` (pytest-benchmark's own timing of the whole
measurement means little here).

Run alone: ``python benchmarks/test_bench_small_maps.py`` prints the ratios.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import threadmap

SIZES = (16, 128, 1024)
SYSTEM = 4
ROUNDS, BEST_OF = 15, 5
#: Target ratio threadmap / loop per size (issue 57).
TARGETS = {16: 1.1, 128: 1.0, 1024: 1.0}
F32 = np.float32
TITLE = "Cholesky solve of a 4 x 4 system per element, inside `jax.jit`"


def cholesky_solve(m: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One element: ``m^-1 b`` for an SPD ``m``, by Cholesky."""
    lower = np.linalg.cholesky(m)
    return np.linalg.solve(lower.T, np.linalg.solve(lower, b))


def _loop(m: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The recipe's callback: every element in a loop, written in place."""
    m, b = np.asarray(m), np.asarray(b)  # (JAX may pass jax.Arrays)
    out = np.empty(b.shape, b.dtype)
    for i in range(len(b)):
        out[i] = cholesky_solve(m[i], b[i])
    return out


def inputs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, SYSTEM, SYSTEM))
    m = q @ np.swapaxes(q, -1, -2) + SYSTEM * np.eye(SYSTEM)
    return m.astype(F32), rng.standard_normal((n, SYSTEM)).astype(F32)


def runs(n: int) -> dict[str, Callable[[], jax.Array]]:
    """Per side, a thunk running the compiled program to its end."""
    m, b = (jax.device_put(a) for a in inputs(n))
    out = jax.ShapeDtypeStruct((SYSTEM,), jnp.float32)
    mapped = jax.vmap(lambda m, b: threadmap(cholesky_solve, out, m, b))
    batch = jax.ShapeDtypeStruct((n, SYSTEM), jnp.float32)
    looped = lambda m, b: jax.pure_callback(_loop, batch, m, b)  # noqa: E731
    compiled = {
        side: jax.jit(f).lower(m, b).compile()
        for side, f in (("threadmap", mapped), ("loop", looped))
    }
    return {
        side: (lambda c=c: jax.block_until_ready(c(m, b)))
        for side, c in compiled.items()
    }


def _best(run: Callable[[], object]) -> float:
    times = []
    for _ in range(BEST_OF):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return min(times)


def alternate(sides: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each side's best time, the sides alternated round by round (which runs
    first alternates too)."""
    for run in sides.values():
        run()  # warm: the pool's threads, the kernel's first call
    best = dict.fromkeys(sides, float("inf"))
    keys = list(sides)
    for r in range(ROUNDS):
        for side in keys if r % 2 == 0 else keys[::-1]:
            best[side] = min(best[side], _best(sides[side]))
    return best


@pytest.mark.parametrize("n", SIZES)
def test_small_map(measure, benchmark, n):
    sides = runs(n)
    m, b = inputs(n)
    want = np.stack([cholesky_solve(m[i], b[i]) for i in range(n)])
    for run in sides.values():
        np.testing.assert_allclose(np.asarray(run()), want, rtol=1e-5, atol=1e-6)
    best: dict[str, float] = {}
    measure(
        lambda: best.update(alternate(sides)),
        group=f"small-map-{n}",
        rounds=1,
        warmup=0,
        case=f"small-map-{n}",
        method="alternating",
        title=TITLE,
        elements=n,
        batch_elements=n,
    )
    benchmark.extra_info.update({side: t / n for side, t in best.items()})
    benchmark.extra_info["target"] = TARGETS[n]


if __name__ == "__main__":
    import os

    print(f"{TITLE}; best of {ROUNDS} rounds of {BEST_OF}, sides alternated")
    for n in SIZES:
        best = alternate(runs(n))
        ratio = best["threadmap"] / best["loop"]
        print(
            f"{n:5d} elements: threadmap {best['threadmap'] * 1e6:8.0f} us, "
            f"loop {best['loop'] * 1e6:8.0f} us, threadmap / loop {ratio:.2f} "
            f"(target {TARGETS[n]}), load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
