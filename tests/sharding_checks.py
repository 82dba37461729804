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
from jax_threadmap import threadmap
from jax_threadmap._host import maps as _host  # noqa: E402

assert jax.device_count() == 4, jax.devices()
# Every host call of a flat map records its batch shape and kernel name.
host_calls = []
_lock = threading.Lock()
_original_init = _host.HostMap.__init__


def _recording_init(self, caller, spec, operands, *rest):
    with _lock:
        host_calls.append((caller.name.rsplit(".", 1)[-1], spec.shape))
    _original_init(self, caller, spec, operands, *rest)


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


def auto_per_shard_jit(xs, tag):
    """jit with NamedSharding inputs in automatic mode (and, on jax 0.8.1 to
    0.9.0.1, explicit mode): the equation is lowered through
    custom_partitioning, so XLA's partitioner splits it along the batch axis:
    one flat map per device on its own 2 rows, no collective, and the result
    keeps the rows' sharding (docs/sharding.md)."""
    f = jax.jit(per_row(scaled_sort))
    out = compiled_without_movement(f, xs, A)(xs, A)
    check(
        f"{tag} jit NamedSharding per shard", out, SORTED, [("scaled_sort", (2,))] * 4
    )
    assert_same_sharding(out, xs)


def assert_same_sharding(out, x):
    assert out.sharding.is_equivalent_to(x.sharding, x.ndim), (out.sharding, x.sharding)


def compiled_without_movement(f, *args):
    """``f`` compiled for ``args``, after checking that the program moves no
    operand between devices and calls the host on every device (no conditional
    on the partition id). The checks call it (one compilation, not two)."""
    compiled = f.lower(*args).compile()
    hlo = compiled.as_text()
    for op in ("all-gather(", "collective-permute(", "all-to-all(", "conditional("):
        assert op not in hlo, (op, hlo)
    return compiled


OUT16 = jax.ShapeDtypeStruct((16,), jnp.float32)


@jax_threadmap.kernel(OUT16)
def sin16(x, c):
    return np.sin(x) * c


@sin16.defjvp
def sin16_jvp(x, c, tx, tc):
    return np.cos(x) * c * tx + np.sin(x) * tc


@sin16.defvjp
def sin16_vjp(x, c, ct):
    return ct * np.cos(x) * c, np.sum(ct * np.sin(x))


