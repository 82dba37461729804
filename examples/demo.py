"""The demo (``python -m examples.demo`` from the repository's root): a 3-level
nested vmap of a GIL-releasing kernel, timed.

It prints the jaxpr (one ``threadmap`` equation for three ``vmap`` levels), then
times ``jax.pure_callback(vmap_method="sequential")`` and ``threadmap`` at a few
thread counts and prints the speedups. Its kernels, inputs and runners (below)
are also the ``sleep`` and ``sort`` cases of ``benchmarks/``, which import them,
so the demo's numbers are the benchmarks' numbers. It is not part of the
installed package: nothing of the library imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_threadmap import threadmap


def available_cpus() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# --- kernels and inputs ---------------------------------------------------------------

#: Length of the window that :func:`window_median` sorts.
SORT_SIZE = 100_000
#: Distinct window starts, so that neighbouring elements sort different data.
SORT_OFFSETS = 4096


def counting_inputs(batch_shape: tuple[int, ...]) -> tuple[tuple, tuple]:
    """One batched float32 argument counting 0, 1, 2, ... over the batch."""
    x = np.arange(math.prod(batch_shape), dtype=np.float32).reshape(batch_shape)
    return (x,), (True,)


def sleep_1ms(x: np.ndarray) -> np.ndarray:
    """I/O-like kernel: ``time.sleep`` releases the GIL, like a network wait."""
    time.sleep(1e-3)
    return x


def window_median(table: np.ndarray, start: np.ndarray) -> np.ndarray:
    """CPU-bound kernel: sorts a window of 100k floats (NumPy releases the GIL)."""
    i = int(start)
    return np.sort(table[i : i + SORT_SIZE])[SORT_SIZE // 2]


def window_inputs(batch_shape: tuple[int, ...]) -> tuple[tuple, tuple]:
    """An unbatched table of random floats and a batched window start per element."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal(SORT_SIZE + SORT_OFFSETS).astype(np.float32)
    n = math.prod(batch_shape)
    starts = (np.arange(n, dtype=np.int32) % SORT_OFFSETS).reshape(batch_shape)
    return (table, starts), (False, True)


