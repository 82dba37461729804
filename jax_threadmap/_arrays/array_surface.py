"""The ``jax.Array`` surface of :class:`~.async_array.AsyncArray`.

JAX defines the methods, operators and properties of its arrays from three tables
(``_array_methods``, ``_array_operators``, ``_array_properties`` of
``jax/_src/numpy/array_methods.py``, reached through :mod:`.._jax.hooks`).
:func:`install` puts each entry on ``AsyncArray`` as :func:`apply`: where the
data has landed, JAX's own entry runs on the ``jax.Array`` s; where it is pending,
the call returns at once, as a jitted call on pending data does (``y + 1``,
``y.sum()``, ``y[i]``, ``y.at[i].set(v)``): its outputs are ``AsyncArray`` s of a
deferred program run (:mod:`.deferred_dispatch`) that runs JAX's entry on the
values when they land, their avals traced once per abstract signature, with the
arguments traced as JAX traces them (Python scalars weakly typed, NumPy scalars
and arrays as values; Python ints static only where the trace needs them
concrete; a float is never a key). An entry that needs concrete values
(``nonzero()`` without ``size``, a boolean mask, a NumPy shape) fails to trace;
it then waits and runs on the values.

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

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .._jax import hooks as _compat
from . import async_dispatch as _async_dispatch
from . import deferred_dispatch as _deferred_dispatch

#: Table entries run as they are, not under jit: they return no array, or
#: return a helper whose own calls are deferred (``at``).
_DIRECT = frozenset({"__array_namespace__", "nbytes", "itemsize", "flat", "deepcopy"})
#: Table entries that always need the value (skip the trace that would fail).
_NEEDS_VALUE = frozenset({"item"})
#: Methods of JAX's array class (outside the tables) that read the buffer or its
#: state: each waits in Python, then delegates. Those this JAX lacks are skipped.
#: Not the buffer protocol (``__buffer__``, Python 3.12+): NumPy tries it first in
#: ``np.asarray`` and swallows any error of it, a Ctrl-C's ``KeyboardInterrupt``
#: too, then calls ``__array__``, which would wait on with the signal gone.
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
    result = getattr(x, "result", None)
    if result is not None and not isinstance(x, jax.Array):
        x = result()
    if isinstance(x, jax.Array) and not x.is_deleted():
        x.block_until_ready()
    return x


class _Static:
    """The static part of a call's arguments: the tree and its non-array leaves,
    hashable for ``jit``'s cache (typed keys, :func:`_key`)."""

    def __init__(self, treedef: Any, leaves: list[Any]) -> None:
        self.treedef, self.leaves = treedef, leaves
        self._key = (treedef, tuple(_key(leaf) for leaf in leaves))
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key == other._key


def _key(leaf: Any) -> Any:
    """A static leaf's key: its type and value, so that ``1``, ``1.0`` and
    ``True`` never share an entry (floats are never static, :func:`_marked`)."""
    if isinstance(leaf, slice):
        return (slice, *(_key(v) for v in (leaf.start, leaf.stop, leaf.step)))
    return (type(leaf), leaf)


#: A leaf that is a placeholder for a dynamic argument in ``_Static.leaves``.
_DYNAMIC = object()
#: Plans (:func:`_plan`) that are not an output tree and avals: the call needs
#: concrete arguments (it waits for the values); try again with ints static.
_WAIT, _INTS = "wait", "ints"
#: Where the outputs go is not known before the run (:func:`_placement`).
_ELSEWHERE = "elsewhere"
#: The plans kept (:data:`_plans`), a bound against ever new static arguments.
MAX_PLANS = 1024
_plans: dict[Any, Any] = {}
_VALUES = (jax.Array, np.ndarray, np.generic)
#: Entries whose integer arguments JAX's eager code takes as concrete, with
#: another result type (``x ** np.int32(3)`` keeps ``x``'s dtype, traced it
#: promotes): their integer scalars are static (set by :func:`install`).
_CONCRETE_INTS: set[Any] = set()


def _marked(leaf: Any, is_async: bool, static_ints: bool) -> tuple[Any, Any]:
    """``(_DYNAMIC, abstract key)`` for a value (traced, as JAX traces it:
    arrays and NumPy scalars by shape and dtype, Python floats and ints
    weakly typed), else ``(leaf, typed key)``: a static leaf; ``static_ints``:
    Python ints and NumPy integer scalars are static."""
    if static_ints and isinstance(leaf, np.integer):
        return leaf, _key(leaf)
    if is_async or isinstance(leaf, _VALUES):
        return _DYNAMIC, (leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False))
    kind = type(leaf)
    if kind is float or kind is complex:
        return _DYNAMIC, kind
    if kind is int and not static_ints and -(2**31) <= leaf < 2**31:
        return _DYNAMIC, kind
    return leaf, _key(leaf)


