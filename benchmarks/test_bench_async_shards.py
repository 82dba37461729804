"""Sharded loads: every shard fetched at once, and a thousand ``async def`` loads.

Three measurements, each printed as a ratio (the machine's speed swings, ratios
less so):

1. **Shards.** An (8, 4096) float32 array on 8 CPU devices (``P('x')``), each
   shard's fetch sleeping FETCH_S (a network read): the wall time from the call
   to the array ready, for ``async_array_from_callback`` with a plain callback
   (``time.sleep``) and with an ``async def`` one (``asyncio.sleep``), against
   ``jax.make_array_from_callback`` (the 8 fetches one after another) and
   ``async_call`` of the whole array (one fetch of FETCH_S, then placed on the
   sharding): the floor, "one fetch". Target: the per-shard sides within 1.3x of
   it.
2. **A thousand loads.** LOADS ``async_call`` s of one ``async def`` load each
   (``asyncio.sleep(LOAD_S)``, then a small array), from the first call to every
   array ready, against one such load. Target: within 2x. The threads the
   package started during those runs are counted (the event loop's thread is
   started once, before).
3. **Peak memory.** A SHARD_MB x 8 array fetched shard by shard, each method in a
   process of its own: the peak resident memory above the process's baseline,
   in units of the array's size. The callback returns a fresh buffer per shard
   (as a network client does). Target: the per-shard sides at or below
   ``make_array_from_callback`` (2.0: the callbacks' buffers and one copy).

Sides alternate rep by rep in one process (a child started with 8 CPU devices),
best of ROUNDS. The async pool's bound (``async_pool_status().bound``) and the
load average are reported with the numbers.

Run:
    pytest benchmarks/test_bench_async_shards.py -s
    python benchmarks/test_bench_async_shards.py
"""

from __future__ import annotations

import json
import os
import sys
import time

FETCH_S = 0.2
LOADS = 1000
LOAD_S = 0.05
ROUNDS = int(os.environ.get("ROUNDS", 7))
SHARD_MB = 32
MEMORY_METHODS = (
    "per_shard",
    "per_shard_async",
    "make_array_from_callback",
    "async_call",
)


def _run_child(*args: str) -> dict:
    import harness  # here: the child runs this file too, and needs none of it

    return harness.script_in_child(__file__, *args, devices=8, timeout=900)


# --- in the child --------------------------------------------------------------------


def shards() -> dict[str, float]:
    import asyncio

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_threadmap as jtm

    assert jax.device_count() == 8, jax.devices()
    shape = (8, 4096)
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))

    def fetch(index):
        time.sleep(FETCH_S)
        return data[index]

    async def afetch(index):
        await asyncio.sleep(FETCH_S)
        return data[index]

    spec = jax.ShapeDtypeStruct(shape, np.float32)
    everything = (slice(None), slice(None))
    sides = {
        "per_shard": lambda: jtm.async_array_from_callback(
            shape, sharding, fetch, np.float32
        ).result(),
        "per_shard_async": lambda: jtm.async_array_from_callback(
            shape, sharding, afetch, np.float32
        ).result(),
        "make_array_from_callback": lambda: jax.make_array_from_callback(
            shape, sharding, fetch
        ),
        "async_call": lambda: jtm.async_call(
            fetch, spec, everything, device=sharding
        ).result(),
    }
    for f in sides.values():  # warm up, and check the values
        out = f()
        assert np.array_equal(np.asarray(out), data) and out.sharding == sharding
    best = {name: float("inf") for name in sides}
    for _ in range(ROUNDS):
        for name, f in sides.items():
            t = time.perf_counter()
            f().block_until_ready()
            best[name] = min(best[name], time.perf_counter() - t)
    best["bound"] = jtm.async_pool_status().bound
    return best


def thousand_loads() -> dict[str, float]:
    import asyncio
    import threading

    import jax
    import numpy as np

    import jax_threadmap as jtm
    from jax_threadmap._coroutines import event_loop as _event_loop

    spec = jax.ShapeDtypeStruct((4,), np.float32)

    async def load(i):
        await asyncio.sleep(LOAD_S)
        return np.full((4,), i, np.float32)

    def run(n: int) -> float:
        t = time.perf_counter()
        xs = [jtm.async_call(load, spec, i) for i in range(n)]
        jax.block_until_ready(xs)
        wall = time.perf_counter() - t
        assert float(xs[-1].result()[0]) == n - 1
        return wall

    run(2)
    run(LOADS)  # warm up: the loop's thread starts here
    before = {t.ident for t in threading.enumerate()}
    loop_threads = _event_loop.event_loop().threads_started
    ones, manys = [], []
    for _ in range(ROUNDS):
        ones.append(run(1))
        manys.append(run(LOADS))
    new = [
        t.name
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith("jax_threadmap")
    ]
    return {
        "one": min(ones),
        "many": min(manys),
        "ratio": min(manys) / min(ones),
        "threads_started": len(new)
        + _event_loop.event_loop().threads_started
        - loop_threads,
        "loop_threads": _event_loop.event_loop().threads_started,
    }


