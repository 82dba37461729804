"""Abstract values: ``typeof``, ``ShapedArray``, and the manual mesh axes an
abstract value varies over inside ``shard_map`` (on the hooks of :mod:`.hooks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .hooks import HOOKS, RESOLVED, Missing, UnsupportedJaxError, get

ShapedArray: Any = RESOLVED["ShapedArray"]


#: ``jax.typeof(x)``, with the sharding check of JAX >= 0.8.2 on older ones: the
#: hook itself, bound once (it runs for every abstract value; a Missing raises by
#: name when called, and each feature's ``require`` names it first).
typeof: Callable[[Any], Any] = RESOLVED["typeof"]


def varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes over which values of ``aval`` vary (inside shard_map).

    Without the hook, only programs outside ``shard_map`` run: no mesh axis is
    manual there (public API), so nothing varies.
    """
    varying = RESOLVED["varying_axes"]  # read here, not through get(): per aval
    if isinstance(varying, Missing):
        if not _inside_shard_map():
            return frozenset()
        get("varying_axes", "jax_threadmap inside jax.shard_map")  # raises
    try:
        return frozenset(varying.of(aval))
    except AttributeError as e:
        # Never an empty set by default: a wrong type here becomes a wrong
        # cotangent type later.
        hook = next(h for h in HOOKS if h.name == "varying_axes")
        missing = Missing(hook, f"the abstract value {aval} has no such field ({e})")
        raise UnsupportedJaxError(missing.message("jax_threadmap")) from e


def _inside_shard_map() -> bool:
    """Whether a mesh axis is manual here: tracing inside ``shard_map``."""
    manual = jax.sharding.AxisType.Manual
    return manual in tuple(jax.sharding.get_abstract_mesh().axis_types)


def shaped_array(shape: tuple[int, ...], dtype: Any, varying: frozenset) -> Any:
    """A ``ShapedArray`` that varies over the manual mesh axes ``varying``."""
    if not varying:
        return ShapedArray(shape, dtype)
    # What jax._src.core.get_cur_mesh_sharding() returns (the same source on
    # every supported JAX), from public names.
    sharding = jax.sharding.NamedSharding(
        jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec()
    )
    return get("varying_axes").make(shape, dtype, varying, sharding)
