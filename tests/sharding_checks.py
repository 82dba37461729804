"""Checks of threadmap in sharded programs, on 8 CPU devices.

Run by tests/_core/test_sharding.py in a subprocess (the number of CPU devices is
fixed when JAX starts, and the main test session keeps one), once per
partitioner and part (``python tests/sharding_checks.py PART [shardy|gspmd]``;
without the partitioner, JAX's default or ``JAX_USE_SHARDY_PARTITIONER``):

- ``shard_map``: ``shard_map``, ``pmap``, derivatives inside them, and ``jit``
  on meshes of 4 devices, explicit and automatic (``per_shard_jit``: the rules
  of explicit mesh axes, 2-D meshes, a mesh mixing explicit and automatic axes);
- ``jit``: per-shard maps under ``jit`` on 8 devices, the same checks for both
  mesh kinds (``jax.make_mesh(..., axis_types=Explicit)`` and a classic
  ``jax.sharding.Mesh``): the compiled program has no collective on the map's
  operands or results, each device's block is handed to the host once, the
  results keep the batch sharding, and values equal the one-device run bit for
  bit (and jax.numpy under the same vmaps).

Prints one line per check and exits non-zero on the first failure.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import logging  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_threadmap  # noqa: E402
from jax_threadmap import threadmap  # noqa: E402
from jax_threadmap._host import maps as _host  # noqa: E402
from jax_threadmap._jax import hooks as _hooks  # noqa: E402

# The partitioner, set before anything is lowered (as JAX_USE_SHARDY_PARTITIONER
# sets it at JAX's import).
if len(sys.argv) > 2:
    jax.config.update("jax_use_shardy_partitioner", sys.argv[2] == "shardy")
assert jax.device_count() == 8, jax.devices()

# Every host call of a flat map records its kernel name and batch shape.
host_calls = []
_lock = threading.Lock()
_original_init = _host.HostMap.__init__


def _recording_init(self, caller, spec, operands, *rest):
    with _lock:
        host_calls.append((caller.name.rsplit(".", 1)[-1], spec.shape))
    _original_init(self, caller, spec, operands, *rest)


_host.HostMap.__init__ = _recording_init

MOVES = ("all-gather(", "all-to-all(", "collective-permute(", "conditional(")
W = 16
OUT = jax.ShapeDtypeStruct((W,), jnp.float32)
A = np.float32(1.5)
#: The 4-device part's rows, and the 8-device part's.
X = np.random.default_rng(0).standard_normal((8, W)).astype(np.float32)
X64 = np.random.default_rng(0).standard_normal((64, W)).astype(np.float32)
SORTED = np.sort(X, axis=-1) * A


@jax_threadmap.kernel(OUT)
def scaled_sort(x, a):
    return np.sort(x) * a


@jax_threadmap.kernel(OUT)
def sin_a(x, a):
    return np.sin(x) * a


@sin_a.defjvp
def sin_a_jvp(x, a, tx, ta):
    return np.cos(x) * a * tx + np.sin(x) * ta


@sin_a.defvjp
def sin_a_vjp(x, a, ct):
    return ct * np.cos(x) * a, np.sum(ct * np.sin(x))


@jax_threadmap.kernel(OUT)
def sin_res(x, a):
    return np.sin(x) * a


def sin_res_fwd(x, a):
    return np.sin(x) * a, (np.cos(x) * a, np.sin(x))


def sin_res_bwd(res, ct):
    d, v = res
    return ct * d, np.sum(ct * v)


sin_res.defvjp(sin_res_fwd, sin_res_bwd, residuals=(OUT, OUT))


def sort_rows(x, a):  # a vectorized chunk: x (k, W), a (k,)
    return np.sort(x, axis=-1) * a[:, None]


def vectorized(x, a):
    return threadmap(sort_rows, OUT, x, a, vectorized=True)


def ref(x, a):
    return jnp.sin(x) * a


def rows(f):
    return jax.vmap(f, in_axes=(0, None))


def total(f):
    return lambda x, a: rows(f)(x, a).sum()


def check(name, got, want, calls=None, exact=False, elements=None):
    """Compares values (bit for bit with ``exact``) and the host calls made;
    ``elements``: the number of kernel calls over all host calls."""
    if exact:
        assert np.array_equal(np.asarray(got), np.asarray(want)), name
    else:
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    if calls is not None:
        assert sorted(host_calls) == sorted(calls), (name, host_calls, calls)
    if elements is not None:
        n = sum(int(np.prod(shape)) for _, shape in host_calls)
        assert n == elements, (name, host_calls, elements)
    host_calls.clear()
    print("ok", name, flush=True)


def compiled(f, *args, allowed=()):
    """``f`` compiled for ``args``, after checking that the program moves no
    operand between devices but by ``allowed``, calls the host on every device
    (no conditional on the partition id), and has no device holding the whole
    of a value (maximal sharding). The checks call it (one compilation)."""
    program = f.lower(*args).compile()
    hlo = program.as_text()
    for op in MOVES:
        assert op in allowed or op not in hlo, (op, hlo)
    assert "maximal" not in hlo, hlo
    return program


def collectives(f, x):
    """The collectives in ``f``'s program on ``x`` (and ``A``)."""
    hlo = f.lower(x, A).compile().as_text()
    return [op for op in (*MOVES, "all-reduce(", "reduce-scatter(") if op in hlo]


