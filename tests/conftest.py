import os
import pathlib

# Worker processes (spawned pools, Dask workers) import tests/worker_kernels.py.
_here = str(pathlib.Path(__file__).parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_here, os.environ.get("PYTHONPATH")) if p
)

# A fixed pool size so that tests observing threads see the same bound everywhere.
os.environ.setdefault("JAX_THREADMAP_NUM_THREADS", "4")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Enables jax_enable_x64 for one test."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", prev)
