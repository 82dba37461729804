"""Kernels importable by worker processes (spawned pools, Dask workers).

conftest.py puts this folder on PYTHONPATH so that child processes import it.
"""

import os
import time

import numpy as np


def scaled_with_pid(x, y, *, scale):
    """One element: (x + y) * scale, and the id of the process that ran it."""
    return {"value": (x + y) * scale, "pid": np.int32(os.getpid())}


def dies_at_three(x):
    if float(x) == 3:
        os._exit(1)  # a worker that is killed mid-map
    time.sleep(0.05)
    return x


def raises_at_five(x):
    if float(x) == 5:
        raise KeyError("five")
    return x


def dot(x, w):
    """One element: x @ w, for reverse mode in worker processes."""
    return np.float32(x @ w)


def dot_vjp(x, w, ct):
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
