"""The built-in demo: a 3-level nested vmap of a GIL-releasing kernel, timed.

It prints the jaxpr (one ``threadmap`` equation for three ``vmap`` levels), then
times ``jax.pure_callback(vmap_method="sequential")`` and ``threadmap`` at a few
thread counts and prints the speedups. Kernels, inputs and baselines come from
:mod:`jax_threadmap._baselines`, as in ``benchmarks/``, so the demo's numbers are
the benchmarks' numbers.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

from . import _baselines as B
from ._api import threadmap

DESCRIPTION = """\
Shows what jax_threadmap does, on this machine, in under a minute.

A kernel written for one element runs under a 3-level nested jax.vmap
(SIZE x SIZE x SIZE elements). The demo prints the jaxpr, where the three vmap
levels fold into a single `threadmap` equation, then times the whole batch with
jax.pure_callback(vmap_method="sequential") and with threadmap at a few thread
counts, and prints wall times and speedups. The sequential baseline runs on the
first elements only and is extrapolated per element (marked *).

Kernels: `sort` (default) sorts a window of 100k float32 per element, CPU-bound;
NumPy releases the GIL, so it scales up to the number of cores. `sleep` sleeps
1 ms per element, like a network or disk wait; it scales with threads far beyond
the cores. They are the `sort` and `sleep` cases of benchmarks/, with the same
inputs, so the numbers match.
"""


def default_threads(kernel: str) -> list[int]:
    """1, 2, 4, ... up to the CPUs, and twice the CPUs (sort); up to 32 (sleep)."""
    if kernel == "sleep":
        return [1, 4, 16, 32]
    cpus = B.num_cpus()
    counts = [2**k for k in range(int(math.log2(cpus)) + 1)]
    return sorted({*counts, cpus, 2 * cpus})


def _thread_list(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers like 1,2,4; got {text!r}"
        )
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jax_threadmap",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--kernel",
        choices=["sort", "sleep"],
        default="sort",
        help="the per-element kernel (default: sort)",
    )
    parser.add_argument(
        "--size",
        type=int,
        default=B.NESTED_SHAPE[0],
        metavar="SIZE",
        help="the batch is SIZE x SIZE x SIZE elements (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=_thread_list,
        metavar="N,N,...",
        help="thread counts to time threadmap with (default: 1, 2, 4, ... up to "
        "twice the CPUs for sort; 1,4,16,32 for sleep)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="timed runs per row; the median is shown (default: %(default)s)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also write a speedup-versus-threads plot (needs matplotlib: "
        "pip install 'jax_threadmap[plot]')",
    )
    args = parser.parse_args(argv)
    if args.size < 1 or args.rounds < 1:
        parser.error("--size and --rounds must be positive")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                "--plot needs matplotlib; install it with "
                "pip install 'jax_threadmap[plot]'"
            )
    if args.threads is None:
        args.threads = default_threads(args.kernel)
    return args


def _progress(step: int, steps: int, label: str) -> None:
    sys.stdout.flush()  # keeps the order of both streams when they are piped
    print(f"[{step}/{steps}] {label} ...", end="", file=sys.stderr, flush=True)


def _done(seconds: float) -> None:
    print(f" {seconds:.2f} s", file=sys.stderr, flush=True)


def _timed(run, rounds: int) -> tuple[np.ndarray, float]:
    """The flat result of the first run, and the median seconds of ``rounds``."""
    t = time.perf_counter()
    result = np.asarray(run()).reshape(-1)
    times = [time.perf_counter() - t, *B.time_runs(run, rounds - 1)]
    seconds = B.median(times)
    _done(seconds)
    return result, seconds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    case = B.CASES[args.kernel]
    inputs = case.inputs((args.size,) * 3)
    n = inputs.size
    subset = inputs.subset(min(case.sequential_subset, n))

    def model(*arrays):
        return threadmap(case.kernel, case.out, *arrays, executor=case.workers)

    print(f"Kernel: {case.title}.")
    print(f"Batch: a 3-level nested vmap of {args.size}^3 = {n} elements.\n")
    jaxpr = jax.make_jaxpr(B.nest(model, inputs))(*inputs.arrays)
    print("jax.make_jaxpr(vmap(vmap(vmap(model)))):")
    print(jaxpr)
    eqns = sum(e.primitive.name == "threadmap" for e in jaxpr.eqns)
    print(f"-> {eqns} `threadmap` equation for 3 nested vmaps.\n")

    steps = 1 + len(args.threads)
    rows = []  # (method, threads, elements timed, seconds for the full batch)
    with B.OtherLoad() as load:
        _progress(1, steps, f"pure_callback sequential on {subset.size} elements")
        expected, t = _timed(B.sequential_runner(case, subset), args.rounds)
        rows.append(("pure_callback sequential", 1, subset.size, t / subset.size * n))
        ok = True
        for i, threads in enumerate(args.threads, start=2):
            label = f"{threads} thread{'s' * (threads > 1)}"
            _progress(i, steps, f"threadmap, {label}, {n} elements")
            got, t = _timed(B.threadmap_runner(case, inputs, threads), args.rounds)
            ok = ok and np.array_equal(got[: expected.size], expected)
            rows.append(("threadmap", threads, n, t))
    print(format_table(rows, n, B.num_cpus()))
    if load.cores is not None and load.cores > 0.25:
        print(
            f"Note: other processes kept {load.cores:.1f} CPUs busy during the "
            "timings; the numbers are slower than on a quiet machine."
        )
    print(f"Results match pure_callback: {ok}.")
    if args.kernel == "sort":
        print(
            "Try --kernel sleep for an I/O-like kernel, which scales with threads "
            "far beyond the CPUs."
        )
    if args.plot:
        plot(rows, args.plot, case)
        print(f"Wrote {args.plot}.")
    return 0 if ok else 1


def format_table(rows, n: int, cpus: int) -> str:
    """The demo's table; speedups are against the sequential row."""
    sequential = rows[0][3]
    lines = [
        f"\n{'method':<26}{'threads':>8}{'wall time':>12}{'per element':>14}"
        f"{'speedup':>10}",
        "-" * 70,
    ]
    for method, threads, timed, seconds in rows:
        star = "*" if timed < n else ""
        lines.append(
            f"{method:<26}{threads:>8}{seconds:>11.3f}s{star or ' '}"
            f"{seconds / n * 1e3:>11.3f} ms{sequential / seconds:>9.1f}x"
        )
    lines.append("-" * 70)
    if any(timed < n for _, _, timed, _ in rows):
        timed = min(r[2] for r in rows)
        lines.append(f"* timed on the first {timed} elements, extrapolated to {n}.")
    lines.append(f"This machine: {cpus} CPUs.")
    return "\n".join(lines)


def plot(rows, path: str, case: B.Case) -> None:
    """Writes speedup over ``pure_callback`` sequential versus threads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sequential = rows[0][3]
    pts = sorted((threads, sequential / s) for _, threads, _, s in rows[1:])
    threads = [p[0] for p in pts]
    speedup = [p[1] for p in pts]
    cpus = B.num_cpus()
    # Ideal: the 1-thread speedup times the threads that can run at once (all of
    # them for a waiting kernel, at most one per CPU for a CPU-bound one).
    per_thread = speedup[0] / threads[0]
    ideal = [per_thread * (min(t, cpus) if case.cpu_bound else t) for t in threads]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(threads, speedup, "o-", label="threadmap")
    ax.plot(threads, ideal, "--", color="gray", label="ideal")
    ax.axvline(cpus, color="tab:red", lw=0.8, ls=":", label=f"{cpus} CPUs")
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(threads, [str(t) for t in threads])
    ax.set_xlabel("threads")
    ax.set_ylabel("speedup over pure_callback sequential")
    ax.set_title(f"kernel {case.kernel.__name__}, 3 nested vmaps", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
