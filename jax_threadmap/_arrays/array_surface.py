"""The ``jax.Array`` surface of :class:`~.async_array.AsyncArray`.

JAX defines the methods, operators and properties of its arrays from three tables
(``_array_methods``, ``_array_operators``, ``_array_properties`` of
``jax/_src/numpy/array_methods.py``, reached through :mod:`.._jax.hooks`).
:func:`install` puts each entry on ``AsyncArray`` (:func:`apply`): on landed
data, JAX's own entry on the values; on pending data, it returns at once, as a
jitted call does: its outputs are those of a deferred program run that runs the
entry on the values when they land, their avals traced once per abstract
signature (Python scalars weakly typed, NumPy ones values: a float is never a
key). Where a trace needs concrete values (a boolean mask, a NumPy shape), it
waits and runs on the values.

What reads the buffer (``tolist``, ``__array__``, ``__dlpack__``, the buffer
protocol, ``unsafe_buffer_pointer``, ``addressable_shards``, ``__bool__``,
``__reduce__``...) waits in Python first (:func:`landed`: the call's value, then
``block_until_ready``, which releases the GIL) and then delegates to the
``jax.Array``: a wait in C++ that holds the GIL could never let the thread
that dispatches the deferred program filling it run.

Where this JAX lacks a table (a release that moved it), no ``AsyncArray`` is made:
:func:`.leaves.leaf_specs` requires the tables, with the others async arrays need.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .._jax import hooks as _compat
from . import dispatch as _dispatch
from .results import Results

#: Table entries run as they are, not under jit: they return no array, or
#: return a helper whose own calls are deferred (``at``).
_DIRECT = frozenset({"__array_namespace__", "nbytes", "itemsize", "flat", "deepcopy"})
#: Table entries that always need the value (skip the trace that would fail).
_NEEDS_VALUE = frozenset({"item"})
#: Methods of JAX's array class (outside the tables) that read the buffer or its
#: state: each waits in Python, then delegates. Those this JAX lacks are skipped.
#: The buffer protocol (``__buffer__``, Python 3.12+) is ``AsyncArray``'s own.
WAITING_METHODS = (
    "tolist",
    "tobytes",
    "__array__",
    "__dlpack__",
    "__dlpack_device__",
    "__bool__",
    "__int__",
    "__float__",
    "__complex__",
    "__index__",
    "__hex__",
    "__oct__",
    "__reduce__",
    "__format__",
    "__array_module__",
    "unsafe_buffer_pointer",
    "unsafe_raw_buffer",
    "addressable_data",
    "copy_to_host_async",
    "on_device_size_in_bytes",
    "delete",
    "clone",
    "devices",
    "is_deleted",
    "_check_if_deleted",  # JAX's, which its own code and tests call
)
#: Properties of the same kind.
WAITING_PROPERTIES = (
    "addressable_shards",
    "global_shards",
    "is_fully_addressable",
    "is_fully_replicated",
    "traceback",
    "platform",
    "device",
    "committed",
    "__cuda_array_interface__",
    "device_buffer",  # removed in JAX: raises as it does there
    "device_buffers",
    "_npy_value",  # JAX's, which its tests read (None once deleted)
    "_arrays",
)
#: Left out: JAX's own dispatch reads them from every ``jit`` argument that has
#: them (``arg.format``, ``arg.layout.device_local_layout`` on 0.6), so they must
#: not wait, and an AsyncArray's layout is not known before its value is.
NO_LAYOUT = ("format", "layout")
#: The class of JAX's arrays (``object`` where this JAX moved it: then no
#: ``AsyncArray`` is made, and nothing is installed).
_IMPL: Any = _compat.or_missing("ArrayImpl", object)


def landed(x: Any) -> Any:
    """``x``'s value, waited for in Python: an ``AsyncArray``'s result, and any
    ``jax.Array`` ready (``block_until_ready`` releases the GIL while it waits)."""
    if isinstance(x, jax.Array) and hasattr(x, "result"):  # an AsyncArray
        x = x.result()
    if isinstance(x, jax.Array) and not x.is_deleted():
        x.block_until_ready()
    return x


class _Static:
    """Static arguments, hashable for ``jit``: equal when their plan keys are."""

    def __init__(self, key: Any, marked: list[Any]) -> None:
        self.key, self.marked = key, marked

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.key == other.key


def _key(leaf: Any) -> Any:
    """A static leaf's key: its type and value (``1``, ``1.0``, ``True`` differ)."""
    if isinstance(leaf, slice):
        return (slice, *(_key(v) for v in (leaf.start, leaf.stop, leaf.step)))
    return (type(leaf), leaf)