def same_sharding(out, x):
    assert out.sharding.is_equivalent_to(x.sharding, x.ndim), (out.sharding, x.sharding)


# --- part "shard_map": 4 devices ----------------------------------------------

FOUR = jax.devices()[:4]


def mesh4(shape, names, *types):
    return jax.make_mesh(shape, names, axis_types=types, devices=FOUR)


def two_levels_on_2x2(mesh2):
    """Issue 27: ``jit(vmap(vmap(f, (0, None)), (0, None)))(xs, 0.7)`` with ``xs``
    on ``P("x", "y")`` raised DuplicateSpecError (``P('x', ('y', 'x'), None)``)
    when the inner level's size let it be split over "x" too. For threadmap,
    kernel and grad, against jax.numpy on the same sharding: one flat map per
    device."""

    def by_threadmap(x, c):
        return threadmap(lambda x, c: np.sin(x) * c, OUT, x, c)

    def two_levels(f):
        return jax.vmap(rows(f), (0, None))

    def total2(f):
        return lambda x, c: two_levels(f)(x, c).sum()

    want_f = jax.jit(two_levels(ref))
    ref_grad = jax.jit(jax.grad(total2(ref), argnums=(0, 1)))
    for shape in ((2, 4, W), (4, 4, W), (4, 6, W), (2, 2, W)):
        data = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        xs = jax.device_put(data, NamedSharding(mesh2, P("x", "y")))
        want = want_f(xs, 0.7)
        block = (shape[0] // 2, shape[1] // 2)
        for name, f in (("threadmap", by_threadmap), ("kernel", sin_a)):
            out = compiled(jax.jit(two_levels(f)), xs, 0.7)(xs, 0.7)
            calls = [("<lambda>" if f is by_threadmap else "sin_a", block)] * 4
            check(f"Explicit {name} 2 levels {shape} on P(x, y)", out, want, calls)
            assert out.sharding.is_equivalent_to(want.sharding, 3), out.sharding
        gx, gc = jax.jit(jax.grad(total2(sin_a), argnums=(0, 1)))(xs, 0.7)
        rx, rc = ref_grad(xs, 0.7)
        check(f"Explicit grad 2 levels {shape} on P(x, y) (x)", gx, rx)
        check(f"Explicit grad 2 levels {shape} on P(x, y) (c)", gc, rc)
        assert gx.sharding.is_equivalent_to(rx.sharding, 3), gx.sharding


def per_shard_jit(mesh, xs):
    """jit with explicitly sharded inputs ("sharding in types"): one flat map
    per shard, by the process holding the device, results sharded as the
    operands' batch axes (docs/sharding.md)."""
    f = jax.jit(rows(scaled_sort))
    one_device = f(X, A)  # NumPy input: one device, one flat map
    check("Explicit one-device reference", one_device, SORTED, [("scaled_sort", (8,))])
    out = compiled(f, xs, A)(xs, A)
    check("Explicit jit per shard", out, one_device, [("scaled_sort", (2,))] * 4)
    same_sharding(out, xs)

    # Derivatives: per-shard JVP and VJP equations; the cotangent of the
    # unbatched `a` is the sum over the shards (an all-reduce of one scalar).
    rx, ra = jax.grad(total(sin_a), argnums=(0, 1))(X, A)  # one device
    host_calls.clear()
    grad = jax.jit(jax.grad(total(sin_a), argnums=(0, 1)))
    gx, ga = compiled(grad, xs, A)(xs, A)
    check("Explicit grad per shard (x)", gx, rx, [("sin_a_vjp", (2,))] * 4)
    check("Explicit grad per shard (a)", ga, ra)
    same_sharding(gx, xs)
    jac = compiled(jax.jit(jax.jacfwd(total(sin_a))), xs, A)
    # Per shard: the JVP kernel on 8 * W tangents (the primal's result is unused).
    check("Explicit jacfwd per shard", jac(xs, A), rx, [("sin_a_jvp", (8 * W, 2))] * 4)

    # Nested vmaps, with the inner or the outer batch axis sharded: still one
    # flat map per shard, and the result keeps the sharded axis.
    nested = jax.jit(jax.vmap(rows(scaled_sort), in_axes=(0, None)))
    for spec, shape, block in (
        (P("d"), (4, 2, W), (1, 2)),
        (P(None, "d"), (2, 4, W), (2, 1)),
    ):
        x3 = jax.device_put(X.reshape(shape), NamedSharding(mesh, spec))
        out = compiled(nested, x3, A)(x3, A)
        want = SORTED.reshape(shape)
        check(f"Explicit nested vmap {spec}", out, want, [("scaled_sort", block)] * 4)
        same_sharding(out, x3)

    # A vectorized kernel: one chunk call per shard.
    check(
        "Explicit vectorized per shard",
        jax.jit(rows(vectorized))(xs, A),
        SORTED,
        [("sort_rows", (2,))] * 4,
    )

    # A 2x2 mesh with the batch sharded over "x" only: the elements are split
    # over "y" too (each device maps its own 2 rows), and the results come back
    # sharded over "x" as the operand.
    mesh2 = mesh4((2, 2), ("x", "y"), AxisType.Explicit, AxisType.Explicit)
    x2 = jax.device_put(X, NamedSharding(mesh2, P("x")))
    out = f(x2, A)
    check("Explicit 2x2 mesh", out, SORTED, [("scaled_sort", (2,))] * 4)
    same_sharding(out, x2)
    # Two vmap levels sharded over two mesh axes: one flat map per device.
    x22 = jax.device_put(X.reshape(4, 2, W), NamedSharding(mesh2, P("x", "y")))
    out = compiled(nested, x22, A)(x22, A)
    calls = [("scaled_sort", (2, 1))] * 4
    check("Explicit 2 levels on 2 mesh axes", out, SORTED.reshape(4, 2, W), calls)
    same_sharding(out, x22)
    out = jax.vmap(rows(scaled_sort), in_axes=(0, None))(x22, A)  # eager
    check("Explicit eager", out, SORTED.reshape(4, 2, W), calls)
    same_sharding(out, x22)

    two_levels_on_2x2(mesh2)

    # The per-row gradient of an unbatched parameter: the VJP equation sums the
    # inner level away, and that level is split over "y" (the outer one, of 2,
    # cannot take it), so the shards' partial sums are added up over "y".
    grad_a = jax.vmap(jax.grad(total(sin_a), argnums=1), in_axes=(0, None))
    x24 = jax.device_put(X.reshape(2, 4, W), NamedSharding(mesh2, P("x")))
    check(
        "Explicit summed level split over another mesh axis",
        jax.jit(grad_a)(x24, A),
        grad_a(X.reshape(2, 4, W), A),
    )

    # An unbatched operand sharded over "y" reaches each shard whole.
    scales = jax.device_put(
        np.arange(4, dtype=np.float32), NamedSharding(mesh2, P("y"))
    )
    scaled = jax.jit(
        rows(lambda x, s: threadmap(lambda r, s: np.sort(r) * s.sum(), OUT, x, s))
    )
    check(
        "Explicit sharded unbatched operand",
        scaled(x2, scales),
        np.sort(X) * 6.0,
        elements=8,
    )
    # A mesh mixing explicit and automatic axes: partitioned along "x"; the
    # devices along the automatic "y" map the same rows, with either
    # partitioner (the result stays on P("x"); GSPMD once took a split over "y").
    mixed = mesh4((2, 2), ("x", "y"), AxisType.Explicit, AxisType.Auto)
    xm = jax.device_put(X, NamedSharding(mixed, P("x")))
    out = compiled(f, xm, A)(xm, A)
    check("Explicit and Auto axes", out, SORTED, [("scaled_sort", (4,))] * 4)
    # A batch too small to split over "y" too: each row is mapped on both
    # devices of its "x" block (no data moves).
    x1 = jax.device_put(X[:2], NamedSharding(mesh2, P("x")))
    out = compiled(f, x1, A)(x1, A)
    check(
        "Explicit batch of 2 on 4 devices", out, SORTED[:2], [("scaled_sort", (1,))] * 4
    )


def in_shard_map(mesh, xs, tag):
    """Inside shard_map, each of the 4 shards maps its own 2 rows."""
    rows4 = NamedSharding(mesh, P("d"))

    def shard_map(f, out_specs=None):
        return jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=P("d") if out_specs is None else out_specs,
        )

    body = shard_map(rows(lambda x, a: threadmap(scaled_sort.fn, OUT, x, a)))
    host_calls.clear()
    check(f"{tag} shard_map", body(xs, A), SORTED, [("scaled_sort", (2,))] * 4)
    out = jax.jit(body)(xs, A)
    check(f"{tag} jit shard_map", out, SORTED, [("scaled_sort", (2,))] * 4)
    assert out.sharding.spec[0] == "d", out.sharding
    # A 2-level vmap inside shard_map stays one flat map per shard.
    check(
        f"{tag} shard_map nested vmap",
        jax.jit(shard_map(jax.vmap(rows(scaled_sort), in_axes=(0, None))))(
            jax.device_put(X.reshape(4, 2, W), rows4), A
        ),
        SORTED.reshape(4, 2, W),
        [("scaled_sort", (1, 2))] * 4,
    )
    # A vectorized kernel inside shard_map: one flat map of chunks per shard.
    check(
        f"{tag} shard_map vectorized",
        jax.jit(shard_map(rows(vectorized)))(xs, A),
        SORTED,
        [("sort_rows", (2,))] * 4,
    )

    # Derivatives inside shard_map: per-shard JVP/VJP equations.
    gx, ga = jax.jit(shard_map(jax.grad(total(sin_a), (0, 1)), (P("d"), P())))(xs, A)
    rx, ra = jax.grad(total(ref), argnums=(0, 1))(X, A)
    check(f"{tag} grad in shard_map (x)", gx, rx)
    # `a` is the same on every shard: its cotangent is the sum over shards.
    check(f"{tag} grad in shard_map (a)", ga, ra)
    # Results vary over the mesh axis, so collectives see per-shard values.
    psum = jax.jit(shard_map(lambda x, a: jax.lax.psum(total(sin_a)(x, a), "d"), P()))
    check(f"{tag} psum in shard_map", psum(xs, A), total(ref)(X, A))
    gx, ga = jax.jit(jax.grad(psum, argnums=(0, 1)))(xs, A)
    check(f"{tag} grad of psum in shard_map (x)", gx, rx)
    check(f"{tag} grad of psum in shard_map (a)", ga, ra)
    tangent = jax.jit(shard_map(lambda x, a: jax.jvp(rows(sin_a), (x, a), (x, a))[1]))(
        xs, A
    )
    want = jax.jvp(rows(ref), (X, A), (X, A))[1]
    check(f"{tag} jvp in shard_map", tangent, want)

    # Derivatives of a jitted function with NamedSharding inputs.
    host_calls.clear()
    gx, ga = jax.jit(jax.grad(total(sin_a), argnums=(0, 1)))(xs, A)
    check(f"{tag} grad jit NamedSharding (x)", gx, rx)
    check(f"{tag} grad jit NamedSharding (a)", ga, ra)
    check(
        f"{tag} jacfwd jit NamedSharding", jax.jit(jax.jacfwd(total(sin_a)))(xs, A), rx
    )


