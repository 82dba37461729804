"""Async dispatch: two loads feed two slow-to-compile functions; the seed example.

Pipeline. Two "downloads" of LOAD_S seconds each (sleeps, as network I/O would:
they release the GIL) feed two jitted functions that each take about COMPILE_S
seconds to trace and compile (a fresh function per round, so each really
compiles). Four ways to run it, each ending when both results are on the host:

- ``blocking order``: plain JAX: load, compile+run, load, compile+run. About
  ``2 * (LOAD_S + COMPILE_S)``.
- ``async, both loads first``: ``a1 = async_call(load)``, ``a2 = async_call(load)``,
  ``y1 = f1(a1)``, ``y2 = f2(a2)``, then use both: the loads run together while
  the thread compiles, so about ``max(LOAD_S, 2 * COMPILE_S)`` (ideal: the max of
  the loads, run in parallel, and the compiles, run one after the other).
- ``async, load then dispatch``: ``a1 = async_call(load); y1 = f1(a1); a2 = ...;
  y2 = f2(a2)``: the second load starts after the first dispatch returns. With
  async dispatch that is after the first compile; with blocking dispatch (the
  wait at dispatch, ``JAX_THREADMAP_ASYNC_DISPATCH=0``) after the first load too.

Each async way runs with async dispatch and with blocking dispatch. With
LOAD_S == COMPILE_S the two dispatch modes tie on the first async way: async
dispatch pays off when a load outlasts a compile (set LOAD_S=2 to see it), and
when the thread has other work between dispatches.

Seed example (the motivating example of issue 13), timed line by line:
``x = async_call(slow)`` (slow sleeps SEED_S), ``y = square(x)``, ``print(y)``.

Training loop fed by loads: ``for i in range(STEPS): batch = async_call(load_batch,
i); params = step(params, batch)``, each load BATCH_LOAD_S (a sleep), then the final
parameters used; with async dispatch the loop queues steps while batches load (on the
pool, several at once); with blocking dispatch each step waits for its batch.

Program runs: ``_program_runs.RUNS`` wraps JAX's ``ExecuteReplicated.__call__``
(to defer the runs on pending data).
A jitted program with a host callback (always run from Python) and an ordinary
jitted call (JAX's C++ fast path, which never reaches the wrapper:
tests/_jax/test_compat_arrays.py) are timed with the wrapper and without.

Every comparison alternates its sides round by round and keeps the best of
ROUNDS (the shared machine's speed swings about 2x minute to minute).

Run:
    pytest benchmarks/test_bench_async_dispatch.py --benchmark-only   # tables
    python benchmarks/test_bench_async_dispatch.py                    # report
    LOAD_S=2 python benchmarks/test_bench_async_dispatch.py           # longer loads
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_threadmap as jtm
from jax_threadmap._arrays import dispatch as _dispatch

LOAD_S = float(os.environ.get("LOAD_S", "1.0"))
COMPILE_S = 1.0  # target; calibrated below
SEED_S = 3.0
ROUNDS = int(os.environ.get("ROUNDS", "5"))
STEPS = 24
BATCH_LOAD_S = 0.1
N = 4096
SPEC = jax.ShapeDtypeStruct((N,), jnp.float32)
DATA = np.linspace(-1.0, 1.0, N, dtype=np.float32)


def load(seed: int) -> np.ndarray:
    """A slow loader: waits like a download, then returns the array."""
    time.sleep(LOAD_S)
    return DATA * (seed + 1)


def make_model(n_ops: int):
    """A fresh function (a new function object compiles anew)."""

    def model(x):
        for i in range(n_ops):
            x = jnp.sin(x * (1.0 + i * 1e-3))[::-1] + jnp.float32(i * 1e-3)
            x = jnp.roll(x, 1)
        return x

    return model


_n_ops: int | None = None


def n_ops() -> int:
    """The model depth that compiles in about COMPILE_S here (measured once)."""
    global _n_ops
    if _n_ops is None:
        jax.jit(lambda v: v + 1)(DATA).block_until_ready()  # warm the backend
        ops = 40
        for _ in range(3):  # compile time grows faster than linearly: refine
            t0 = time.perf_counter()
            jax.jit(make_model(ops)).lower(SPEC).compile()
            ops = max(10, round(ops * COMPILE_S / (time.perf_counter() - t0)))
        _n_ops = ops
    return _n_ops


@contextlib.contextmanager
def dispatch_mode(mode: str):
    old = os.environ.get(_dispatch.ENV_ASYNC_DISPATCH)
    os.environ[_dispatch.ENV_ASYNC_DISPATCH] = "1" if mode == "async" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[_dispatch.ENV_ASYNC_DISPATCH]
        else:
            os.environ[_dispatch.ENV_ASYNC_DISPATCH] = old


def blocking_order() -> list[np.ndarray]:
    outs = []
    for seed in (0, 1):
        x = load(seed)
        outs.append(np.asarray(jax.jit(make_model(n_ops()))(x)))
    return outs


def async_loads_first() -> list[np.ndarray]:
    a1 = jtm.async_call(load, SPEC, 0)
    a2 = jtm.async_call(load, SPEC, 1)
    y1 = jax.jit(make_model(n_ops()))(a1)
    y2 = jax.jit(make_model(n_ops()))(a2)
    return [np.asarray(y1), np.asarray(y2)]


def async_load_then_dispatch() -> list[np.ndarray]:
    a1 = jtm.async_call(load, SPEC, 0)
    y1 = jax.jit(make_model(n_ops()))(a1)
    a2 = jtm.async_call(load, SPEC, 1)
    y2 = jax.jit(make_model(n_ops()))(a2)
    return [np.asarray(y1), np.asarray(y2)]


WAYS = {
    "blocking order": (blocking_order, None),
    "async, both loads first, async dispatch": (async_loads_first, "async"),
    "async, both loads first, blocking dispatch": (async_loads_first, "blocking"),
    "async, load then dispatch, async dispatch": (async_load_then_dispatch, "async"),
    "async, load then dispatch, blocking dispatch": (
        async_load_then_dispatch,
        "blocking",
    ),
}


def run_way(name: str) -> tuple[float, list[np.ndarray]]:
    fn, mode = WAYS[name]
    with dispatch_mode(mode or "async"):
        t0 = time.perf_counter()
        outs = fn()
        return time.perf_counter() - t0, outs


def seed_example(mode: str) -> dict[str, float]:
    """The issue's example, each line timed."""

    def slow():
        time.sleep(SEED_S)
        return np.arange(4, dtype=np.int32)

    square = jax.jit(lambda v: v * v)
    times = {}
    with dispatch_mode(mode):
        t0 = time.perf_counter()
        x = jtm.async_call(slow, jax.ShapeDtypeStruct((4,), np.int32))
        t1 = time.perf_counter()
        y = square(x)
        t2 = time.perf_counter()
        text = str(y)
        t3 = time.perf_counter()
    assert text == "[0 1 4 9]", text
    times["x = async_call(slow)"] = t1 - t0
    times["y = square(x)"] = t2 - t1
    times["print(y)"] = t3 - t2
    return times


