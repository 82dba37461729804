import os
import pathlib
import sys

# Worker processes (spawned pools, Dask workers) import tests/worker_kernels.py.
_here = str(pathlib.Path(__file__).parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_here, os.environ.get("PYTHONPATH")) if p
)

# A fixed pool size so that tests observing threads see the same bound everywhere.
os.environ.setdefault("JAX_THREADMAP_NUM_THREADS", "4")

import jax  # noqa: E402
import jax.extend  # noqa: E402
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


def count_eqns(jaxpr, name: str) -> int:
    """Counts equations of primitive ``name``, sub-jaxprs included."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            n += 1
        for sub in jaxprs_in_params(eqn.params):
            n += count_eqns(sub, name)
    return n


def jaxprs_in_params(params):
    # What jax.extend.core.jaxprs_in_params (jax >= 0.10) does, for every JAX.
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def cause_of(e: BaseException) -> BaseException | None:
    """``e.__cause__``, as JAX's traceback filter leaves it.

    On Python 3.10 only, an exception that crosses a JAX API gets a
    ``SimplifiedTraceback`` as its ``__cause__``, with the original cause behind
    it (jax/_src/traceback_util.py; Python 3.11 has notes instead).
    """
    cause = e.__cause__
    if sys.version_info < (3, 11) and type(cause).__name__ == "SimplifiedTraceback":
        assert type(cause.__cause__).__name__ != "SimplifiedTraceback"
        return cause.__cause__
    return cause
