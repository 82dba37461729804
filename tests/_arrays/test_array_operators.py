"""Operators and methods of an AsyncArray trace as jax.numpy's (issue 56 items 3, 4).

Python scalars are weakly typed dynamic arguments and NumPy scalars values, so
``x + i`` over a thousand ``i`` compiles once, a NaN does not compile again, and
``-0.0`` keeps its sign (a float is never a cache key). On pending data they
return while the load is still held, and the value is right once it lands.
Arguments that must be concrete (boolean masks, NumPy shapes) wait for the data
and run as on a ``jax.Array``; every member of a failed or cancelled array
raises its error. Each result is compared with the same use of a ``jax.Array``.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PATIENCE, Held, examples, returns_within, run_script
from hypothesis import given, settings
from hypothesis import strategies as st
from test_array_surface import HOUSEKEEPING, NAMES, _array_for, _use

from jax_threadmap import AsyncArray, async_call
from jax_threadmap._arrays import array_surface as _array_surface
from jax_threadmap._arrays import dispatch as _dispatch

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype"),
    pytest.mark.filterwarnings("ignore:overflow encountered"),
]

SDS = jax.ShapeDtypeStruct
X = np.array([[1.5, -2.0, 3.25], [0.5, 4.0, -1.0]], np.float32)
ASYNC = _dispatch.mechanism.status() is None  # (blocking: ops wait)

# JAX reports each XLA compilation under this name (tests/_arrays/test_async_array.py).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: list[str] = []


def _on_duration(event: str, duration: float, *args, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _compiles.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _array(value: np.ndarray, state: str) -> tuple[AsyncArray, threading.Event]:
    held = Held(value)
    if state == "landed" or not ASYNC:
        held.release.set()
        held.array.block_until_ready()
    return held.array, held.release


def _same(got, want, where: str = "") -> None:
    """Same shape, dtype, weak type, values and signs (NaN equal to NaN)."""
    assert (got.shape, got.dtype) == (want.shape, want.dtype), where
    assert got.weak_type == want.weak_type, where
    g, w = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(g, w, err_msg=where)
    if np.issubdtype(w.dtype, np.floating):
        np.testing.assert_array_equal(np.signbit(g), np.signbit(w), err_msg=where)


# --- one compile for every scalar ---------------------------------------------------


@pytest.mark.parametrize("state", ["pending", "landed"])
def test_x_plus_i_over_a_thousand_ints_compiles_once(state):
    warm, release = _array(X, state)
    release.set()
    np.asarray(warm + 0)  # compiles JAX's add once (this process may have)
    x, release = _array(X, state)
    plans, compiles = len(_array_surface._plans), len(_compiles)
    ys = [x + i for i in range(1000)]
    assert len(_array_surface._plans) <= plans + (state == "pending")
    release.set()
    got = np.stack([np.asarray(y) for y in ys])
    assert len(_compiles) == compiles, "x + i compiled again for a new i"
    a = jnp.asarray(X)
    np.testing.assert_array_equal(
        got, np.stack([np.asarray(a + i) for i in range(1000)])
    )


@pytest.mark.parametrize("state", ["pending", "landed"])
def test_nan_and_changing_numpy_scalars_do_not_compile_again(state):
    warm, release = _array(X, state)
    release.set()
    np.asarray(warm * np.float32(np.nan) + np.float32(1.0))
    x, release = _array(X, state)
    scalars = [np.float32(np.nan)] * 20 + [
        np.float32(s) for s in np.linspace(-3, 3, 40)
    ]
    # The reference first: its own ops on a jax.Array may compile (not counted).
    want = jax.block_until_ready(
        [jnp.asarray(X) * s + np.float32(1.0) for s in scalars]
    )
    plans, compiles = len(_array_surface._plans), len(_compiles)
    ys = [x * s + np.float32(1.0) for s in scalars]
    release.set()
    for y in ys:
        np.asarray(y)  # run, waited for
    assert len(_compiles) == compiles
    for y, w in zip(ys, want, strict=True):
        _same(y, w)
    assert len(_array_surface._plans) <= plans + 2 * (state == "pending")


# --- signs: -0.0 is not 0.0 ---------------------------------------------------------

SIGNED = {
    "div np.float32": lambda a, z: a / np.float32(z),
    "div float": lambda a, z: a / z,
    "rdiv np.float32": lambda a, z: np.float32(1.0) / (a * 0 + np.float32(z)),
    "at.set np.float32": lambda a, z: a.at[0, 1].set(np.float32(z)),
    "at.set float": lambda a, z: a.at[0, 1].set(z),
    "mul": lambda a, z: a * np.float32(z),
    "add": lambda a, z: (a * 0 - 0.0) + np.float32(z),
}


@pytest.mark.parametrize("state", ["pending", "landed"])
@pytest.mark.parametrize("use", sorted(SIGNED))
def test_the_sign_of_zero_is_kept_after_plus_zero(use, state):
    a = jnp.asarray(X)
    x, release = _array(X, state)
    got = [SIGNED[use](x, z) for z in (0.0, -0.0, 0.0)]
    release.set()
    for y, z in zip(got, (0.0, -0.0, 0.0), strict=True):
        _same(y, SIGNED[use](a, z), f"{use} with {z}")


_FLOAT64_SIGNS = """
import threading
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap as jtm
jax.config.update("jax_enable_x64", True)
X = np.array([1.5, -2.0, 3.0])
a = jnp.asarray(X)
for state in ("pending", "landed"):
    go = threading.Event()
    spec = jax.ShapeDtypeStruct((3,), np.float64)
    x = jtm.async_call(lambda: go.wait(60) and X, spec)
    if state == "landed":
        go.set(); x.block_until_ready()
    uses = {
        "div": lambda v, z: v / np.float64(z),
        "at.set": lambda v, z: v.at[0].set(np.float64(z)),
        "div float": lambda v, z: v / z,
    }
    zeros = (0.0, -0.0, 0.0)  # (as keys, 0.0 and -0.0 would be one)
    got = [(k, z, f(x, z)) for k, f in uses.items() for z in zeros]
    go.set()
    for k, z, y in got:
        want = uses[k](a, z)
        assert y.dtype == want.dtype == np.float64, (k, y.dtype, want.dtype)
        assert np.array_equal(np.signbit(np.asarray(y)), np.signbit(np.asarray(want)))
        assert np.array_equal(np.asarray(y), np.asarray(want)), (k, z)