# --- cases ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """A kernel with its inputs, its result and the threads it is run with.

    Attributes:
        name: Short name used by the benchmarks, the demo and the report.
        title: One line for tables.
        kernel: The per-element kernel, a function of NumPy arrays.
        out: One element's result.
        workers: Threads for ``threadmap`` and the recipe; ``None`` means the
            shared pool (one thread per CPU unless the environment says more).
        sequential_subset: Elements that the slow baselines (``sequential``,
            and ``bare_loop`` when it measures the serial kernel time) run; their
            per-element time is extrapolated to the full batch.
        make_arrays: ``batch_shape -> (arrays, batched)``; batched arrays lead
            with ``batch_shape``, unbatched ones are passed whole to every element.
        cpu_bound: Whether the kernel keeps a CPU busy (so that its ideal
            depends on how many CPUs are free), rather than waiting.
    """

    name: str
    title: str
    kernel: Callable[..., Any]
    out: jax.ShapeDtypeStruct
    workers: int | None
    sequential_subset: int
    make_arrays: Callable[[tuple[int, ...]], tuple[tuple, tuple]] = counting_inputs
    cpu_bound: bool = False

    def inputs(self, batch_shape: Sequence[int]) -> Inputs:
        """Inputs for a batch: NumPy arrays, each batched or unbatched."""
        batch_shape = tuple(int(s) for s in batch_shape)
        arrays, batched = self.make_arrays(batch_shape)
        return Inputs(batch_shape, arrays, batched)

    @property
    def num_workers(self) -> int:
        return available_cpus() if self.workers is None else self.workers


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The arguments of one batch; batched ones lead with ``batch_shape``."""

    batch_shape: tuple[int, ...]
    arrays: tuple[np.ndarray, ...]
    batched: tuple[bool, ...]

    @property
    def size(self) -> int:
        return math.prod(self.batch_shape)

    def subset(self, max_elements: int) -> Inputs:
        """The leading part of the batch with at most ``max_elements`` elements.

        The outermost levels shrink first, so the subset is a prefix of the flat
        batch and keeps the nesting depth.
        """
        shape = list(self.batch_shape)
        for d in range(len(shape)):
            inner = math.prod(shape[d + 1 :])
            if inner * shape[d] <= max_elements:
                break
            shape[d] = max(1, max_elements // inner)
            if inner * shape[d] <= max_elements:
                break
        index = tuple(slice(0, s) for s in shape)
        arrays = tuple(
            a[index] if b else a for a, b in zip(self.arrays, self.batched, strict=True)
        )
        return Inputs(tuple(shape), arrays, self.batched)


CASES: dict[str, Case] = {
    "sleep": Case(
        "sleep",
        "kernel sleeping 1 ms (releases the GIL), 32 threads",
        sleep_1ms,
        jax.ShapeDtypeStruct((), jnp.float32),
        workers=32,
        sequential_subset=512,
    ),
    "sort": Case(
        "sort",
        "CPU-bound kernel: `np.sort` of 100k float32 (releases the GIL), all cores",
        window_median,
        jax.ShapeDtypeStruct((), jnp.float32),
        workers=available_cpus(),
        sequential_subset=256,
        make_arrays=window_inputs,
        cpu_bound=True,
    ),
}

#: The batch of the comparison cases: a 3-level nested vmap of 16 x 16 x 16.
NESTED_SHAPE = (16, 16, 16)


# --- runners --------------------------------------------------------------------------


def nest(fn: Callable[..., Any], inputs: Inputs) -> Callable[..., Any]:
    """``fn`` under one ``vmap`` per batch level (unbatched arguments: ``None``)."""
    in_axes = tuple(0 if b else None for b in inputs.batched)
    for _ in inputs.batch_shape:
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn


def compiled_thunk(fn: Callable[..., Any], inputs: Inputs) -> Callable[[], Any]:
    """Compiles ``jit(fn)`` for ``inputs``; returns a thunk running it to the end."""
    args = [jax.device_put(a) for a in inputs.arrays]
    compiled = jax.jit(fn).lower(*args).compile()

    def run() -> Any:
        return jax.block_until_ready(compiled(*args))

    return run


def threadmap_runner(
    case: Case, inputs: Inputs, executor: int | None | Any = "case"
) -> Callable[[], Any]:
    """Runs the batch with ``threadmap`` (``executor`` defaults to the case's)."""
    executor = case.workers if executor == "case" else executor

    def f(*args: Any) -> Any:
        return threadmap(case.kernel, case.out, *args, executor=executor)

    return compiled_thunk(nest(f, inputs), inputs)


def _numpy_args(kernel: Callable[..., Any]) -> Callable[..., Any]:
    # pure_callback passes jax.Arrays; a user would convert them once, as here.
    def callback(*args: Any) -> Any:
        return kernel(*(np.asarray(a) for a in args))

    return callback


def sequential_runner(case: Case, inputs: Inputs) -> Callable[[], Any]:
    """Runs the batch with ``jax.pure_callback(vmap_method="sequential")``."""
    callback = _numpy_args(case.kernel)

    def f(*args: Any) -> Any:
        return jax.pure_callback(callback, case.out, *args, vmap_method="sequential")

    return compiled_thunk(nest(f, inputs), inputs)


# --- timing ---------------------------------------------------------------------------


def time_runs(run: Callable[[], Any], rounds: int) -> list[float]:
    """Wall-clock seconds of ``rounds`` calls of ``run``."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return times


def median(times: Sequence[float]) -> float:
    """The statistic the demo and the report use for every comparison."""
    return statistics.median(times)


# --- other load on the machine --------------------------------------------------------


class OtherLoad:
    """Measures the CPU that other processes use while a block runs.

    Timings on a shared machine are only as good as the machine is quiet, so the
    demo and the benchmarks record this next to every number. ``cores`` is the
    average number of CPUs busy with other processes (``None`` off Linux).

    Example:
        >>> with OtherLoad() as load:
        ...     pass
        >>> load.cores is None or load.cores >= 0
        True
    """

    cores: float | None = None

    @staticmethod
    def _busy_seconds() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal ...: all but idle/iowait.
        busy = sum(fields[:3]) + sum(fields[5:8])
        return busy / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_seconds() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __enter__(self) -> OtherLoad:
        self._start = (time.perf_counter(), self._busy_seconds(), self._own_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        wall = time.perf_counter() - wall0
        busy = self._busy_seconds()
        if busy is None or busy0 is None or wall <= 0:
            return
        other = (busy - busy0) - (self._own_seconds() - own0)
        self.cores = max(0.0, other / wall)


#: A row of the demo's table: method, threads, elements timed, seconds for the batch.
#: ... and the CPUs other processes kept busy while it ran (None off Linux).
Row = tuple[str, int, int, float, float | None]

#: Seconds that one round of the 1-thread row should take: the rows are timed on
#: as many elements of the batch as fit, so that several rounds fit in a minute.
ROW_SECONDS = 2.0
#: Rows taken while other processes kept more CPUs busy than this are marked.
NOISY_CORES = 0.25

# --- the command line -----------------------------------------------------------------

DESCRIPTION = """\
Shows what jax_threadmap does, on this machine, in under a minute.

A kernel written for one element runs under a 3-level nested jax.vmap
(SIZE x SIZE x SIZE elements). The demo prints the jaxpr, where the three vmap
levels fold into a single `threadmap` equation, then times the batch with
jax.pure_callback(vmap_method="sequential") and with threadmap at a few thread
counts, and prints wall times and speedups for the whole batch. Each row is the
median of --rounds runs. To fit in a minute, rows run on the first elements of the
batch (as many as one thread handles in about two seconds) and are extrapolated per
element (marked *). Rows taken while other processes kept CPUs busy are marked †.

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
    cpus = available_cpus()
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
        prog="python -m examples.demo",
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
        default=NESTED_SHAPE[0],
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
        default=3,
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


def _timed(run: Callable[[], Any], rounds: int) -> tuple[np.ndarray, float]:
    """The flat result of the first run, and the median seconds of ``rounds``."""
    t = time.perf_counter()
    result = np.asarray(run()).reshape(-1)
    times = [time.perf_counter() - t, *time_runs(run, rounds - 1)]
    seconds = median(times)
    _done(seconds)
    return result, seconds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    case = CASES[args.kernel]
    inputs = case.inputs((args.size,) * 3)
    n = inputs.size
    subset = inputs.subset(min(case.sequential_subset, n))

    def model(*arrays: Any) -> Any:
        return threadmap(case.kernel, case.out, *arrays, executor=case.workers)

    print(f"Kernel: {case.title}.")
    print(f"Batch: a 3-level nested vmap of {args.size}^3 = {n} elements.\n")
    jaxpr = jax.make_jaxpr(nest(model, inputs))(*inputs.arrays)
    print("jax.make_jaxpr(vmap(vmap(vmap(model)))):")
    print(jaxpr)
    eqns = sum(e.primitive.name == "threadmap" for e in jaxpr.eqns)
    print(f"-> {eqns} `threadmap` equation for 3 nested vmaps.\n")

    steps = 1 + len(args.threads)
    rows: list[Row] = []
    _progress(1, steps, f"pure_callback sequential on {subset.size} elements")
    with OtherLoad() as load:
        expected, t = _timed(sequential_runner(case, subset), args.rounds)
    rows.append(
        ("pure_callback sequential", 1, subset.size, t / subset.size * n, load.cores)
    )
    # The threadmap rows run on as much of the batch as one thread does in
    # about ROW_SECONDS (all of it when that fits), timed per element.
    per_element = t / subset.size
    timed = inputs.subset(max(subset.size, int(ROW_SECONDS / max(per_element, 1e-9))))
    ok = True
    for i, threads in enumerate(args.threads, start=2):
        label = f"{threads} thread{'s' * (threads > 1)}"
        _progress(i, steps, f"threadmap, {label}, {timed.size} elements")
        with OtherLoad() as load:
            got, t = _timed(threadmap_runner(case, timed, threads), args.rounds)
        ok = ok and np.array_equal(got[: expected.size], expected)
        rows.append(("threadmap", threads, timed.size, t / timed.size * n, load.cores))
    print(format_table(rows, n, available_cpus(), args.rounds))
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


def format_table(rows: list[Row], n: int, cpus: int, rounds: int = 1) -> str:
    """The demo's table; speedups are against the sequential row."""
    sequential = rows[0][3]
    lines = [
        f"\n{'method':<26}{'threads':>8}{'wall time':>12}{'per element':>14}"
        f"{'speedup':>10}",
        "-" * 71,
    ]
    for method, threads, timed, seconds, other in rows:
        star = "*" if timed < n else " "
        dagger = "†" if other is not None and other > NOISY_CORES else ""
        lines.append(
            f"{method:<26}{threads:>8}{seconds:>11.3f}s{star}"
            f"{seconds / n * 1e3:>11.3f} ms{sequential / seconds:>9.1f}x{dagger}"
        )
    lines.append("-" * 71)
    lines.append(f"Median of {rounds} round{'s' * (rounds > 1)} per row.")
    lines += _footnotes(rows, n, cpus)
    lines.append(f"This machine: {cpus} CPUs.")
    return "\n".join(lines)


def _footnotes(rows: list[Row], n: int, cpus: int) -> list[str]:
    """The table's notes on extrapolated rows (*) and rows taken while the
    machine was busy (†)."""
    lines = []
    for timed in sorted({r[2] for r in rows if r[2] < n}):
        which = ", ".join(f"{r[0]} ({r[1]})" for r in rows if r[2] == timed)
        lines.append(
            f"* timed on the first {timed} elements, extrapolated to {n}: {which}."
        )
    noisy = [r for r in rows if r[4] is not None and r[4] > NOISY_CORES]
    if noisy:
        busiest = max(r[4] or 0.0 for r in noisy)
        lines.append(
            f"† taken while other processes kept up to {busiest:.1f} of the {cpus} "
            "CPUs busy: slower than on a quiet machine."
        )
    return lines


def plot(rows: list[Row], path: str, case: Case) -> None:
    """Writes speedup over ``pure_callback`` sequential versus threads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sequential = rows[0][3]
    pts = sorted((r[1], sequential / r[3]) for r in rows[1:])
    threads = [p[0] for p in pts]
    speedup = [p[1] for p in pts]
    cpus = available_cpus()
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


if __name__ == "__main__":
    raise SystemExit(main())
