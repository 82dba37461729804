"""Checks of threadmap in sharded programs, on 4 CPU devices.

Run by tests/test_sharding.py in a subprocess, because the number of CPU devices
is fixed when JAX starts and the main test session keeps one. Prints one line per
check and exits non-zero on the first failure.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import threading  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_threadmap  # noqa: E402
from jax_threadmap import _host, threadmap  # noqa: E402

assert jax.device_count() == 4, jax.devices()

# Every host call of a flat map records its batch shape and kernel name.
host_calls = []
_lock = threading.Lock()
_original_init = _host.HostMap.__init__


def _recording_init(self, caller, spec, operands):
    with _lock:
        host_calls.append((caller.name.rsplit(".", 1)[-1], spec.shape))
    _original_init(self, caller, spec, operands)


_host.HostMap.__init__ = _recording_init

OUT = jax.ShapeDtypeStruct((3,), jnp.float32)


@jax_threadmap.kernel(OUT)
def scaled_sort(x, a):
    return np.sort(x) * a


@jax_threadmap.kernel(OUT)
def scaled_sin(x, a):
    return np.sin(x) * a


@scaled_sin.defjvp
def scaled_sin_jvp(x, a, tx, ta):
    return np.cos(x) * a * tx + np.sin(x) * ta


@scaled_sin.defvjp
def scaled_sin_vjp(x, a, ct):
    return ct * np.cos(x) * a, np.sum(ct * np.sin(x))


def scaled_sin_ref(x, a):
    return jnp.sin(x) * a


def per_row(f):
    return jax.vmap(f, in_axes=(0, None))


X = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
A = np.float32(1.5)
SORTED = np.sort(X, axis=-1) * A


def check(name, got, want, calls=None, elements=None):
    """Compares results; ``calls``: the expected host calls, ``elements``: the
    expected number of kernel calls over all host calls."""
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    if calls is not None:
        assert sorted(host_calls) == sorted(calls), (name, host_calls, calls)
    if elements is not None:
        n = sum(int(np.prod(shape)) for _, shape in host_calls)
        assert n == elements, (name, host_calls, elements)
    host_calls.clear()
    print("ok", name)


def main():
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((4,), ("d",), axis_types=(axis_type,))
        rows = NamedSharding(mesh, P("d"))
        xs = jax.device_put(X, rows)
        tag = axis_type.name

        # shard_map: each of the 4 shards runs its own flat map over its 2 rows.
        body = jax.shard_map(
            per_row(lambda x, a: threadmap(scaled_sort.fn, OUT, x, a)),
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=P("d"),
        )
        host_calls.clear()
        check(f"{tag} shard_map", body(xs, A), SORTED, [("scaled_sort", (2,))] * 4)
        out = jax.jit(body)(xs, A)
        check(f"{tag} jit shard_map", out, SORTED, [("scaled_sort", (2,))] * 4)
        assert out.sharding.spec[0] == "d", out.sharding

        # A 2-level vmap inside shard_map stays one flat map per shard.
        body2 = jax.shard_map(
            jax.vmap(per_row(scaled_sort), in_axes=(0, None)),
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=P("d"),
        )
        check(
            f"{tag} shard_map nested vmap",
            jax.jit(body2)(jax.device_put(X.reshape(4, 2, 3), rows), A),
            SORTED.reshape(4, 2, 3),
            [("scaled_sort", (1, 2))] * 4,
        )

        # A vectorized kernel inside shard_map: one flat map of chunks per shard.
        def sort_rows(x, a):  # a chunk: x (k, 3), a (k,)
            return np.sort(x, axis=-1) * a[:, None]

        body3 = jax.shard_map(
            per_row(lambda x, a: threadmap(sort_rows, OUT, x, a, vectorized=True)),
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=P("d"),
        )
        check(
            f"{tag} shard_map vectorized",
            jax.jit(body3)(xs, A),
            SORTED,
            [("sort_rows", (2,))] * 4,
        )

        # jit with NamedSharding inputs (automatic partitioning): what the
        # compiled program does, as docs/sharding.md says. The partitioner
        # places the host call on device 0: the batched operand is all-gathered,
        # device 0 alone calls the host (a conditional on the partition id),
        # with all 8 rows in one flat map, and the result stays on device 0.
        f = jax.jit(per_row(scaled_sort))
        out = f(xs, A)
        check(f"{tag} jit NamedSharding", out, SORTED, [("scaled_sort", (8,))])
        hlo = f.lower(xs, A).compile().as_text()
        assert "all-gather(" in hlo, hlo
        assert "conditional(" in hlo and "partition-id()" in hlo, hlo
        assert "{maximal device=0}" in str(out.sharding), out.sharding

        # Derivatives inside shard_map: per-shard JVP/VJP equations.
        def loss(x, a):
            return per_row(scaled_sin)(x, a).sum()

        def loss_ref(x, a):
            return per_row(scaled_sin_ref)(x, a).sum()

        grad_body = jax.shard_map(
            jax.grad(loss, argnums=(0, 1)),
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=(P("d"), P()),
        )
        gx, ga = jax.jit(grad_body)(xs, A)
        rx, ra = jax.grad(loss_ref, argnums=(0, 1))(X, A)
        check(f"{tag} grad in shard_map (x)", gx, rx)
        # `a` is the same on every shard: its cotangent is the sum over shards.
        check(f"{tag} grad in shard_map (a)", ga, ra)
        # Results vary over the mesh axis, so collectives see per-shard values.
        total = jax.jit(
            jax.shard_map(
                lambda x, a: jax.lax.psum(loss(x, a), "d"),
                mesh=mesh,
                in_specs=(P("d"), P()),
                out_specs=P(),
            )
        )
        check(f"{tag} psum in shard_map", total(xs, A), loss_ref(X, A))
        gx, ga = jax.jit(jax.grad(total, argnums=(0, 1)))(xs, A)
        check(f"{tag} grad of psum in shard_map (x)", gx, rx)
        check(f"{tag} grad of psum in shard_map (a)", ga, ra)
        tangent = jax.jit(
            jax.shard_map(
                lambda x, a: jax.jvp(per_row(scaled_sin), (x, a), (x, a))[1],
                mesh=mesh,
                in_specs=(P("d"), P()),
                out_specs=P("d"),
            )
        )(xs, A)
        want = jax.jvp(per_row(scaled_sin_ref), (X, A), (X, A))[1]
        check(f"{tag} jvp in shard_map", tangent, want)

        # Derivatives of a jitted function with NamedSharding inputs.
        gx, ga = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, A)
        check(f"{tag} grad jit NamedSharding (x)", gx, rx)
        check(f"{tag} grad jit NamedSharding (a)", ga, ra)
        jac = jax.jit(jax.jacfwd(loss))(xs, A)
        check(f"{tag} jacfwd jit NamedSharding", jac, rx)

    # pmap: one flat map per device.
    out = jax.pmap(per_row(scaled_sort), in_axes=(0, None))(X.reshape(4, 2, 3), A)
    check("pmap", out.reshape(8, 3), SORTED, [("scaled_sort", (2,))] * 4)
    g = jax.pmap(
        jax.grad(lambda x, a: per_row(scaled_sin)(x, a).sum()), in_axes=(0, None)
    )
    check(
        "grad in pmap",
        g(X.reshape(4, 2, 3), A).reshape(8, 3),
        jax.grad(lambda x: per_row(scaled_sin_ref)(x, A).sum())(X),
    )
    print("all sharding checks passed")


if __name__ == "__main__":
    main()