#: Marks a dynamic leaf; plans that are not (output tree, avals): the op needs
#: concrete values (it waits for them), or a retry with integers static.
_DYNAMIC, _WAIT, _INTS = object(), "wait", "ints"
_ELSEWHERE = "elsewhere"  # where outputs go is not known before the run
_plans: dict[Any, Any] = {}
MAX_PLANS = 1024  # kept plans: a bound against ever new static arguments
#: Entries whose integer arguments JAX's eager code takes as concrete, with
#: another result type (``x ** np.int32(3)`` keeps ``x``'s dtype, traced it
#: promotes): their integer scalars are static (set by :func:`install`).
_CONCRETE_INTS: set[Any] = set()


def _marked(leaf: Any, is_async: bool, static_ints: bool) -> tuple[Any, Any]:
    """``(_DYNAMIC, abstract key)`` for a value traced as JAX traces it (arrays
    and NumPy scalars by shape and dtype, Python floats and ints weakly
    typed: never a float in a key), else ``(leaf, typed key)``."""
    if static_ints and isinstance(leaf, np.integer):
        return leaf, _key(leaf)
    if is_async or isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return _DYNAMIC, (leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False))
    kind = type(leaf)
    if kind in (float, complex) or (
        kind is int and not static_ints and -(2**31) <= leaf < 2**31
    ):
        return _DYNAMIC, kind
    return leaf, _key(leaf)


def _call(fn: Callable[..., Any], treedef: Any, flat: list[Any]) -> Any:
    args, kwargs = jax.tree_util.tree_unflatten(treedef, flat[1:])
    return fn(flat[0], *args, **kwargs)


def _plan(fn: Any, treedef: Any, flat: list, asyncs: list) -> tuple[Any, Any, list]:
    """``fn``'s output tree and avals on ``flat`` (or :data:`_WAIT`), its key and
    the marked leaves: traced once per abstract signature, integers first
    traced, then static where the trace needs them concrete."""
    static_ints = fn in _CONCRETE_INTS
    while True:
        marks = [_marked(a, y, static_ints) for a, y in zip(flat, asyncs, strict=True)]
        marked = [m for m, _ in marks]
        x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]
        # (a strict promotion raises where a plan of the standard one would not)
        promotion = jax.config.jax_numpy_dtype_promotion  # type: ignore[attr-defined]
        key = (fn, treedef, x64, promotion, static_ints, tuple(k for _, k in marks))
        try:
            plan = _plans.get(key)
        except TypeError:  # an unhashable static argument
            return _WAIT, None, marked
        if plan is None:
            plan = _trace(fn, treedef, flat, marked) or (
                _WAIT if static_ints else _INTS
            )
            if len(_plans) >= MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
        if plan is not _INTS:
            return plan, key, marked
        static_ints = True


def _trace(fn: Any, treedef: Any, flat: list, marked: list) -> Any:
    """The output tree and avals of ``fn`` with the dynamic leaves abstract;
    ``None`` where the trace fails (a value must be concrete, or an error)."""

    def abstract(dynamic: list[Any]) -> Any:
        values = iter(dynamic)
        leaves = [next(values) if m is _DYNAMIC else m for m in marked]
        return _call(fn, treedef, leaves)

    dynamic = [a for a, m in zip(flat, marked, strict=True) if m is _DYNAMIC]
    try:
        jaxpr, shapes = jax.make_jaxpr(abstract, return_shape=True)(dynamic)
    except Exception:  # noqa: BLE001 - run on the values, as a jax.Array would
        return None
    return jax.tree_util.tree_structure(shapes), list(jaxpr.out_avals)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def array_method(fn: Any, treedef: Any, static: _Static, dynamic: list) -> Any:
    values = iter(dynamic)
    leaves = [next(values) if m is _DYNAMIC else m for m in static.marked]
    return _call(fn, treedef, leaves)


