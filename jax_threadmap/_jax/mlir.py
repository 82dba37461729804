"""The lowering's JAX side (on the hooks of :mod:`.hooks`): what the lowering
of ``threadmap_p`` (:mod:`.._core.lowering`) emits into JAX's MLIR, and what it
reads from the lowering context.

- one host callback, as ``jax.pure_callback`` lowers it
  (:func:`emit_python_callback`, :func:`callback_op_sharding`), or zeros
  (:func:`lower_zeros`); the devices that the callback holds
  (:func:`lowering_devices`);
- the module and block being emitted into, and whether two IR values are
  computed alike (:func:`lowering_place`, :func:`computed_alike`: the reuse
  of an equal equation's results);
- per-shard maps under ``jit`` on several devices: :func:`lower_partitioned`
  lowers a function through ``custom_partitioning``;
  :func:`shard_callback_lowering` lowers the per-device host call inside its
  partition function, as JAX's own FFI host-callback call with the index of a
  callback that :func:`register_host_callback` registered in the program while
  it was lowered (the partition function's module is built apart from the
  program's, so a callback registered there would be lost: jax-ml/jax#23620).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .hooks import (
    AUTO_PER_SHARD,
    PYTHON_CALLBACK_TARGETS,
    RESOLVED,
    get,
    missing_for,
    or_missing,
)

logger = logging.getLogger("jax_threadmap.sharding")

# The host callback's op sharding and custom call, as jax.pure_callback lowers them.
callback_op_sharding: Callable[..., Any] = RESOLVED["callback_op_sharding"]
emit_python_callback: Callable[..., Any] = RESOLVED["emit_python_callback"]


def register_lowering(
    prim: Any,
    rule: Callable[..., Any],
    *,
    cacheable: bool = True,
    devices_during_lowering: bool = False,
) -> None:
    """Registers the lowering ``rule`` of ``prim`` (where this JAX has no
    table: nothing); ``devices_during_lowering``: as for ``pure_callback_p``,
    the lowering context then names the program's devices."""
    register = or_missing("register_lowering", lambda *_, **__: None)
    register(prim, rule, cacheable=cacheable)
    if devices_during_lowering:
        or_missing("prim_requires_devices_during_lowering", set()).add(prim)