print("ok")
"""


def test_the_sign_of_zero_is_kept_in_float64():
    ran = run_script(_FLOAT64_SIGNS, timeout=180, forked=True)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.report


# JAX's eager code takes an integer exponent as concrete (integer_pow: x's dtype);
# traced, a NumPy integer would promote: such exponents are static.
EXPONENTS = {
    "uint8 ** np.int32": (np.uint8, lambda a: a ** np.int32(3)),
    "bool ** np.int8": (np.bool_, lambda a: a ** np.int8(2)),
    "float32 ** int": (np.float32, lambda a: a**3),
    "int32 ** 2": (np.int32, lambda a: a**2),
    "float32 ** np.int64": (np.float32, lambda a: a ** np.int64(5)),
}


@pytest.mark.parametrize("state", ["pending", "landed"])
@pytest.mark.parametrize("use", sorted(EXPONENTS))
def test_integer_exponents_give_what_jax_gives(use, state):
    dtype, power = EXPONENTS[use]
    data = np.array([3.0, 1.0, 0.0, 2.0]).astype(dtype)
    x, release = _array(data, state)
    want = power(jnp.asarray(data))
    got = power(x)
    release.set()
    _same(got, want, use)


# --- pending data: return at once, wait only to read --------------------------------

W = np.ones((3, 2), np.float32)
AT_ONCE = {
    "x + i": lambda x, y: x + 7,
    "x * np.float32": lambda x, y: x * np.float32(0.5),
    "0.05 * x": lambda x, y: 0.05 * x,
    "x[i]": lambda x, y: x[1],
    "x[i, j]": lambda x, y: x[1, 2],
    "x[np.int32]": lambda x, y: x[np.int32(1)],
    "x[1:, ::2]": lambda x, y: x[1:, ::2],
    "x.sum()": lambda x, y: x.sum(),
    "x.sum(axis)": lambda x, y: x.sum(axis=1),
    "x.reshape(3, 2)": lambda x, y: x.reshape(3, 2),
    "x.at[i].set(v)": lambda x, y: x.at[0].set(np.float32(9.0)),
    "x.at[i].add(x)": lambda x, y: x.at[0].add(y[1]),
    "x - y": lambda x, y: x - y,
    "np - x": lambda x, y: np.ones((2, 3), np.float32) - x,
    "x @ w": lambda x, y: x @ W,
    "x ** 2": lambda x, y: x**2,
    "-x": lambda x, y: -x,
    "x.T": lambda x, y: x.T,
    "x.astype": lambda x, y: x.astype(np.int32),
    "x > 2": lambda x, y: x > 2,
    "tree_map sgd": lambda x, y: jax.tree.map(lambda p, g: p - 0.05 * g, [y], [x])[0],
}


@pytest.mark.skipif(not ASYNC, reason="blocking dispatch: operators wait")
def test_operators_on_pending_data_return_at_once_and_the_values_are_right():
    y, _ = _array(X[::-1].copy(), "landed")
    held = Held(X)
    got = {}
    for name, use in AT_ONCE.items():
        got[name] = returns_within(use, held.array, y, limit=PATIENCE)
        assert isinstance(got[name], AsyncArray), name
    assert not held.array.done() and not any(v.done() for v in got.values())
    held.release.set()
    a, b = jnp.asarray(X), jnp.asarray(X[::-1].copy())
    for name, use in AT_ONCE.items():
        _same(got[name], use(a, b), name)


def test_the_repr_of_an_op_on_pending_data_names_the_op_once_quoted():
    """``repr(x + 1)`` names the op as a jitted call's repr names its program:
    in one pair of backticks (it was two)."""
    held = Held(X)
    try:
        text = repr(held.array + 1)
    finally:
        held.release.set()
    if ASYNC:  # (`operator_add`; `deferring_binary_op` on JAX 0.6)
        assert re.search(r"pending, from `\w+`\)$", text), text
    assert "``" not in text, text


def test_ops_in_an_x64_context_give_what_they_give_on_a_jax_array():
    """A ``jax.enable_x64`` context holds for the op's caller thread only: the
    deferred op runs as in it (its planned float64 outputs failed every use
    with an AssertionError, run in a thread where x64 was off)."""
    value = np.arange(3, dtype=np.int32)
    held = Held(value)
    try:
        enable = getattr(jax, "enable_x64", None)
        if enable is None:  # JAX 0.6
            enable = importlib.import_module("jax.experimental").enable_x64
        with enable(True):
            got = [held.array.astype(jnp.float64), held.array + np.float64(0.5)]
            want = [jnp.asarray(value).astype(jnp.float64), jnp.asarray(value) + 0.5]
    finally:
        held.release.set()
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == np.float64
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert np.asarray(g).dtype == np.float64


def test_a_strict_promotion_raises_on_pending_data_as_on_a_jax_array():
    """``int32 + float32`` raises in a ``jax.numpy_dtype_promotion("strict")``
    context, pending or not (the plan made outside it was used, and it did not)."""
    held = Held(np.arange(3, dtype=np.int32))
    try:
        outside = held.array + jnp.float32(1.5)  # a plan of the standard promotion
        with jax.numpy_dtype_promotion("strict"):
            with pytest.raises(ValueError, match="promot") as on_jax:
                jnp.arange(3, dtype=jnp.int32) + jnp.float32(1.5)
            with pytest.raises(type(on_jax.value)):
                held.array + jnp.float32(1.5)
    finally:
        held.release.set()
    np.testing.assert_array_equal(np.asarray(outside), np.arange(3) + 1.5)


_DEFAULT_DEVICE = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import threading
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap as jtm
from jax_threadmap._arrays import dispatch
ASYNC = dispatch.mechanism.status() is None  # (blocking: ops wait)
go = threading.Event()
if not ASYNC:
    go.set()
x = jtm.async_call(lambda: go.wait(60) and np.ones(3, np.float32),
                   jax.ShapeDtypeStruct((3,), np.float32))
other = jax.devices()[1]
with jax.default_device(other):
    got = {"x + 1": x + 1, "x.sum()": x.sum(), "jnp.sin(x)": jnp.sin(x)}
    want = {"x + 1": jnp.ones(3) + 1, "x.sum()": jnp.ones(3).sum(),
            "jnp.sin(x)": jnp.sin(jnp.ones(3))}
assert not ASYNC or not any(y.done() for y in got.values())  # returned at once
go.set()
for k, y in got.items():
    on = y.result().devices()
    assert on == want[k].devices() == {other}, (k, on)
    assert np.array_equal(np.asarray(y), np.asarray(want[k])), k
print("ok")
"""


