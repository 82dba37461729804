"""How much of the loading an Equinox, Optax or Flax training loop hides when it
runs, unchanged, on batches that are still loading (``async_call``).

For each loop of ``tests/library_loops.py`` (the loops of docs/async-libraries.md),
three ways, in turn each round, best of ``--rounds``:

- steps alone: the loop on ready batches (compiled beforehand);
- loads alone: ``--steps`` loads of ``--load-ms`` each started at once on the async
  pool, then waited for;
- the loop on loading batches: the loads started, then the loop run on them at once.

Overlap means the third is well under the sum of the first two.

Usage::

    PYTHONPATH=. python benchmarks/library_loops.py [--steps 40] [--load-ms 20]

Not collected by pytest (not a ``test_`` file): a measurement, whose numbers are in
docs/async-libraries.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from library_loops import LOOPS, NEEDS, loading, ready  # noqa: E402


def _timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _best_of(loop, rounds: int, steps: int, seconds: float) -> dict[str, float]:
    best = {"steps": float("inf"), "loads": float("inf"), "both": float("inf")}
    for _ in range(rounds):
        batches = ready(steps)
        times = {
            "steps": _timed(lambda: loop(batches)),  # noqa: B023 - called here
            "loads": _timed(lambda: [b[0].result() for b in loading(steps, seconds)]),
            "both": _timed(lambda: loop(loading(steps, seconds))),
        }
        best = {k: min(best[k], times[k]) for k in best}
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--load-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    seconds = args.load_ms / 1000
    platform = jax.devices()[0].platform
    print(
        f"jax {jax.__version__}, {platform}, {args.steps} steps, "
        f"{args.load_ms:g} ms loads, best of {args.rounds} rounds"
    )
    print("| loop | steps alone | loads alone | loop on loading batches |")
    print("|---|---|---|---|")
    for name, loop in LOOPS.items():
        if any(importlib.util.find_spec(p) is None for p in NEEDS[name]):
            print(f"| {name} | (not installed) | | |")
            continue
        for batches in (ready(3), loading(3, 0.0), loading(3, 0.0)):
            jax.block_until_ready(loop(batches))  # compile both ways
        best = _best_of(loop, args.rounds, args.steps, seconds)
        print(
            f"| {name} | {best['steps']:.3f} s | {best['loads']:.3f} s | "
            f"{best['both']:.3f} s |"
        )


if __name__ == "__main__":
    main()
