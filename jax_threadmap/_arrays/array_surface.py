"""The ``jax.Array`` surface of :class:`~.async_array.AsyncArray`.

JAX defines the methods, operators and properties of its arrays from three tables
(``_array_methods``, ``_array_operators``, ``_array_properties`` of
``jax/_src/numpy/array_methods.py``, reached through :mod:`.._jax.hooks`).
:func:`install` puts each entry on ``AsyncArray``, run under ``jax.jit`` with the
array as an argument: the call traces with the array's abstract value and
dispatches at once, as any jitted call on pending data does (``y.T``, ``y.sum()``,
``y.astype(...)``, ``y.at[i].set(v)`` never wait). An entry that needs a concrete
value (``item``, ``nonzero()`` without ``size``, a boolean mask) fails to trace
with a ``ConcretizationTypeError``; it then waits and runs on the landed array.

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
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .._jax import hooks as _compat

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
_TRACE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def landed(x: Any) -> Any:
    """``x``'s value, waited for in Python: an ``AsyncArray``'s result, and any
    ``jax.Array`` ready (``block_until_ready`` releases the GIL while it waits)."""
    if _is_async(x):
        x = x.result()
    if isinstance(x, jax.Array) and not x.is_deleted():
        x.block_until_ready()
    return x


def _never(x: Any) -> bool:
    return False


#: Whether an object is an ``AsyncArray`` (set by :func:`install`).
_is_async: Callable[[Any], bool] = _never


def _landed_tree(tree: Any, is_async: Callable[[Any], bool]) -> Any:
    return jax.tree_util.tree_map(
        lambda a: landed(a) if is_async(a) or isinstance(a, jax.Array) else a, tree
    )


class _Static:
    """The static part of a call's arguments: the tree and its non-array leaves,
    hashable for ``jit``'s cache (slices are made hashable; a leaf's type is part
    of the key, so that ``1``, ``1.0`` and ``True`` never share an entry)."""

    def __init__(self, treedef: Any, leaves: list[Any]) -> None:
        self.treedef, self.leaves = treedef, leaves
        self._key = (treedef, tuple(_key(leaf) for leaf in leaves))
        self._hash = hash(self._key)  # TypeError: not hashable, the caller waits

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key == other._key


def _key(leaf: Any) -> Any:
    if isinstance(leaf, slice):
        return (slice, leaf.start, leaf.stop, leaf.step)
    return (type(leaf), leaf)


#: A leaf that is a placeholder for a dynamic argument in ``_Static.leaves``.
_DYNAMIC = object()


def _dynamic(leaf: Any, is_async: Callable[[Any], bool]) -> bool:
    # Python ints stay static (axes, shapes, integer powers); floats are traced
    # as JAX traces Python scalars (weak types), so that a changing step size
    # does not compile again.
    return (
        is_async(leaf)
        or isinstance(leaf, (jax.Array, np.ndarray, float, complex))
        and not isinstance(leaf, np.generic)
    )


@functools.partial(jax.jit, static_argnums=(0, 1))
def array_method(fn: Callable[..., Any], static: _Static, x: Any, dynamic: list) -> Any:
    values = iter(dynamic)
    leaves = [next(values) if s is _DYNAMIC else s for s in static.leaves]
    args, kwargs = jax.tree_util.tree_unflatten(static.treedef, leaves)
    return fn(x, *args, **kwargs)


def apply(
    fn: Callable[..., Any],
    x: Any,
    args: tuple,
    kwargs: dict,
    is_async: Callable[[Any], bool],
) -> Any:
    """``fn(x, *args, **kwargs)`` under ``jax.jit`` (deferred where ``x`` is
    pending); where it needs a concrete value, on the landed values instead."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [leaf for leaf in leaves if _dynamic(leaf, is_async)]
    marked = [_DYNAMIC if _dynamic(leaf, is_async) else leaf for leaf in leaves]
    try:
        static = _Static(treedef, marked)
    except TypeError:  # an unhashable static argument: run it on the value
        static = None
    if static is not None:
        try:
            return array_method(fn, static, x, dynamic)
        except _TRACE_ERRORS:
            pass
    args, kwargs = _landed_tree((args, kwargs), is_async)
    return fn(landed(x), *args, **kwargs)


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
    global _is_async
    _is_async = is_async
    methods, operators, properties = _tables()
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
