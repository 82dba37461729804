"""Kernels, baselines and timing shared by the demo and ``benchmarks/``.

The demo (``python -m jax_threadmap``) and the benchmark suite build every timed
call here, from the same kernels, inputs and batch shapes, so that they report
the same numbers. Each runner returns a thunk that runs a whole batch once and
blocks until the result is ready; compilation happens when the runner is built.

The ways to run a per-element kernel over a nested-vmap batch:

- ``threadmap``: this package.
- ``sequential``: ``jax.pure_callback(vmap_method="sequential")``, which calls the
  host once per element, one after the other.
- ``recipe``: the best user-side recipe without this package: ``pure_callback``
  with ``vmap_method="expand_dims"``, the batch shape recovered by broadcasting
  the leading dims of each argument (size-1 dims indexed at 0, so nothing is
  tiled), a new ``ThreadPoolExecutor`` per call mapping over a flat index, and
  ``np.stack`` of the list of results. It gets NumPy views of its arguments, not
  ``jax.Array`` s, which would cost about 1 ms more per element to index.
- ``bare_loop``: a Python loop calling the kernel on NumPy views, without JAX,
  writing into a preallocated output: the per-element floor of any Python-level
  map. On a subset of the batch it also measures the serial kernel time, from
  which ``ideal = serial time / workers``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._api import threadmap

# --- kernels ------------------------------------------------------------------------

#: Length of the window that :func:`window_median` sorts.
SORT_SIZE = 100_000
#: Distinct window starts, so that neighbouring elements sort different data.
SORT_OFFSETS = 4096


def add_one(x: np.ndarray) -> np.ndarray:
    """Trivial kernel: measures the per-element overhead of a map."""
    return x + 1


def sleep_1ms(x: np.ndarray) -> np.ndarray:
    """I/O-like kernel: ``time.sleep`` releases the GIL, like a network wait."""
    time.sleep(1e-3)
    return x


def window_median(table: np.ndarray, start: np.ndarray) -> np.ndarray:
    """CPU-bound kernel: sorts a window of 100k floats (NumPy releases the GIL)."""
    i = int(start)
    return np.sort(table[i : i + SORT_SIZE])[SORT_SIZE // 2]


def fill(x: np.ndarray, *, size: int) -> np.ndarray:
    """Large-output kernel for the memory benchmark: ``size`` float32 per element."""
    return np.full(size, x, np.float32)


def counting_inputs(batch_shape: tuple[int, ...]) -> tuple[tuple, tuple]:
    """One batched float32 argument counting 0, 1, 2, ... over the batch."""
    x = np.arange(math.prod(batch_shape), dtype=np.float32).reshape(batch_shape)
    return (x,), (True,)


def window_inputs(batch_shape: tuple[int, ...]) -> tuple[tuple, tuple]:
    """An unbatched table of random floats and a batched window start per element."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal(SORT_SIZE + SORT_OFFSETS).astype(np.float32)
    n = math.prod(batch_shape)
    starts = (np.arange(n, dtype=np.int32) % SORT_OFFSETS).reshape(batch_shape)
    return (table, starts), (False, True)


