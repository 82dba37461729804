"""Vectorized kernels against their floors, side by side in one process.

- ``outer``: ``x + y + z`` over a 3-level nested vmap of 128 x 128 x 128, each
  operand batched at its own level, so every chunk gathers its slices. The floor
  is the same sum in NumPy on broadcast arrays (the two alternate round by
  round); the per-element map runs on a leading subset of the batch and is
  compared per element.
- ``sort_rows``: 2048 rows of 8192 float32, sorted by a GIL-releasing NumPy
  routine. The floor is the best a user writes by hand: one thread per core,
  each sorting a block of rows, without JAX. Also timed: a ``pure_callback``
  that only returns a preallocated result, the host callback's own cost. The
  three alternate round by round and each gets the median of its rounds.
- Peak memory of the outer sum at 256 x 256 x 256 in a fresh process, against
  inputs + outputs + the host callback's copy of the outputs + one chunk per
  worker.
"""

from __future__ import annotations

import statistics
import time

import harness as B
import numpy as np

OUTER_SUBSET = (1, 32, 128)  # 4096 elements for the per-element map
SORT_ROUNDS = 15
OUTER_ROUNDS = 30
OUTER_TITLE = "`x + y + z`, each batched at its own level of 3 nested vmaps"


def _outer_expected(arrays):
    x, y, z = arrays
    return x[:, None, None] + y[None, :, None] + z[None, None, :]


def test_outer(measure, benchmark):
    arrays = B.outer_inputs()
    runs = {
        "vectorized": B.outer_runner(arrays, True),
        "numpy": B.outer_numpy_runner(arrays),
    }
    for run in runs.values():
        np.testing.assert_allclose(
            np.asarray(run()), _outer_expected(arrays), rtol=1e-6
        )
    times = _Alternating(runs, OUTER_ROUNDS)
    elements = int(np.prod(B.VECTOR_SHAPE))
    measure(
        times.run,
        group="vectorized-outer",
        rounds=1,
        warmup=0,
        case="outer",
        method="alternating",
        title=OUTER_TITLE,
        elements=elements,
        batch_elements=elements,
    )
    benchmark.extra_info["per_element"] = times.medians(elements)


def test_outer_per_element(measure):
    arrays = tuple(a[:s] for a, s in zip(B.outer_inputs(), OUTER_SUBSET, strict=True))
    run = B.outer_runner(arrays, False)
    np.testing.assert_allclose(np.asarray(run()), _outer_expected(arrays), rtol=1e-6)
    measure(
        run,
        group="vectorized-outer",
        rounds=5,
        case="outer",
        method="per_element",
        title=OUTER_TITLE,
        elements=int(np.prod([a.size for a in arrays])),
        batch_elements=int(np.prod(B.VECTOR_SHAPE)),
    )


class _Alternating:
    """Times several runners round by round, so that a slow spell of a shared
    machine slows them alike; each gets the median of its rounds."""

    def __init__(self, runs, rounds):
        self.runs, self.rounds = runs, rounds
        self.times: dict[str, list[float]] = {m: [] for m in runs}

    def run(self):
        for _ in range(self.rounds):
            for method, run in self.runs.items():
                t = time.perf_counter()
                run()
                self.times[method].append(time.perf_counter() - t)

    def medians(self, elements):
        return {m: statistics.median(t) / elements for m, t in self.times.items()}


def test_sort_rows(measure, benchmark):
    rows = B.sort_rows_inputs()
    runs = {
        "vectorized": B.sort_rows_runner(rows),
        "hand_threads": B.hand_threads_runner(rows, B.num_cpus()),
        "callback_only": B.callback_only_runner(rows),
    }
    for run in runs.values():
        np.testing.assert_array_equal(np.asarray(run()), np.sort(rows, axis=-1))
    times = _Alternating(runs, SORT_ROUNDS)
    measure(
        times.run,
        group="vectorized-sort_rows",
        rounds=1,
        warmup=0,
        case="sort_rows",
        method="alternating",
        title=f"`np.sort` of rows of {rows.shape[1]} float32, {B.num_cpus()} threads",
        elements=rows.shape[0],
        batch_elements=rows.shape[0],
    )
    benchmark.extra_info["per_element"] = times.medians(rows.shape[0])


def test_vector_memory(measure, benchmark):
    result = {}
    measure(
        lambda: result.update(B.vector_peak_memory()),
        group="vectorized-memory",
        rounds=1,
        warmup=0,
        case="outer",
        method="vectorized",
    )
    benchmark.extra_info.update(result)
    assert result["added_bytes"] > 0
