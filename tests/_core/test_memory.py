"""Unbatched operands are never tiled: a 16 MB constant under an 8x8 vmap.

Tiled, the operand would take 64 x 16 MB = 1 GB; each script measures the peak
memory of one call in a child of its own (forked from a process that imported
JAX once, tests/fresh_scripts.py) and asserts a bound of a few copies, a tenth
to a third of the tiled size (a broadcasting callback adds 5 GB)."""

import inspect

import pytest
from helpers import peak_mb, run_script

#: The scripts measure themselves with tests/helpers.py's peak_mb.
PEAK_MB = "import resource\n\n" + inspect.getsource(peak_mb)

SCRIPT = (
    PEAK_MB
    + r"""
import jax, jax.numpy as jnp, numpy as np
from jax_threadmap import threadmap

big = np.random.default_rng(0).standard_normal(4 * 2**20).astype(np.float32)  # 16 MB
x = np.arange(64, dtype=np.int32).reshape(8, 8)

def kernel(table, i):
    return table[int(i) * 1000 : int(i) * 1000 + 4].sum()

def f(table, i):
    return threadmap(kernel, jax.ShapeDtypeStruct((), jnp.float32), table, i)

g = jax.jit(jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(None, 0)))
small = jax.jit(jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(None, 0)))
small(big[:70000], x).block_until_ready()  # warm up JAX itself
big_dev = jax.device_put(big)
before = peak_mb()
out = np.asarray(g(big_dev, x))
after = peak_mb()
expected = np.array([[big[i * 1000 : i * 1000 + 4].sum() for i in row] for row in x])
assert np.allclose(out, expected, rtol=1e-5), (out, expected)
text = str(jax.make_jaxpr(g)(big_dev, x))
assert "broadcast_in_dim" not in text and text.count("threadmap[") == 1
print(after - before)
"""
)


def peak_added_mb(script: str, timeout: float) -> float:
    """Runs ``script`` in a child of its own; returns the peak RSS it reports."""
    proc = run_script(script, timeout=timeout, forked=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_unbatched_16mb_operand_under_8x8_vmap_is_not_tiled():
    added_mb = peak_added_mb(SCRIPT, timeout=170)
    # Tiling would add 64 x 16 MB = 1 GB; the host callback may copy the operand
    # once (16 MB). Allow a few copies of the operand, far below the tiled size.
    assert added_mb < 100, f"peak memory grew by {added_mb:.0f} MB"


GRAD_SCRIPT = (
    PEAK_MB
    + r"""
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap

N = 4 * 2**20  # a 16 MB table

@jax_threadmap.kernel(jax.ShapeDtypeStruct((), jnp.float32))
def lookup(table, i, x):
    j = int(i) * 1000
    return table[j : j + 4].sum() * x

@lookup.defvjp
def lookup_vjp(table, i, x, ct):
    j = int(i) * 1000
    g = np.zeros_like(table)
    g[j : j + 4] = ct * x
    return g, np.zeros((), jax.dtypes.float0), table[j : j + 4].sum() * ct

def loss(table, idx, x):
    f = jax.vmap(jax.vmap(lookup, (None, 0, 0)), (None, 0, 0))
    return f(table, idx, x).sum()

table = np.random.default_rng(0).standard_normal(N).astype(np.float32)
idx = np.arange(64, dtype=np.int32).reshape(8, 8)
x = np.full((8, 8), 2.0, np.float32)
g = jax.jit(jax.grad(loss))
small_idx = np.zeros((8, 8), np.int32)
g(table[:70000], small_idx, x).block_until_ready()  # warm up JAX itself
table_dev = jax.device_put(table)
before = peak_mb()
grad = np.asarray(g(table_dev, idx, x))
after = peak_mb()
expected = np.zeros(N, np.float32)
for i in range(64):
    expected[i * 1000 : i * 1000 + 4] += 2.0
assert np.array_equal(grad, expected)
print(after - before)
"""
)


@pytest.mark.timeout(300)
def test_grad_wrt_unbatched_16mb_operand_under_8x8_vmap_is_not_tiled():
    added_mb = peak_added_mb(GRAD_SCRIPT, timeout=280)
    # Per-element cotangents would take 64 x 16 MB = 1 GB; summed on the host they
    # take a few copies of the table (the partial sums of the chunks in flight,
    # each kernel's own result, the result and its copy back to JAX).
    assert added_mb < 350, f"peak memory grew by {added_mb:.0f} MB"
