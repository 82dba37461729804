"""Kernels that thread themselves: inner threads 1 and N under the default pool.

A kernel may run threads of its own: a threaded BLAS behind ``a @ b``, FFTW or
``scipy.fft`` with ``workers=``, OpenMP, a gridder's ``nthreads=``. The default
pool already runs one kernel per CPU, so N inner threads per kernel put N x N
threads on N CPUs. This measures a map of ``ELEMENTS`` such kernels (both
release the GIL) under ``executor=None``:

- ``matmul``: ``a @ b`` of two 512 x 512 float32 matrices (OpenBLAS, its threads
  limited with threadpoolctl, as joblib's ``inner_max_num_threads`` does);
- ``fft``: the power spectrum ``abs(scipy.fft.rfft2(x, workers=k)) ** 2`` of a
  512 x 512 float32 image (pocketfft's threads).

Each runs on the default pool (N kernels at once, N = the CPUs the process may
use) with 1 and with N inner threads, and on ``executor=1`` (one kernel at a
time) with N inner threads. Rounds alternate the configurations of a kernel;
each figure is the best of ``REPS`` calls in a round, then the median over
``ROUNDS`` rounds (environment variable, default 7).

Run:
    python benchmarks/test_bench_threaded_kernels.py     # the report
    pytest benchmarks/test_bench_threaded_kernels.py --benchmark-only
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
import pytest

from jax_threadmap import threadmap
from jax_threadmap._support.cpus import available_cpus

threadpoolctl = pytest.importorskip("threadpoolctl")
scipy_fft = pytest.importorskip("scipy.fft")

ELEMENTS = 16
N = available_cpus()
ROUNDS = int(os.environ.get("ROUNDS", "7"))
REPS = 3

_rng = np.random.default_rng(0)
A = _rng.standard_normal((ELEMENTS, 512, 512), dtype=np.float32)
B = _rng.standard_normal((512, 512), dtype=np.float32)
X = _rng.standard_normal((ELEMENTS, 512, 512), dtype=np.float32)


def matmul(a, b):
    return a @ b


def fft_1(x):
    return np.abs(scipy_fft.rfft2(x, workers=1)) ** 2


def fft_n(x):
    return np.abs(scipy_fft.rfft2(x, workers=N)) ** 2


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
        yield


def _matmul_map(executor: int | None) -> Callable:
    def one(a, b):
        out = jax.ShapeDtypeStruct(a.shape, a.dtype)
        return threadmap(matmul, out, a, b, executor=executor)

    return jax.jit(jax.vmap(one, in_axes=(0, None)))


def _fft_map(kernel: Callable, executor: int | None) -> Callable:
    out = jax.ShapeDtypeStruct((512, 257), np.float32)
    return jax.jit(jax.vmap(lambda x: threadmap(kernel, out, x, executor=executor)))


def configurations() -> dict[tuple[str, str], Callable[[], object]]:
    """(kernel, configuration) -> a call that runs the whole map once."""

    def matmul_run(executor: int | None, inner: int) -> Callable[[], object]:
        f = _matmul_map(executor)

        def run():
            with blas_threads(inner):
                return jax.block_until_ready(f(A, B))

        return run

    def fft_run(executor: int | None, kernel: Callable) -> Callable[[], object]:
        f = _fft_map(kernel, executor)
        return lambda: jax.block_until_ready(f(X))

    return {
        ("matmul", f"{N} kernels x 1 inner thread"): matmul_run(None, 1),
        ("matmul", f"{N} kernels x {N} inner threads"): matmul_run(None, N),
        ("matmul", f"1 kernel x {N} inner threads"): matmul_run(1, N),
        ("fft", f"{N} kernels x 1 inner thread"): fft_run(None, fft_1),
        ("fft", f"{N} kernels x {N} inner threads"): fft_run(None, fft_n),
        ("fft", f"1 kernel x {N} inner threads"): fft_run(1, fft_n),
    }


def _best(run: Callable[[], object], reps: int = REPS) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def compare(rounds: int = ROUNDS) -> dict[tuple[str, str], float]:
    """Median over alternating rounds of the best of REPS, in seconds per map.

    Each kernel's configurations alternate among themselves, one kernel after
    the other: OpenBLAS's threads keep spinning for a while after a call, which
    would slow whatever runs next.
    """
    configs = configurations()
    times: dict[tuple[str, str], list[float]] = {k: [] for k in configs}
    for kernel in dict.fromkeys(k for k, _ in configs):
        keys = [key for key in configs if key[0] == kernel]
        for key in keys:
            configs[key]()  # compile, warm up
        for r in range(rounds):
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                times[key].append(_best(configs[key]))
    return {k: statistics.median(v) for k, v in times.items()}


def report(t: dict[tuple[str, str], float]) -> str:
    lines = [
        f"{ELEMENTS} elements, default pool of {N} threads, {N} CPUs",
        "| kernel | threads | ms per map | ratio to 1 inner thread |",
        "|---|---|---|---|",
    ]
    for (kernel, config), seconds in t.items():
        ratio = seconds / t[(kernel, f"{N} kernels x 1 inner thread")]
        lines.append(f"| {kernel} | {config} | {seconds * 1e3:.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


def test_configurations_compute_the_same():
    configs = configurations()
    want_mm = A @ B
    want_fft = np.abs(np.fft.rfft2(X)) ** 2
    for (kernel, _), run in configs.items():
        got = np.asarray(run())
        want = want_mm if kernel == "matmul" else want_fft
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("key", list(configurations()), ids=" / ".join)
def test_threaded_kernel(benchmark, key):
    run = configurations()[key]
    run()
    benchmark.group = f"threaded kernel: {key[0]}"
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1, iterations=REPS)


if __name__ == "__main__":
    print(report(compare()))