def test_ops_in_a_default_device_context_land_where_a_jax_array_s_do():
    """A ``jax.default_device`` context holds for the op's caller thread only:
    the outputs of an op on pending uncommitted data go where it says (they went
    to the first device, that of the thread that ran the deferred op)."""
    ran = run_script(_DEFAULT_DEVICE, timeout=180, forked=True)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.report


# --- arguments that must be concrete: wait, then as on a jax.Array --------------------

MASK = np.array([[True, False, True], [False, True, False]])
CONCRETE = {
    "x[np mask]": lambda x: x[MASK],
    "x[x > 2]": lambda x: x[x > 2],
    "x.at[np mask].set(0)": lambda x: x.at[MASK].set(0),
    "x.at[x > 2].set(0)": lambda x: x.at[x > 2].set(0),
    "x.reshape(np shape)": lambda x: x.reshape(np.array([3, 2])),
    "x.nonzero()": lambda x: x.nonzero(),
    "x.compress": lambda x: x.compress(np.array([True, False]), axis=0),
    "x.repeat(np)": lambda x: x.repeat(np.array([1, 2]), axis=0),
    "x[np.array ints]": lambda x: x[np.array([1, 0, 1])],
}


@pytest.mark.parametrize("state", ["pending", "landed"])
@pytest.mark.parametrize("use", sorted(CONCRETE))
def test_concrete_arguments_run_as_on_a_jax_array(use, state):
    x, release = _array(X, state)
    threading.Timer(0.05, release.set).start()  # released while the use waits
    got = returns_within(CONCRETE[use], x, limit=PATIENCE)
    want = CONCRETE[use](jnp.asarray(X))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _same(g, w, use)


