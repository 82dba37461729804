"""Checks of per-shard maps under ``jit`` on automatic mesh axes, 8 CPU devices.

Run by tests/test_auto_sharding.py in a subprocess (the number of CPU devices is
fixed when JAX starts), once per partitioner (``JAX_USE_SHARDY_PARTITIONER``).
Classic meshes (``jax.sharding.Mesh``, axis types ``Auto``) with
``NamedSharding`` inputs: the compiled program has no collective on the map's
operands or results, each device's block is handed to the host once, the
results keep the batch sharding, and values equal the explicit-mesh path bit
for bit (and jax.numpy under the same vmaps). Prints one line per check and
exits non-zero on the first failure.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import logging  # noqa: E402
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

MESH = Mesh(np.array(jax.devices()), ("b",))
MESH2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
EXPLICIT = jax.make_mesh((8,), ("b",), axis_types=(AxisType.Explicit,))
MOVES = ("all-gather(", "all-to-all(", "collective-permute(", "conditional(")
W = 16
OUT = jax.ShapeDtypeStruct((W,), jnp.float32)
X = np.random.default_rng(0).standard_normal((64, W)).astype(np.float32)
A = np.float32(1.5)


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


def check(name, got, want, calls=None, exact=False):
    """Compares values (bit for bit with ``exact``) and the host calls made."""
    if exact:
        assert np.array_equal(np.asarray(got), np.asarray(want)), name
    else:
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    if calls is not None:
        assert sorted(host_calls) == sorted(calls), (name, host_calls, calls)
    host_calls.clear()
    print("ok", name, flush=True)


def compiled(f, *args, allowed=()):
    """``f`` compiled for ``args``: no collective but ``allowed``, no device
    holding the whole of a value (maximal sharding)."""
    hlo = f.lower(*args).compile().as_text()
    for op in MOVES:
        assert op in allowed or op not in hlo, (op, hlo)
    assert "maximal" not in hlo, hlo
    return f


def explicit(x):
    return jax.device_put(x, NamedSharding(EXPLICIT, P("b")))


def one_mesh_axis():
    xs = jax.device_put(X, NamedSharding(MESH, P("b")))
    for name, f, kname in (
        ("threadmap", lambda x, a: threadmap(sin_a.fn, OUT, x, a), "sin_a"),
        ("kernel", sin_a, "sin_a"),
        ("vectorized", vectorized, "sort_rows"),
    ):
        g = compiled(jax.jit(rows(f)), xs, A)
        want = np.asarray(jax.jit(rows(f))(explicit(X), A))
        host_calls.clear()
        out = g(xs, A)
        assert out.sharding.is_equivalent_to(xs.sharding, 2), out.sharding
        check(f"1-D mesh {name} per shard", out, want, [(kname, (8,))] * 8, exact=True)
    check("1-D mesh against jax.numpy", jax.jit(rows(sin_a))(xs, A), rows(ref)(X, A))

    # in_shardings/out_shardings as in JAX's sharding tutorial.
    rowwise = NamedSharding(MESH, P("b"))
    g = jax.jit(rows(sin_a), in_shardings=(rowwise, None), out_shardings=rowwise)
    check(
        "in/out_shardings",
        compiled(g, X, A)(X, A),
        rows(ref)(X, A),
        [("sin_a", (8,))] * 8,
    )

    # in_axes=None: an unbatched vector, replicated (no collective) or sharded
    # over the batch's mesh axis (gathered: each element needs all of it).
    def with_vector(x, v):
        return threadmap(lambda x, v: np.sin(x) * v, OUT, x, v)

    v = np.linspace(0.5, 2, W, dtype=np.float32)
    for spec, allowed in ((P(), ()), (P("b"), ("all-gather(",))):
        vs = jax.device_put(v, NamedSharding(MESH, spec))
        g = compiled(jax.jit(rows(with_vector)), xs, vs, allowed=allowed)
        check(
            f"in_axes=None operand on {spec}",
            g(xs, vs),
            np.sin(X) * v,
            [("<lambda>", (8,))] * 8,
        )

    # in_axes=1, out_axes=1: the sharded axis moves with the result.
    xt = jax.device_put(X.T.copy(), NamedSharding(MESH, P(None, "b")))
    moved = compiled(jax.jit(jax.vmap(sin_a, in_axes=(1, None), out_axes=1)), xt, A)
    out = moved(xt, A)
    check("in_axes=1 out_axes=1", out, (np.sin(X) * A).T, [("sin_a", (8,))] * 8)
    assert tuple(out.sharding.spec)[:2] == (None, "b"), out.sharding


def nested_and_two_axes():
    nested = jax.jit(jax.vmap(rows(sin_a), in_axes=(0, None)))
    x3 = X.reshape(4, 16, W)
    for spec, block in ((P("b"), None), (P(None, "b"), (4, 2))):
        if block is None:  # outer level of 4 on 8 devices: split in pairs
            x3s = jax.device_put(X.reshape(8, 8, W), NamedSharding(MESH, spec))
            want = rows(rows(ref))(X.reshape(8, 8, W), A)
            block = (1, 8)
        else:
            x3s = jax.device_put(x3, NamedSharding(MESH, spec))
            want = rows(rows(ref))(x3, A)
        out = compiled(nested, x3s, A)(x3s, A)
        check(f"nested vmaps sharded on {spec}", out, want, [("sin_a", block)] * 8)
        assert out.sharding.is_equivalent_to(x3s.sharding, 3), out.sharding

    f = jax.jit(rows(sin_a))
    # 2-D mesh, batch on "x", "y" replicated: no collective; under GSPMD the
    # proposed split over "y" is taken, under Shardy the devices along "y"
    # map the same rows.
    x2 = jax.device_put(X, NamedSharding(MESH2, P("x")))
    out = compiled(f, x2, A)(x2, A)
    block = (16,) if jax.config.jax_use_shardy_partitioner else (8,)
    check("2-D mesh, y replicated", out, rows(ref)(X, A), [("sin_a", block)] * 8)
    assert tuple(out.sharding.spec)[0] in ("x", ("x", "y")), out.sharding
    # 2-D mesh, "y" sharding the element's own axis: gathered along it only.
    x22 = jax.device_put(X, NamedSharding(MESH2, P("x", "y")))
    out = compiled(f, x22, A, allowed=("all-gather(",))(x22, A)
    check("2-D mesh, y on the core axis", out, rows(ref)(X, A), [("sin_a", (16,))] * 8)
    assert tuple(out.sharding.spec)[0] == "x", out.sharding


def derivatives():
    xs = jax.device_put(X, NamedSharding(MESH, P("b")))

    def total(f):
        return lambda x, a: rows(f)(x, a).sum()

    rx, ra = jax.grad(total(ref), argnums=(0, 1))(X, A)
    for name, f in (("defvjp", sin_a), ("residuals", sin_res)):
        g = jax.jit(jax.grad(total(f), argnums=(0, 1)))
        gx, ga = compiled(g, xs, A)(xs, A)  # (the cotangent of `a`: an all-reduce)
        check(f"grad ({name}) x", gx, rx)
        check(f"grad ({name}) a", ga, ra)
        assert gx.sharding.is_equivalent_to(xs.sharding, 2), gx.sharding
        ex, ea = g(explicit(X), A)
        check(f"grad ({name}) as the explicit mesh x", gx, ex, exact=True)
        check(f"grad ({name}) as the explicit mesh a", ga, ea, exact=True)
    tangent = jax.jit(lambda x, a: jax.jvp(rows(sin_a), (x, a), (x, a))[1])
    want = jax.jvp(rows(ref), (X, A), (X, A))[1]
    check("jvp", compiled(tangent, xs, A)(xs, A), want, [("sin_a_jvp", (8,))] * 8)
    check("jacfwd", jax.jit(jax.jacfwd(total(sin_a)))(xs, A), rx)


def uneven():
    # 10 and 3 rows on 8 devices: blocks padded at the end; the host maps only
    # a block's real rows (5 blocks of 2; 3 blocks of 1), the rest is dropped.
    rowwise = NamedSharding(MESH, P("b"))
    for n, calls in ((10, [("sin_a", (2,))] * 5), (3, [("sin_a", (1,))] * 3)):
        f = jax.jit(
            lambda x, a: rows(sin_a)(jax.lax.with_sharding_constraint(x, rowwise), a)
        )
        check(f"{n} rows on 8 devices", f(X[:n], A), rows(ref)(X[:n], A), calls)


def unchanged_paths():
    # Explicit meshes take the same path: one equation, its result typed with
    # the batch sharding.
    jaxpr = str(jax.make_jaxpr(rows(sin_a))(explicit(X), A))
    assert "shard_map" not in jaxpr and "f32[64@b,16]" in jaxpr, jaxpr
    out = jax.jit(rows(sin_a))(explicit(X), A)
    check("explicit mesh", out, rows(ref)(X, A), [("sin_a", (8,))] * 8)
    # shard_map: one map per shard, as before.
    body = jax.shard_map(
        rows(sin_a), mesh=MESH, in_specs=(P("b"), P()), out_specs=P("b")
    )
    xs = jax.device_put(X, NamedSharding(MESH, P("b")))
    check("shard_map", jax.jit(body)(xs, A), rows(ref)(X, A), [("sin_a", (8,))] * 8)


def property_against_jax_numpy():
    """Random batch shapes (even or not), meshes, sharded levels and in_axes:
    values and gradients (the unbatched operand's cotangent sums every
    element) equal jax.numpy's under the same vmaps."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    meshes = {"b": (MESH, ("b",)), "xy": (MESH2, ("x", "y"))}

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
        spec = P(*([None] * level), names[0] if level < 2 else None)
        axis = 1 if transposed else 0  # the inner level's axis in its operand

        def loss(f):
            def total(x, a):
                if f is sin_a:  # (jax.numpy's reference runs eagerly, on one device)
                    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
                inner_map = jax.vmap(f, in_axes=(axis, None))
                y = jax.vmap(inner_map, in_axes=(0, None))(
                    jnp.swapaxes(x, 1, 2) if transposed else x, a
                )
                return (y * y).sum()

            return total

        whole = NamedSharding(mesh, P())  # (an uneven result cannot leave jit)
        both = jax.value_and_grad(loss(sin_a), argnums=(0, 1))
        got = jax.jit(lambda x, a: jax.lax.with_sharding_constraint(both(x, a), whole))(
            x, A
        )
        want = jax.value_and_grad(loss(ref), argnums=(0, 1))(x, A)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-4
            )

    case()
    host_calls.clear()
    print("ok property: values and gradients against jax.numpy", flush=True)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def fallback_without_a_hook():
    """A JAX that moved a hook: one device maps every element, one INFO line."""
    records = _Records()
    logger = logging.getLogger("jax_threadmap.sharding")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    hook = next(h for h in _hooks.HOOKS if h.name == "custom_partitioning")
    saved = _hooks.RESOLVED[hook.name]
    _hooks.RESOLVED[hook.name] = _hooks.Missing(hook, "moved (a test)")
    try:
        xs = jax.device_put(X, NamedSharding(MESH, P("b")))
        for a in (A, A + 1):  # two programs, one log line
            out = jax.jit(rows(sin_a))(xs, a)
            check("fallback without a hook", out, rows(ref)(X, a), [("sin_a", (64,))])
    finally:
        _hooks.RESOLVED[hook.name] = saved
        logger.removeHandler(records)
    assert len(records.lines) == 1, records.lines
    assert "custom_partitioning is missing" in records.lines[0], records.lines


def main():
    one_mesh_axis()
    nested_and_two_axes()
    derivatives()
    uneven()
    unchanged_paths()
    property_against_jax_numpy()
    fallback_without_a_hook()
    print("all auto sharding checks passed", flush=True)


if __name__ == "__main__":
    main()
