"""threadmap against the baselines on a 3-level nested vmap of 16 x 16 x 16.

Each case runs all its baselines in this process, one after the other. The slow
baselines (``sequential``, and the ``bare_loop`` that measures the serial kernel
time of the sleeping and sorting kernels) run on the leading
``case.sequential_subset`` elements; the report extrapolates their per-element
time to the full batch and says so.
"""

from __future__ import annotations

import harness as B
import numpy as np
import pytest

# (case, method, rounds): about a second or a few per benchmark on 2 cores.
PLAN = [
    ("trivial", "threadmap", 30),
    ("trivial", "bare_loop", 30),
    ("trivial", "recipe", 10),
    ("trivial", "sequential", 3),
    ("sleep", "threadmap", 10),
    ("sleep", "bare_loop", 3),
    ("sleep", "recipe", 5),
    ("sleep", "sequential", 3),
    ("sort", "threadmap", 3),
    ("sort", "bare_loop", 3),
    ("sort", "recipe", 3),
    ("sort", "sequential", 3),
]


def timed_inputs(case: B.Case, method: str) -> B.Inputs:
    full = case.inputs(B.NESTED_SHAPE)
    serial = method == "sequential" or (
        method == "bare_loop" and case.name != "trivial"
    )
    return full.subset(case.sequential_subset) if serial else full


@pytest.mark.parametrize(
    "case_name,method,rounds", PLAN, ids=[f"{c}-{m}" for c, m, _ in PLAN]
)
def test_compare(measure, case_name, method, rounds):
    case = B.CASES[case_name]
    inputs = timed_inputs(case, method)
    run = B.RUNNERS[method](case, inputs)
    # Warm-up round: also checks that every baseline computes the same thing.
    expected = B.reference(case, inputs.subset(case.sequential_subset)).reshape(-1)
    got = np.asarray(run()).reshape(-1)[: expected.size]
    np.testing.assert_array_equal(got, expected)
    measure(
        run,
        group=f"compare-{case_name}",
        rounds=rounds,
        warmup=0,
        case=case_name,
        method=method,
        title=case.title,
        elements=inputs.size,
        batch_elements=int(np.prod(B.NESTED_SHAPE)),
        batch_shape=list(inputs.batch_shape),
        workers=case.num_workers,
        cpus=B.num_cpus(),
        cpu_bound=case.cpu_bound,
    )