def two_levels_on_2x2(mesh2):
    """Issue 27: ``jit(vmap(vmap(f, (0, None)), (0, None)))(xs, 0.7)`` with ``xs``
    on ``P("x", "y")`` raised DuplicateSpecError (``P('x', ('y', 'x'), None)``)
    when the inner level's size let it be split over "x" too: the inner level's
    rule cannot see that the outer vmap maps over "x". For threadmap, kernel and
    grad, against jax.numpy on the same sharding: one flat map per device."""

    def by_threadmap(x, c):
        return threadmap(lambda x, c: np.sin(x) * c, OUT16, x, c)

    def two_levels(f):
        return jax.vmap(jax.vmap(f, (0, None)), (0, None))

    def total(f):
        return lambda x, c: two_levels(f)(x, c).sum()

    ref = jax.jit(two_levels(lambda x, c: jnp.sin(x) * c))
    ref_grad = jax.jit(jax.grad(total(lambda x, c: jnp.sin(x) * c), argnums=(0, 1)))
    for shape in ((2, 4, 16), (4, 4, 16), (4, 6, 16), (2, 2, 16)):
        data = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        xs = jax.device_put(data, NamedSharding(mesh2, P("x", "y")))
        want = ref(xs, 0.7)
        block = (shape[0] // 2, shape[1] // 2)
        for name, f in (("threadmap", by_threadmap), ("kernel", sin16)):
            out = compiled_without_movement(jax.jit(two_levels(f)), xs, 0.7)(xs, 0.7)
            calls = [("<lambda>" if f is by_threadmap else "sin16", block)] * 4
            check(f"Explicit {name} 2 levels {shape} on P(x, y)", out, want, calls)
            assert out.sharding.is_equivalent_to(want.sharding, 3), out.sharding
        gx, gc = jax.jit(jax.grad(total(sin16), argnums=(0, 1)))(xs, 0.7)
        rx, rc = ref_grad(xs, 0.7)
        check(f"Explicit grad 2 levels {shape} on P(x, y) (x)", gx, rx)
        check(f"Explicit grad 2 levels {shape} on P(x, y) (c)", gc, rc)
        assert gx.sharding.is_equivalent_to(rx.sharding, 3), gx.sharding


def per_shard_jit(mesh, xs):
    """jit with explicitly sharded inputs ("sharding in types"): one flat map
    per shard, by the process holding the device, results sharded as the
    operands' batch axes (docs/sharding.md)."""
    f = jax.jit(per_row(scaled_sort))
    one_device = f(X, A)  # NumPy input: one device, one flat map
    check("Explicit one-device reference", one_device, SORTED, [("scaled_sort", (8,))])
    out = compiled_without_movement(f, xs, A)(xs, A)
    check("Explicit jit per shard", out, one_device, [("scaled_sort", (2,))] * 4)
    assert_same_sharding(out, xs)

    # Derivatives: per-shard JVP and VJP equations; the cotangent of the
    # unbatched `a` is the sum over the shards (an all-reduce of one scalar).
    def loss(x, a):
        return per_row(scaled_sin)(x, a).sum()

    rx, ra = jax.grad(loss, argnums=(0, 1))(X, A)  # one device
    host_calls.clear()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    gx, ga = compiled_without_movement(grad, xs, A)(xs, A)
    check("Explicit grad per shard (x)", gx, rx, [("scaled_sin_vjp", (2,))] * 4)
    check("Explicit grad per shard (a)", ga, ra)
    assert_same_sharding(gx, xs)
    jac = compiled_without_movement(jax.jit(jax.jacfwd(loss)), xs, A)
    # Per shard: the JVP kernel on 24 tangents (the primal's result is unused).
    check(
        "Explicit jacfwd per shard", jac(xs, A), rx, [("scaled_sin_jvp", (24, 2))] * 4
    )

    # Nested vmaps, with the inner or the outer batch axis sharded: still one
    # flat map per shard, and the result keeps the sharded axis.
    nested = jax.jit(jax.vmap(per_row(scaled_sort), in_axes=(0, None)))
    for spec, shape, block in (
        (P("d"), (4, 2, 3), (1, 2)),
        (P(None, "d"), (2, 4, 3), (2, 1)),
    ):
        x3 = jax.device_put(X.reshape(shape), NamedSharding(mesh, spec))
        out = compiled_without_movement(nested, x3, A)(x3, A)
        want = SORTED.reshape(shape)
        check(f"Explicit nested vmap {spec}", out, want, [("scaled_sort", block)] * 4)
        assert_same_sharding(out, x3)

    # out_axes=1: the sharded batch axis moves with the result; in_axes=1.
    moved = jax.jit(jax.vmap(scaled_sort, in_axes=(1, None), out_axes=1))
    xt = jax.device_put(X.T.copy(), NamedSharding(mesh, P(None, "d")))
    out = moved(xt, A)
    check("Explicit in_axes=1 out_axes=1", out, SORTED.T, [("scaled_sort", (2,))] * 4)
    assert out.sharding.spec[:2] == (None, "d"), out.sharding

    # A vectorized kernel: one chunk call per shard.
    def sort_rows(x, a):
        return np.sort(x, axis=-1) * a[:, None]

    vec = jax.jit(
        per_row(lambda x, a: threadmap(sort_rows, OUT, x, a, vectorized=True))
    )
    check(
        "Explicit vectorized per shard", vec(xs, A), SORTED, [("sort_rows", (2,))] * 4
    )

    # A 2x2 mesh with the batch sharded over "x" only: the elements are split
    # over "y" too (each device maps its own 2 rows), and the results come back
    # sharded over "x" as the operand.
    mesh2 = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    x2 = jax.device_put(X, NamedSharding(mesh2, P("x")))
    out = f(x2, A)
    check("Explicit 2x2 mesh", out, SORTED, [("scaled_sort", (2,))] * 4)
    assert_same_sharding(out, x2)
    # Two vmap levels sharded over two mesh axes: one flat map per device.
    x22 = jax.device_put(X.reshape(4, 2, 3), NamedSharding(mesh2, P("x", "y")))
    nested = jax.jit(jax.vmap(per_row(scaled_sort), in_axes=(0, None)))
    out = compiled_without_movement(nested, x22, A)(x22, A)
    calls = [("scaled_sort", (2, 1))] * 4
    check("Explicit 2 levels on 2 mesh axes", out, SORTED.reshape(4, 2, 3), calls)
    assert_same_sharding(out, x22)
    out = jax.vmap(per_row(scaled_sort), in_axes=(0, None))(x22, A)  # eager
    check("Explicit eager", out, SORTED.reshape(4, 2, 3), calls)
    assert_same_sharding(out, x22)

    two_levels_on_2x2(mesh2)

    # The per-row gradient of an unbatched parameter: the VJP equation sums the
    # inner level away, and that level is split over "y" (the outer one, of 2,
    # cannot take it), so the shards' partial sums are added up over "y".
    def loss(x, a):
        return per_row(scaled_sin)(x, a).sum()

    grad_a = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))
    x24 = jax.device_put(X.reshape(2, 4, 3), NamedSharding(mesh2, P("x")))
    check(
        "Explicit summed level split over another mesh axis",
        jax.jit(grad_a)(x24, A),
        grad_a(X.reshape(2, 4, 3), A),
    )

    # An unbatched operand sharded over "y" reaches each shard whole.
    scales = jax.device_put(
        np.arange(4, dtype=np.float32), NamedSharding(mesh2, P("y"))
    )
    scaled = jax.jit(
        jax.vmap(
            lambda x, s: threadmap(lambda r, s: np.sort(r) * s.sum(), OUT, x, s),
            in_axes=(0, None),
        )
    )
    check(
        "Explicit sharded unbatched operand",
        scaled(x2, scales),
        np.sort(X) * 6.0,
        elements=8,
    )
    # A mesh mixing explicit and automatic axes: partitioned by XLA along "x"
    # (custom_partitioning); the devices along the automatic "y" map the same
    # rows under Shardy, which keeps the result on P("x"), and their own rows
    # under GSPMD, which takes the finer sharding proposed.
    mixed = jax.make_mesh(
        (2, 2), ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    xm = jax.device_put(X, NamedSharding(mixed, P("x")))
    shardy = jax.config.jax_use_shardy_partitioner
    block = (4,) if shardy else (2,)
    out = compiled_without_movement(f, xm, A)(xm, A)
    check("Explicit and Auto axes", out, SORTED, [("scaled_sort", block)] * 4)
    # A batch too small to split over "y" too: each row is mapped on both
    # devices of its "x" block (no data moves).
    x1 = jax.device_put(X[:2], NamedSharding(mesh2, P("x")))
    out = compiled_without_movement(f, x1, A)(x1, A)
    check(
        "Explicit batch of 2 on 4 devices", out, SORTED[:2], [("scaled_sort", (1,))] * 4
    )


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

        if axis_type == AxisType.Explicit:
            per_shard_jit(mesh, xs)
        else:
            auto_per_shard_jit(xs, tag)

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
        host_calls.clear()
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
