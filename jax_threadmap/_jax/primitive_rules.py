"""The primitive class and the registration of its rules (batching, lowering,
JVP, transpose), on the hooks of :mod:`.hooks`.

Registrations run when the package is imported. Where a hook is missing they
register nothing, and :func:`.hooks.require` reports it when the feature is
first used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .hooks import RESOLVED, THREADMAP, or_missing, require


class _PrimitiveStandIn:
    """``threadmap_p`` when JAX has no Primitive class: imports, never binds."""

    multiple_results = False

    def __init__(self, name: str) -> None:
        self.name = name

    def def_impl(self, impl: Callable[..., Any]) -> Callable[..., Any]:
        return impl

    def def_abstract_eval(self, rule: Callable[..., Any]) -> Callable[..., Any]:
        return rule

    def bind(self, *args: Any, **params: Any) -> Any:
        del args, params
        require(THREADMAP, f"{self.name}_p.bind")


Primitive: Any = or_missing("Primitive", _PrimitiveStandIn)
# Symbolic zeros and linear inputs, as JVP and transpose rules receive them.
Zero: Any = RESOLVED["Zero"]
is_undefined_primal: Callable[[Any], bool] = RESOLVED["is_undefined_primal"]
# The host callback's op sharding and custom call, as jax.pure_callback lowers them.
callback_op_sharding: Callable[..., Any] = RESOLVED["callback_op_sharding"]
emit_python_callback: Callable[..., Any] = RESOLVED["emit_python_callback"]


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
    primitives that need devices during lowering (:func:`register_rules`'s
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


def register_rules(
    prim: Any,
    lowering: Callable[..., Any],
    batching: Callable[..., Any] | None = None,
    jvp: Callable[..., Any] | None = None,
    transpose: Callable[..., Any] | None = None,
    *,
    cacheable: bool = True,
    devices_during_lowering: bool = False,
) -> None:
    """Registers the rules of ``prim`` (with ``multiple_results``), each in its
    table where this JAX has one (a missing table: a throwaway one).

    ``batching(args, dims, **params) -> (outs, out_dims)``. JAX calls rules of
    its table with ``(axis_data, vals, dims, **params)``, also when no operand is
    batched; then the primitive is bound as it is, as JAX's own shim for the
    classic signature does.
    """
    register_lowering = or_missing("register_lowering", lambda *_, **__: None)
    register_lowering(prim, lowering, cacheable=cacheable)
    rules = {"primitive_jvps": jvp, "primitive_transposes": transpose}
    if batching is not None:

        def batching_rule(
            axis_data: Any,
            vals: Sequence[Any],
            dims: Sequence[int | None],
            **params: Any,
        ) -> tuple[Any, Any]:
            del axis_data
            if all(d is None for d in dims):
                outs = prim.bind(*vals, **params)
                return outs, [None] * len(outs)
            return batching(vals, dims, **params)

        rules["fancy_primitive_batchers"] = batching_rule
    for table, rule in rules.items():
        if rule is not None:
            or_missing(table, {})[prim] = rule
    if devices_during_lowering:
        or_missing("prim_requires_devices_during_lowering", set()).add(prim)
