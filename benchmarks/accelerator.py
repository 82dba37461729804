"""What docs/accelerators.md reports, measured on the default backend (a TPU).

Run by hand on the accelerator, in one process (one program may hold a TPU), after
the README's set-up (``.venv``, the package installed):

    .venv/bin/python benchmarks/accelerator.py --out accelerator.json
    .venv/bin/python benchmarks/accelerator.py --quick    # a first look

It prints each part's results as it finishes, with the time it took, and writes
them all as JSON to ``--out`` (nothing is written without it). On a CPU the
full run is slow: its maps run 4096 elements of each kernel on the host's
cores, 7 reps of each side (``RUN_TIME`` below, measured, which it prints
first); ``--quick`` runs 64 elements, one rep and one dispatch round, to check
that everything runs (its numbers are not the page's).

Sides are alternated rep by rep and each side's best is kept (these machines'
speed swings), and every timed result is checked against NumPy on the host:

- ``call``: one jitted call of one element, ``threadmap`` against
  ``pure_callback`` (the fixed cost of a host callback in a device program);
- ``maps``: the headline cases of ``benchmarks/test_bench_compare.py`` (16 x 16 x
  16, trivial / sleeping / sorting kernels) with ``threadmap``, the best user
  recipe (``pure_callback`` + a thread pool) and ``pure_callback(vmap_method=
  "sequential")`` (on a leading subset, per element);
- ``dispatch``: ``y = f(x)`` with ``x`` pending (a load of ``LOAD_S``): when the
  call returns, against ``f``'s compile time; when a program that does not use
  ``x``, dispatched right after, finishes, against its own time; when ``y`` is
  ready, against the load; with async (deferred) and with blocking dispatch;
- ``nested``: a kernel that calls a jitted, vmapped ``threadmap``, and one that
  runs a program on the device its caller holds (an error at once, not a hang).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import harness as B
import jax
import jax.numpy as jnp
import numpy as np

import jax_threadmap as jtm
from jax_threadmap import threadmap
from jax_threadmap._arrays import dispatch as _dispatch

F32 = jax.ShapeDtypeStruct((), jnp.float32)
#: The load behind the pending array of the dispatch measurements (seconds).
LOAD_S = float(os.environ.get("LOAD_S", "1.5"))
#: ``--quick``: the maps' batch (64 elements, not 4096), reps, dispatch rounds.
QUICK_SHAPE, QUICK_REPS, QUICK_ROUNDS = (4, 4, 4), 1, 1
#: What the run took, measured (printed at the start, so that a reader knows).
RUN_TIME = (
    "measured on a 2-CPU machine's CPU backend, shared with other work: the full "
    "run 15 min (14 of them the maps), --quick 21 s"
)


def best_alternated(sides: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Each side's best wall time over ``reps`` rounds, the sides alternated."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(reps):
        for name, run in sides.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return {name: min(ts) for name, ts in times.items()}


def call_cost(reps: int) -> dict[str, Any]:
    """One element, one jitted call: the fixed cost of a host callback."""
    x = jnp.float32(1.5)
    tm = jax.jit(lambda v: threadmap(B.add_one, F32, v))
    pc = jax.jit(lambda v: jax.pure_callback(lambda a: np.asarray(a) + 1, F32, v))
    for f in (tm, pc):
        assert float(f(x)) == 2.5

    def many(f: Callable[[Any], Any]) -> Callable[[], Any]:
        return lambda: [f(x).block_until_ready() for _ in range(20)]

    best = best_alternated({"threadmap": many(tm), "pure_callback": many(pc)}, reps)
    return {k: v / 20 for k, v in best.items()}


def maps(reps: int, shape: tuple[int, ...] = B.NESTED_SHAPE) -> dict[str, Any]:
    """The headline cases, per element, with their baselines."""
    out = {}
    for name in ("trivial", "sleep", "sort"):
        case = B.CASES[name]
        full = case.inputs(shape)
        sub = full.subset(min(case.sequential_subset, 256))
        runs = {
            "threadmap": (B.threadmap_runner(case, full), full.size),
            "recipe": (B.recipe_runner(case, full), full.size),
            "sequential": (B.sequential_runner(case, sub), sub.size),
        }
        want = B.reference(case, full).reshape(-1)
        for method, (run, n) in runs.items():  # each computes what NumPy does
            got = np.asarray(run()).reshape(-1)
            np.testing.assert_allclose(got, want[:n], rtol=1e-6, err_msg=method)
        best = best_alternated({m: r for m, (r, _) in runs.items()}, reps)
        out[name] = {m: best[m] / runs[m][1] for m in runs}
        out[name]["title"] = case.title
    return out


def _dispatch_once(blocking: bool) -> dict[str, float]:
    os.environ["JAX_THREADMAP_ASYNC_DISPATCH"] = "0" if blocking else "1"
    value = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024) / 1e6
    load_start = {}

    def load() -> np.ndarray:
        load_start["t"] = time.perf_counter()
        time.sleep(LOAD_S)
        return value

    # A fresh function each round: its compile is part of the call.
    scale = float(np.random.default_rng().integers(2, 9))
    f = jax.jit(lambda a: jnp.tanh(a @ a.T) * scale)
    other_in = jnp.ones((2048, 2048), jnp.float32)
    other = jax.jit(lambda b: (b @ b).sum())
    other(other_in).block_until_ready()  # compiled: its own time is its run
    t = time.perf_counter()
    other(other_in).block_until_ready()
    other_alone = time.perf_counter() - t

    start = time.perf_counter()
    x = jtm.async_call(load, jax.ShapeDtypeStruct(value.shape, value.dtype))
    y = f(x)
    returned = time.perf_counter() - start
    t = time.perf_counter()
    other(other_in).block_until_ready()
    other_meanwhile = time.perf_counter() - t
    y_ready = None
    np.asarray(y)  # waits
    y_ready = time.perf_counter() - load_start["t"]
    ref = np.tanh(value.astype(np.float64) @ value.T.astype(np.float64)) * scale
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-2, atol=2e-3)
    compile_s = _compile_time(value, scale)
    return {
        "returned_s": returned,
        "compile_s": compile_s,
        "other_alone_s": other_alone,
        "other_meanwhile_s": other_meanwhile,
        "y_ready_after_load_start_s": y_ready,
        "load_s": LOAD_S,
        "result_type": type(y).__name__,
    }


def _compile_time(value: np.ndarray, scale: float) -> float:
    f = jax.jit(lambda a: jnp.tanh(a @ a.T) * scale)
    t = time.perf_counter()
    f.lower(jax.ShapeDtypeStruct(value.shape, value.dtype)).compile()
    return time.perf_counter() - t


def dispatch(rounds: int) -> dict[str, Any]:
    """Async (deferred) against blocking dispatch, rounds alternated."""
    results: dict[str, list[dict[str, float]]] = {"async": [], "blocking": []}
    status = _dispatch.mechanism.status() or "async"
    for _ in range(rounds):
        results["async"].append(_dispatch_once(blocking=False))
        results["blocking"].append(_dispatch_once(blocking=True))
    os.environ.pop("JAX_THREADMAP_ASYNC_DISPATCH", None)
    summary: dict[str, Any] = {"status": status}
    for side, rows in results.items():
        summary[side] = {
            key: (
                min(r[key] for r in rows)
                if isinstance(rows[0][key], float)
                else rows[0][key]
            )
            for key in rows[0]
        }
        summary[side]["median_returned_s"] = statistics.median(
            r["returned_s"] for r in rows
        )
    return summary


def nested() -> dict[str, Any]:
    """A kernel calling JAX: on the host it finishes; on the held device it
    raises at once."""
    inner = jax.jit(
        jax.vmap(
            lambda r: threadmap(np.sort, jax.ShapeDtypeStruct(r.shape, r.dtype), r)
        )
    )

    def kernel(rows: np.ndarray) -> np.ndarray:
        return np.asarray(inner(rows))

    x = np.random.default_rng(0).standard_normal((8, 16, 32)).astype(np.float32)
    outer = jax.jit(
        jax.vmap(lambda r: threadmap(kernel, jax.ShapeDtypeStruct(r.shape, r.dtype), r))
    )
    t = time.perf_counter()
    got = np.asarray(outer(x))
    finished = time.perf_counter() - t
    np.testing.assert_array_equal(got, np.sort(x, axis=-1))
    on_device = jax.device_put(jnp.ones(32), jax.devices()[0])  # committed there

    def held(row: np.ndarray) -> np.ndarray:
        return np.asarray(jax.jit(lambda a, b: a + b)(row, on_device))

    bad = jax.jit(
        jax.vmap(lambda r: threadmap(held, jax.ShapeDtypeStruct(r.shape, r.dtype), r))
    )
    error = ""
    t = time.perf_counter()
    try:
        np.asarray(bad(x[0]))
    except Exception as e:  # noqa: BLE001 - reported
        error = f"{type(e).__name__}: {str(e)[-400:]}"
    raised = time.perf_counter() - t
    return {
        "kernel_calls_jitted_map_s": finished,
        "held_device_error_s": raised,
        "held_device_error": error,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", "--json", default=None, help="write the results here, as JSON"
    )
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dispatch-rounds", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{int(np.prod(QUICK_SHAPE))} elements, {QUICK_REPS} rep, "
        f"{QUICK_ROUNDS} dispatch round: a check that it runs, not the numbers",
    )
    args = parser.parse_args(argv)
    shape = QUICK_SHAPE if args.quick else B.NESTED_SHAPE
    reps = QUICK_REPS if args.quick else args.reps
    rounds = QUICK_ROUNDS if args.quick else args.dispatch_rounds
    results: dict[str, Any] = {
        "devices": [str(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "quick": args.quick,
    }
    print(
        f"benchmarks/accelerator.py on {results['backend']} "
        f"({'--quick' if args.quick else 'full run'}; {RUN_TIME})",
        flush=True,
    )
    started = time.perf_counter()
    for name, run in (
        ("call", lambda: call_cost(reps)),
        ("maps", lambda: maps(reps, shape)),
        ("dispatch", lambda: dispatch(rounds)),
        ("nested", nested),
    ):
        t = time.perf_counter()
        results[name] = run()
        results[name + "_took_s"] = time.perf_counter() - t
        print(name, json.dumps(results[name], indent=1), flush=True)
        print(
            f"{name}: {results[name + '_took_s']:.1f} s "
            f"({time.perf_counter() - started:.0f} s in all)",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"results written to {args.out}")


if __name__ == "__main__":
    threading.current_thread().name = "main"
    main()