MISUSES = {
    "setitem": lambda x: x.__setitem__(0, 1.0),
    "reshape": lambda x: x.reshape(7),
    "matmul shapes": lambda x: x @ np.ones((2, 2), np.float32),
}


@pytest.mark.parametrize("use", sorted(MISUSES))
def test_misuses_raise_at_once_as_on_a_jax_array(use):
    held = Held(X)
    with pytest.raises(Exception) as want:
        MISUSES[use](jnp.asarray(X))
    with pytest.raises(type(want.value)):
        returns_within(MISUSES[use], held.array, limit=PATIENCE)
    held.release.set()


# --- a failed or cancelled array: every member raises --------------------------------

#: Members that need no value: they answer on a failed array too.
NO_VALUE = {
    "shape",
    "dtype",
    "ndim",
    "size",
    "nbytes",
    "itemsize",
    "weak_type",
    "aval",
    "sharding",
    "is_ready",  # False
    "__len__",
    "__repr__",
    "__str__",  # a plain async_call array prints its state
    "__array_namespace__",
    "__array_priority__",
    "__numpy_dtype__",  # the dtype, for NumPy
    "__hash__",  # None: unhashable, as a jax.Array
    "flat",  # NotImplementedError, as on any jax.Array
    "__setitem__",  # TypeError, as on any jax.Array
    *_array_surface.NO_LAYOUT,
    "__buffer__",
    "__release_buffer__",
}


class LoadError(Exception):
    pass


def _failed(value: np.ndarray, how: str) -> tuple[AsyncArray, type]:
    if how == "failed":

        def load():
            raise LoadError("the disk is gone")

        x = async_call(load, SDS(value.shape, value.dtype))
        concurrent.futures.wait([x._task.future], timeout=PATIENCE)
        return x, LoadError
    held = Held(value)
    y = held.array * 1  # deferred (its input still loads)
    assert held.array.cancel()
    held.release.set()  # its thread ends; what it returns then is dropped
    if how == "cancelled":
        return held.array, concurrent.futures.CancelledError
    concurrent.futures.wait([y._task.future], timeout=PATIENCE)
    return y, jax.errors.JaxRuntimeError


