"""The primitive class, JAX's tables of batching, JVP and transpose rules, and
the values those rules receive, on the hooks of :mod:`.hooks` (the lowering's
table is :func:`.mlir.register_lowering`).

Registrations run when the package is imported. Where a hook is missing they
register nothing (a table that this JAX lacks is a throwaway one), and
:func:`.hooks.require` reports it when the feature is first used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
#: JAX's JVP and transpose rules, by primitive, as ``jax.interpreters.ad`` keeps them.
primitive_jvps: dict[Any, Callable[..., Any]] = or_missing("primitive_jvps", {})
primitive_transposes: dict[Any, Callable[..., Any]] = or_missing(
    "primitive_transposes", {}
)


def register_batching(prim: Any, batching: Callable[..., Any]) -> None:
    """Registers the batching rule of ``prim`` (with ``multiple_results``).

    ``batching(args, dims, **params) -> (outs, out_dims)``. JAX calls rules of
    its table with ``(axis_data, vals, dims, **params)``, also when no operand is
    batched; then the primitive is bound as it is, as JAX's own shim for the
    classic signature does.
    """

    def batching_rule(
        axis_data: Any, vals: Sequence[Any], dims: Sequence[int | None], **params: Any
    ) -> tuple[Any, Any]:
        del axis_data
        if all(d is None for d in dims):
            outs = prim.bind(*vals, **params)
            return outs, [None] * len(outs)
        return batching(vals, dims, **params)

    or_missing("fancy_primitive_batchers", {})[prim] = batching_rule