def num_cpus() -> int:
    """The CPUs this process may run on (what "all cores" means here)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


# --- cases --------------------------------------------------------------------------


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
        return num_cpus() if self.workers is None else self.workers


CASES: dict[str, Case] = {
    "trivial": Case(
        "trivial",
        "trivial kernel `x + 1` on a 0-d float32",
        add_one,
        jax.ShapeDtypeStruct((), jnp.float32),
        workers=None,
        sequential_subset=4096,
    ),
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
        workers=num_cpus(),
        sequential_subset=256,
        make_arrays=window_inputs,
        cpu_bound=True,
    ),
}

#: The batch of the comparison cases: a 3-level nested vmap of 16 x 16 x 16.
NESTED_SHAPE = (16, 16, 16)


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


def nest(fn: Callable[..., Any], inputs: Inputs) -> Callable[..., Any]:
    """``fn`` under one ``vmap`` per batch level (unbatched arguments: ``None``)."""
    in_axes = tuple(0 if b else None for b in inputs.batched)
    for _ in inputs.batch_shape:
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn


def _compiled_thunk(fn: Callable[..., Any], inputs: Inputs) -> Callable[[], Any]:
    args = [jax.device_put(a) for a in inputs.arrays]
    compiled = jax.jit(fn).lower(*args).compile()

    def run():
        return jax.block_until_ready(compiled(*args))

    return run


# --- the ways to run a batch --------------------------------------------------------


def threadmap_runner(
    case: Case, inputs: Inputs, executor: int | None | Any = "case"
) -> Callable[[], Any]:
    """Runs the batch with ``threadmap`` (``executor`` defaults to the case's)."""
    executor = case.workers if executor == "case" else executor

    def f(*args):
        return threadmap(case.kernel, case.out, *args, executor=executor)

    return _compiled_thunk(nest(f, inputs), inputs)


def _numpy_args(kernel: Callable[..., Any]) -> Callable[..., Any]:
    # pure_callback passes jax.Arrays; a user would convert them once, as here.
    def callback(*args):
        return kernel(*(np.asarray(a) for a in args))

    return callback


def sequential_runner(case: Case, inputs: Inputs) -> Callable[[], Any]:
    """Runs the batch with ``jax.pure_callback(vmap_method="sequential")``."""
    callback = _numpy_args(case.kernel)

    def f(*args):
        return jax.pure_callback(callback, case.out, *args, vmap_method="sequential")

    return _compiled_thunk(nest(f, inputs), inputs)


def threaded_pure_callback(
    kernel: Callable[..., Any],
    result_shape_dtype: jax.ShapeDtypeStruct,
    core_ranks: Sequence[int],
    num_threads: int,
) -> Callable[..., Any]:
    """The best user-side recipe: ``pure_callback`` + a thread pool per call.

    Args:
        kernel: The per-element kernel.
        result_shape_dtype: One element's result (a single array).
        core_ranks: The number of non-batch (trailing) dims of each argument,
            which the caller must state because ``expand_dims`` does not.
        num_threads: Threads of the pool created on each call.

    Returns:
        A function of the unbatched arguments, to be ``vmap``-ed.
    """
    out_shape = tuple(result_shape_dtype.shape)
    out_dtype = np.dtype(result_shape_dtype.dtype)

    def callback(*args):
        args = [np.asarray(a) for a in args]
        leads = [a.shape[: a.ndim - r] for a, r in zip(args, core_ranks, strict=True)]
        batch_shape = np.broadcast_shapes(*leads)
        # Per argument: its leading dims, right-aligned with the batch shape as
        # in broadcasting, and which of them are real batch dims (size-1 dims
        # stand for levels the argument is not mapped at; they are read at 0).
        plans = []
        for lead in leads:
            pad = len(batch_shape) - len(lead)
            dims = [(d, d + pad) for d, s in enumerate(lead) if s != 1]
            plans.append((len(lead), dims))

        def one(i):
            index = np.unravel_index(i, batch_shape)
            elem = []
            for a, (rank, dims) in zip(args, plans, strict=True):
                ii = [0] * rank
                for own, full in dims:
                    ii[own] = index[full]
                elem.append(a[(*ii, Ellipsis)])
            return kernel(*elem)

        with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
            results = list(pool.map(one, range(math.prod(batch_shape))))
        return np.stack(results).astype(out_dtype).reshape(batch_shape + out_shape)

    def call(*args):
        return jax.pure_callback(
            callback, result_shape_dtype, *args, vmap_method="expand_dims"
        )

    return call


def recipe_runner(case: Case, inputs: Inputs) -> Callable[[], Any]:
    """Runs the batch with :func:`threaded_pure_callback` (``case.num_workers``)."""
    core_ranks = [
        a.ndim - (len(inputs.batch_shape) if b else 0)
        for a, b in zip(inputs.arrays, inputs.batched, strict=True)
    ]
    f = threaded_pure_callback(case.kernel, case.out, core_ranks, case.num_workers)
    return _compiled_thunk(nest(f, inputs), inputs)


def bare_loop_runner(case: Case, inputs: Inputs) -> Callable[[], np.ndarray]:
    """Runs the batch as a plain Python loop on NumPy views, without JAX."""
    n = inputs.size
    nb = len(inputs.batch_shape)
    flat = [
        a.reshape((n, *a.shape[nb:])) if b else a
        for a, b in zip(inputs.arrays, inputs.batched, strict=True)
    ]
    out = np.empty((n, *case.out.shape), case.out.dtype)
    kernel = case.kernel
    if inputs.batched == (True,):
        (x,) = flat

        def run():
            for i in range(n):
                out[i] = kernel(x[i, ...])
            return out

    else:
        pairs = list(zip(flat, inputs.batched, strict=True))

        def run():
            for i in range(n):
                out[i] = kernel(*(a[i, ...] if b else a for a, b in pairs))
            return out

    return run


RUNNERS: dict[str, Callable[..., Callable[[], Any]]] = {
    "threadmap": threadmap_runner,
    "sequential": sequential_runner,
    "recipe": recipe_runner,
    "bare_loop": bare_loop_runner,
}


def reference(case: Case, inputs: Inputs) -> np.ndarray:
    """The expected result of a batch, from the bare loop."""
    return bare_loop_runner(case, inputs)().reshape(
        inputs.batch_shape + tuple(case.out.shape)
    )


# --- timing -------------------------------------------------------------------------


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


# --- peak memory --------------------------------------------------------------------

#: The memory benchmark: 4096 elements of 64 KB results (256 MB of outputs).
MEMORY_SHAPE = (16, 16, 16)
MEMORY_ELEMENT_FLOATS = 16384


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    # ru_maxrss is in kilobytes on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _fill_kernel(x):
    return fill(x, size=MEMORY_ELEMENT_FLOATS)


def _memory_child(method: str, batch_shape: Sequence[int]) -> dict[str, Any]:
    """Runs in a fresh process: the peak memory one batch adds, in bytes."""
    case = Case(
        "fill",
        "64 KB result per element",
        _fill_kernel,
        jax.ShapeDtypeStruct((MEMORY_ELEMENT_FLOATS,), jnp.float32),
        workers=num_cpus(),
        sequential_subset=0,
    )
    inputs = case.inputs(batch_shape)
    # Warm up JAX, the pools and the allocator on a small batch of another
    # shape: a warm-up of the measured shape would already reach its peak.
    small = inputs.subset(max(1, inputs.size // 64))
    RUNNERS[method](case, small)()
    run = RUNNERS[method](case, inputs)
    before = _rss_bytes()
    result = run()
    peak = _peak_rss_bytes()
    expected = np.arange(inputs.size, dtype=np.float32)
    assert np.array_equal(np.asarray(result).reshape(inputs.size, -1)[:, 0], expected)
    out_bytes = inputs.size * MEMORY_ELEMENT_FLOATS * 4
    in_bytes = sum(a.nbytes for a in inputs.arrays)
    return {
        "method": method,
        "elements": inputs.size,
        "input_bytes": in_bytes,
        "output_bytes": out_bytes,
        "added_bytes": peak - before,
        "budget_bytes": in_bytes + 2 * out_bytes,
    }


def peak_memory(
    method: str, batch_shape: Sequence[int] = MEMORY_SHAPE, timeout: float = 300
) -> dict[str, Any]:
    """Measures the peak memory of one batch of :func:`fill` in a subprocess.

    The budget is inputs + outputs + one copy of the outputs (the result moved
    into JAX); threads add O(threads x element), nothing else may grow with the
    batch. ``ratio`` is the memory added by the call over that budget.

    Args:
        method: One of :data:`RUNNERS`.
        batch_shape: The nested batch.
        timeout: Seconds before the subprocess is abandoned.

    Returns:
        A dict with ``elements``, ``input_bytes``, ``output_bytes``,
        ``added_bytes``, ``budget_bytes`` and ``ratio``.
    """
    code = (
        "import json, sys\n"
        "from jax_threadmap._baselines import _memory_child\n"
        f"print(json.dumps(_memory_child({method!r}, {tuple(batch_shape)!r})))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"The memory measurement of {method!r} failed:\n{proc.stderr[-3000:]}"
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["ratio"] = result["added_bytes"] / result["budget_bytes"]
    return result


# --- other load on the machine ------------------------------------------------------


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

    def __exit__(self, *exc) -> None:
        wall0, busy0, own0 = self._start
        wall = time.perf_counter() - wall0
        busy = self._busy_seconds()
        if busy is None or busy0 is None or wall <= 0:
            return
        other = (busy - busy0) - (self._own_seconds() - own0)
        self.cores = max(0.0, other / wall)