def apply(
    fn: Callable[..., Any],
    x: Any,
    args: tuple,
    kwargs: dict,
    is_async: Callable[[Any], bool],
) -> Any:
    """``fn(x, *args, **kwargs)`` as on the ``jax.Array`` s the async arrays
    stand for: landed, JAX's own ``fn`` on their values; pending, deferred
    with the avals of its plan (:func:`_plan`), ``fn`` run when they land;
    where it needs concrete values, or dispatch is blocking, it waits."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    flat = [x, *leaves]
    if any(isinstance(a, jax.core.Tracer) for a in flat):
        # Under a trace: JAX's own, with the async arrays as constants (the
        # program embeds their values: its lowering waits for them).
        return _call(fn, treedef, flat)
    asyncs = [is_async(a) for a in flat]
    if all(a.done() for a, y in zip(flat, asyncs, strict=True) if y):
        return _on_values(fn, treedef, flat, asyncs, wait=False)
    plan, key, marked = _plan(fn, treedef, flat, asyncs)
    if plan is _WAIT:
        _raise_if_never(fn, treedef, flat, asyncs)
        return _on_values(fn, treedef, flat, asyncs, wait=True)
    placement = _placement(flat, marked, asyncs)
    if placement is _ELSEWHERE:  # jit finds where the outputs go
        dynamic = [a for a, m in zip(flat, marked, strict=True) if m is _DYNAMIC]
        return array_method(fn, treedef, _Static(key, marked), dynamic)
    name = getattr(fn, "__name__", "op").strip("_")
    outs = types.SimpleNamespace(
        out_avals=plan[1], out_shardings=[placement] * len(plan[1])
    )
    program = types.SimpleNamespace(name=name, mut=None, out_handler=outs)
    if (
        _dispatch.mechanism.status() is not None  # blocking dispatch
        or _dispatch.processes() > 1
        or not _dispatch.deferrable(program)  # a pool thread, PRNG keys
    ):
        return _on_values(fn, treedef, flat, asyncs, wait=True)
    return _defer(fn, treedef, flat, asyncs, plan, program)


#: What a trace raises where it needs a value (:func:`_raise_if_never`).
_NEEDS_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def _raise_if_never(fn: Any, treedef: Any, flat: list, asyncs: list) -> None:
    """Raises at once, as on a ``jax.Array``, what ``fn`` raises whatever the
    values of its one async array (``x[0] = 1``, a shape that does not fit)."""
    if sum(asyncs) == 1:  # (the values of others may be what it needs)
        try:
            jax.make_jaxpr(lambda x: _call(fn, treedef, [x, *flat[1:]]))(flat[0])
        except Exception as e:
            if not isinstance(e, _NEEDS_VALUES):
                raise


def _on_values(fn: Any, treedef: Any, flat: list, asyncs: list, wait: bool) -> Any:
    """JAX's own ``fn`` on the values (``wait``: waited for in Python), its
    array outputs ``AsyncArray`` s of a landed call (the kind follows the
    arguments)."""
    get = landed if wait else (lambda a: a.result())
    values = [get(a) if y else a for a, y in zip(flat, asyncs, strict=True)]
    out = _call(fn, treedef, values)
    leaves, tree = jax.tree_util.tree_flatten(out)
    at = [
        k
        for k, leaf in enumerate(leaves)  # (a trace closing over x: its tracers)
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
    ]
    if at:
        made = _arrays_of(flat, asyncs, Results([leaves[k] for k in at]))
        for k, array in zip(at, made, strict=True):
            leaves[k] = array
    return jax.tree_util.tree_unflatten(tree, leaves)


def _placement(flat: list, marked: list, asyncs: list) -> Any:
    """Where an op's outputs go, as JAX's eager ops put them: ``None`` (the
    default device, uncommitted), the one single-device sharding of the
    committed arrays, or :data:`_ELSEWHERE` (several devices, or a device or
    sharding argument: not known before the run)."""
    found = None
    for a, m, is_async in zip(flat, marked, asyncs, strict=True):
        if isinstance(m, (jax.Device, jax.sharding.Sharding)):
            return _ELSEWHERE
        committed = is_async or (isinstance(a, jax.Array) and a.committed)
        sharding = a.sharding if committed else None
        if sharding is not None and sharding != found:
            if found is not None or len(sharding.device_set) > 1:
                return _ELSEWHERE
            found = sharding
    if found is None and jax.config.jax_default_device is not None:  # type: ignore[attr-defined]
        # A jax.default_device context holds for this thread only, not the one
        # that runs a deferred op: jit places the outputs as it says.
        return _ELSEWHERE
    return found


def _defer(
    fn: Any, treedef: Any, flat: list, asyncs: list, plan: Any, program: Any
) -> Any:
    """The op's outputs: ``AsyncArray`` s of a deferred program run that runs
    JAX's own ``fn`` on the values when they land (its arguments kept as at the
    call, :meth:`.dispatch.Readers.freeze`)."""
    out_tree, avals = plan
    saved = settings()

    def dispatch(frozen: tuple[Any, ...]) -> list[jax.Array]:
        # An async argument may be a jax.Array copy of it by now (it was handed
        # on first: Readers.settle, ProgramRun.let_go).
        values = [
            a.result() if y and hasattr(a, "result") else a
            for a, y in zip(frozen, asyncs, strict=True)
        ]
        with settings_as(saved):
            outs = jax.tree_util.tree_leaves(_call(fn, treedef, values))
        got = [(o.shape, o.dtype, o.weak_type) for o in outs]
        # A bug, if ever: the trace and the run disagree.
        assert got == [(a.shape, a.dtype, a.weak_type) for a in avals], (fn, got)
        return outs

    reads = [a._pending() if y else None for a, y in zip(flat, asyncs, strict=True)]
    run = _dispatch.defer(
        dispatch, program, tuple(flat), reads, _dispatch.mechanism.readers
    )
    return jax.tree_util.tree_unflatten(out_tree, _arrays_of(flat, asyncs, run))


#: The settings a deferred op or program runs under, as its caller's thread had
#: them (a context, ``jax.enable_x64`` or ``jax.debug_nans``, holds for its thread).
SETTINGS = ("jax_enable_x64", "jax_debug_nans", "jax_debug_infs")


def settings() -> tuple[bool, ...]:
    """This thread's :data:`SETTINGS`, for :func:`settings_as`."""
    return tuple(bool(getattr(jax.config, name)) for name in SETTINGS)


