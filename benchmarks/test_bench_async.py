"""async_call + jit against load-then-jit: compilation hidden behind a slow load.

A "download" of model weights takes LOAD_S seconds (a sleep, as network I/O
would; it releases the GIL) and a model takes about a second to trace and
compile. Loading first and then calling the jitted model takes about
load + compile; passing ``async_call(load, ...)`` to the jitted model compiles
while the load runs, so it takes about max(load, compile).

Every round uses a fresh model function, so each one really compiles.

Run:
    pytest benchmarks/test_bench_async.py            # pytest-benchmark tables + ratio
    python benchmarks/test_bench_async.py            # just the side-by-side ratio

The ratio (async_call + jit time / load-then-jit time) is printed and stored in
the benchmark's ``extra_info``; ideal is max(load, compile) / (load + compile).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_threadmap as jtm

LOAD_S = 1.0  # the simulated download
N_OPS = 60  # model depth: about a second of tracing and compiling on a laptop CPU
HIDDEN = 256
ROUNDS = 3

SHAPES = {
    "w_in": jax.ShapeDtypeStruct((HIDDEN, HIDDEN), jnp.float32),
    "b_in": jax.ShapeDtypeStruct((HIDDEN,), jnp.float32),
    "w_out": jax.ShapeDtypeStruct((HIDDEN, 10), jnp.float32),
}


def load_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """A slow loader: waits like a download, then returns the arrays."""
    time.sleep(LOAD_S)
    rng = np.random.default_rng(seed)
    return {
        k: (rng.standard_normal(s.shape) / np.sqrt(s.shape[0])).astype(s.dtype)
        for k, s in SHAPES.items()
    }


def make_model():
    """A fresh model function (a new function object compiles anew)."""

    def model(params, x):
        h = jnp.tanh(x @ params["w_in"] + params["b_in"])
        for i in range(N_OPS):
            h = jnp.sin(h * (1.0 + i * 1e-3))[::-1] + jnp.float32(i * 1e-3)
            h = jnp.roll(h, 1, axis=-1)
        return h @ params["w_out"]

    return model


X = np.linspace(-1.0, 1.0, 8 * HIDDEN, dtype=np.float32).reshape(8, HIDDEN)


def load_then_jit() -> tuple[jax.Array, float, float]:
    """Returns the output, the load time and the jit (trace+compile+run) time."""
    t0 = time.perf_counter()
    params = load_weights()
    t1 = time.perf_counter()
    out = jax.jit(make_model())(params, X).block_until_ready()
    return out, t1 - t0, time.perf_counter() - t1


def async_call_jit() -> jax.Array:
    params = jtm.async_call(load_weights, SHAPES)
    return jax.jit(make_model())(params, X).block_until_ready()


def _warm_up() -> None:
    jax.jit(lambda a: a + 1)(X).block_until_ready()


def compare(rounds: int = ROUNDS) -> dict[str, float]:
    """Runs both ways, alternating, in this process; returns medians and ratio."""
    _warm_up()
    seq, par, loads, compiles = [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ref, load_s, jit_s = load_then_jit()
        seq.append(time.perf_counter() - t0)
        loads.append(load_s)
        compiles.append(jit_s)
        t0 = time.perf_counter()
        out = async_call_jit()
        par.append(time.perf_counter() - t0)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    load_s, compile_s = statistics.median(loads), statistics.median(compiles)
    result = {
        "load_then_jit_s": statistics.median(seq),
        "async_call_jit_s": statistics.median(par),
        "load_s": load_s,
        "compile_s": compile_s,
    }
    result["ratio"] = result["async_call_jit_s"] / result["load_then_jit_s"]
    result["ideal_ratio"] = max(load_s, compile_s) / (load_s + compile_s)
    return result


def _report(r: dict[str, float]) -> str:
    return (
        f"load {r['load_s']:.2f} s, trace+compile+run {r['compile_s']:.2f} s | "
        f"load-then-jit {r['load_then_jit_s']:.2f} s, "
        f"async_call+jit {r['async_call_jit_s']:.2f} s | "
        f"ratio {r['ratio']:.2f} (ideal about {r['ideal_ratio']:.2f})"
    )


@pytest.mark.parametrize("variant", ["load_then_jit", "async_call_jit"])
def test_weights_load_and_first_call(benchmark, variant):
    benchmark.group = "weights load + first jit call"
    _warm_up()
    fn = {"load_then_jit": lambda: load_then_jit()[0], "async_call_jit": async_call_jit}
    out = benchmark.pedantic(fn[variant], rounds=ROUNDS, iterations=1)
    assert out.shape == (8, 10)


def test_ratio_side_by_side(benchmark):
    benchmark.group = "ratio: async_call+jit / load-then-jit"
    result = benchmark.pedantic(compare, kwargs={"rounds": ROUNDS}, rounds=1)
    benchmark.extra_info.update(result)
    print("\n" + _report(result))


if __name__ == "__main__":
    print(_report(compare()))