def part_shard_map():
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = mesh4((4,), ("d",), axis_type)
        xs = jax.device_put(X, NamedSharding(mesh, P("d")))
        in_shard_map(mesh, xs, axis_type.name)
        if axis_type == AxisType.Explicit:
            per_shard_jit(mesh, xs)

    # pmap: one flat map per device.
    out = jax.pmap(rows(scaled_sort), in_axes=(0, None), devices=FOUR)(
        X.reshape(4, 2, W), A
    )
    check("pmap", out.reshape(8, W), SORTED, [("scaled_sort", (2,))] * 4)
    g = jax.pmap(jax.grad(total(sin_a)), in_axes=(0, None), devices=FOUR)
    check(
        "grad in pmap",
        g(X.reshape(4, 2, W), A).reshape(8, W),
        jax.grad(lambda x: total(ref)(x, A))(X),
    )


# --- part "jit": 8 devices, both mesh kinds -----------------------------------


class Kind:
    """One mesh kind: its 1-D mesh ``b`` of 8 and 2-D mesh ``x`` (4) by ``y`` (2)."""

    def __init__(self, name):
        self.name = name
        self.explicit = name == "explicit"
        devices = np.array(jax.devices())
        if self.explicit:
            self.mesh = jax.make_mesh((8,), ("b",), axis_types=(AxisType.Explicit,))
            self.mesh2 = jax.make_mesh(
                (4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2
            )
        else:  # a classic mesh: automatic axes
            self.mesh = Mesh(devices, ("b",))
            self.mesh2 = Mesh(devices.reshape(4, 2), ("x", "y"))

    def put(self, x, *spec, mesh=None):
        return jax.device_put(x, NamedSharding(mesh or self.mesh, P(*spec)))


def one_mesh_axis(kind):
    xs = kind.put(X64, "b")
    for name, f, kname in (
        ("threadmap", lambda x, a: threadmap(sin_a.fn, OUT, x, a), "sin_a"),
        ("kernel", sin_a, "sin_a"),
        ("vectorized", vectorized, "sort_rows"),
    ):
        want = np.asarray(jax.jit(rows(f))(X64, A))  # one device, one flat map
        g = compiled(jax.jit(rows(f)), xs, A)
        host_calls.clear()
        out = g(xs, A)
        same_sharding(out, xs)
        check(f"{kind.name} {name} per shard", out, want, [(kname, (8,))] * 8, True)
    check(
        f"{kind.name} against jax.numpy", jax.jit(rows(sin_a))(xs, A), rows(ref)(X64, A)
    )

    # in_shardings/out_shardings as in JAX's sharding tutorial.
    rowwise = NamedSharding(kind.mesh, P("b"))
    g = jax.jit(rows(sin_a), in_shardings=(rowwise, None), out_shardings=rowwise)
    check(
        f"{kind.name} in/out_shardings",
        compiled(g, X64, A)(X64, A),
        rows(ref)(X64, A),
        [("sin_a", (8,))] * 8,
    )

    # in_axes=None: an unbatched vector, replicated (no collective) or, on a
    # classic mesh, sharded over the batch's mesh axis (gathered: each element
    # needs all of it; vmap refuses that on an explicit mesh).
    def with_vector(x, v):
        return threadmap(lambda x, v: np.sin(x) * v, OUT, x, v)

    v = np.linspace(0.5, 2, W, dtype=np.float32)
    cases = [((), ())] + ([] if kind.explicit else [(("b",), ("all-gather(",))])
    for spec, allowed in cases:
        vs = kind.put(v, *spec)
        g = compiled(jax.jit(rows(with_vector)), xs, vs, allowed=allowed)
        check(
            f"{kind.name} in_axes=None operand on {P(*spec)}",
            g(xs, vs),
            np.sin(X64) * v,
            [("<lambda>", (8,))] * 8,
        )

    # in_axes=1, out_axes=1: the sharded axis moves with the result.
    xt = kind.put(X64.T.copy(), None, "b")
    moved = compiled(jax.jit(jax.vmap(sin_a, in_axes=(1, None), out_axes=1)), xt, A)
    out = moved(xt, A)
    calls = [("sin_a", (8,))] * 8
    check(f"{kind.name} in_axes=1 out_axes=1", out, (np.sin(X64) * A).T, calls)
    assert tuple(out.sharding.spec)[:2] == (None, "b"), out.sharding


def nested_and_two_axes(kind):
    nested = jax.jit(jax.vmap(rows(sin_a), in_axes=(0, None)))
    for spec, shape, block in (
        (("b",), (8, 8, W), (1, 8)),  # outer level of 8 on 8 devices
        ((None, "b"), (4, 16, W), (4, 2)),
    ):
        x3s = kind.put(X64.reshape(shape), *spec)
        out = compiled(nested, x3s, A)(x3s, A)
        want = rows(rows(ref))(X64.reshape(shape), A)
        name = f"{kind.name} nested vmaps sharded on {P(*spec)}"
        check(name, out, want, [("sin_a", block)] * 8)
        assert out.sharding.is_equivalent_to(x3s.sharding, 3), out.sharding

    f = jax.jit(rows(sin_a))
    # 2-D mesh, batch on "x", "y" replicated. Explicit: the elements are split
    # over "y" too, and the results gathered back over it (the operand does
    # not move). Classic: no collective, with either partitioner; the devices
    # along "y" map the same rows.
    x2 = kind.put(X64, "x", mesh=kind.mesh2)
    allowed = ("all-gather(",) if kind.explicit else ()
    out = compiled(f, x2, A, allowed=allowed)(x2, A)
    calls = [("sin_a", (8,) if kind.explicit else (16,))] * 8
    check(f"{kind.name} 2-D mesh, y replicated", out, rows(ref)(X64, A), calls)
    assert tuple(out.sharding.spec)[0] == "x", out.sharding
    if not kind.explicit:  # issue 58: GSPMD split over "y", then gathered back
        on_x = NamedSharding(kind.mesh2, P("x"))
        g = jax.jit(rows(sin_a), out_shardings=on_x)
        out = compiled(g, x2, A)(x2, A)
        got = collectives(g, x2)
        want = collectives(jax.jit(rows(ref), out_shardings=on_x), x2)
        assert got == want == [], (got, want)
        check(
            f"{kind.name} 2-D mesh, out_shardings P('x')", out, rows(ref)(X64, A), calls
        )
    # 2-D mesh, "y" sharding the element's own axis: gathered along it only.
    x22 = kind.put(X64, "x", "y", mesh=kind.mesh2)
    out = compiled(f, x22, A, allowed=("all-gather(",))(x22, A)
    calls = [("sin_a", (16,))] * 8
    check(f"{kind.name} 2-D mesh, y on the core axis", out, rows(ref)(X64, A), calls)
    assert tuple(out.sharding.spec)[0] == "x", out.sharding


#: The cotangents of `a` on the explicit mesh (checked first), by kernel.
GRADS = {}


def derivatives(kind):
    xs = kind.put(X64, "b")
    rx, ra = jax.grad(total(ref), argnums=(0, 1))(X64, A)
    for name, f in (("defvjp", sin_a), ("residuals", sin_res)):
        g = jax.jit(jax.grad(total(f), argnums=(0, 1)))
        gx, ga = compiled(g, xs, A)(xs, A)  # (the cotangent of `a`: an all-reduce)
        check(f"{kind.name} grad ({name}) x", gx, rx)
        check(f"{kind.name} grad ({name}) a", ga, ra)
        assert gx.sharding.is_equivalent_to(xs.sharding, 2), gx.sharding
        ex = g(X64, A)[0]  # one device
        check(f"{kind.name} grad ({name}) as on one device x", gx, ex, exact=True)
        # `a`'s cotangent sums the devices' partial sums: the same on both kinds.
        ea = GRADS.setdefault(name, ga)
        check(f"{kind.name} grad ({name}) as explicit a", ga, ea, exact=True)
    tangent = jax.jit(lambda x, a: jax.jvp(rows(sin_a), (x, a), (x, a))[1])
    want = jax.jvp(rows(ref), (X64, A), (X64, A))[1]
    out = compiled(tangent, xs, A)(xs, A)
    check(f"{kind.name} jvp", out, want, [("sin_a_jvp", (8,))] * 8)
    check(f"{kind.name} jacfwd", jax.jit(jax.jacfwd(total(sin_a)))(xs, A), rx)


def uneven(kind):
    # 10 and 3 rows on 8 devices: blocks padded at the end; the host maps only
    # a block's real rows (5 blocks of 2; 3 blocks of 1), the rest is dropped.
    # (JAX refuses an uneven explicit sharding: there the rows are replicated,
    # and split over the devices all the same.)
    rowwise = NamedSharding(kind.mesh, P("b"))
    for n, calls in ((10, [("sin_a", (2,))] * 5), (3, [("sin_a", (1,))] * 3)):
        if kind.explicit:
            f, x = jax.jit(rows(sin_a)), kind.put(X64[:n])
        else:
            f = jax.jit(
                lambda x, a: rows(sin_a)(
                    jax.lax.with_sharding_constraint(x, rowwise), a
                )
            )
            x = X64[:n]
        check(
            f"{kind.name} {n} rows on 8 devices", f(x, A), rows(ref)(X64[:n], A), calls
        )


def one_mechanism(kind):
    # One equation on either mesh, no shard_map; on an explicit mesh its result
    # is typed with the batch sharding.
    jaxpr = str(jax.make_jaxpr(rows(sin_a))(kind.put(X64, "b"), A))
    typed = "f32[64@b,16]" in jaxpr
    assert "shard_map" not in jaxpr and typed == kind.explicit, jaxpr
    # shard_map on the 8 devices: one map per shard, as before.
    body = jax.shard_map(
        rows(sin_a), mesh=kind.mesh, in_specs=(P("b"), P()), out_specs=P("b")
    )
    out = jax.jit(body)(kind.put(X64, "b"), A)
    check(f"{kind.name} shard_map", out, rows(ref)(X64, A), [("sin_a", (8,))] * 8)
    # Under jax.set_mesh (jax.sharding.use_mesh on jax 0.6; how explicit
    # sharding is used): each device's call is traced on the partitioner's
    # mesh, not the context's (on 0.6.2 the context's left a "Sharding" custom
    # call that XLA could not run, issue 58).
    context = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    with context(kind.mesh):
        xs = kind.put(X64, "b")
        out = jax.jit(rows(sin_a))(xs, A)
        check(f"{kind.name} in set_mesh", out, rows(ref)(X64, A), [("sin_a", (8,))] * 8)
        gx = jax.jit(jax.grad(total(sin_a)))(xs, A)
        check(f"{kind.name} grad in set_mesh", gx, jax.grad(total(ref))(X64, A))
        # NumPy rows, replicated: every device maps every row, as jax.numpy
        # computes them on every device (issue 58: the map was placed on one
        # device, whose result JAX could not type, as for jax.pure_callback).
        out = jax.jit(rows(sin_a))(X64, A)
        check(
            f"{kind.name} NumPy rows in set_mesh",
            out,
            rows(ref)(X64, A),
            [("sin_a", (64,))] * 8,
        )


def property_against_jax_numpy(kind):
    """Random batch shapes (even or not), meshes, sharded levels and in_axes:
    values and gradients (the unbatched operand's cotangent sums every
    element) equal jax.numpy's under the same vmaps."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    meshes = {"b": (kind.mesh, ("b",)), "xy": (kind.mesh2, ("x", "y"))}

    @settings(max_examples=10, deadline=None, derandomize=True)
    @given(
        outer=st.integers(1, 9),
        inner=st.integers(1, 9),
        mesh_name=st.sampled_from(sorted(meshes)),
        level=st.integers(0, 1),
        transposed=st.booleans(),
    )
    def case(outer, inner, mesh_name, level, transposed):
        mesh, names = meshes[mesh_name]
        data = np.random.default_rng(outer * 10 + inner).standard_normal(
            (outer, inner, W)
        )
        x = data.astype(np.float32)
        spec = P(*([None] * level), names[0])
        axis = 1 if transposed else 0  # the inner level's axis in its operand
        size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[names[0]]
        if kind.explicit:  # (an explicit sharding must divide evenly)
            even = x.shape[level] % size == 0
            x = jax.device_put(x, NamedSharding(mesh, spec if even else P()))

        def loss(f):
            def total_sq(x, a):
                if f is sin_a and not kind.explicit:  # (the reference: one device)
                    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
                inner_map = jax.vmap(f, in_axes=(axis, None))
                y = jax.vmap(inner_map, in_axes=(0, None))(
                    jnp.swapaxes(x, 1, 2) if transposed else x, a
                )
                return (y * y).sum()

            return total_sq

        whole = NamedSharding(mesh, P())  # (an uneven result cannot leave jit)
        both = jax.value_and_grad(loss(sin_a), argnums=(0, 1))
        if kind.explicit:
            got = jax.jit(both)(x, A)
        else:
            got = jax.jit(
                lambda x, a: jax.lax.with_sharding_constraint(both(x, a), whole)
            )(x, A)
        # (jitted: one compile where op-by-op dispatch compiled each op anew
        # for each example's shapes)
        want = jax.jit(jax.value_and_grad(loss(ref), argnums=(0, 1)))(np.asarray(x), A)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-4
            )

    case()
    host_calls.clear()
    print(f"ok {kind.name} property: values and gradients against jax.numpy")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def fallback_without_a_hook(kinds):
    """A JAX that moved a hook: one device maps every element, on either mesh
    kind, and the log says so once, at INFO level."""
    records = _Records()
    logger = logging.getLogger("jax_threadmap.sharding")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    hook = next(h for h in _hooks.HOOKS if h.name == "custom_partitioning")
    saved = _hooks.RESOLVED[hook.name]
    _hooks.RESOLVED[hook.name] = _hooks.Missing(hook, "moved (a test)")
    try:
        for kind in kinds:
            xs = kind.put(X64, "b")
            for a in (A, A + 1):  # two programs per kind, one log line in all
                out = jax.jit(rows(sin_a))(xs, a)
                want = rows(ref)(X64, a)
                check(
                    f"{kind.name} fallback without a hook",
                    out,
                    want,
                    [("sin_a", (64,))],
                )
    finally:
        _hooks.RESOLVED[hook.name] = saved
        logger.removeHandler(records)
    assert len(records.lines) == 1, records.lines
    assert "custom_partitioning is missing" in records.lines[0], records.lines


def part_jit():
    kinds = [Kind("explicit"), Kind("classic")]
    for kind in kinds:
        one_mesh_axis(kind)
        nested_and_two_axes(kind)
        derivatives(kind)
        uneven(kind)
        one_mechanism(kind)
        property_against_jax_numpy(kind)
    fallback_without_a_hook(kinds)


if __name__ == "__main__":
    {"shard_map": part_shard_map, "jit": part_jit}[sys.argv[1]]()
    print(f"all sharding checks passed ({sys.argv[1]})", flush=True)