def settings_as(saved: tuple[bool, ...]) -> contextlib.ExitStack:
    """The caller's :func:`settings` in the thread that runs a deferred op."""
    stack = contextlib.ExitStack()
    for name, on in zip(SETTINGS, saved, strict=True):
        if getattr(jax.config, name) != on:
            enable = getattr(jax, name[4:], None)  # jax.enable_x64: public from 0.7
            if enable is None:  # JAX 0.6
                enable = importlib.import_module("jax.experimental").enable_x64
            stack.enter_context(enable(on))
    return stack


def _arrays_of(flat: list, asyncs: list, task: Any) -> list[Any]:
    """The arrays of ``task``'s call, made by the class of the op's first
    ``AsyncArray`` (no climb back up to its module)."""
    cls = next(type(a) for a, y in zip(flat, asyncs, strict=True) if y)
    return cls._of_call(task)


def _deferred(name: str, fn: Callable[..., Any], is_async: Any) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return apply(fn, self, args, kwargs, is_async)

    return _named(method, name, "as jax.Array's, under jax.jit: never waits")


def _waiting(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(landed(self), name)(*args, **kwargs)

    return _named(method, name, "waits for the value (in Python), then delegates")


def _waiting_property(name: str) -> property:
    def get(self: Any) -> Any:
        return getattr(landed(self), name)

    return property(_named(get, name, "waits for the value (in Python), then reads it"))


def _named(method: Any, name: str, how: str) -> Any:
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``jax.Array.{name}``: {how}."
    return method


class _At:
    """``x.at``: ``x.at[index].set(v)`` and the other updates, deferred."""

    __slots__ = ("_array", "_is_async")

    def __init__(self, array: Any, is_async: Any) -> None:
        self._array, self._is_async = array, is_async

    def __getitem__(self, index: Any) -> _AtIndex:
        return _AtIndex(self._array, index, self._is_async)


class _AtIndex:
    __slots__ = ("_array", "_index", "_is_async")

    def __init__(self, array: Any, index: Any, is_async: Any) -> None:
        self._array, self._index, self._is_async = array, index, is_async

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op.startswith("_"):
            raise AttributeError(op)

        def update(*args: Any, **kwargs: Any) -> Any:
            call = (self._index, op, *args)
            return apply(_update, self._array, call, kwargs, self._is_async)

        return _named(update, op, f"x.at[...].{op}, under jax.jit: never waits")


def _update(x: Any, index: Any, op: str, *args: Any, **kwargs: Any) -> Any:
    at = _tables()[2]["at"](x)  # JAX's own (x: an AsyncArray under a trace)
    return getattr(at[index], op)(*args, **kwargs)


#: The most rows that ``iter`` hands out deferred, from one program (its compile
#: grows with the rows, and each pending row is a deferred program): beyond, it
#: waits.
DEFERRED_ROWS = 32


def _rows(x: Any) -> tuple:
    return tuple(x[i] for i in range(x.shape[0]))


def iterate(x: Any, is_async: Any) -> Iterator[Any]:
    """``iter(x)`` as for a ``jax.Array``: up to :data:`DEFERRED_ROWS` rows from
    one deferred program; more, from the landed array (JAX's own iteration)."""
    if not x.shape:
        raise TypeError("iteration over a 0-d array")
    if x.shape[0] > DEFERRED_ROWS:
        return iter(landed(x))
    return iter(apply(_rows, x, (), {}, is_async))


def _tables() -> tuple[dict, dict, dict]:
    """JAX's three tables (empty where this JAX lacks one: no ``AsyncArray`` is
    made then)."""
    names = ("array_methods", "array_operators", "array_properties")
    methods, operators, properties = (_compat.or_missing(n, {}) for n in names)
    return methods, operators, properties


def install(cls: type, is_async: Callable[[Any], bool]) -> None:
    """Puts the whole ``jax.Array`` surface on ``cls`` (``AsyncArray``)."""
    methods, operators, properties = _tables()
    _CONCRETE_INTS.add(operators.get("pow"))
    for name, fn in methods.items():
        setattr(cls, name, _method(name, fn, is_async))
    for name, fn in operators.items():
        dunder = f"__{name}__"
        setattr(cls, dunder, _method(dunder, fn, is_async, key=name))
    for name, fn in properties.items():
        if name == "at":
            value: Any = property(lambda self: _At(self, is_async))
        elif name in _DIRECT:
            value = property(fn, doc=f"``jax.Array.{name}``.")
        else:
            value = property(_deferred(name, fn, is_async))
        setattr(cls, name, value)
    for name in WAITING_METHODS:
        if hasattr(_IMPL, name):
            setattr(cls, name, _waiting(name))
    for name in WAITING_PROPERTIES:
        if hasattr(_IMPL, name):
            setattr(cls, name, _waiting_property(name))
    if "__numpy_dtype__" in vars(jax.Array):  # JAX >= 0.10: reads .dtype only
        cls.__numpy_dtype__ = vars(jax.Array)["__numpy_dtype__"]  # type: ignore[attr-defined]


def _method(
    name: str, fn: Any, is_async: Any, key: str | None = None
) -> Callable[..., Any]:
    key = key or name
    if key in _NEEDS_VALUE:
        return _waiting(name)
    if key in _DIRECT:
        return fn
    return _deferred(name, fn, is_async)
