"""Kernels that call a threaded BLAS, under ``threadmap`` and by hand.

A reader who wraps a NumPy kernel that calls BLAS (``np.linalg.eigvalsh``,
``a @ b``) in ``threadmap`` gets the default pool: one kernel per CPU. OpenBLAS
starts its own threads, one per CPU, in each call, so N kernels at once put
N x N threads on N CPUs, unless its threads are limited. This compares, per
kernel, sides alternated rep by rep and each side's best over ``REPS`` reps
(environment variable, default 7):

- ``threadmap`` as a reader writes it (``executor=None``, nothing else): BLAS
  limited to one thread per call automatically while the map runs;
- ``threadmap`` with that automatic limit off (``JAX_THREADMAP_LIMIT_BLAS=0``,
  the default before it), BLAS with its own threads;
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

What the automatic limit costs where it cannot help (:func:`costs`, the same
two ``threadmap`` sides, default and ``JAX_THREADMAP_LIMIT_BLAS=0``): maps of a
kernel that calls no BLAS (``x + 1`` over 2, 16 and 4096 elements; ``np.sort``
of 64 rows of 100,000 floats), a single-element map of the eigvalsh kernel,
and a thread doing 1024 x 1024 ``a @ b`` in a loop beside a map of the sort
kernel or of a kernel that sleeps 5 ms (the matmuls' best time while maps run).

Run:
    python benchmarks/test_bench_blas_kernels.py     # the tables (docs/performance.md)
    PART=costs python benchmarks/test_bench_blas_kernels.py   # one of them
    pytest benchmarks/test_bench_blas_kernels.py --benchmark-only
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable

import harness
import jax
import numpy as np
import pytest

import jax_threadmap as jtm
from jax_threadmap._support.cpus import available_cpus

threadpoolctl = pytest.importorskip("threadpoolctl")

N = available_cpus()
REPS = int(os.environ.get("REPS", "7"))
COST_REPS = int(os.environ.get("COST_REPS", "15"))

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


@contextlib.contextmanager
def _auto_limit_off():
    os.environ["JAX_THREADMAP_LIMIT_BLAS"] = "0"
    try:
        yield
    finally:
        del os.environ["JAX_THREADMAP_LIMIT_BLAS"]


def _off(run: Callable[[], object]) -> Callable[[], object]:
    """``run`` with the automatic BLAS limit off."""

    def call():
        with _auto_limit_off():
            return run()

    return call


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

    default = lambda: jax.block_until_ready(tm(*args))  # noqa: E731
    return {
        "threadmap (default)": default,
        "threadmap, JAX_THREADMAP_LIMIT_BLAS=0": _off(default),
        "threadmap in limit_inner_threads(1)": limited,
        f"hand ThreadPoolExecutor({N}), BLAS limited": lambda: jax.block_until_ready(
            hand(*args)
        ),
        "pure_callback sequential": lambda: jax.block_until_ready(seq(*args)),
    }


def compare(name: str, reps: int = REPS) -> dict[str, float]:
    """Each side's best over ``reps`` reps, sides alternated rep by rep (s)."""
    return alternate(sides(name), reps)


