"""Every use of JAX internals, in one place.

JAX gives no compatibility promise for the hooks a new primitive needs (batching
rules, lowering through a host callback, the eager impl) nor for the hooks an
array-like type needs to be passed to ``jit`` without its data. This module is the
only one in the package that touches them. ``tests/test_compat.py`` checks every
name listed in :data:`HOOKS`, so a JAX upgrade that moves one fails loudly there
rather than somewhere deep in a user's program.

Rules for this module: import each hook once, with the public location first and
the private one as the fallback; keep a comment saying why the hook is needed;
and nothing else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Primitive as Primitive
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

# --- the primitive --------------------------------------------------------------------

ShapedArray = jax.core.ShapedArray
JaxRuntimeError = jax.errors.JaxRuntimeError
register_lowering = _mlir.register_lowering
primitive_jvps = _ad.primitive_jvps
primitive_transposes = _ad.primitive_transposes
# Symbolic zeros and linear inputs, as JVP and transpose rules receive them.
Zero = _ad.Zero
instantiate_zeros = _ad.instantiate_zeros
is_undefined_primal = _ad.is_undefined_primal

# `jax.interpreters.mlir` re-exports `emit_python_callback` "temporarily" (jax 0.10);
# the private home is the fallback for when the re-export goes away.
try:
    emit_python_callback: Callable[..., Any] = _mlir.emit_python_callback
except AttributeError:  # pragma: no cover - depends on the JAX version
    from jax._src.callback import emit_python_callback  # noqa: F401

# The eager impl compiles the primitive alone and runs it, so eager calls take the
# same lowering path (one host callback) as jitted ones.
# The op sharding that `pure_callback` uses: MAXIMAL on one device under automatic
# sharding, MANUAL inside shard_map, none otherwise.
from jax._src.callback import (  # noqa: E402
    _callback_op_sharding as callback_op_sharding,  # noqa: F401
)
from jax._src.dispatch import apply_primitive as apply_primitive  # noqa: E402

# Like `pure_callback_p`, the primitive needs devices while lowering so that the
# callback can be placed in sharded (shard_map, pmap, NamedSharding) programs.
from jax._src.dispatch import (  # noqa: E402
    prim_requires_devices_during_lowering as prim_requires_devices_during_lowering,
)


# Inside `shard_map`, an aval records the manual mesh axes its value varies over
# (`jax.typeof(x).mat.varying`, "vma"). A host call on varying operands gives
# varying results, and cotangents must have the type of their primal, so the
# abstract eval propagates them. There is no public constructor for such avals.
def varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes over which values of ``aval`` vary (inside shard_map)."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def shaped_array(shape: tuple[int, ...], dtype: Any, varying: frozenset) -> Any:
    """A ``ShapedArray`` that varies over the manual mesh axes ``varying``."""
    if not varying:
        return ShapedArray(shape, dtype)
    from jax._src import core as _core

    return ShapedArray(
        shape,
        dtype,
        sharding=_core.get_cur_mesh_sharding(),
        manual_axis_type=_core.ManualAxisType(varying=varying),
    )


def register_batching_rule(prim: Primitive, rule: Callable[..., Any]) -> None:
    """Registers ``rule(args, dims, **params) -> (outs, out_dims)`` for ``prim``.

    `jax.interpreters.batching.primitive_batchers` is a shim over the axis-data
    aware table in jax 0.10; it still calls the classic signature.
    """
    _batching.primitive_batchers[prim] = rule


def is_batching_rule_registered(prim: Primitive) -> bool:
    from jax._src.interpreters import batching as _src_batching

    return prim in _src_batching.fancy_primitive_batchers


# --- checks ---------------------------------------------------------------------------

#: (module, attribute) pairs this package relies on; see tests/test_compat.py.
HOOKS: list[tuple[str, str]] = [
    ("jax.extend.core", "Primitive"),
    ("jax.interpreters.batching", "primitive_batchers"),
    ("jax._src.interpreters.batching", "fancy_primitive_batchers"),
    ("jax.interpreters.mlir", "register_lowering"),
    ("jax.interpreters.mlir", "emit_python_callback"),
    ("jax.interpreters.ad", "primitive_jvps"),
    ("jax.interpreters.ad", "primitive_transposes"),
    ("jax.interpreters.ad", "Zero"),
    ("jax.interpreters.ad", "instantiate_zeros"),
    ("jax.interpreters.ad", "is_undefined_primal"),
    ("jax._src.dispatch", "apply_primitive"),
    ("jax._src.dispatch", "prim_requires_devices_during_lowering"),
    ("jax._src.callback", "_callback_op_sharding"),
    ("jax._src.core", "get_cur_mesh_sharding"),
    ("jax._src.core", "ManualAxisType"),
]


def missing_hooks() -> list[str]:
    """Returns the hooks in :data:`HOOKS` that this JAX no longer provides."""
    missing = []
    for module_name, attr in HOOKS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{module_name} (module)")
            continue
        if not hasattr(module, attr):
            missing.append(f"{module_name}.{attr}")
    return missing


# --- async arrays ---------------------------------------------------------------------
# An `AsyncArray` (jax_threadmap/_async.py) is passed to `jit` without its data:
# tracing and compilation need only its abstract value, and the wait for the
# data belongs at execution. JAX has no public hook for such a type, and since
# jax 0.8 `__jax_array__` is no longer honoured during abstractification (it
# raises), so three private tables are needed. They have no public location.

# Type -> abstract value, read by `jax.typeof` / `shaped_abstractify` when `jit`
# traces, so tracing and compiling never touch the data.
from jax._src.core import pytype_aval_mappings as pytype_aval_mappings  # noqa: E402

# Argument canonicalisation runs before sharding at execution; without a handler
# an unknown type is rejected as "not a valid JAX type". `None` keeps the value
# as it is, so that the sharding handler below receives it.
from jax._src.dtypes import (  # noqa: E402
    register_canonicalize_value_handler as register_canonicalize_value_handler,
)

# Type -> function that turns arguments into device buffers. `jit` calls it only
# when the compiled program runs, after compilation: the place to wait. It
# delegates to `shard_args`, so resharding and layouts work as for `jax.Array`.
from jax._src.interpreters.pxla import (  # noqa: E402
    shard_arg_handlers as shard_arg_handlers,
)
from jax._src.interpreters.pxla import shard_args as shard_args  # noqa: E402


def register_array_like(
    cls: type,
    aval_of: Callable[[Any], Any],
    arrays_of: Callable[[list[Any], list[Any]], list[Any]],
) -> None:
    """Lets instances of ``cls`` be passed to ``jit`` before their data exists.

    ``aval_of(x)`` returns the abstract value (used to trace and compile);
    ``arrays_of(xs, shardings)`` returns one ``jax.Array`` per ``x`` and is called
    only when a compiled program runs with them; ``shardings`` are the shardings
    the program expects for them (so that arrays made there need no resharding).
    """
    pytype_aval_mappings[cls] = aval_of
    register_canonicalize_value_handler(cls, None)

    def handler(xs: Any, shardings: Any, layouts: Any, copy_semantics: Any) -> Any:
        arrays = arrays_of(list(xs), list(shardings))
        return shard_args(shardings, layouts, copy_semantics, arrays)

    shard_arg_handlers[cls] = handler


ASYNC_HOOKS: list[tuple[str, str]] = [
    ("jax._src.core", "pytype_aval_mappings"),
    ("jax._src.dtypes", "register_canonicalize_value_handler"),
    ("jax._src.interpreters.pxla", "shard_arg_handlers"),
    ("jax._src.interpreters.pxla", "shard_args"),
]
HOOKS += ASYNC_HOOKS


# --- async dispatch (issue 13) -----------------------------------------------------
# A jitted call with a pending `AsyncArray` returns at once when the argument handler
# can hand JAX a `jax.Array` whose buffer is filled later. No public API makes one.
# `jax.experimental.transfer` (jax 0.6.2 ... 0.12, same module and signatures in all
# three) can: `TransferConnection.pull` returns arrays whose buffers arrive when the
# server's `await_pull` offers them. `_async.py` pulls only a 4-byte gate through it
# (the data goes through a `pure_callback` program that waits on the gate), so the
# loopback socket carries no data. Each hook is optional: when one is missing,
# `async_dispatch_unavailable()` says why and `_async.py` falls back to blocking
# dispatch (the wait in `shard_arg_handlers`, as before).

start_transfer_server: Callable[..., Any] | None
_transfer_import_error: str | None
try:  # jax.experimental.transfer: 0.6.2, 0.10.2, 0.12.0.1 (experimental: may move)
    from jax.experimental.transfer import (  # noqa: E402
        start_transfer_server as start_transfer_server,
    )
except Exception as _e:  # pragma: no cover - depends on the JAX version
    start_transfer_server = None
    _transfer_import_error = f"{type(_e).__name__}: {_e}"
else:
    _transfer_import_error = None

# `jax.pure_callback` logs every exception of its callback with `logger.exception`
# on this logger (jax/_src/callback.py, 0.6.2 ... 0.12). The gate programs re-raise a
# failed call's error there on purpose; `_async.py` filters those records and logs
# one warning of its own instead.
CALLBACK_LOGGER_NAME = "jax._src.callback"


def async_dispatch_unavailable() -> str | None:
    """Why this JAX cannot dispatch on pending arrays, or ``None`` if it can."""
    if start_transfer_server is None:
        return (
            "jax.experimental.transfer.start_transfer_server could not be imported "
            f"({_transfer_import_error})"
        )
    return None


ASYNC_DISPATCH_HOOKS: list[tuple[str, str]] = [
    ("jax.experimental.transfer", "start_transfer_server"),
    ("jax.experimental.transfer", "TransferServer"),
    ("jax.experimental.transfer", "TransferConnection"),
    ("jax._src.callback", "logger"),
]
HOOKS += ASYNC_DISPATCH_HOOKS