def lower_zeros(ctx: Any, args: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """IR values of zeros shaped like ``avals``, inside the lowering ``ctx`` of
    an equation whose operands are ``args`` (read by no one)."""

    def zeros(*operands: Any) -> list[Any]:
        del operands
        return [jnp.zeros(a.shape, a.dtype) for a in avals]

    return list(RESOLVED["lower_fun"](zeros, multiple_results=True)(ctx, *args))


def lowering_devices(ctx: Any) -> frozenset[Any]:
    """The devices of the program being lowered (those its host callbacks hold).

    Read from the lowering context's axis context, which JAX fills for the
    primitives that need devices during lowering (:func:`register_lowering`'s
    ``devices_during_lowering``): a ``device_assignment`` (jit), or a mesh
    (shard_map); else, as a bound from above, every device of the lowering
    platforms (pmap)."""
    module = ctx.module_context
    axis_context = getattr(module, "axis_context", None)
    devices = getattr(axis_context, "device_assignment", None)
    if devices is None:
        try:  # an abstract mesh (shard_map inside jit) has no devices
            devices = axis_context.mesh.devices.flat  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            devices = None
    if devices is not None:
        return frozenset(devices)
    found: set[Any] = set()
    for platform in getattr(module, "platforms", ()):
        try:
            found.update(jax.devices(platform))
        except RuntimeError:  # a platform this process has no backend for
            continue
    return frozenset(found)


def lowering_place(ctx: Any) -> tuple[Any, Any] | None:
    """The module and the block that the lowering ``ctx`` emits into: an
    operation there dominates the later ones of the block. ``None`` where the
    context has no module (then each equation is lowered on its own, and
    tests/_core/test_derivative_counts.py says so)."""
    module = getattr(ctx.module_context, "module", None)
    if module is None:
        return None
    return module, RESOLVED["mlir_ir"].InsertionPoint.current.block


#: Operations whose results may differ between runs on equal operands (host
#: calls, random numbers, tokens, jax.checkpoint's barrier against reuse); so
#: may those with regions or of other dialects (func.call), to be safe.
_OWN_RESULTS = frozenset(
    "stablehlo." + name
    for name in "custom_call rng optimization_barrier infeed outfeed send recv "
    "after_all create_token".split()
)

#: The most pairs of values one comparison walks (about 25 us each): a kernel
#: called many times in a block on deep, nearly equal computations would
#: otherwise cost compile time quadratic in its calls.
_MOST_PAIRS = 10_000


def computed_alike(a: Any, b: Any) -> bool:
    """Whether IR values ``a`` and ``b`` are the same value, or results of
    equal operations (name, attributes, result types, operands computed alike)
    of the same values, as XLA's common-subexpression elimination finds them:
    equal at run time. The walk stops at the values they share."""
    pairs, seen = [(a, b)], set[tuple[Any, Any]]()
    while pairs:
        a, b = pairs.pop()
        if a == b or (a, b) in seen:
            continue
        if len(seen) == _MOST_PAIRS:
            return False  # (told apart: a bound on the compile time it costs)
        seen.add((a, b))
        (op_a, key_a), (op_b, key_b) = _defining(a), _defining(b)
        if key_a is None or key_a != key_b:
            return False
        pairs.extend(zip(op_a.operands, op_b.operands, strict=True))
    return True


def _defining(v: Any) -> tuple[Any, Any]:
    """The operation that computed ``v``, and what they are but for its
    operands (``None`` where its results may differ between runs)."""
    op = getattr(v.owner, "operation", v.owner)
    name = getattr(op, "name", "")  # (an argument's owner is a Block: no name)
    if not name.startswith(("stablehlo.", "chlo.")) or name in _OWN_RESULTS:
        return op, None
    a, results = op.attributes, list(op.results)  # (a[i]: NamedAttribute in all JAX)
    attrs = tuple((a[i].name, a[i].attr) for i in range(len(a)))
    types = tuple(r.type for r in results)
    key = (name, attrs, types, results.index(v), len(op.operands))
    return op, None if len(op.regions) else key


def per_shard_mesh(ctx: Any) -> Any:
    """The mesh of a lowering under ``jit`` on several devices (explicit or
    automatic axes; not inside ``shard_map``) that can map per shard; else
    ``None``. Where such a lowering cannot (a missing hook, or a platform whose
    host callbacks are not FFI calls), one INFO line per reason says so: one
    device maps every element."""
    axis_context = ctx.module_context.axis_context
    why = missing_for(AUTO_PER_SHARD)
    if why is None:
        mesh = RESOLVED["ShardingContext"](axis_context)
    else:  # only jit's axis context has a device assignment (read to log why)
        several = len(getattr(axis_context, "device_assignment", None) or ()) > 1
        mesh = True if several else None
    if mesh is None:
        return None
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) != 1 or platforms[0] not in PYTHON_CALLBACK_TARGETS:
        why = why or f"host callbacks on {'/'.join(platforms)} are not FFI calls"
    if why is not None:
        _log_fallback(why)
        return None
    return mesh


@functools.cache  # once per reason
def _log_fallback(reason: str) -> None:
    logger.info(
        "threadmap under jit on a mesh maps every element on one device here: %s",
        reason,
    )


def on_mesh(mesh: Any) -> Any:
    """A context in which ``mesh``'s abstract mesh is the current one."""
    return get("use_abstract_mesh")(mesh.abstract_mesh)


def register_host_callback(ctx: Any, callback: Callable[..., Any]) -> int:
    """Registers ``callback`` in the program being lowered; its index."""
    return int(RESOLVED["ModuleContext"](ctx.module_context, callback))


def lower_partitioned(
    ctx: Any,
    args: Sequence[Any],
    body: Callable[..., list[Any]],
    *,
    partition: Callable[..., Any],
    infer: Callable[..., Any],
    rule: str,
) -> list[Any]:
    """Lowers ``body(*args)`` as a ``custom_partitioning`` call with these
    ``partition`` and ``infer_sharding_from_operands`` functions and Shardy
    ``sharding_rule``."""
    fn = get("custom_partitioning")(body)
    fn.def_partition(
        partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule
    )
    lower_fun = get("lower_fun")
    return list(lower_fun(lambda *xs: list(fn(*xs)), multiple_results=True)(ctx, *args))


def shard_callback_lowering(ctx: Any, *args: Any, index: int, result_avals: Any) -> Any:
    """The lowering rule of one device's host call (``shard_callback_p``): the
    host callback registered at ``index`` called on ``args`` (the results
    typed by ``ctx.avals_out``)."""
    del result_avals
    target = PYTHON_CALLBACK_TARGETS[ctx.module_context.platforms[0]]
    call = RESOLVED["ffi_lowering"](target, has_side_effect=False)
    return call(ctx, *args, index=np.uint64(index))