def alternate(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Each run's best wall time over ``reps`` reps, runs alternated (s)."""
    return {key: wall for key, (wall, _) in harness.alternate(runs, reps).items()}


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


def _plus_one(x: np.ndarray) -> np.ndarray:
    return x + 1


def _sort(x: np.ndarray) -> np.ndarray:
    return np.sort(x)


def _sleep(x: np.ndarray) -> np.ndarray:
    time.sleep(0.005)
    return x


def _mapped(kernel: Callable, x: np.ndarray) -> Callable[[], object]:
    one = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    f = jax.jit(jax.vmap(lambda r: jtm.threadmap(kernel, one, r)))
    return lambda: jax.block_until_ready(f(x))


def _beside(run: Callable[[], object], maps: int = 4) -> Callable[[], float]:
    """``maps`` runs of ``run`` while a thread does 1024 x 1024 ``a @ b`` in a
    loop; returns the best matmul's seconds."""
    a = _rng.standard_normal((1024, 1024), dtype=np.float32)

    def call() -> float:
        stop, times = threading.Event(), []

        def matmuls():
            while not stop.is_set():
                start = time.perf_counter()
                a @ a
                times.append(time.perf_counter() - start)

        thread = threading.Thread(target=matmuls)
        thread.start()
        try:
            for _ in range(maps):
                run()
        finally:
            stop.set()
            thread.join()
        return min(times)

    return call


def costs(reps: int = COST_REPS) -> dict[str, dict[str, float]]:
    """Case -> {"default": s, "off": s}: the automatic limit where it cannot
    help, against ``JAX_THREADMAP_LIMIT_BLAS=0``; each side's best of ``reps``
    rounds (``COST_REPS``, default 15) of 20 calls (5 for the sort), alternated."""
    rows = _rng.standard_normal((64, 100_000)).astype(np.float32)
    sort = _mapped(_sort, rows)
    cases: dict[str, tuple[Callable[[], object], int]] = {
        f"x + 1, {n} elements": (_mapped(_plus_one, np.ones((n, 4), np.float32)), 20)
        for n in (2, 16, 4096)
    }
    cases["np.sort, 64 rows of 100,000"] = (sort, 5)
    eig = _nest(lambda m: jtm.threadmap(eigvalsh, KERNELS["eigvalsh"][3], m), [(0,)])
    one = SYM[0, :1]
    cases["eigvalsh, a single-element map"] = (
        lambda: jax.block_until_ready(eig(one)),
        20,
    )
    out = {}
    for case, (run, calls) in cases.items():
        repeated = _repeat(run, calls)
        best = alternate({"default": repeated, "off": _off(repeated)}, reps)
        out[case] = {side: t / calls for side, t in best.items()}
    for case, run in {
        "a @ b in a thread beside np.sort maps": sort,
        "a @ b in a thread beside maps that sleep": _mapped(
            _sleep, np.ones((32, 4), np.float32)
        ),
    }.items():
        beside = _beside(run)
        beside()
        best = {"default": float("inf"), "off": float("inf")}
        for r in range(reps):
            for side in ("default", "off") if r % 2 else ("off", "default"):
                if side == "off":
                    with _auto_limit_off():
                        best[side] = min(best[side], beside())
                else:
                    best[side] = min(best[side], beside())
        out[case] = best
    return out


def _repeat(run: Callable[[], object], calls: int) -> Callable[[], object]:
    def repeated():
        for _ in range(calls):
            run()

    return repeated


def report_costs(results: dict[str, dict[str, float]]) -> str:
    lines = [
        "| case | default | JAX_THREADMAP_LIMIT_BLAS=0 | ratio |",
        "|---|---|---|---|",
    ]
    for case, t in results.items():
        lines.append(
            f"| {case} | {_time(t['default'])} | {_time(t['off'])} | "
            f"{t['default'] / t['off']:.2f}x |"
        )
    return "\n".join(lines)


def _time(seconds: float) -> str:
    if seconds >= 0.1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


@pytest.mark.parametrize("name", list(KERNELS))
def test_sides_compute_the_same(name):
    kernel, args, _, _ = KERNELS[name]
    want = kernel(*(a[:2] if a.ndim > 2 else a for a in args))  # 2 rows suffice
    for side, run in sides(name).items():
        got = np.asarray(run())[:2]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-2, err_msg=side)


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize(
    "side", range(5), ids=["default", "off", "limited", "hand", "seq"]
)
def test_blas_kernel(benchmark, name, side):
    run = list(sides(name).values())[side]
    run()
    benchmark.group = f"BLAS kernel: {name}"
    benchmark.pedantic(run, rounds=REPS, warmup_rounds=1, iterations=1)


if __name__ == "__main__":
    # PART=kernels or PART=costs runs one of the two tables.
    part = os.environ.get("PART", "both")
    if part in ("both", "kernels"):
        print(report({name: compare(name) for name in KERNELS}))
        print(f"load average {os.getloadavg()}")
    if part in ("both", "costs"):
        print(report_costs(costs()))
        print(f"load average {os.getloadavg()}")
