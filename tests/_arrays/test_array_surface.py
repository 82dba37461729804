"""The jax.Array surface of AsyncArray (issue 48 items 2 and 4).

Every public name and dunder of ``jax.Array`` (and of the class of JAX's arrays)
exists on an AsyncArray and gives what it gives on the landed ``jax.Array``, for
a pending and for a landed array. The names that need no value
(``y.T``, ``y.sum()``, ``y.at[i].set(v)``...) return while the load is still held;
those that read the buffer wait in Python, never in C++ holding the GIL (a child
process checks each with a bounded wait). A hypothesis test compares the
value-producing methods with ``jax.numpy`` on the same data.
"""

from __future__ import annotations

import pickle
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PATIENCE, Held, examples, returns_within, run_script
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_threadmap import AsyncArray, async_call
from jax_threadmap._arrays import array_surface as _array_surface
from jax_threadmap._arrays import dispatch as _dispatch
from jax_threadmap._jax import hooks as _compat

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Implicit conversion of an array to a dtype"),
]

SDS = jax.ShapeDtypeStruct
IMPL = type(jnp.zeros(()))

#: The names a jax.Array answers to: public names and the dunders that JAX's
#: classes define themselves (not those inherited from ``object``).
NAMES = sorted(
    n
    for n in set(dir(jax.Array)) | set(dir(IMPL))
    if not (n.startswith("_") and not n.endswith("__"))
    and getattr(IMPL, n, None) is not getattr(object, n, None)
)
#: Not part of an array's behaviour (class bookkeeping, construction).
HOUSEKEEPING = {
    "__class__",
    "__annotations__",
    "__dict__",
    "__del__",
    "__doc__",
    "__init__",
    "__init_subclass__",
    "__module__",
    "__new__",
    "__slots__",
    "__subclasshook__",
    "__weakref__",
    "__firstlineno__",
    "__static_attributes__",
}
#: Different by design, each said in the AsyncArray docstring: ``repr``/``str``
#: of a plain async_call array never wait (they say whether the call ended);
#: ``sharding`` is ``None`` for an uncommitted array (it names the target
#: only); ``format``/``layout`` are absent (JAX's dispatch reads them from every
#: jit argument that has them, so they could not wait for a value).
BY_DESIGN = {"__repr__", "__str__", "sharding", *_array_surface.NO_LAYOUT}
#: The buffer protocol (Python 3.12+): ``__buffer__`` waits and exports the value's
#: buffer (tests/_arrays/test_jax_array.py); the memoryview it returns releases it, so
#: there is no ``__release_buffer__``.
NO_BUFFER_PROTOCOL = {"__release_buffer__"}
BY_DESIGN |= NO_BUFFER_PROTOCOL | {"__buffer__"}
#: Whether the value is there now: checked on its own (False while pending).
BY_DESIGN |= {"is_ready"}
#: Destructive: checked on their own, last.
DESTRUCTIVE = {"delete"}
#: Names that need no value: on a pending array they return while the load is
#: held. The rest read the buffer or its state and wait (in Python).
WAITS = set(_array_surface.WAITING_METHODS) | set(_array_surface.WAITING_PROPERTIES)
WAITS |= {"item", "block_until_ready", "__jax_array__", "is_deleted"}
#: Their result's shape depends on the values: under jit they fail to trace
#: (ConcretizationTypeError), so they wait and run on the landed array.
WAITS |= {"compress", "nonzero"}
#: The array each name is tried on: "f" a (2, 3) float32, "INTS" a (2, 3) int32,
#: "s" a 0-d int32 (for the conversions to Python scalars).
INT_ONLY = {"and", "or", "xor", "lshift", "rshift", "invert", "hex", "oct"}
SCALAR = {"__bool__", "__int__", "__float__", "__complex__", "__index__", "item"}
SCALAR |= {"__hex__", "__oct__"}
F = np.array([[1.5, -2.0, 3.25], [0.5, 4.0, -1.0]], np.float32)
INTS = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
S = np.array(3, np.int32)
#: Arguments of the methods that need some (others are called without any).
ARGS: dict[str, tuple] = {
    "astype": (np.int32,),
    "reshape": (3, 2),
    "take": (np.array([0, 2]),),
    "dot": (np.ones(3, np.float32),),
    "choose": ([np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)],),
    "compress": (np.array([True, False]),),
    "searchsorted": (np.float32(2.0),),
    "repeat": (2,),
    "swapaxes": (0, 1),
    "argpartition": (1,),
    "to_device": (jax.devices()[0],),
    "view": (np.int32,),
    "clip": (0.0, 2.0),
    "__getitem__": ((1, slice(None, 2)),),
    "__setitem__": (0, 1.0),
    "__contains__": (2.0,),
    "__deepcopy__": ({},),
    "__round__": (1,),
    "__format__": ("",),
    "__array_module__": ((IMPL,),),
    "__matmul__": (np.ones((3, 2), np.float32),),
    "__rmatmul__": (np.ones((4, 2), np.float32),),
    "__divmod__": (2.0,),
    "__rdivmod__": (2.0,),
    "addressable_data": (0,),
    "__dlpack__": (),
    "__array__": (),
}


