"""Per-shard maps under ``jit`` when the avals carry their sharding (explicit mode).

With a mesh whose axes are ``AxisType.Explicit`` ("sharding in types"), every
abstract value carries its sharding while ``jit`` traces. When a ``threadmap``
equation is bound with batch axes sharded over such mesh axes, :func:`bind` binds
it inside a ``jax.shard_map`` over those axes: each device's block of elements
is one flat map, run by the process that holds the device, and the results keep
the batch sharding (``docs/sharding.md``). Elsewhere (no explicit sharding of a
batch axis, automatic mode, inside ``shard_map`` already, or under a vmap over
explicit mesh axes, whose own rule plans every level at once) the equation is
bound as it is.

The plan is made per batch level (``BatchSpec.shape``): the mesh axes of the
first batched operand that is sharded at that level. JAX places host callbacks
only where every mesh axis is manual, so the mesh's other axes are added to a
level whose size they divide (each device maps its own elements) and the results
are resharded back over them afterwards. Every batched operand is resharded to
exactly the planned axes on its batch axes (its other axes whole), and every
unbatched operand to replicated, so the body sees whole elements. Levels that an
output sums away (reverse-mode cotangents of operands not batched there) are
summed over their mesh axes with ``psum`` inside the body.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._host.batch_spec import BatchSpec
from .._jax import avals as _avals
from .._jax import explicit_sharding as _explicit_sharding
from .._jax import traces as _traces

Bind = Callable[..., Sequence[Any]]
MeshAxes = tuple[str, ...]


def bind(prim_bind: Bind, *args: Any, spec: BatchSpec, **params: Any) -> Any:
    """Binds the equation per shard where its batch axes are explicitly sharded."""
    plan = _plan(args, spec)
    if plan is None:
        return prim_bind(*args, spec=spec, **params)
    mesh, levels, split = plan
    in_specs = [
        _operand_spec(x, axes, split)
        for x, axes in zip(args, spec.in_axes, strict=True)
    ]
    args = tuple(
        x
        if _typeof_spec(x) == s
        else _explicit_sharding.reshard(x, NamedSharding(mesh, s))
        for x, s in zip(args, in_specs, strict=True)
    )
    num_outs = len(params["result_avals"])

    def out_spec(k: int, levels: list[MeshAxes]) -> Any:
        summed = spec.summed(k)
        kept = [lv for lv in range(len(spec.shape)) if lv not in summed]
        return P(*(_spec_entry(levels[lv]) for lv in kept))

    def body(*blocks: Any) -> list[Any]:
        outs = prim_bind(*blocks, spec=_local(spec, split, mesh), **params)
        return [_sum_levels(o, spec.summed(k), split) for k, o in enumerate(outs)]

    # Every mesh axis is manual in the body (JAX places host callbacks only
    # there); the elements are split over all of them (see _plan).
    outs = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=[out_spec(k, split) for k in range(num_outs)],
        # Named: jax 0.8.3 takes the default (none named: all) as none manual.
        axis_names=set(mesh.axis_names),
    )(*args)
    if split == levels:
        return outs
    # Mesh axes that no batch axis was sharded over: the results go back to the
    # batch sharding of the operands (whole along those axes).
    return [
        _explicit_sharding.reshard(o, NamedSharding(mesh, out_spec(k, levels)))
        for k, o in enumerate(outs)
    ]


def _plan(
    args: Sequence[Any], spec: BatchSpec
) -> tuple[Any, list[MeshAxes], list[MeshAxes]] | None:
    """``(mesh, levels, split)``, or ``None`` to bind the equation as it is.

    ``levels``: per batch level, the explicit mesh axes it is sharded over in the
    operands (the first batched operand sharded at that level decides).
    ``split``: the same, with the mesh's other axes (of size > 1) added to the
    first level whose size they divide, so that every device maps its own
    elements; where none does, ``None`` (one device maps all, as in automatic
    mode).
    """
    if not spec.shape or _explicit_sharding.per_shard_unavailable() is not None:
        return None
    mesh = None
    levels: list[MeshAxes] = [()] * len(spec.shape)
    for x, axes in zip(args, spec.in_axes, strict=True):
        sharding: Any = getattr(_avals.typeof(x), "sharding", None)
        found = _sharded_levels(sharding, axes, levels)
        if not found:
            continue
        if mesh is not None and mesh != sharding.mesh:
            return None  # JAX refuses operands on different meshes anyway
        mesh = sharding.mesh
        for level, mesh_axes in found.items():
            levels[level] = mesh_axes
    if mesh is None or jax.sharding.AxisType.Manual in tuple(mesh.axis_types):
        return None  # inside a shard_map over part of the mesh: left as it was
    if _traces.vmapped_mesh_axes():
        # An enclosing vmap maps over mesh axes this level cannot see (they are
        # not in the operands' types here): splitting over them would shard one
        # mesh axis twice once that vmap batches the shard_map. Its own rule
        # binds the equation again with every level, and plans it then.
        return None
    split = _split_over_other_axes(mesh, levels, spec.shape)
    return None if split is None else (mesh, levels, split)


def _sharded_levels(
    sharding: Any, axes: Sequence[int | None], levels: list[MeshAxes]
) -> dict[int, MeshAxes]:
    """The levels not yet planned that this operand has sharded over explicit
    mesh axes not yet taken by another level."""
    if sharding is None or all(a is None for a in axes):
        return {}
    explicit = _explicit_axes(sharding.mesh)
    taken = {a for mesh_axes in levels for a in mesh_axes}
    found: dict[int, MeshAxes] = {}
    for level, d in enumerate(axes):
        entry = () if d is None or levels[level] else _entry(sharding.spec, d)
        if entry and all(a in explicit and a not in taken for a in entry):
            found[level] = entry
            taken.update(entry)
    return found


def _split_over_other_axes(
    mesh: Any, levels: list[MeshAxes], shape: tuple[int, ...]
) -> list[MeshAxes] | None:
    """``levels`` with each mesh axis that none of them uses (of size > 1) added
    to the first level whose size it divides; ``None`` where one divides none,
    or is not explicit (``reshard`` refuses automatic axes)."""
    split = list(levels)
    taken = {a for mesh_axes in levels for a in mesh_axes}
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    explicit = _explicit_axes(mesh)
    for name in mesh.axis_names:
        if name in taken or sizes[name] == 1:
            continue
        if name not in explicit:
            return None
        for level, size in enumerate(shape):
            if size % (_size(mesh, split[level]) * sizes[name]) == 0:
                split[level] = (*split[level], name)
                break
        else:
            return None
    return split


def _explicit_axes(mesh: Any) -> frozenset[str]:
    explicit = jax.sharding.AxisType.Explicit
    return frozenset(
        n
        for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == explicit
    )


def _entry(pspec: Any, d: int) -> MeshAxes:
    """The mesh axes on dimension ``d`` of a partition spec, as a tuple."""
    entry = tuple(pspec)[d] if d < len(tuple(pspec)) else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _typeof_spec(x: Any) -> Any:
    sharding = getattr(_avals.typeof(x), "sharding", None)
    return None if sharding is None else P(*_padded(sharding.spec, jax.numpy.ndim(x)))


def _padded(pspec: Any, ndim: int) -> list[Any]:
    entries = [_entry(pspec, d) for d in range(ndim)]
    return [None if not e else e[0] if len(e) == 1 else e for e in entries]


def _operand_spec(x: Any, axes: Sequence[int | None], levels: list[MeshAxes]) -> Any:
    """The operand's spec in the body: each batch axis on its level's mesh axes."""
    entries: list[Any] = [None] * jax.numpy.ndim(x)
    for level, d in enumerate(axes):
        if d is not None and levels[level]:
            entries[d] = _spec_entry(levels[level])
    return P(*entries)


def _spec_entry(axes: MeshAxes) -> Any:
    """A partition spec's entry for ``axes``: ``None``, one name, or a tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _local(spec: BatchSpec, levels: list[MeshAxes], mesh: Any) -> BatchSpec:
    """The spec of one shard's block: each sharded level divided by its devices."""
    shape = tuple(
        size // _size(mesh, axes) for size, axes in zip(spec.shape, levels, strict=True)
    )
    return BatchSpec(shape, spec.in_axes, spec.out_sum)


def _size(mesh: Any, axes: MeshAxes) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    n = 1
    for a in axes:
        n *= sizes[a]
    return n


def _sum_levels(out: Any, summed: tuple[int, ...], levels: list[MeshAxes]) -> Any:
    """Adds up the shards' partial sums of the levels an output sums away."""
    axes = tuple(a for lv in summed for a in levels[lv])
    return jax.lax.psum(out, axes) if axes else out
