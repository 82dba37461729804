"""Per-call time of an AsyncArray's operators against the same on a jax.Array.

``x + i``, ``x * np.float32(s)`` (a new ``i`` or ``s`` at every call), ``x[i]``
(a new row at every call) and ``x.sum()`` on a (256, 64) float32: on a
``jax.Array``, on a landed ``AsyncArray`` (JAX's own operator on the value, its
result an ``AsyncArray``) and on a pending one (the call returns at once: a
deferred program, run when the data lands). Each figure is the time of a batch of
``CALLS`` calls (dispatch only: the batch's last result is waited for after the
clock stops), best of ``BEST_OF`` batches, the three subjects alternating batch
by batch, median over ``ROUNDS`` rounds; the target is at most 2x the
``jax.Array`` (issue 56).

Run:
    pytest benchmarks/test_bench_operators.py --benchmark-only   # + the report row
    python benchmarks/test_bench_operators.py                    # just the ratios
"""

from __future__ import annotations

import gc
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_threadmap as jtm

SHAPE = (256, 64)
CALLS, BEST_OF, ROUNDS = 100, 5, 5
DATA = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) / 1e3

#: name -> the k-th call's use of an array (a new scalar or row each call).
CASES = {
    "x + i": lambda x, k: x + k,
    "x * np.float32(s)": lambda x, k: x * np.float32(k * 0.25),
    "x[i]": lambda x, k: x[k % SHAPE[0]],
    "x.sum()": lambda x, k: x.sum(),
}
SUBJECTS = ("jax.Array", "landed", "pending")


def _batch(use, x, start: int) -> float:
    gc.collect()  # the garbage of one subject's batch is not the next one's cost
    t = time.perf_counter()
    for k in range(start, start + CALLS):
        y = use(x, k)
    elapsed = time.perf_counter() - t
    if not isinstance(y, jtm.AsyncArray) or y.done():
        jax.block_until_ready(y)  # (a pending result waits for the release)
    return elapsed / CALLS


def measure_case(name: str) -> dict[str, float]:
    """Seconds per call of case ``name`` on each subject (median of rounds of
    the best of ``BEST_OF`` batches, subjects alternating), and the ratios."""
    use = CASES[name]
    release = threading.Event()
    spec = jax.ShapeDtypeStruct(SHAPE, np.float32)
    landed = jtm.async_call(lambda: DATA, spec)
    pending = jtm.async_call(lambda: release.wait(600) and DATA, spec)
    subjects = {"jax.Array": jnp.asarray(DATA), "landed": landed.block_until_ready()}
    subjects["pending"] = pending
    outs = {s: use(x, 1) for s, x in subjects.items()}  # warm: compiles, traces
    rounds: dict[str, list[float]] = {s: [] for s in SUBJECTS}
    start = 0
    try:
        for _ in range(ROUNDS):
            best = dict.fromkeys(SUBJECTS, float("inf"))
            for _ in range(BEST_OF):
                for s in SUBJECTS:
                    best[s] = min(best[s], _batch(use, subjects[s], start))
                start += CALLS
            for s in SUBJECTS:
                rounds[s].append(best[s])
    finally:
        release.set()
    want = np.asarray(use(subjects["jax.Array"], 1))
    for s in ("landed", "pending"):
        np.testing.assert_array_equal(np.asarray(outs[s]), want, err_msg=s)
    times = {s: statistics.median(t) for s, t in rounds.items()}
    return {
        **times,
        "landed / jax.Array": times["landed"] / times["jax.Array"],
        "pending / jax.Array": times["pending"] / times["jax.Array"],
    }


@pytest.mark.parametrize("name", list(CASES))
def test_operator(measure, benchmark, name):
    got: dict[str, float] = {}
    measure(
        lambda: got.update(measure_case(name)),
        group="operators",
        rounds=1,
        warmup=0,
        case=name,
        method=name,
        elements=1,
        batch_elements=1,
    )
    benchmark.extra_info.update(got)


def main() -> None:
    print(f"per call, {SHAPE} float32, best of {BEST_OF} x {CALLS} calls:")
    for name in CASES:
        r = measure_case(name)
        print(
            f"{name:18} jax.Array {r['jax.Array'] * 1e6:7.1f} us | landed "
            f"{r['landed'] * 1e6:7.1f} us ({r['landed / jax.Array']:.2f}x) | pending "
            f"{r['pending'] * 1e6:7.1f} us ({r['pending / jax.Array']:.2f}x)"
        )


if __name__ == "__main__":
    main()