def _array_for(name: str) -> np.ndarray:
    bare = name.strip("_").removeprefix("r")
    if name in SCALAR:
        return S
    if bare in INT_ONLY or name.strip("_") in INT_ONLY:
        return INTS
    return F


def _use(name: str, a):
    """What ``name`` gives on ``a``: the attribute, called where it is a method."""
    if name == "at":
        return a.at[0, 1].set(7.0)
    if name == "__iter__":
        return list(iter(a))
    if name == "__reversed__":
        return list(reversed(a))
    if name == "__reduce__":
        return pickle.loads(pickle.dumps(a))
    if name == "searchsorted":
        return a[0].sort().searchsorted(*ARGS[name])
    attr = getattr(a, name)
    if callable(attr) and not isinstance(attr, (type, types.ModuleType)):
        if name.startswith("__r") or name in ("__add__", "__sub__", "__mul__"):
            args = ARGS.get(name, (2.0 if a.dtype == np.float32 else 2,))
        elif name.strip("_") in {"eq", "ne", "lt", "le", "gt", "ge", "truediv"}:
            args = (2.0,)
        elif name.strip("_") in {"floordiv", "mod", "pow", "and", "or", "xor"}:
            args = (2,)
        elif name.strip("_") in {"lshift", "rshift"}:
            args = (1,)
        else:
            args = ARGS.get(name, ())
        return attr(*args)
    return attr


def _outcome(name: str, a):
    try:
        return "value", _use(name, a)
    except Exception as e:  # compared with the jax.Array's
        return "error", e


def _same(got, want, where: str) -> None:
    if isinstance(want, jax.Array) or isinstance(got, AsyncArray):
        assert isinstance(got, (jax.Array, AsyncArray)), f"{where}: {type(got)}"
        assert (got.shape, got.dtype) == (want.shape, want.dtype), where
        assert got.weak_type == want.weak_type, where
        # Exact, but for floats: one program under jit may round the last bit
        # otherwise than JAX's eager ops, one program per op (var on JAX 0.6.2).
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), rtol=1e-6, atol=0, err_msg=where
        )
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for g, w in zip(got, want, strict=True):
            _same(g, w, where)
    elif isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want, err_msg=where)
        assert got.dtype == want.dtype, where
    elif type(want).__name__ == "PyCapsule":  # __dlpack__: one per call
        assert type(got) is type(want), where
    elif type(want).__name__ == "Shard":
        assert (got.device, got.index) == (want.device, want.index), where
        _same(got.data, want.data, where)
    elif type(want).__name__ == "RawBuffer":  # the same buffer, a new handle
        assert repr(got) == repr(want), where
    elif type(want).__name__ == "Traceback":
        assert type(got) is type(want), where
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} {want!r}"


def _compare(name: str, got, want, where: str) -> None:
    (gkind, gvalue), (wkind, wvalue) = got, want
    assert gkind == wkind, (
        f"{where}: {gkind} {gvalue!r} where jax.Array gives {wvalue!r}"
    )
    if gkind == "error":
        assert type(gvalue) is type(wvalue), f"{where}: {gvalue!r} vs {wvalue!r}"
    else:
        _same(gvalue, wvalue, where)


