"""Per-shard maps under ``jit`` on several devices: the JAX side (on the hooks
of :mod:`.hooks`).

:func:`lower_partitioned` lowers a function through ``custom_partitioning``;
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

import numpy as np

from .hooks import (
    AUTO_PER_SHARD,
    PYTHON_CALLBACK_TARGETS,
    RESOLVED,
    get,
    missing_for,
)

logger = logging.getLogger("jax_threadmap.sharding")


def automatic_mesh(ctx: Any) -> Any:
    """The mesh of a lowering under ``jit`` on several devices (explicit or
    automatic axes; not inside ``shard_map``), or ``None``. Where a hook is missing,
    ``True`` for such a lowering (:func:`unavailable` says which hook)."""
    axis_context = ctx.module_context.axis_context
    if missing_for(AUTO_PER_SHARD) is not None:
        # Only jit's axis context has a device assignment (read to log why).
        several = len(getattr(axis_context, "device_assignment", None) or ()) > 1
        return True if several else None
    return RESOLVED["ShardingContext"](axis_context)


def unavailable(ctx: Any) -> str | None:
    """Why this lowering cannot map per shard (a missing hook,
    or a platform whose host callbacks are not FFI calls), or ``None``."""
    missing = missing_for(AUTO_PER_SHARD)
    if missing is not None:
        return missing
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) != 1 or platforms[0] not in PYTHON_CALLBACK_TARGETS:
        return f"host callbacks on {'/'.join(platforms)} are not FFI calls"
    return None


@functools.cache  # once per reason
def log_fallback(reason: str) -> None:
    """One INFO line per reason: this map runs on one device."""
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


def shard_callback_lowering(ctx: Any, *args: Any, index: int) -> Any:
    """The host callback registered at ``index`` called on ``args`` (the
    results typed by ``ctx.avals_out``)."""
    target = PYTHON_CALLBACK_TARGETS[ctx.module_context.platforms[0]]
    call = RESOLVED["ffi_lowering"](target, has_side_effect=False)
    return call(ctx, *args, index=np.uint64(index))
