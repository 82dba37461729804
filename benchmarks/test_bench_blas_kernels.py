"""Kernels that call a threaded BLAS, under ``threadmap`` and by hand.

A reader who wraps a NumPy kernel that calls BLAS (``np.linalg.eigvalsh``,
``a @ b``) in ``threadmap`` gets the default pool: one kernel per CPU. OpenBLAS
starts its own threads, one per CPU, in each call, so N kernels at once put
N x N threads on N CPUs, unless its threads are limited. This compares, per
kernel, sides alternated rep by rep and each side's best over ``REPS`` reps
(environment variable, default 7):

- ``threadmap`` as a reader writes it (``executor=None``, nothing else);
- ``threadmap`` inside ``limit_inner_threads(1)``;
- a hand ``ThreadPoolExecutor`` of N threads over the elements, BLAS limited
  to 1 thread (threadpoolctl), inside one ``pure_callback`` (the fastest a
  reader gets by hand);
- ``pure_callback(vmap_method="sequential")``: one element after the other,
  with BLAS's own threads.

Kernels:

- ``eigvalsh``: ``np.linalg.eigvalsh`` of a 192 x 192 symmetric float32 matrix,
  over a (16, 32) nested ``vmap`` (512 calls);
- ``matmul``: ``a @ b``, 512 x 512 float32, over a ``vmap`` of 16.

Run:
    python benchmarks/test_bench_blas_kernels.py     # the table (docs/performance.md)
    pytest benchmarks/test_bench_blas_kernels.py --benchmark-only
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable

import jax
import numpy as np
import pytest
from jax_threadmap._scheduling import available_cpus

import jax_threadmap as jtm

threadpoolctl = pytest.importorskip("threadpoolctl")

N = available_cpus()
REPS = int(os.environ.get("REPS", "7"))

_rng = np.random.default_rng(0)
_m = _rng.standard_normal((16, 32, 192, 192), dtype=np.float32)
SYM = (_m + np.swapaxes(_m, -1, -2)) / 2
A = _rng.standard_normal((16, 512, 512), dtype=np.float32)
B = _rng.standard_normal((512, 512), dtype=np.float32)


def eigvalsh(m: np.ndarray) -> np.ndarray:
    return np.linalg.eigvalsh(m)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a @ b


#: kernel -> (the kernel, its args, in_axes of the outer vmaps (outermost first),
#: the result of one element).
KERNELS: dict[str, tuple[Callable, tuple, list[tuple], jax.ShapeDtypeStruct]] = {
    "eigvalsh": (
        eigvalsh,
        (SYM,),
        [(0,), (0,)],
        jax.ShapeDtypeStruct((192,), np.float32),
    ),
    "matmul": (
        matmul,
        (A, B),
        [(0, None)],
        jax.ShapeDtypeStruct((512, 512), np.float32),
    ),
}


def _nest(one: Callable, in_axes: list[tuple]) -> Callable:
    for axes in reversed(in_axes):
        one = jax.vmap(one, in_axes=axes)
    return jax.jit(one)


def _hand_pool_callback(kernel: Callable, out: jax.ShapeDtypeStruct) -> Callable:
    """One ``pure_callback`` over the whole batch: a pool of N threads runs the
    elements, BLAS limited to 1 thread, as a reader would write it by hand."""
    pool = concurrent.futures.ThreadPoolExecutor(N)

    def batch(*args):
        args = [np.asarray(a) for a in args]
        shape = args[0].shape[: args[0].ndim - 2]
        flat = [a.reshape(-1, *a.shape[-2:]) if a.ndim > 2 else a for a in args]
        count = flat[0].shape[0]
        result = np.empty((count, *out.shape), out.dtype)

        def one(i):
            result[i] = kernel(*(f[i] if f.ndim > 2 else f for f in flat))

        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
            list(pool.map(one, range(count)))
        return result.reshape(*shape, *out.shape)

    return batch


def sides(name: str) -> dict[str, Callable[[], object]]:
    """side -> a call that runs the whole batch of kernel ``name`` once."""
    kernel, args, in_axes, out = KERNELS[name]
    tm = _nest(lambda *a: jtm.threadmap(kernel, out, *a), in_axes)
    seq = _nest(
        lambda *a: jax.pure_callback(kernel, out, *a, vmap_method="sequential"),
        in_axes,
    )
    batch_shape = args[0].shape[: len(in_axes)]
    full = jax.ShapeDtypeStruct(batch_shape + out.shape, out.dtype)
    hand_cb = _hand_pool_callback(kernel, out)
    hand = jax.jit(lambda *a: jax.pure_callback(hand_cb, full, *a))

    def limited():
        with jtm.limit_inner_threads(1):
            return jax.block_until_ready(tm(*args))

    return {
        "threadmap (default)": lambda: jax.block_until_ready(tm(*args)),
        "threadmap in limit_inner_threads(1)": limited,
        f"hand ThreadPoolExecutor({N}), BLAS limited": lambda: jax.block_until_ready(
            hand(*args)
        ),
        "pure_callback sequential": lambda: jax.block_until_ready(seq(*args)),
    }


def compare(name: str, reps: int = REPS) -> dict[str, float]:
    """Each side's best over ``reps`` reps, sides alternated rep by rep (s)."""
    runs = sides(name)
    for run in runs.values():
        run()  # compile, warm up
    best = dict.fromkeys(runs, float("inf"))
    keys = list(runs)
    for r in range(reps):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            start = time.perf_counter()
            runs[key]()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def report(results: dict[str, dict[str, float]]) -> str:
    hand = f"hand ThreadPoolExecutor({N}), BLAS limited"
    lines = [
        f"{N} CPUs, best of {REPS} reps, sides alternated",
        "| kernel | side | s per batch | ratio to the hand pool |",
        "|---|---|---|---|",
    ]
    for name, t in results.items():
        for side, seconds in t.items():
            lines.append(
                f"| {name} | {side} | {seconds:.3f} | {seconds / t[hand]:.2f}x |"
            )
    return "\n".join(lines)


@pytest.mark.parametrize("name", list(KERNELS))
def test_sides_compute_the_same(name):
    kernel, args, _, _ = KERNELS[name]
    want = kernel(*(a[:2] if a.ndim > 2 else a for a in args))  # 2 rows suffice
    for side, run in sides(name).items():
        got = np.asarray(run())[:2]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-2, err_msg=side)


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("side", range(4), ids=["default", "limited", "hand", "seq"])
def test_blas_kernel(benchmark, name, side):
    run = list(sides(name).values())[side]
    run()
    benchmark.group = f"BLAS kernel: {name}"
    benchmark.pedantic(run, rounds=REPS, warmup_rounds=1, iterations=1)


if __name__ == "__main__":
    print(report({name: compare(name) for name in KERNELS}))