def peak_memory(method: str) -> dict[str, float]:
    import asyncio
    import resource

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_threadmap as jtm

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))

    def fresh(shape, index):
        # A new buffer per call, every page written, as bytes from a socket.
        out = np.empty(shape, np.float32)
        out[...] = index
        return out

    def load(rows: int) -> None:
        shape = (8 * rows, 1024)

        def fetch(index):
            time.sleep(0.05)
            return fresh((rows, 1024), index[0].start or 0)

        async def afetch(index):
            await asyncio.sleep(0.05)
            return fresh((rows, 1024), index[0].start or 0)

        def whole():
            time.sleep(0.05)
            return np.concatenate([fresh((rows, 1024), k * rows) for k in range(8)])

        if method == "per_shard":
            x = jtm.async_array_from_callback(shape, sharding, fetch, np.float32)
        elif method == "per_shard_async":
            x = jtm.async_array_from_callback(shape, sharding, afetch, np.float32)
        elif method == "make_array_from_callback":
            x = jax.make_array_from_callback(shape, sharding, fetch)
        else:
            spec = jax.ShapeDtypeStruct(shape, np.float32)
            x = jtm.async_call(whole, spec, device=sharding)
        jax.block_until_ready(x)
        del x

    load(16)  # warm up on 512 KB
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = SHARD_MB * 256  # SHARD_MB of float32 per shard, 1024 wide
    load(rows)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = 8 * rows * 1024 * 4
    return {"peak_over_array": (peak - base) / size}


# --- in this process -----------------------------------------------------------------


def compare() -> dict[str, float]:
    result = {"load_average": os.getloadavg()[0], "cpus": os.cpu_count() or 1}
    result.update({f"shards_{k}": v for k, v in _run_child("--shards").items()})
    result.update({f"loads_{k}": v for k, v in _run_child("--loads").items()})
    for method in MEMORY_METHODS:
        result[f"memory_{method}"] = _run_child("--memory", method)["peak_over_array"]
    base = result["shards_async_call"]
    for side in ("per_shard", "per_shard_async", "make_array_from_callback"):
        result[f"shards_{side}_ratio"] = result[f"shards_{side}"] / base
    result["load_average_after"] = os.getloadavg()[0]
    return result


def report(r: dict[str, float]) -> str:
    ms = {
        k: r[f"shards_{k}"] * 1e3
        for k in (
            "per_shard",
            "per_shard_async",
            "make_array_from_callback",
            "async_call",
        )
    }
    lines = [
        f"{r['cpus']} CPUs, load average {r['load_average']:.2f} before, "
        f"{r['load_average_after']:.2f} after; best of {ROUNDS}",
        f"8 shards of a fetch sleeping {FETCH_S * 1e3:.0f} ms, async pool bound "
        f"{r['shards_bound']:.0f}:",
        f"  async_array_from_callback, plain callback  {ms['per_shard']:7.1f} ms  "
        f"{r['shards_per_shard_ratio']:.2f}x one fetch (target <= 1.3)",
        f"  async_array_from_callback, async def       "
        f"{ms['per_shard_async']:7.1f} ms  "
        f"{r['shards_per_shard_async_ratio']:.2f}x one fetch (target <= 1.3)",
        f"  jax.make_array_from_callback               "
        f"{ms['make_array_from_callback']:7.1f} ms  "
        f"{r['shards_make_array_from_callback_ratio']:.2f}x one fetch",
        f"  async_call of the whole array (one fetch)  {ms['async_call']:7.1f} ms",
        f"{LOADS} async def loads of {LOAD_S * 1e3:.0f} ms: "
        f"{r['loads_many'] * 1e3:.1f} ms against one load {r['loads_one'] * 1e3:.1f} "
        f"ms: {r['loads_ratio']:.2f}x (target < 2); threads started by the package "
        f"during the runs: {r['loads_threads_started']:.0f} (the event loop's "
        f"thread: {r['loads_loop_threads']:.0f}, at first use)",
        "peak memory above baseline, in units of the array "
        f"({8 * SHARD_MB} MB): "
        + ", ".join(f"{m} {r[f'memory_{m}']:.2f}" for m in MEMORY_METHODS)
        + " (target: per_shard and per_shard_async <= make_array_from_callback)",
    ]
    return "\n".join(lines)


def test_sharded_loads(benchmark):
    benchmark.group = "async: sharded loads"
    result = benchmark.pedantic(compare, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + report(result))


if __name__ == "__main__":
    if sys.argv[1:] == ["--shards"]:
        print(json.dumps(shards()))
    elif sys.argv[1:] == ["--loads"]:
        print(json.dumps(thousand_loads()))
    elif sys.argv[1:2] == ["--memory"]:
        print(json.dumps(peak_memory(sys.argv[2])))
    else:
        print(report(compare()))