def test_every_name_of_jax_array_is_on_async_array():
    missing = [
        n
        for n in NAMES
        if n not in HOUSEKEEPING | set(_array_surface.NO_LAYOUT) | NO_BUFFER_PROTOCOL
        and not hasattr(AsyncArray, n)
    ]
    assert not any(hasattr(AsyncArray, n) for n in NO_BUFFER_PROTOCOL)
    assert not missing, f"AsyncArray lacks {missing} of jax.Array"
    # The tables that make them are JAX's own on every supported JAX.
    assert _compat.missing_for(_compat.ARRAY_SURFACE) is None
    assert all(_array_surface._tables())


@pytest.mark.parametrize("state", ["pending", "landed"])
def test_every_name_gives_what_the_landed_jax_array_gives(state):
    failures = []
    for name in NAMES:
        if name in HOUSEKEEPING | BY_DESIGN | DESTRUCTIVE:
            continue
        held = Held(_array_for(name))
        x = held.array
        if state == "landed":
            held.release.set()
            x.block_until_ready()
        try:
            if state == "pending" and name not in WAITS:  # returns while held
                got = returns_within(_outcome, name, x, limit=PATIENCE)
                held.release.set()
            else:
                call = threading.Thread(target=held.release.set)
                call.start()  # released while the use waits
                got = returns_within(_outcome, name, x, limit=PATIENCE)
                call.join()
            _compare(name, got, _outcome(name, x.result()), f"{name} ({state})")
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


def test_by_design_differences_are_those_documented():
    held = Held(F)
    x = held.array
    assert "AsyncArray(shape=(2, 3)" in repr(x) and "pending" in repr(x)
    assert x.sharding is None and not hasattr(x, "format") and not x.is_ready()
    held.release.set()
    assert x.block_until_ready().is_ready()
    landed = x.result()
    assert landed.sharding.device_set == x.devices() == landed.devices()
    assert str(x.block_until_ready() + 0) == str(landed)


def test_delete_waits_and_deletes_the_value():
    held = Held(F)
    x = held.array
    threading.Timer(0.05, held.release.set).start()
    assert x.is_deleted() is False
    x.delete()
    assert x.is_deleted() and x.result().is_deleted()


def test_iteration_and_updates_defer_and_match_numpy():
    rows = _array_surface.DEFERRED_ROWS
    want = np.arange(2 * rows + 4, dtype=np.float32).reshape(rows + 2, 2)
    few, many = Held(want[:rows]), Held(want)
    deferred = returns_within(list, few.array, limit=PATIENCE)  # one program
    updated = returns_within(lambda: few.array.at[1:3, 0].add(10.0), limit=PATIENCE)
    threading.Timer(0.05, many.release.set).start()
    waited = list(many.array)  # more rows: waits, then iterates the jax.Array
    few.release.set()
    for got, expected in ((deferred, want[:rows]), (waited, want)):
        assert len(got) == len(expected)
        np.testing.assert_array_equal(np.stack([np.asarray(r) for r in got]), expected)
    expected = want[:rows].copy()
    expected[1:3, 0] += 10.0
    np.testing.assert_array_equal(np.asarray(updated), expected)
    np.testing.assert_array_equal(
        np.stack(list(reversed(few.array))), want[:rows][::-1]
    )


# --- the value-producing methods against jax.numpy, property-based -----------------