def _call(fn: Callable[..., Any], treedef: Any, flat: list[Any]) -> Any:
    args, kwargs = jax.tree_util.tree_unflatten(treedef, flat[1:])
    return fn(flat[0], *args, **kwargs)


def _plan(
    fn: Callable[..., Any], treedef: Any, flat: list[Any], asyncs: list[bool]
) -> tuple[Any, list[Any]]:
    """The output tree and avals of ``fn`` on ``flat`` (traced once per
    abstract signature: integer scalars first traced, then static where a
    trace needs them concrete), or :data:`_WAIT`; and the leaves marked."""
    static_ints = fn in _CONCRETE_INTS
    while True:
        marks = [
            _marked(a, is_async, static_ints)
            for a, is_async in zip(flat, asyncs, strict=True)
        ]
        marked = [m for m, _ in marks]
        x64 = jax.config.jax_enable_x64
        key = (fn, treedef, x64, static_ints, tuple(k for _, k in marks))
        try:
            plan = _plans.get(key)
        except TypeError:  # an unhashable static argument
            return _WAIT, marked
        if plan is None:
            plan = _trace(fn, treedef, flat, marked)
            if plan is None:
                plan = _WAIT if static_ints else _INTS
            if len(_plans) >= MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
        if plan is not _INTS:
            return plan, marked
        static_ints = True


def _trace(fn: Callable[..., Any], treedef: Any, flat: list, marked: list) -> Any:
    """``fn``'s output tree and avals, traced with the dynamic leaves abstract;
    ``None`` if the trace fails (a value must be concrete, or an error that
    the run on the values then raises as JAX does)."""

    def abstract(dynamic: list[Any]) -> Any:
        values = iter(dynamic)
        return _call(
            fn, treedef, [next(values) if m is _DYNAMIC else m for m in marked]
        )

    dynamic = [leaf for leaf, m in zip(flat, marked, strict=True) if m is _DYNAMIC]
    try:
        jaxpr, shapes = jax.make_jaxpr(abstract, return_shape=True)(dynamic)
    except Exception:  # noqa: BLE001 - run on the values, as a jax.Array would
        return None
    return jax.tree_util.tree_structure(shapes), list(jaxpr.out_avals)


@functools.partial(jax.jit, static_argnums=(0, 1))
def array_method(fn: Callable[..., Any], static: _Static, dynamic: list) -> Any:
    values = iter(dynamic)
    leaves = [next(values) if s is _DYNAMIC else s for s in static.leaves]
    return _call(fn, static.treedef, leaves)


