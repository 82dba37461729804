"""ducc0's w-gridder under a 3-level nested vmap: threadmap against its floor.

The example of examples/gridding: ``vis2dirty`` and ``dirty2vis`` at N = 256
pixels (float32, ducc0 accuracy 1e-5) with 300 baselines and one channel per
element, vmapped over polarisations x times x channels (4 x 4 x 4 = 64
elements). Side by side in one process, alternating rep by rep, best of the reps:

- ``threadmap``: ``Gridder.vis2dirty`` / ``dirty2vis`` (jax_threadmap.kernel);
- ``pure_callback``: ``jax.pure_callback(..., vmap_method="sequential")`` around
  the same host function, under the same vmaps;
- ``floor``: a hand-written ``ThreadPoolExecutor`` (one thread per CPU, made once)
  mapping the same host function over the same elements, without JAX.

Also: the per-element overhead without the gridding (the host function replaced
by one returning zeros, 256 elements; beside it, what XLA takes to fill an output
of the same size, which any jitted program returning it pays), and ducc0's own
``nthreads`` inside the kernel (1 and the CPU count) under the default pool and
under ``executor=1``.

Run:
    pytest benchmarks/test_bench_gridding.py      # pytest-benchmark + ratios
    python benchmarks/test_bench_gridding.py      # just the report (docs/gridding.md)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    "ducc0", reason="the gridding benchmark needs ducc0: pip install '.[examples]'"
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from examples.gridding.operators import (  # noqa: E402
    SPEED_OF_LIGHT,
    Gridder,
    ducc0_dirty2vis,
    ducc0_vis2dirty,
)

NPIX = 256
ROWS = 300
SHAPE = (4, 4, 4)  # polarisations x times x channels
OVERHEAD_SHAPE = (4, 8, 8)
REPS = 15
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2


@dataclasses.dataclass(frozen=True)
class Problem:
    """One operator over a polarisation x time x channel batch."""

    name: str
    host: Callable[..., np.ndarray]  # host(data, uvw=, freq=) for one element
    data: np.ndarray  # images (P, N, N) or visibilities (P, T, C, ROWS, 1)
    uvw: np.ndarray  # (T, ROWS, 3)
    freq: np.ndarray  # (C, 1)
    result: jax.ShapeDtypeStruct  # one element's result

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], self.uvw.shape[0], self.freq.shape[0])

    def element(self, p: int, t: int, c: int) -> np.ndarray:
        return self.data[p] if self.data.ndim == 3 else self.data[p, t, c]

    def nested(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(data, uvw, freq)`` for one element, vmapped over the 3 levels."""
        per_image = self.data.ndim == 3  # images vary by polarisation only
        chan = jax.vmap(fn, (None if per_image else 0, None, 0))
        time_ = jax.vmap(chan, (None if per_image else 0, 0, None))
        return jax.jit(jax.vmap(time_, (0, None, None)))


def problems(
    shape: tuple[int, int, int] = SHAPE, gridder: Gridder | None = None
) -> dict[str, Problem]:
    g = gridder or default_gridder()
    rng = np.random.default_rng(0)
    p, t, c = shape
    uvw = rng.uniform(-1000.0, 1000.0, (t, ROWS, 3))
    uvw[..., 2] = 0.0
    freq = np.linspace(1.0e9, 1.4e9, c)[:, None]
    # What JAX passes without x64; the floor gets the same arrays.
    uvw, freq = uvw.astype(np.float32), freq.astype(np.float32)
    images = rng.standard_normal((p, NPIX, NPIX)).astype(np.float32)
    vis = (rng.standard_normal((p, t, c, ROWS, 1)) * (1 + 1j)).astype(np.complex64)
    return {
        "dirty2vis": Problem(
            "dirty2vis",
            functools.partial(ducc0_dirty2vis, g),
            images,
            uvw,
            freq,
            jax.ShapeDtypeStruct((ROWS, 1), jnp.complex64),
        ),
        "vis2dirty": Problem(
            "vis2dirty",
            functools.partial(ducc0_vis2dirty, g),
            vis,
            uvw,
            freq,
            jax.ShapeDtypeStruct((NPIX, NPIX), jnp.float32),
        ),
    }


def default_gridder(**kw: Any) -> Gridder:
    pixsize = 1.0 / (2.2 * 1000.0 * 1.4e9 / SPEED_OF_LIGHT)
    return Gridder(npix_x=NPIX, npix_y=NPIX, pixsize_x=pixsize, pixsize_y=pixsize, **kw)


# --- the three ways to run a batch ----------------------------------------------


def threadmap_runner(problem: Problem, kernel: Callable[..., Any]) -> Callable:
    f = problem.nested(kernel)
    return lambda: f(problem.data, problem.uvw, problem.freq).block_until_ready()


def callback_runner(problem: Problem) -> Callable:
    def host(data, uvw, freq):
        return problem.host(np.asarray(data), uvw=uvw, freq=freq)

    def one(data, uvw, freq):
        return jax.pure_callback(
            host, problem.result, data, uvw, freq, vmap_method="sequential"
        )

    f = problem.nested(one)
    return lambda: f(problem.data, problem.uvw, problem.freq).block_until_ready()


def floor_runner(
    problem: Problem, pool: concurrent.futures.ThreadPoolExecutor
) -> Callable:
    out = np.empty(problem.shape + problem.result.shape, problem.result.dtype)
    indices = list(itertools.product(*map(range, problem.shape)))

    def one(index):
        p, t, c = index
        out[index] = problem.host(
            problem.element(p, t, c), uvw=problem.uvw[t], freq=problem.freq[c]
        )

    def run():
        list(pool.map(one, indices))
        return out

    return run


