"""Kernels importable by worker processes (spawned pools, Dask workers).

conftest.py puts this folder on PYTHONPATH so that child processes import it.
"""

import os
import time

import numpy as np


def scaled_with_pid(x, y, *, scale):
    """One element: (x + y) * scale, and the id of the process that ran it."""
    assert x.shape == y.shape == (3,) and scale.shape == (), (x.shape, scale.shape)
    assert x.dtype == y.dtype == scale.dtype == np.float32
    return {"value": (x + y) * scale, "pid": np.int32(os.getpid())}


def dies_at_three(x):
    assert x.shape == () and x.dtype == np.float32, (x.shape, x.dtype)
    if float(x) == 3:
        os._exit(1)  # a worker that is killed mid-map
    time.sleep(0.05)
    return x


def raises_at_five(x):
    assert x.shape == () and x.dtype == np.float32, (x.shape, x.dtype)
    if float(x) == 5:
        raise KeyError("five")
    return x


def dot(x, w):
    """One element: x @ w, for reverse mode in worker processes."""
    assert x.shape == w.shape == (4,), (x.shape, w.shape)
    return np.float32(x @ w)


def dot_vjp(x, w, ct):
    assert x.shape == w.shape == (4,) and ct.shape == (), (x.shape, ct.shape)
    assert ct.dtype == np.float32
    return ct * w, ct * x


def dot_fwd(x, w):
    """``dot`` and its residuals (w, x), for defvjp(fwd, bwd, residuals=...)."""
    assert x.shape == w.shape == (4,), (x.shape, w.shape)
    return np.float32(x @ w), (w, x)


def dot_bwd(res, ct):
    w, x = res
    assert w.shape == x.shape == (4,) and ct.shape == (), (w.shape, ct.shape)
    return ct * w, ct * x


def scaled_chunk_with_pid(x, y, *, scale):
    """A vectorized kernel: a chunk of k elements of (x + y) * scale, and the id of
    the process that ran it. Checks the shapes and flags it receives."""
    k = x.shape[0]
    assert x.shape == (k, 3) and y.shape == (k, 3) and scale.shape == (k,), (
        x.shape,
        y.shape,
        scale.shape,
    )
    assert not (x.flags.writeable or y.flags.writeable or scale.flags.writeable)
    return {
        "value": (x + y) * scale[:, None],
        "pid": np.full(k, os.getpid(), np.int32),
    }


def checked_sum(*args, expected):
    """Asserts the type, shape and dtype of each argument, then sums them all.

    ``expected``: one ``(shape, dtype name)`` per argument, as one element sees it.
    """
    got = tuple((type(a).__name__, a.shape, a.dtype.name) for a in args)
    want = tuple(("ndarray", shape, dtype) for shape, dtype in expected)
    assert got == want, f"the kernel received {got}, expected {want}"
    return np.float32(sum(np.sum(a, dtype=np.float64) for a in args))


def big_count(x):
    """An int64 beyond int32 at element 2, else the element."""
    assert x.shape == () and x.dtype == np.int32, (x.shape, x.dtype)
    return np.int64(2**40) if int(x) == 2 else np.int64(x)


class Abort(BaseException):
    """A kernel's own BaseException subclass."""


def aborts_at_one(x):
    assert x.shape == () and x.dtype == np.float32, (x.shape, x.dtype)
    if float(x) == 1:
        raise Abort("stop")
    return x


def reads_param(x, w):
    """One element of x plus the first and last entries of a large parameter."""
    assert x.shape == () and w.ndim == 1 and not w.flags.writeable, (x.shape, w)
    return np.float32(x + w[0] + w[-1] + os.getpid() * 0)


def reads_param_chunk(x, w):
    """A vectorized kernel: reads_param for a chunk of k elements."""
    k = x.shape[0]
    assert x.shape == (k,) and w.shape[0] == k and not w.flags.writeable, (x, w)
    return (x + w[:, 0] + w[:, -1]).astype(np.float32)


def dies_once_at_three(x, *, marker):
    """Kills its worker at element 3 the first time only (``marker``: a path that
    the first death creates), so a retry elsewhere succeeds."""
    assert x.shape == () and x.dtype == np.float32, (x.shape, x.dtype)
    if float(x) == 3:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return x
        os._exit(1)
    return x


class Unprintable(Exception):
    """An exception whose message cannot be built."""

    def __str__(self):
        raise RuntimeError("str broke")


def unprintable_at_two(x):
    if float(x) == 2:
        raise Unprintable("two")
    return x


def slow_identity(x):
    """Two seconds per element: a process-pool map still running at exit."""
    time.sleep(2.0)
    return x


# --- the property test of tests/_core/test_properties.py ------------------------
# One element: x (2,), w (), and ``extra``, a pytree that holds either nothing (empty
# tuples, lists, dicts) or one leaf y (3,). Outputs: a = x * w + sum(y) and
# b = sum(x * x) * w. The vectorized forms take and return a leading chunk axis.
# Every value in the tests is a small integer, so every sum is exact in float32 and
# results compare bit for bit whatever the order of summation.


def _y_leaves(extra):
    import jax

    return jax.tree_util.tree_leaves(extra)


def _sum_y(extra, shape):
    ys = _y_leaves(extra)
    return ys[0].sum(-1) if ys else np.zeros(shape, np.float32)


def prop_kernel(x, w, extra):
    a = x * w + _sum_y(extra, ())
    return a, np.float32((x * x).sum() * w)


def prop_jvp(x, w, extra, tx, tw, textra):
    da = tx * w + x * tw + _sum_y(textra, ())
    db = np.float32(2 * (x * tx).sum() * w + (x * x).sum() * tw)
    return da, db


def prop_vjp(x, w, extra, ct):
    ca, cb = ct
    gx = ca * w + 2 * cb * x * w
    gw = np.float32((ca * x).sum() + cb * (x * x).sum())
    gy = np.full(3, ca.sum(), np.float32)
    import jax

    return gx, gw, jax.tree_util.tree_map(lambda y: gy, extra)


def prop_kernel_chunk(x, w, extra):
    k = x.shape[0]
    a = x * w[:, None] + _sum_y(extra, (k,))[:, None]
    return a, (x * x).sum(-1) * w


def prop_jvp_chunk(x, w, extra, tx, tw, textra):
    k = x.shape[0]
    da = tx * w[:, None] + x * tw[:, None] + _sum_y(textra, (k,))[:, None]
    db = 2 * (x * tx).sum(-1) * w + (x * x).sum(-1) * tw
    return da, db


def prop_vjp_chunk(x, w, extra, ct):
    import jax

    ca, cb = ct
    gx = ca * w[:, None] + 2 * cb[:, None] * x * w[:, None]
    gw = (ca * x).sum(-1) + cb * (x * x).sum(-1)
    gy = np.repeat(ca.sum(-1)[:, None], 3, axis=1)
    return gx, gw, jax.tree_util.tree_map(lambda y: gy, extra)


def double(x):
    return x * np.float32(2)