def apply(
    fn: Callable[..., Any],
    x: Any,
    args: tuple,
    kwargs: dict,
    is_async: Callable[[Any], bool],
) -> Any:
    """``fn(x, *args, **kwargs)`` as on the ``jax.Array`` s the async arrays
    stand for. Landed: JAX's own ``fn`` on their values. Pending: deferred
    (returns at once) with the output avals of a trace cached by abstract
    signature, and run on the values when they land; where the trace needs
    concrete values, or dispatch is blocking, it waits for them."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    flat = [x, *leaves]
    asyncs = [is_async(a) for a in flat]
    if all(a.done() for a, y in zip(flat, asyncs, strict=True) if y):
        return _on_values(fn, treedef, flat, asyncs, wait=False)
    plan, marked = _plan(fn, treedef, flat, asyncs)
    placement = _placement(flat, marked, asyncs)
    if plan is _WAIT:
        _raise_if_never(fn, treedef, flat, asyncs)
    if plan is _WAIT or _blocking(fn, plan, placement):
        return _on_values(fn, treedef, flat, asyncs, wait=True)
    if placement is _ELSEWHERE:  # JAX's jit finds where the outputs go
        dynamic = [a for a, m in zip(flat, marked, strict=True) if m is _DYNAMIC]
        return array_method(fn, _Static(treedef, marked), dynamic)
    return _defer(fn, treedef, flat, asyncs, plan, placement)


#: What a trace raises where it needs a value (:func:`_raise_if_never`).
_NEEDS_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def _raise_if_never(fn: Callable[..., Any], treedef: Any, flat: list, asyncs: list):
    """Raises at once, as JAX does on a ``jax.Array``, the error that ``fn``
    raises whatever the values of its one async array (``x[0] = 1``, a shape
    that does not fit): traced with every other argument concrete."""
    if sum(asyncs) > 1:  # the others' values may be what it needs: it waits
        return
    try:
        jax.make_jaxpr(lambda x: _call(fn, treedef, [x, *flat[1:]]))(flat[0])
    except Exception as e:
        if not isinstance(e, _NEEDS_VALUES):
            raise


def _on_values(
    fn: Callable[..., Any], treedef: Any, flat: list, asyncs: list, wait: bool
) -> Any:
    """JAX's own ``fn`` on the values (waited for in Python), its array outputs
    ``AsyncArray`` s of a landed call (the kind follows the arguments)."""
    get = landed if wait else (lambda a: a.result())
    out = _call(
        fn, treedef, [get(a) if y else a for a, y in zip(flat, asyncs, strict=True)]
    )
    leaves, tree = jax.tree_util.tree_flatten(out)
    at = [k for k, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    if at:
        kind = _async_dispatch.mechanism.kind
        assert kind is not None  # set when the array type was
        made = kind.arrays_of(_async_dispatch.Results([leaves[k] for k in at]))
        for k, array in zip(at, made, strict=True):
            leaves[k] = array
    return jax.tree_util.tree_unflatten(tree, leaves)


def _placement(flat: list, marked: list, asyncs: list) -> Any:
    """Where the outputs of an op on ``flat`` go: ``None`` (the default device,
    uncommitted, as JAX's eager ops on uncommitted arrays), the one
    single-device sharding the committed arrays among ``flat`` share, or
    :data:`_ELSEWHERE` (several devices, or a device or sharding argument)."""
    found = None
    for a, m, is_async in zip(flat, marked, asyncs, strict=True):
        if isinstance(m, (jax.Device, jax.sharding.Sharding)):
            return _ELSEWHERE
        if is_async:
            sharding = a.sharding
        elif isinstance(a, jax.Array) and a.committed:
            sharding = a.sharding
        else:
            continue
        if sharding is None or sharding == found:
            continue
        if found is not None or len(sharding.device_set) > 1:
            return _ELSEWHERE
        found = sharding
    return found


def _blocking(fn: Callable[..., Any], plan: Any, placement: Any) -> bool:
    """Whether the op waits for its data: blocking dispatch, several processes,
    a pool thread, or outputs deferred dispatch does not make (PRNG keys)."""
    if _async_dispatch.mechanism.status() is not None:
        return True
    if _deferred_dispatch.processes() > 1:
        return True
    return not _deferred_dispatch.deferrable(_program(fn, plan, placement))


def _program(fn: Callable[..., Any], plan: Any, placement: Any) -> Any:
    """What deferred dispatch reads of a program: its name and outputs."""
    _, avals = plan
    outs = types.SimpleNamespace(
        out_avals=avals, out_shardings=[placement] * len(avals)
    )
    name = f"`{getattr(fn, '__name__', 'op').strip('_')}`"
    return types.SimpleNamespace(name=name, mut=None, out_handler=outs)


def _defer(
    fn: Callable[..., Any],
    treedef: Any,
    flat: list,
    asyncs: list,
    plan: Any,
    placement: Any,
) -> Any:
    """The op's outputs, ``AsyncArray`` s of a deferred program run that runs
    JAX's own ``fn`` on the values when they land (arguments kept as at the
    call: :meth:`.deferred_dispatch.Readers.freeze`)."""
    out_tree, avals = plan
    kind = _async_dispatch.mechanism.kind
    assert kind is not None  # set when the array type was

    def dispatch(frozen: tuple[Any, ...]) -> list[jax.Array]:
        values = [a.result() if y else a for a, y in zip(frozen, asyncs, strict=True)]
        outs = jax.tree_util.tree_leaves(_call(fn, treedef, values))
        for out, aval in zip(outs, avals, strict=True):
            if (out.shape, out.dtype, out.weak_type) != (
                aval.shape,
                aval.dtype,
                aval.weak_type,
            ):  # a bug if ever: the trace and the run disagree
                raise AssertionError(f"{fn}: {out.aval} where its trace gave {aval}")
        return outs

    reads = [
        kind.pending_of(a) if y else None for a, y in zip(flat, asyncs, strict=True)
    ]
    made = _deferred_dispatch.defer(
        dispatch,
        _program(fn, plan, placement),
        tuple(flat),
        reads,
        kind.arrays_of,
        _async_dispatch.mechanism.readers,
    )
    return jax.tree_util.tree_unflatten(out_tree, made)


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
    return getattr(x.at[index], op)(*args, **kwargs)


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