#: The pending load while unrelated work runs (long enough to tell waiting apart).
UNRELATED_LOAD_S = float(os.environ.get("UNRELATED_LOAD_S", "3.0"))


def unrelated_work(where: str) -> float:
    """Seconds until ``g(jnp.ones(3))`` is done while ``y = f(x)`` waits for ``x``.

    ``where`` is ``"same thread"`` (the thread that dispatched ``f(x)``) or
    ``"other thread"``. The target is < 0.1 s in both: ``f``'s program is
    deferred (not in XLA's queue) until ``x`` lands (docs/async-dispatch.md,
    "Ordering").
    """
    release = threading.Event()
    x = jtm.async_call(lambda: (release.wait(UNRELATED_LOAD_S), DATA)[1], SPEC)
    f = jax.jit(lambda v: v * 2)
    g = jax.jit(lambda v: v + 3)
    g(jnp.ones(3)).block_until_ready()  # compiled before the clock starts
    y = f(x)
    box: dict = {}

    def run_g() -> None:
        t0 = time.perf_counter()
        g(jnp.ones(3)).block_until_ready()
        box["s"] = time.perf_counter() - t0

    if where == "same thread":
        run_g()
    else:
        thread = threading.Thread(target=run_g)
        thread.start()
        thread.join()
    release.set()
    np.testing.assert_allclose(np.asarray(y), DATA * 2)
    return box["s"]


