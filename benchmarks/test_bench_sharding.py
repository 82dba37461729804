"""Sharded data on 4 CPU devices: one map per shard against one gathered map.

Three sides: ``shard_map`` (one map per shard), ``jit`` without ``shard_map`` on an
explicitly sharded array (``AxisType.Explicit``: jax_threadmap maps per shard by
itself), and ``jit`` on an automatically sharded array (``AxisType.Auto``: the
partitioner gathers every row to device 0, which maps them all; see
docs/sharding.md).

ROWS rows of WIDTH float32, sharded by rows over 4 CPU devices, each sorted by a
host kernel (``np.sort``, which releases the GIL). Both sides run in one process
(a child started with ``--xla_force_host_platform_device_count=4``), alternating,
best of ROUNDS; the ratios are per-shard time / gathered time.

On one machine the gather is a copy in memory, so the two sides cost about the
same; the per-shard path matters where shards live on several hosts or GPUs (no
data through device 0, each host maps its own rows).

Run:
    pytest benchmarks/test_bench_sharding.py -s
    python benchmarks/test_bench_sharding.py
"""

from __future__ import annotations

import json
import sys
import time

ROWS = 4096
WIDTH = 1024
ROUNDS = 5


def child() -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_threadmap import threadmap

    assert jax.device_count() == 4, jax.devices()
    out = jax.ShapeDtypeStruct((WIDTH,), jnp.float32)

    def per_row(rows):
        return jax.vmap(lambda r: threadmap(np.sort, out, r))(rows)

    auto = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    explicit = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = np.random.default_rng(0).random((ROWS, WIDTH)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(auto, P("d")))
    xe = jax.device_put(x, NamedSharding(explicit, P("d")))
    sides = {
        "per_shard": (
            jax.jit(
                jax.shard_map(per_row, mesh=auto, in_specs=P("d"), out_specs=P("d"))
            ),
            xs,
        ),
        "explicit_jit": (jax.jit(per_row), xe),
        "gathered": (jax.jit(per_row), xs),
    }
    expected = np.sort(x, axis=1)
    best = {name: float("inf") for name in sides}
    for f, arg in sides.values():  # compile, off the clock
        np.testing.assert_array_equal(np.asarray(f(arg)), expected)
    for _ in range(ROUNDS):
        for name, (f, arg) in sides.items():
            t = time.perf_counter()
            f(arg).block_until_ready()
            best[name] = min(best[name], time.perf_counter() - t)
    best["ratio"] = best["per_shard"] / best["gathered"]
    best["explicit_ratio"] = best["explicit_jit"] / best["gathered"]
    return best


def compare() -> dict[str, float]:
    """Runs :func:`child` in a process with 4 CPU devices."""
    import harness  # here: the child runs this file too, and needs none of it

    return harness.script_in_child(__file__, "--child", devices=4)


def report(r: dict[str, float]) -> str:
    return (
        f"{ROWS} rows x {WIDTH} float32 sorted on 4 CPU devices, best of {ROUNDS}: "
        f"per shard (shard_map) {r['per_shard'] * 1e3:.1f} ms, per shard (jit, "
        f"explicit mesh) {r['explicit_jit'] * 1e3:.1f} ms, gathered (jit, auto mesh) "
        f"{r['gathered'] * 1e3:.1f} ms; ratios to gathered: shard_map "
        f"{r['ratio']:.2f}, explicit jit {r['explicit_ratio']:.2f}"
    )


def test_per_shard_against_gathered(benchmark):
    benchmark.group = "sharding: per shard / gathered"
    result = benchmark.pedantic(compare, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + report(result))


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(child()))
    else:
        print(report(compare()))
