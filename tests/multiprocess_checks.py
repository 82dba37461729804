"""One of 2 JAX processes (jax.distributed on 127.0.0.1, 2 CPU devices each).

Run by tests/_core/test_multiprocess.py as ``python multiprocess_checks.py PORT INDEX``.
Prints ``ok <check>`` per check and ends with ``all multiprocess checks passed``;
then process 1 calls a kernel that raises, uncaught, so that the test sees both
processes exit promptly when one fails (process 1 with the error, process 0
cleanly).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import asyncio  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402

PORT, INDEX = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(
    f"127.0.0.1:{PORT}", num_processes=2, process_id=INDEX, initialization_timeout=60
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from wait_hooks import calling_on_wait  # noqa: E402

import jax_threadmap  # noqa: E402
from jax_threadmap import KernelError, threadmap  # noqa: E402

assert jax.process_index() == INDEX and jax.process_count() == 2
assert jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()

MESH = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
ROWS = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)[:, ::-1].copy()
A = np.float32(2.0)
OUT = {
    "v": jax.ShapeDtypeStruct((3,), jnp.float32),
    "pid": jax.ShapeDtypeStruct((), jnp.int32),
}

#: Per kernel call in this process: the thread that ran it.
calls = []
_lock = threading.Lock()
RAISE_AT = [None]  # a row value at which this process's kernel raises


def sort_scaled(row, a):
    with _lock:
        calls.append(threading.get_ident())
    if RAISE_AT[0] is not None and float(row[0]) == RAISE_AT[0]:
        raise ValueError(f"row starting {row[0]} in process {INDEX}")
    return {"v": np.sort(row) * a, "pid": np.int32(os.getpid())}


def per_row(rows, a):
    return jax.vmap(lambda r: threadmap(sort_scaled, OUT, r, a))(rows)


@jax_threadmap.kernel(jax.ShapeDtypeStruct((3,), jnp.float32))
def sin_scaled(x, a):
    return np.sin(x) * a


@sin_scaled.defvjp
def sin_scaled_vjp(x, a, ct):
    return np.cos(x) * a * ct, np.float32(np.sum(np.sin(x) * ct))


def global_rows(mesh=MESH):
    sharding = NamedSharding(mesh, P("d"))
    return jax.make_array_from_callback(ROWS.shape, sharding, lambda i: ROWS[i])


def gathered(x):
    # A result of a call on AsyncArrays is an AsyncArray, which JAX's
    # process_allgather (it tests isinstance(x, jax.Array)) takes by its value.
    if isinstance(x, jax_threadmap.AsyncArray):
        x = x.result()
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check(name, ok, detail=""):
    if not ok:
        print(f"FAILED {name}: {detail}", flush=True)
        sys.exit(3)
    print(f"ok {name}", flush=True)


def local_pids(x):
    return {int(p) for s in x.addressable_shards for p in np.asarray(s.data).ravel()}


def index_text(index):
    return jax_threadmap._arrays.shards.index_str(index)


def async_array_from_callback_checks(f, expected):
    """Each process fetches only its own devices' shards, each distinct one once."""
    seen = []
    arrived = threading.Event()

    async def fetch(index):
        await asyncio.get_running_loop().run_in_executor(None, arrived.wait, 60)
        seen.append(index_text(index))
        return ROWS[index]

    sharding = NamedSharding(MESH, P("d"))
    x = jax_threadmap.async_array_from_callback(ROWS.shape, sharding, fetch, np.float32)
    # shard_map over the pending array. A multi-process run dispatches its
    # programs in one order (docs/async-dispatch.md), so the call waits for the
    # data: it arrives once this thread is inside that wait.
    with calling_on_wait(arrived.set):
        out = f(x, A)
    check(
        "async_array_from_callback + shard_map, on data that arrived in the call",
        np.array_equal(gathered(out["v"]), expected) and arrived.is_set(),
    )
    mine = sorted(
        index_text(i)
        for i in sharding.addressable_devices_indices_map(ROWS.shape).values()
    )
    check(
        "async_array_from_callback: only this process's shards, once",
        sorted(seen) == mine,
        seen,
    )
    ref = global_rows()

    def local(a):
        return {
            (s.device.id, index_text(s.index)): np.asarray(s.data)
            for s in a.addressable_shards
        }

    got, want = local(x.result(60)), local(ref)
    check(
        "async_array_from_callback: the addressable shards of make_array_from_callback",
        got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got),
        (sorted(got), sorted(want)),
    )
    check(
        "async_array_from_callback: gathered",
        np.array_equal(gathered(x.result()), ROWS),
    )

    # A replicated axis: both devices of this process hold the same rows.
    seen.clear()
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh2 = jax.make_mesh((2, 2), ("x", "y"), axis_types=auto)
    y = jax_threadmap.async_array_from_callback(
        ROWS.shape, NamedSharding(mesh2, P("x")), fetch, np.float32
    )
    y.result(60)
    rows = f"[{4 * INDEX}:{4 * INDEX + 4}, :]"
    check("replicated axis: fetched once per process", seen == [rows], seen)

    # A shard that fails in process 1 only names its index and global device.
    def flaky(index):
        if INDEX == 1:
            raise OSError(f"no object for rows {index_text(index)}")
        return ROWS[index]

    z = jax_threadmap.async_array_from_callback(ROWS.shape, sharding, flaky, np.float32)
    try:
        z.result(60)
        error = None
    except OSError as e:
        error = e
    if INDEX == 0:
        check("process 0's shards are fine", error is None, repr(error))
        return
    named = [
        f"the shard at index {index_text(i)} (device {d.id})"
        for d, i in sharding.addressable_devices_indices_map(ROWS.shape).items()
    ]
    notes = " ".join(getattr(error, "__notes__", []))
    check(
        "a failing shard in process 1 names its index and global device",
        isinstance(error, OSError)
        and (sys.version_info < (3, 11) or any(n in notes for n in named)),
        (notes, named),
    )