def training_loop(mode: str) -> tuple[float, np.ndarray]:
    """Seconds for STEPS steps each fed by a load of BATCH_LOAD_S, and the result."""

    def load_batch(i: int) -> np.ndarray:
        time.sleep(BATCH_LOAD_S)
        return np.full(N, (i % 7) * 1e-3, np.float32)

    @jax.jit
    def step(params, batch):
        return params - 0.1 * jnp.tanh(params * batch + batch)

    params = jnp.asarray(DATA)
    step(params, DATA).block_until_ready()  # compiled before the clock starts
    with dispatch_mode(mode):
        t0 = time.perf_counter()
        for i in range(STEPS):
            params = step(params, jtm.async_call(load_batch, SPEC, i))
        out = np.asarray(params)
        return time.perf_counter() - t0, out


_programs: dict = {}


def program_run_ns(wrapped: bool, fast: bool = False, calls: int = 3000) -> float:
    """Nanoseconds per run of a program, with JAX's run from Python wrapped or not.

    ``fast``: an ordinary jitted call (JAX's C++ fast path, which never reaches
    the wrapper); else a program with a host callback, which JAX always runs
    from Python.
    """
    from jax_threadmap._arrays import async_array as _async_array
    from jax_threadmap._arrays import dispatch as _dispatch
    from jax_threadmap._jax import hooks as _compat

    _dispatch.mechanism.prepare(_async_array._around)
    cls = _compat.get("ExecuteReplicated")
    wrapper = cls.__call__
    original = getattr(wrapper, "__jax_threadmap_original__", wrapper)
    if not _programs:
        _programs[False] = jax.jit(lambda v: jax.pure_callback(lambda a: a, SPEC, v))
        _programs[True] = jax.jit(lambda v: v + 1)
    f, x = _programs[fast], jnp.asarray(DATA)
    f(x).block_until_ready()
    n = calls * 5 if fast else calls
    cls.__call__ = wrapper if wrapped else original
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            y = f(x)
        y.block_until_ready()
        return (time.perf_counter() - t0) / n * 1e9
    finally:
        cls.__call__ = wrapper


def _best_alternated(sides: dict, rounds: int) -> dict:
    """Runs each side once per round, in turn; keeps each side's best."""
    best: dict = {}
    for _ in range(rounds):
        for name, run in sides.items():
            value = run()
            best[name] = value if name not in best else min(best[name], value)
    return best