#: (method on the array, the same in jax.numpy), for arrays of rank 2.
METHODS = {
    "sum": (lambda a, ax: a.sum(axis=ax), lambda a, ax: jnp.sum(a, axis=ax)),
    "mean": (lambda a, ax: a.mean(ax), lambda a, ax: jnp.mean(a, ax)),
    "max": (lambda a, ax: a.max(ax), lambda a, ax: jnp.max(a, ax)),
    "argmin": (lambda a, ax: a.argmin(ax), lambda a, ax: jnp.argmin(a, ax)),
    "cumsum": (lambda a, ax: a.cumsum(ax), lambda a, ax: jnp.cumsum(a, ax)),
    "var": (lambda a, ax: a.var(ax, ddof=0), lambda a, ax: jnp.var(a, ax)),
    "sort": (lambda a, ax: a.sort(ax), lambda a, ax: jnp.sort(a, ax)),
    "T": (lambda a, ax: a.T, lambda a, ax: jnp.transpose(a)),
    "ravel": (lambda a, ax: a.ravel(), lambda a, ax: jnp.ravel(a)),
    "astype": (lambda a, ax: a.astype(jnp.int32), lambda a, ax: a.astype(jnp.int32)),
    "clip": (lambda a, ax: a.clip(-1.0, 1.0), lambda a, ax: jnp.clip(a, -1.0, 1.0)),
    "round": (lambda a, ax: a.round(1), lambda a, ax: jnp.round(a, 1)),
    "getitem": (lambda a, ax: a[::2, ax], lambda a, ax: jnp.asarray(a)[::2, ax]),
    "at.mul": (
        lambda a, ax: a.at[:, ax].multiply(3.0),
        lambda a, ax: jnp.asarray(a).at[:, ax].multiply(3.0),
    ),
    "rsub": (lambda a, ax: 1.5 - a, lambda a, ax: jnp.subtract(1.5, a)),
    "pow": (lambda a, ax: a**2, lambda a, ax: jnp.power(a, 2)),
    "matmul": (lambda a, ax: a @ a.T, lambda a, ax: jnp.matmul(a, jnp.transpose(a))),
    "swapaxes": (lambda a, ax: a.swapaxes(0, 1), lambda a, ax: jnp.swapaxes(a, 0, 1)),
}


@settings(max_examples=examples(60), deadline=None)
@given(
    method=st.sampled_from(sorted(METHODS)),
    shape=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    axis=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
)
def test_methods_match_jax_numpy_on_the_same_data(method, shape, axis, seed):
    data = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    go = threading.Event()
    x = async_call(lambda: go.wait(PATIENCE) and data, SDS(shape, np.float32))
    if _dispatch.mechanism.status() is not None:  # blocking: waits for it
        go.set()
    on_async, on_jnp = METHODS[method]
    got = on_async(x, axis)  # with async dispatch: before the data
    go.set()
    want = on_jnp(jnp.asarray(data), axis)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# --- no wait in C++ holding the GIL (issue 48 item 4) ------------------------------

_BUFFER_USES = """
import pickle, sys, threading
import jax, numpy as np
import jax_threadmap as jtm

uses = {
    "unsafe_buffer_pointer": lambda y: y.unsafe_buffer_pointer(),
    "__array__": lambda y: np.asarray(y),
    "__dlpack__": lambda y: np.from_dlpack(y),
    "item": lambda y: y.item(0),
    "tolist": lambda y: y.tolist(),
    "tobytes": lambda y: y.tobytes(),
    "addressable_shards": lambda y: np.asarray(y.addressable_shards[0].data),
    "copy_to_host_async": lambda y: y.copy_to_host_async(),
    "__reduce__": lambda y: pickle.dumps(y),
    "__format__": lambda y: format(y[0], ".2f"),
    "__bool__": lambda y: bool(y[0]),
    "__int__": lambda y: int(y[0]),
    "__float__": lambda y: float(y[0]),
    "__index__": lambda y: y.astype(np.int32)[0].__index__(),
    "is_deleted": lambda y: y.is_deleted(),
    "on_device_size_in_bytes": lambda y: y.on_device_size_in_bytes(),
}
printing = threading.Lock()

def run(subject, name):
    use = uses[name]
    release = threading.Event()
    def load():
        release.wait(60)
        return np.arange(3, dtype=np.float32)
    x = jtm.async_call(load, jax.ShapeDtypeStruct((3,), np.float32))
    y = x if subject == "array" else jax.jit(lambda a: a + 1)(x)
    assert isinstance(y, jtm.AsyncArray), type(y)
    threading.Timer(0.2, release.set).start()  # the load ends while the use waits
    use(y)
    with printing:
        print("ok", subject, name, flush=True)

# Every use at once, each in a thread of its own: one that waits holding the GIL
# stops every timer, its own included, and the child hangs as it would alone.
threads = [
    threading.Thread(target=run, args=(s, n)) for s in ("array", "result") for n in uses
]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_buffer_reads_wait_without_holding_the_gil():
    # Each use starts while the load is held and the load ends while it waits:
    # a wait in C++ holding the GIL would hang the child (the bound fails it).
    ran = run_script(_BUFFER_USES, timeout=240, forked=True)
    assert ran.returncode == 0, ran.report
    assert ran.stdout.count("ok array ") == 16, ran.report
    assert ran.stdout.count("ok result ") == 16, ran.report
