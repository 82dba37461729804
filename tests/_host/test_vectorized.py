"""Vectorized kernels: one call per chunk of the batch, equal to the per-element map."""

import concurrent.futures
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import worker_kernels
from helpers import (
    X_CORE,
    Z_CORE,
    assert_trees_close,
    build,
    count_eqns,
    examples,
    make_inputs,
    nested_pids,
    nestings,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_threadmap
from jax_threadmap import KernelError, threadmap

F32 = jax.ShapeDtypeStruct((), jnp.float32)


def element_kernel(x, y, *, z):
    return np.add(x, y["a"]), {"s": np.multiply(x[0], z[1])}


class ChunkKernel:
    """The same computation on chunks; checks what each call receives."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lengths = []

    def __call__(self, x, y, *, z):
        k = x.shape[0]
        assert x.shape == (k, *X_CORE) and y["a"].shape == (k,)
        assert z.shape == (k, *Z_CORE)
        assert not (x.flags.writeable or y["a"].flags.writeable or z.flags.writeable)
        with self.lock:
            self.lengths.append(k)
        return np.add(x, y["a"][:, None]), {"s": np.multiply(x[:, 0], z[:, 1])}


def call(kernel, vectorized, executor):
    def f(x, y, z):
        out = (
            jax.ShapeDtypeStruct(X_CORE, x.dtype),
            {"s": jax.ShapeDtypeStruct((), x.dtype)},
        )
        return threadmap(
            kernel, out, x, y, z=z, vectorized=vectorized, executor=executor
        )

    return f


@settings(max_examples=examples(40), suppress_health_check=[HealthCheck.too_slow])
@given(
    nesting=nestings(),
    dtype=st.sampled_from(["float32", "int32", "bool", "complex64"]),
    max_chunk=st.sampled_from([True, 1, 2, 5]),
    executor=st.sampled_from([None, 1, 3]),
    jit=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_nestings_match_the_per_element_map(
    nesting, dtype, max_chunk, executor, jit, seed
):
    sizes, in_axes, out_axes = nesting
    args = make_inputs(np.random.default_rng(seed), sizes, in_axes, dtype)
    chunks = ChunkKernel()
    f = build(call(chunks, max_chunk, executor), sizes, in_axes, out_axes)
    g = build(call(element_kernel, False, executor), sizes, in_axes, out_axes)
    if jit:
        f = jax.jit(f)
    assert count_eqns(jax.make_jaxpr(f)(*args).jaxpr, "threadmap") == 1
    assert_trees_close(f(*args), g(*args), dtype)
    assert sum(chunks.lengths) == int(np.prod(sizes))
    if max_chunk is not True:
        assert max(chunks.lengths) <= max_chunk


def test_unbatched_operands_repeat_with_stride_zero_and_are_never_tiled():
    seen = []

    def k(x, table):
        seen.append((x.shape, table.shape, table.strides[0], x.strides))
        return x + table[:, 0, 0]

    table = np.arange(1000, dtype=np.float32).reshape(1, 1000).repeat(5, 0).T
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = jax.jit(
        jax.vmap(
            jax.vmap(lambda x, t: threadmap(k, F32, x, t, vectorized=True), (0, None)),
            (0, None),
        )
    )
    out = f(x, table)
    np.testing.assert_array_equal(out, x + table[0, 0])
    assert sum(s[0][0] for s in seen) == 12
    for x_shape, t_shape, t_stride, x_strides in seen:
        assert t_shape == (x_shape[0], 1000, 5) and t_stride == 0
        assert x_strides == (4,)  # the batched operand is a view, not a copy


def test_outer_product_gathers_only_per_chunk():
    # x, y, z each batched at a different level: no layout merges, so each
    # chunk copies its slices, never the whole batch.
    n = 16
    x, y, z = (np.arange(n, dtype=np.float32) * s for s in (1, 10, 100))
    lengths = []

    def add3(a, b, c):
        lengths.append(a.shape[0])
        assert a.shape == b.shape == c.shape
        return a + b + c

    def f(a, b, c):
        return threadmap(add3, F32, a, b, c, vectorized=100)

    g = jax.vmap(
        jax.vmap(jax.vmap(f, (None, None, 0)), (None, 0, None)), (0, None, None)
    )
    out = jax.jit(g)(x, y, z)
    np.testing.assert_array_equal(
        out, x[:, None, None] + y[None, :, None] + z[None, None, :]
    )
    assert sum(lengths) == n**3 and max(lengths) <= 100


def test_an_inner_operand_is_copied_once_per_chunk_length_and_shared():
    # z is batched only inside each piece's rows (pieces: 6, 6 and 4 indices of
    # the middle level, the outer level fixed), so every piece of a length gets
    # the same read-only copy; x and y get their own slices. Three threads.
    n = 16
    x, y, z = (np.arange(n, dtype=np.float32) * s for s in (1, 10, 100))
    seen = {}
    lock = threading.Lock()

    def add3(a, b, c):
        assert not c.flags.writeable
        with lock:  # kept alive, so that no two chunks share memory by reuse
            seen.setdefault(c.shape[0], []).append(c)
        return a + b + c

    def f(a, b, c):
        return threadmap(add3, F32, a, b, c, vectorized=100, executor=3)

    g = jax.vmap(
        jax.vmap(jax.vmap(f, (None, None, 0)), (None, 0, None)), (0, None, None)
    )
    for _ in range(2):  # a second map makes its own
        out = jax.jit(g)(x, y, z)
        np.testing.assert_array_equal(
            out, x[:, None, None] + y[None, :, None] + z[None, None, :]
        )
    assert set(seen) == {96, 64}
    assert sum(len(chunks) for chunks in seen.values()) == 2 * n * 3  # 48 a map
    for chunks in seen.values():  # at most one per thread and map, not per piece
        assert len({c.__array_interface__["data"][0] for c in chunks}) <= 2 * 3


def test_automatic_chunks_are_few_and_keep_workers_busy():
    lengths = []

    def k(x):
        lengths.append(x.shape[0])
        return x * 2

    x = np.arange(2**16, dtype=np.float32)
    out = jax.vmap(lambda v: threadmap(k, F32, v, vectorized=True, executor=2))(x)
    np.testing.assert_array_equal(out, x * 2)
    # About four chunks per worker: enough to balance, few enough to amortise.
    assert 4 <= len(lengths) <= 16 and sum(lengths) == x.size


def test_unbatched_call_gets_a_chunk_of_one():
    def k(x):
        assert x.shape == (1, 3)
        return x[:, ::-1]

    out = threadmap(
        k, jax.ShapeDtypeStruct((3,), jnp.float32), jnp.arange(3.0), vectorized=True
    )
    np.testing.assert_array_equal(out, [2.0, 1.0, 0.0])


@pytest.mark.parametrize("jit", [False, True])
def test_a_failing_chunk_names_its_range_of_batch_indices(jit):
    def k(x):
        if (x == 13).any():
            raise ValueError("thirteen")
        return x

    # One worker: chunks are as long as the bound allows.
    f = jax.vmap(jax.vmap(lambda v: threadmap(k, F32, v, vectorized=4, executor=1)))
    if jit:
        f = jax.jit(f)
    with pytest.raises(Exception) as info:
        f(jnp.arange(24.0).reshape(4, 6)).block_until_ready()
    msg = str(info.value)
    assert "ValueError: thirteen" in msg
    assert "chunk of batch indices (2, 0) to (2, 3) (flat 12..15" in msg
    if not jit:
        assert isinstance(info.value, KernelError) and info.value.index == (2, 0)


@pytest.mark.parametrize(
    "result, fragment",
    [
        (lambda x: x[:1], "returned shape (1,) for output 0, expected (4,)"),
        (lambda x: x.sum(), "returned shape () for output 0, expected (4,)"),
        (lambda x: (x, x), "structure"),
        (lambda x: x.astype(np.complex64), "does not convert to float32"),
    ],
)
def test_wrong_results_are_clear_errors(result, fragment):
    f = jax.vmap(lambda v: threadmap(result, F32, v, vectorized=4, executor=1))
    with pytest.raises(KernelError, match="vectorized") as info:
        f(jnp.arange(64.0))
    assert fragment in str(info.value)


def test_jaxpr_marks_the_kernel_vectorized():
    def kern(x):
        return x

    text = str(
        jax.make_jaxpr(jax.vmap(lambda v: threadmap(kern, F32, v, vectorized=64)))(
            jnp.ones(3)
        )
    )
    assert "kern[vectorized<=64]" in text


def test_bad_vectorized_option_fails_at_the_call():
    for bad in ("yes", 0, -3, 1.5):
        with pytest.raises(TypeError, match="vectorized must be False"):
            threadmap(np.negative, F32, 1.0, vectorized=bad)
    with pytest.raises(TypeError, match="vectorized must be"):
        jax_threadmap.kernel(F32, vectorized="no")


def test_thread_executor_and_progress(capfd):
    lengths = []

    def k(x):
        lengths.append(x.shape[0])
        return -x

    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        f = jax.jit(
            jax.vmap(
                lambda v: threadmap(
                    k, F32, v, vectorized=10, executor=ex, progress=True
                )
            )
        )
        np.testing.assert_array_equal(f(jnp.arange(95.0)), -np.arange(95.0))
    assert sum(lengths) == 95 and max(lengths) <= 10 and len(lengths) >= 10


# --- derivatives -----------------------------------------------------------------


def make_scaled_sin():
    @jax_threadmap.kernel(jax.ShapeDtypeStruct((3,), jnp.float32), vectorized=3)
    def scaled_sin(x, a):  # a chunk: x (k, 3), a (k,)
        assert x.ndim == 2 and a.shape == x.shape[:1]
        return np.sin(x) * a[:, None]

    @scaled_sin.defjvp
    def scaled_sin_jvp(x, a, tx, ta):
        return np.cos(x) * tx * a[:, None] + np.sin(x) * ta[:, None]

    @scaled_sin.defvjp
    def scaled_sin_vjp(x, a, ct):
        return ct * np.cos(x) * a[:, None], np.sum(ct * np.sin(x), axis=1)

    return scaled_sin


def reference(x, a):
    return jnp.sin(x) * a


@pytest.mark.parametrize("jit", [False, True])
def test_vectorized_derivative_kernels_under_nested_vmap(jit):
    f = make_scaled_sin()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5, 3)).astype(np.float32)
    a = rng.standard_normal(5).astype(np.float32)

    def nest(fn):
        return jax.vmap(jax.vmap(fn, (0, 0)), (0, None))

    def loss(fn):
        return lambda x, a: (nest(fn)(x, a) ** 2).sum()

    grad = jax.grad(loss(f), argnums=(0, 1))
    if jit:
        grad = jax.jit(grad)
    tangents = (np.ones_like(x), np.ones_like(a))
    # The jax.numpy gradient and JVP in one jitted program: one compile, not one
    # per eager operation.
    want_grad, rt = jax.jit(
        lambda x, a: (
            jax.grad(loss(reference), argnums=(0, 1))(x, a),
            jax.jvp(nest(reference), (x, a), tangents)[1],
        )
    )(x, a)
    for got, want in zip(grad(x, a), want_grad, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
    _, t = jax.jvp(nest(f), (x, a), tangents)
    np.testing.assert_allclose(t, rt, rtol=2e-5, atol=1e-5)


# --- executors that pickle work ---------------------------------------------------


@pytest.mark.timeout(180)
def test_process_pool_runs_chunks_in_workers(spawn_pool):
    import os

    pids = nested_pids(worker_kernels.scaled_chunk_with_pid, spawn_pool, vectorized=7)
    assert pids and os.getpid() not in pids


@pytest.mark.timeout(180)
def test_dask_cluster_runs_chunks_in_workers(dask_client):
    import os

    pids = nested_pids(
        worker_kernels.scaled_chunk_with_pid,
        dask_client.get_executor(),
        vectorized=7,
    )
    assert pids and pids <= set(dask_client.run(os.getpid).values())
