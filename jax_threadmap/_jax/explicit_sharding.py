"""Per-shard maps under ``jit``: whether this JAX maps batch axes sharded over
explicit mesh axes per shard, and the resharding of their operands (on the hooks
of :mod:`.hooks`).
"""

from __future__ import annotations

from typing import Any

import jax

from .hooks import (
    JAX_VERSION,
    PER_SHARD_JIT,
    RESOLVED,
    SHARD_MAP,
    missing_for,
    version_text,
)

#: JAX releases whose batching rules run with the vmapped explicit mesh axes still
#: in the axis environment, where ``jax.shard_map`` refuses them ("axis_names ...
#: to be a subset of mesh.axis_names"; seen on jax 0.8.3). jax 0.8.1 added those
#: axes (``add_explicit_mesh_axis_names`` in ``vmap``); jax 0.9.1 removes them
#: around batching rules (``remove_explicit_mesh_axis_names``), read from each
#: release's source. There, explicit mesh axes are mapped on one device.
PER_SHARD_REFUSED: tuple[tuple[int, ...], tuple[int, ...]] = ((0, 8, 1), (0, 9, 1))


def per_shard_unavailable() -> str | None:
    """Why batch axes sharded over explicit mesh axes are not mapped per shard
    under ``jit`` (this JAX refuses it, or a hook is missing), or ``None`` if
    they are."""
    since, until = PER_SHARD_REFUSED
    if since <= JAX_VERSION < until:
        return (
            f"jax {jax.__version__} refuses a shard_map over the mesh axes that "
            f"vmap maps over (jax {version_text(since)} to {version_text(until)} "
            "exclusive)"
        )
    return missing_for(PER_SHARD_JIT, SHARD_MAP)


def reshard(x: Any, spec: Any) -> Any:
    """``jax.sharding.reshard(x, spec)``: ``x`` in the layout ``spec`` of its mesh."""
    return RESOLVED["reshard"](x, spec)  # (a Missing raises by name when called)
