"""Per-element cost of the trivial kernel as the batch grows and as it nests.

- size: 4k to 1M elements as ``(N // 256, 16, 16)``, a 3-level nested vmap.
  ``sequential`` runs only at 4k and the thread-pool recipe up to 64k: beyond
  that they take minutes and say nothing new.
- depth: the same 65536 elements as 1, 2, 4 and 8 nested vmap levels.

The bare loop (NumPy views, no JAX) is the per-element floor in both.
"""

from __future__ import annotations

import harness as B
import numpy as np
import pytest

CASE = B.CASES["trivial"]
SIZES = [2**12, 2**14, 2**16, 2**18, 2**20]
DEPTHS = {1: (2**16,), 2: (2**8,) * 2, 4: (2**4,) * 4, 8: (2**2,) * 8}

SIZE_PLAN = [
    (n, m)
    for n in SIZES
    for m in ("threadmap", "bare_loop", "recipe", "sequential")
    if m in ("threadmap", "bare_loop")
    or (m == "recipe" and n <= 2**16)
    or (m == "sequential" and n <= 2**12)
]


def rounds_for(n: int, method: str) -> int:
    # Enough rounds that each small batch is timed for about a second.
    if method in ("sequential", "recipe"):
        return 3
    return max(3, min(50, 3 * 2**18 // n))


def check(run, inputs):
    got = np.asarray(run()).reshape(-1)
    np.testing.assert_array_equal(got, inputs.arrays[0].reshape(-1) + 1)


@pytest.mark.parametrize("n,method", SIZE_PLAN, ids=[f"{n}-{m}" for n, m in SIZE_PLAN])
def test_size(measure, n, method):
    inputs = CASE.inputs((n // 256, 16, 16))
    run = B.RUNNERS[method](CASE, inputs)
    check(run, inputs)
    measure(
        run,
        group="scaling-size",
        rounds=rounds_for(n, method),
        warmup=0,
        case="trivial",
        method=method,
        elements=n,
        batch_elements=n,
        batch_shape=list(inputs.batch_shape),
        workers=CASE.num_workers,
    )


@pytest.mark.parametrize("method", ["threadmap", "bare_loop"])
@pytest.mark.parametrize("depth", list(DEPTHS))
def test_depth(measure, depth, method):
    inputs = CASE.inputs(DEPTHS[depth])
    run = B.RUNNERS[method](CASE, inputs)
    check(run, inputs)
    measure(
        run,
        group="scaling-depth",
        rounds=10,
        warmup=0,
        case="trivial",
        method=method,
        depth=depth,
        elements=inputs.size,
        batch_elements=inputs.size,
        batch_shape=list(inputs.batch_shape),
        workers=CASE.num_workers,
    )
