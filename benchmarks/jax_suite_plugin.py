"""A pytest plugin that makes every array input of JAX's tests a pending AsyncArray.

Loaded by ``benchmarks/jax_suite.py`` (``-p jax_suite_plugin``) into a run of
JAX's own tests. Once the test modules are collected, their names ``jax``, ``jnp``,
``jit`` and ``device_put`` are replaced by wrappers (JAX's own modules, and this
package's, keep the real ones): ``jax.jit`` (each call's array arguments, static
ones excepted) and the array makers that tests use (``jax.device_put``,
``jnp.array``, ``jnp.arange``, ``jnp.zeros``, ``jnp.ones``):
each ``jax.Array`` (not a tracer, not deleted, of a NumPy dtype) or NumPy array
becomes an ``AsyncArray`` whose load returns that value a millisecond later, on
the same sharding when it was committed.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_threadmap as jtm
from jax_threadmap._jax import hooks

_outside_traces = hooks.get("trace_state_clean")

#: Set by the runner: whether this run makes inputs pending.
ACTIVE = os.environ.get("JAX_SUITE_PENDING") == "1"
#: Set by the runner: the file each test's start and outcome are appended to
#: (so that a test that hangs the process is known, and the run goes on without it).
LOG = os.environ.get("JAX_SUITE_LOG")
LOAD_SECONDS = 0.001


def pending(x: Any) -> Any:
    """``x`` as a pending AsyncArray, where it is a concrete array; else ``x``."""
    if isinstance(x, jtm.AsyncArray):  # a jax.Array already pending (or landed)
        return x
    if isinstance(x, jax.Array):
        if isinstance(x, jax.core.Tracer) or x.is_deleted():
            return x
        if not isinstance(x.dtype, np.dtype) or x.dtype == jax.dtypes.float0:
            return x
        if jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype:  # a typed literal's
            return x  # 64 bits without x64: an AsyncArray holds the canonical dtype
        device = x.sharding if getattr(x, "committed", False) else None
    elif type(x) is np.ndarray and x.dtype.kind in "biufc":  # not a MaskedArray
        device = None
    else:
        return x

    def load(value: Any = x) -> Any:
        time.sleep(LOAD_SECONDS)
        return value

    try:
        return jtm.async_call(
            load, jax.ShapeDtypeStruct(x.shape, x.dtype), device=device
        )
    except (TypeError, ValueError):  # a sharding or dtype AsyncArray refuses
        return x


def _pending_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(pending, tree)


class _Jitted:
    """A jitted function whose calls get pending array arguments."""

    def __init__(self, jitted: Any, static: set[int], static_names: set[str]):
        self._jitted, self._static, self._static_names = jitted, static, static_names
        functools.update_wrapper(self, jitted)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _outside_traces():
            args = tuple(
                a if i in self._static else _pending_tree(a) for i, a in enumerate(args)
            )
            kwargs = {
                k: v if k in self._static_names else _pending_tree(v)
                for k, v in kwargs.items()
            }
        return self._jitted(*args, **kwargs)

    def __repr__(self) -> str:
        return repr(self._jitted)

    def __getattr__(self, name: str) -> Any:
        if name == "_jitted":  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self._jitted, name)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)


def _static_positions(fun: Any, kwargs: dict) -> tuple[set[int], set[str]]:
    nums = kwargs.get("static_argnums") or ()
    names = kwargs.get("static_argnames") or ()
    nums = {nums} if isinstance(nums, int) else set(nums)
    names = {names} if isinstance(names, str) else set(names)
    try:
        params = list(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        params = []
    names |= {params[i] for i in nums if 0 <= i < len(params)}
    nums |= {params.index(n) for n in names if n in params}
    return nums, names


def _wrap_jit(jit: Any) -> Any:
    @functools.wraps(jit)
    def wrapped(fun: Any = None, /, **kwargs: Any) -> Any:
        if fun is None:  # jax.jit(static_argnums=...) as a decorator factory
            return functools.partial(wrapped, **kwargs)
        nums, names = _static_positions(fun, kwargs)
        return _Jitted(jit(fun, **kwargs), nums, names)

    return wrapped


def _wrap_maker(make: Any) -> Any:
    @functools.wraps(make)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        made = make(*args, **kwargs)
        return _pending_tree(made) if _outside_traces() else made

    return wrapped


class _Module(types.ModuleType):
    """A module as the tests see it: ``overrides``, then the real module's names."""

    def __init__(self, real: types.ModuleType, overrides: dict[str, Any]) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(overrides)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _test_names() -> dict[str, Any]:
    """What a test module's ``jax``, ``jnp``, ``jit`` and ``device_put`` become."""
    jit, device_put = _wrap_jit(jax.jit), _wrap_maker(jax.device_put)
    makers = {
        n: _wrap_maker(getattr(jnp, n)) for n in ("array", "arange", "zeros", "ones")
    }
    numpy = _Module(jnp, makers)
    return {
        "jax": _Module(jax, {"jit": jit, "device_put": device_put, "numpy": numpy}),
        "jnp": numpy,
        "jit": jit,
        "device_put": device_put,
    }


def pytest_collection_modifyitems(items: list) -> None:
    """Gives each test module of JAX the wrapped names (JAX itself, and this
    package, keep the real ones: a load's value is placed with jax.device_put)."""
    if not ACTIVE:
        return
    names = _test_names()
    for module in {id(i.module): i.module for i in items if i.module}.values():
        for name, value in names.items():
            if name in vars(module):
                setattr(module, name, value)


def _log(*fields: str) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write("\t".join(x.replace("\t", " ").replace("\n", " ") for x in fields))
            f.write("\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """Notes the test that starts (a hang leaves it without an outcome)."""
    del location
    _log("start", nodeid)


def pytest_runtest_logreport(report: Any) -> None:
    """Notes each test's outcome and the first line of its error."""
    if report.when == "call" or report.outcome != "passed":
        message = ""
        if report.failed:
            message = str(
                report.longrepr.reprcrash.message
                if hasattr(report.longrepr, "reprcrash")
                else report.longrepr
            )
        _log(
            report.outcome,
            report.nodeid,
            message.splitlines()[0][:200] if message else "",
        )
