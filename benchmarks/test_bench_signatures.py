"""Per-element cost of every kernel signature against its floor, side by side.

Each case runs ``jit(vmap(threadmap(...)))`` over 4096 elements of a trivial
kernel, and its floor: a bare Python loop that indexes each operand as threadmap
does (``a[i, ...]``, a 0-d view) and calls the same kernel, writing into
preallocated outputs. Each figure is the median over rounds of the best of 5
runs, threadmap and its floor alternating round by round, so that a busy machine
slows both alike. pytest-benchmark's own timing of the whole measurement means
little here; the figures are in ``extra_info``.
"""

from __future__ import annotations

import statistics
import time

import harness as B
import numpy as np
import pytest

CASES = B.signature_cases()
ROUNDS, BEST_OF = 5, 5


def _close(got, want):
    for g, w in zip(
        got if isinstance(got, tuple) else (got,),
        want if isinstance(want, tuple) else (want,),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(g).reshape(-1), np.reshape(w, -1))


def _best(run) -> float:
    times = []
    for _ in range(BEST_OF):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return min(times)


@pytest.mark.parametrize("name", list(CASES))
def test_signature(measure, benchmark, name):
    case = CASES[name]()
    _close(case.threadmap_run(), case.expected)
    _close(case.floor_run(), case.expected)
    rounds: dict[str, list[float]] = {"threadmap": [], "floor": []}

    def alternate():
        for _ in range(ROUNDS):
            rounds["threadmap"].append(_best(case.threadmap_run))
            rounds["floor"].append(_best(case.floor_run))

    measure(
        alternate,
        group=f"signature-{name}",
        rounds=1,
        warmup=0,
        case=name,
        method="alternating",
        title=case.title,
        elements=B.SIGNATURE_ELEMENTS,
        batch_elements=B.SIGNATURE_ELEMENTS,
    )
    benchmark.extra_info.update(
        {m: statistics.median(t) / B.SIGNATURE_ELEMENTS for m, t in rounds.items()}
    )