def main():
    expected = np.sort(ROWS, axis=1) * A
    rows = global_rows()
    main_thread = threading.get_ident()

    # shard_map: each device's 2 rows are mapped by the process holding it.
    # Sharded jit without shard_map, on a classic mesh (automatic axes) and on
    # an explicit one ("sharding in types"): the map is partitioned by XLA
    # (custom_partitioning), so each process maps its own devices' 4 rows on
    # its own threads, and the result keeps the rows' sharding (docs/sharding.md).
    explicit = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = jax.jit(
        jax.shard_map(per_row, mesh=MESH, in_specs=(P("d"), P()), out_specs=P("d"))
    )
    sides = (
        ("shard_map", f, rows),
        ("sharded jit", jax.jit(per_row), rows),
        ("explicit jit", jax.jit(per_row), global_rows(explicit)),
    )
    for tag, g, x in sides:
        del calls[:]
        out = g(x, A)
        check(f"{tag} values", np.array_equal(gathered(out["v"]), expected))
        check(f"{tag} ran here", local_pids(out["pid"]) == {os.getpid()})
        check(
            f"{tag} on this process's threads",
            len(calls) == 4 and main_thread not in calls,
            calls,
        )
        if tag != "shard_map":
            check(
                f"{tag} keeps the sharding",
                out["v"].sharding.is_equivalent_to(x.sharding, 2),
                out["v"].sharding,
            )

    # A derivative inside shard_map: the cotangent of `a` is summed over shards.
    def loss(a, rows):
        body = jax.shard_map(
            lambda r, a: jax.vmap(sin_scaled, (0, None))(r, a),
            mesh=MESH,
            in_specs=(P("d"), P()),
            out_specs=P("d"),
        )
        return body(rows, a).sum()

    grad = jax.jit(jax.grad(loss))(A, rows)
    check("grad", np.allclose(np.asarray(grad), np.sin(ROWS).sum(), rtol=1e-4))

    # async_call feeding a jitted function, in each process.
    arr = jax_threadmap.async_call(
        lambda: ROWS + INDEX, jax.ShapeDtypeStruct(ROWS.shape, jnp.float32)
    )
    doubled = jax.jit(lambda x: x * 2)(arr)
    check("async_call + jit", np.array_equal(np.asarray(doubled), (ROWS + INDEX) * 2))

    async_array_from_callback_checks(f, expected)

    # A kernel that raises in process 1 only: the error there names its batch
    # index (local to the shard: row 5 is row 1 of the third shard); process 0
    # finishes its shards. Under jit the error crosses XLA's runtime as a
    # JaxRuntimeError that carries the KernelError's message.
    RAISE_AT[0] = float(ROWS[5, 0]) if INDEX == 1 else None
    try:
        jax.block_until_ready(f(rows, A))
        raised = None
    except (KernelError, jax.errors.JaxRuntimeError) as e:
        raised = e
    if INDEX == 1:
        check(
            "error in process 1 names the index",
            raised is not None
            and "threadmap kernel 'sort_scaled' at batch index (1,)" in str(raised)
            and f"ValueError: row starting 17.0 in process {INDEX}" in str(raised),
            repr(raised),
        )
    else:
        check("process 0 unaffected", raised is None, repr(raised))
    RAISE_AT[0] = None
    out = f(rows, A)
    check("next map", np.array_equal(gathered(out["v"]), expected))
    print("all multiprocess checks passed", flush=True)

    if INDEX == 1:  # uncaught: this process exits with the error
        RAISE_AT[0] = float(ROWS[4, 0])
        jax.block_until_ready(f(rows, A))


if __name__ == "__main__":
    main()