def alternate(
    runs: dict[str, Callable], reps: int = REPS, rtol: float = 0.0
) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall time and best process CPU time of each run, alternating rep by rep.

    The CPU time (all threads of this process) says what the wall time says on a
    quiet machine: on a loaded one, the wall time also counts the waits for a core.
    The results must agree: exactly for the same host calls, to ``rtol`` of the
    largest value where ducc0 threads itself (its sums then run in another
    order)."""
    results = {name: run() for name, run in runs.items()}  # warm up (compile)
    first = np.asarray(next(iter(results.values())))
    for name, got in results.items():
        np.testing.assert_allclose(
            np.asarray(got),
            first,
            rtol=0,
            atol=rtol * np.abs(first).max(),
            err_msg=name,
        )
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return (
        {name: min(t) for name, t in wall.items()},
        {name: min(t) for name, t in cpu.items()},
    )


# --- the comparisons ------------------------------------------------------------


def against_floor(name: str, reps: int = REPS) -> dict[str, float]:
    problem = problems()[name]
    g = default_gridder()
    with concurrent.futures.ThreadPoolExecutor(CPUS) as pool:
        best, cpu = alternate(
            {
                "threadmap": threadmap_runner(problem, getattr(g, name)),
                "pure_callback": callback_runner(problem),
                "floor": floor_runner(problem, pool),
            },
            reps,
        )
    n = int(np.prod(problem.shape))
    return {
        **{f"{k}_ms_per_element": v / n * 1e3 for k, v in best.items()},
        **{f"{k}_cpu_ms_per_element": v / n * 1e3 for k, v in cpu.items()},
        "threadmap_over_floor": best["threadmap"] / best["floor"],
        "threadmap_over_floor_cpu": cpu["threadmap"] / cpu["floor"],
        "pure_callback_over_threadmap": best["pure_callback"] / best["threadmap"],
    }


def _zeros_problem(problem: Problem) -> Problem:
    result = problem.result

    def zeros(data, *, uvw, freq):
        return np.zeros(result.shape, result.dtype)

    return dataclasses.replace(problem, host=zeros)


def overhead(name: str, reps: int = REPS) -> dict[str, float]:
    """Per-element µs of each way with a host function that returns zeros."""
    problem = _zeros_problem(problems(OVERHEAD_SHAPE)[name])

    def kernel(data, uvw, freq):
        from jax_threadmap import threadmap

        return threadmap(problem.host, problem.result, data, uvw=uvw, freq=freq)

    # What any jitted program pays for an output of this size: XLA filling it.
    shape = problem.shape + problem.result.shape
    fill = jax.jit(lambda x: jnp.zeros(shape, problem.result.dtype) + x)
    zero = jnp.zeros((), problem.result.dtype)
    with concurrent.futures.ThreadPoolExecutor(CPUS) as pool:
        best, cpu = alternate(
            {
                "threadmap": threadmap_runner(problem, kernel),
                "pure_callback": callback_runner(problem),
                "floor": floor_runner(problem, pool),
                "xla_fill": lambda: fill(zero).block_until_ready(),
            },
            reps,
        )
    n = int(np.prod(problem.shape))
    return {
        **{f"{k}_us_per_element": v / n * 1e6 for k, v in best.items()},
        **{f"{k}_cpu_us_per_element": v / n * 1e6 for k, v in cpu.items()},
    }


def inner_threads(name: str = "vis2dirty", reps: int = REPS) -> dict[str, float]:
    """ducc0's nthreads 1 and CPU count, under the default pool and executor=1."""
    problem = problems()[name]
    runs = {}
    for nthreads, executor in itertools.product((1, CPUS), (None, 1)):
        g = default_gridder(nthreads=nthreads, executor=executor)
        label = f"nthreads={nthreads}, executor={executor}"
        runs[label] = threadmap_runner(problem, getattr(g, name))
    best, cpu = alternate(runs, reps, rtol=1e-5)
    n = int(np.prod(problem.shape))
    return {
        **{f"{k}: ms_per_element": v / n * 1e3 for k, v in best.items()},
        **{f"{k}: cpu_ms_per_element": v / n * 1e3 for k, v in cpu.items()},
    }


def report(results: dict[str, dict[str, float]]) -> str:
    lines = [f"N={NPIX}, {ROWS} baselines, {CPUS} CPUs, best of {REPS} reps"]
    for title, numbers in results.items():
        lines.append(title)
        lines += [f"  {k}: {v:.4g}" for k, v in numbers.items()]
    return "\n".join(lines)


@pytest.mark.parametrize("name", ["vis2dirty", "dirty2vis"])
def test_against_floor(benchmark, name):
    benchmark.group = f"gridding {name}: threadmap / floor"
    result = benchmark.pedantic(against_floor, args=(name,), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + report({f"{name} {SHAPE}": result}))


@pytest.mark.parametrize("name", ["vis2dirty", "dirty2vis"])
def test_overhead_without_gridding(benchmark, name):
    benchmark.group = f"gridding {name}: per-element overhead (zeros)"
    result = benchmark.pedantic(overhead, args=(name,), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + report({f"{name} returning zeros {OVERHEAD_SHAPE}": result}))


def test_ducc0_threads_inside_the_kernel(benchmark):
    benchmark.group = "gridding vis2dirty: ducc0 nthreads x executor"
    result = benchmark.pedantic(inner_threads, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + report({"vis2dirty, ducc0 threads": result}))


if __name__ == "__main__":
    print(
        report(
            {
                **{
                    f"{n} {SHAPE}": against_floor(n) for n in ("vis2dirty", "dirty2vis")
                },
                **{
                    f"{n} returning zeros {OVERHEAD_SHAPE}": overhead(n)
                    for n in ("vis2dirty", "dirty2vis")
                },
                "vis2dirty, ducc0 threads": inner_threads(),
            }
        )
    )
