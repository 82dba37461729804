"""Sharded data under ``jit``: the ways threadmap maps it per shard, timed.

The first benchmark, on 4 CPU devices: ``shard_map`` (one map per shard),
``jit`` without ``shard_map`` on an explicitly sharded array
(``AxisType.Explicit``) and on an automatically sharded one (``AxisType.Auto``);
under ``jit`` both are split per device by XLA's partitioner through
``custom_partitioning`` (docs/sharding.md). ROWS rows of WIDTH float32, sharded
by rows, each sorted by a host kernel (``np.sort``, which releases the GIL).
Ratios are to ``shard_map``.

The second benchmark (issue 52) puts a classic mesh (``jax.sharding.Mesh``,
automatic axes) beside an explicit one, on 8 CPU devices: a ``(rows, 4096)``
float32 batch sharded by rows (64 MB; 1 GB with ``--classic 1024``), a
vectorized kernel that doubles the rows or sorts them, and
``jax.pure_callback`` (vectorized) on the classic mesh, which XLA runs on one
device. Ratios are to the explicit mesh.

Each runs in a child process started with the devices it needs; sides
alternated rep by rep (``harness.alternate``), best of each.

Run:
    pytest benchmarks/test_bench_sharding.py -s
    python benchmarks/test_bench_sharding.py
    python benchmarks/test_bench_sharding.py --classic 1024   # the 1 GB batch
"""

from __future__ import annotations

import json
import sys
from typing import Any

import harness

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
        "shard_map": (
            jax.jit(
                jax.shard_map(per_row, mesh=auto, in_specs=P("d"), out_specs=P("d"))
            ),
            xs,
        ),
        "explicit_jit": (jax.jit(per_row), xe),
        "auto_jit": (jax.jit(per_row), xs),
    }
    expected = np.sort(x, axis=1)
    for f, arg in sides.values():  # compile and check, off the clock
        np.testing.assert_array_equal(np.asarray(f(arg)), expected)
    runs = {name: _blocking(f, arg) for name, (f, arg) in sides.items()}
    best = {name: wall for name, (wall, _) in harness.alternate(runs, ROUNDS).items()}
    best["explicit_ratio"] = best["explicit_jit"] / best["shard_map"]
    best["auto_ratio"] = best["auto_jit"] / best["shard_map"]
    return best


def _blocking(f: Any, arg: Any) -> Any:
    return lambda: f(arg).block_until_ready()


CLASSIC_WIDTH = 4096
#: MB of the classic-mesh batch (float32 rows of CLASSIC_WIDTH); 1024: 1 GB.
CLASSIC_MB = 64
CLASSIC_ROUNDS = 5
#: The largest batch timed with pure_callback: its all-gather puts the whole
#: batch on each of the 8 devices (8 GB and more for 1 GB, beyond a shared box).
PURE_CALLBACK_MB = 256


def classic_child(mb: int, rounds: int) -> dict[str, float]:
    """Best times of the classic-mesh sides against the explicit mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_threadmap import threadmap

    assert jax.device_count() == 8, jax.devices()
    rows = mb * 2**20 // (4 * CLASSIC_WIDTH)
    row = jax.ShapeDtypeStruct((CLASSIC_WIDTH,), jnp.float32)
    kernels = {"double": lambda x: x * 2, "sort": lambda x: np.sort(x, axis=-1)}
    classic = Mesh(np.array(jax.devices()), ("b",))
    explicit = jax.make_mesh((8,), ("b",), axis_types=(AxisType.Explicit,))
    x = np.random.default_rng(0).random((rows, CLASSIC_WIDTH), np.float32)
    xc = jax.device_put(x, NamedSharding(classic, P("b")))
    xe = jax.device_put(x, NamedSharding(explicit, P("b")))
    del x
    best: dict[str, float] = {"rows": rows}
    for kname, kernel in kernels.items():

        def mapped(rows, kernel=kernel):
            one = lambda r: threadmap(kernel, row, r, vectorized=True)  # noqa: E731
            return jax.vmap(one)(rows)

        def callback(rows, kernel=kernel):
            return jax.pure_callback(
                kernel, jax.typeof(rows), rows, vmap_method="expand_dims"
            )

        sides = {
            "explicit": (jax.jit(mapped), xe),
            "classic": (jax.jit(mapped), xc),
        }
        if mb <= PURE_CALLBACK_MB:  # (it gathers the batch on all 8 devices)
            sides["pure_callback"] = (jax.jit(jax.vmap(callback)), xc)
        want = None
        for f, arg in sides.values():  # compile and check, off the clock
            got = np.asarray(f(arg))
            want = got if want is None else want
            assert np.array_equal(got, want)
        del want, got
        runs = {name: _blocking(f, arg) for name, (f, arg) in sides.items()}
        times = {
            name: wall for name, (wall, _) in harness.alternate(runs, rounds).items()
        }
        for name, t in times.items():
            best[f"{kname}_{name}"] = t
    return best


def classic_report(r: dict[str, float], mb: int) -> str:
    lines = [
        f"{int(r['rows'])} x {CLASSIC_WIDTH} float32 ({mb} MB) on 8 CPU devices, "
        "vectorized kernel, best of each side:",
        "| kernel | explicit mesh | classic mesh | pure_callback (classic) |",
        "|---|---|---|---|",
    ]
    for k in ("double", "sort"):
        e, c = r[f"{k}_explicit"], r[f"{k}_classic"]
        p = r.get(f"{k}_pure_callback")
        callback = "not run" if p is None else f"{p * 1e3:.0f} ms ({p / e:.2f}x)"
        lines.append(
            f"| {k} | {e * 1e3:.0f} ms | {c * 1e3:.0f} ms ({c / e:.2f}x) | {callback} |"
        )
    return "\n".join(lines)


def compare_classic(mb: int = CLASSIC_MB, rounds: int = CLASSIC_ROUNDS) -> dict:
    """Runs :func:`classic_child` in a process with 8 CPU devices."""
    return harness.script_in_child(
        __file__, "--classic-child", str(mb), str(rounds), devices=8
    )


def test_classic_mesh_against_explicit_mesh(benchmark):
    benchmark.group = "sharding: classic mesh / explicit mesh"
    result = benchmark.pedantic(compare_classic, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + classic_report(result, CLASSIC_MB))


def compare() -> dict[str, float]:
    """Runs :func:`child` in a process with 4 CPU devices."""
    return harness.script_in_child(__file__, "--child", devices=4)


def report(r: dict[str, float]) -> str:
    return (
        f"{ROWS} rows x {WIDTH} float32 sorted on 4 CPU devices, best of {ROUNDS}: "
        f"shard_map {r['shard_map'] * 1e3:.1f} ms, jit on an explicit mesh "
        f"{r['explicit_jit'] * 1e3:.1f} ms ({r['explicit_ratio']:.2f}x), jit on an "
        f"automatic mesh {r['auto_jit'] * 1e3:.1f} ms ({r['auto_ratio']:.2f}x)"
    )


def test_jit_against_shard_map(benchmark):
    benchmark.group = "sharding: jit / shard_map"
    result = benchmark.pedantic(compare, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + report(result))


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(child()))
    elif sys.argv[1:2] == ["--classic-child"]:
        print(json.dumps(classic_child(int(sys.argv[2]), int(sys.argv[3]))))
    elif sys.argv[1:2] == ["--classic"]:
        mb = int(sys.argv[2])
        print(classic_report(compare_classic(mb, 3 if mb > 64 else 5), mb))
    else:
        print(report(compare()))
        print(classic_report(compare_classic(), CLASSIC_MB))