def compare(rounds: int = ROUNDS) -> dict:
    reference = [np.asarray(jax.jit(make_model(n_ops()))(load(s))) for s in (0, 1)]
    t0 = time.perf_counter()
    jax.jit(make_model(n_ops())).lower(SPEC).compile()
    compile_s = time.perf_counter() - t0

    def way(name: str) -> float:
        elapsed, outs = run_way(name)
        for got, want in zip(outs, reference, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        return elapsed

    def loop(mode: str) -> float:
        elapsed, out = training_loop(mode)
        np.testing.assert_array_equal(out, loop_reference)
        return elapsed

    with dispatch_mode("blocking"):
        loop_reference = training_loop("blocking")[1]

    # The seed example takes SEED_S a round: half as many rounds, best per line.
    seeds = {mode: seed_example(mode) for mode in ("async", "blocking")}
    for _ in range(max(1, rounds // 2) - 1):
        for mode, best in seeds.items():
            again = seed_example(mode)
            seeds[mode] = {k: min(v, again[k]) for k, v in best.items()}
    return {
        "load_s": LOAD_S,
        "compile_s": compile_s,
        "rounds": rounds,
        "ways": _best_alternated({n: (lambda n=n: way(n)) for n in WAYS}, rounds),
        "seed": seeds,
        "loop": _best_alternated(
            {m: (lambda m=m: loop(m)) for m in ("async", "blocking")}, rounds
        ),
        "runs": _best_alternated(
            {
                (wrapped, fast): lambda w=wrapped, f=fast: program_run_ns(w, f)
                for fast in (False, True)
                for wrapped in (True, False)
            },
            3 * rounds,
        ),
        "unrelated": {
            where: min(unrelated_work(where) for _ in range(rounds))
            for where in ("same thread", "other thread")
        },
        "status": _dispatch.mechanism.status() or "async",
    }


def report(r: dict) -> str:
    load_s, compile_s = r["load_s"], r["compile_s"]
    lines = [
        f"jax {jax.__version__}; dispatch: {r['status']}; load {load_s:.2f} s, "
        f"compile {compile_s:.2f} s (each); best of {r['rounds']} alternated rounds",
        f"  ideal max(loads, compiles) = {max(load_s, 2 * compile_s):.2f} s; "
        f"blocking order = {2 * (load_s + compile_s):.2f} s",
    ]
    for name, t in r["ways"].items():
        lines.append(f"  {name:<46} {t:6.2f} s")
    lines.append(f"seed example (slow sleeps {SEED_S:.0f} s), per line:")
    for mode, times in r["seed"].items():
        cells = ", ".join(f"{k}: {v:.3f} s" for k, v in times.items())
        lines.append(f"  {mode + ' dispatch:':<19} {cells}")
    loop = r["loop"]
    lines.append(
        f"training loop, {STEPS} steps each fed by a {BATCH_LOAD_S} s load: async "
        f"dispatch {loop['async']:.2f} s, blocking {loop['blocking']:.2f} s "
        f"(blocking / async = {loop['blocking'] / loop['async']:.2f})"
    )
    runs = r["runs"]
    for fast, what in ((False, "run from Python (host callback)"), (True, "C++ path")):
        on, off = runs[True, fast], runs[False, fast]
        lines.append(
            f"a program {what}: wrapped {on / 1e3:.2f} us, not wrapped "
            f"{off / 1e3:.2f} us (ratio {on / off:.3f})"
        )
    lines.append(
        f"g(jnp.ones(3)) done while a {UNRELATED_LOAD_S:.0f} s load is pending "
        "(target < 0.1 s):"
    )
    for where, t in r["unrelated"].items():
        lines.append(f"  {where + ':':<19} {t * 1e3:.2f} ms")
    return "\n".join(lines)


@pytest.mark.parametrize("way", list(WAYS))
def test_two_loads_two_compiles(benchmark, way):
    benchmark.group = "two loads feeding two slow compiles"
    benchmark.extra_info["load_s"] = LOAD_S
    elapsed, outs = benchmark.pedantic(run_way, args=(way,), rounds=ROUNDS)
    assert len(outs) == 2 and outs[0].shape == (N,)


@pytest.mark.parametrize("mode", ["async", "blocking"])
def test_seed_example_line_by_line(benchmark, mode):
    benchmark.group = "seed example: square(async_call(slow))"
    times = benchmark.pedantic(seed_example, args=(mode,), rounds=1)
    benchmark.extra_info.update(times)
    print(f"\n{mode}: " + ", ".join(f"{k}: {v:.3f} s" for k, v in times.items()))


@pytest.mark.parametrize("mode", ["async", "blocking"])
def test_training_loop_fed_by_loads(benchmark, mode):
    benchmark.group = "training loop fed by loads"
    elapsed, out = benchmark.pedantic(training_loop, args=(mode,), rounds=ROUNDS)
    assert out.shape == (N,)


@pytest.mark.parametrize("fast", [False, True], ids=["from_python", "cpp_fast_path"])
@pytest.mark.parametrize("wrapped", [True, False], ids=["wrapped", "not_wrapped"])
def test_program_run_wrapped_or_not(benchmark, wrapped, fast):
    benchmark.group = f"a program run ({'C++' if fast else 'from Python'}), ns"
    benchmark.pedantic(program_run_ns, args=(wrapped, fast), rounds=ROUNDS)


@pytest.mark.parametrize("where", ["same thread", "other thread"])
def test_unrelated_work_while_a_load_is_pending(benchmark, where):
    benchmark.group = "g(jnp.ones(3)) while a load is pending"
    seconds = benchmark.pedantic(unrelated_work, args=(where,), rounds=1)
    benchmark.extra_info["seconds"] = seconds


if __name__ == "__main__":
    print(report(compare()))