@pytest.mark.parametrize("how", ["failed", "cancelled", "deferred on a cancelled"])
def test_every_member_of_a_failed_array_raises_its_error(how):
    if how.startswith("deferred") and not ASYNC:
        pytest.skip("blocking dispatch: no deferred program")
    wrong = []
    for name in NAMES:
        if name in HOUSEKEEPING | NO_VALUE:
            continue
        x, error = _failed(_array_for(name), how)
        try:
            _use(name, x)
        except error:
            continue
        except Exception as e:  # noqa: BLE001 - listed below
            wrong.append(f"{name}: {type(e).__name__}: {e}")
            continue
        wrong.append(f"{name}: no error")
    assert not wrong, f"members of a {how} array that do not raise its error:\n" + (
        "\n".join(wrong)
    )


# --- operators x scalar kinds x dtypes, against jax.Array ----------------------------

OPS = {
    "add": lambda a, s: a + s,
    "radd": lambda a, s: s + a,
    "sub": lambda a, s: a - s,
    "rsub": lambda a, s: s - a,
    "mul": lambda a, s: a * s,
    "truediv": lambda a, s: a / s,
    "rtruediv": lambda a, s: s / a,
    "floordiv": lambda a, s: a // s,
    "mod": lambda a, s: a % s,
    "pow": lambda a, s: a**s,
    "lt": lambda a, s: a < s,
    "eq": lambda a, s: a == s,
    "at.set": lambda a, s: a.at[1].set(s),
    "at.add": lambda a, s: a.at[-1].add(s),
    "clip": lambda a, s: a.clip(s),
}
SCALARS = {
    "int": int,
    "float": float,
    "bool": bool,
    "np.float32": np.float32,
    "np.float64": np.float64,
    "np.int32": np.int32,
    "np.int8": np.int8,
    "np.bool_": np.bool_,
    "0-d np.float32": lambda v: np.array(v, np.float32),
    "jax scalar": lambda v: jnp.asarray(v, jnp.float32),
}
VALUES = [0.0, -0.0, 1.0, -2.0, 3.0, float("nan"), float("inf"), 0.5, 7.0]
DTYPES = [np.float32, np.int32, np.uint8, np.bool_, np.float16]


def _outcome(fn):
    try:
        y = fn()
        np.asarray(y)  # the error of a deferred run is raised where it is read
        return "value", y
    except Exception as e:  # noqa: BLE001 - compared with the jax.Array's
        return "error", e


@settings(max_examples=examples(150), deadline=None)
@given(
    op=st.sampled_from(sorted(OPS)),
    kind=st.sampled_from(sorted(SCALARS)),
    value=st.sampled_from(VALUES),
    dtype=st.sampled_from(DTYPES),
    state=st.sampled_from(["pending", "landed"]),
)
def test_operators_with_every_scalar_kind_match_jax_array(
    op, kind, value, dtype, state
):
    data = np.array([3.0, -1.0, 0.0, 2.0]).astype(dtype)
    try:
        scalar = SCALARS[kind](value)
    except (ValueError, OverflowError):  # int(nan) and the like: not a scalar
        return
    want = _outcome(lambda: OPS[op](jnp.asarray(data), scalar))
    x, release = _array(data, state)
    # A jax.Array on the left (``jax_scalar - x``) converts x with __jax_array__,
    # which waits for the data: released meanwhile.
    waits = threading.Timer(0.5, release.set)

    def use():
        waits.start()
        try:
            return OPS[op](x, scalar)
        finally:
            release.set()  # after the use: it returned without the data
            waits.cancel()

    got = returns_within(_outcome, use, limit=PATIENCE)
    where = f"{op} {dtype.__name__} {kind}({value}) {state}"
    assert got[0] == want[0], f"{where}: {got[1]!r} where jax.Array gives {want[1]!r}"
    if got[0] == "error":
        assert type(got[1]) is type(want[1]), f"{where}: {got[1]!r} vs {want[1]!r}"
    else:
        _same(got[1], want[1], where)
