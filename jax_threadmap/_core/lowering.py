"""The lowering of ``threadmap_p``, in one room (what it emits into JAX's MLIR,
and reads from the lowering context: :mod:`.._jax.mlir`; :mod:`.primitive`
registers :func:`threadmap_lowering` beside the primitive's other rules).

One host callback per equation runs :func:`host_function`, the flat map of
:mod:`.._host.maps` on the executor named in the params
(:func:`.._executors.runners.run_map`), or, for an ``async def`` kernel, as
coroutines on the event loop (:func:`.._coroutines.async_kernels.run_async_map`);
the eager impl calls the same function directly. An equation equal to one
lowered before it in the same block reuses its results (``_LOWERED``).

Per shard, on a mesh of several devices (GSPMD or Shardy): with explicit mesh
axes (``AxisType.Explicit``) the operands' types carry their sharding, and the
results are typed with the batch sharding of the operands
(:func:`explicit_result_shardings`); with automatic ones (``jax.sharding.Mesh``)
XLA's partitioner decides it after the equation is lowered. Either way,
:func:`_lower_per_shard` lowers a batched equation as a ``custom_partitioning``
call: when XLA partitions it, :meth:`_Plan.partition` reads the shardings that
XLA chose (:meth:`_Plan.levels`) and asks for each batched operand with its
batch axes on those mesh axes and its other axes whole (an operand sharded
along an element's own axes is gathered along those only), and for unbatched
operands whole. Each device then calls the host once, on its own block (one
flat map), and the results keep the batch sharding. Blocks are the same size on
every device; where a level does not divide evenly, XLA pads the last blocks,
and the host maps only a block's real elements (it is told the block's
position) and fills the rest with zeros, which XLA drops. Levels that an output
sums away (reverse-mode cotangents) are summed over their mesh axes with
``psum``. Where this JAX or platform cannot (:func:`.._jax.mlir.per_shard_mesh`),
the equation is lowered as one host callback: one device maps every element.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._coroutines.async_kernels import run_async_map
from .._executors.runners import Executor, run_map
from .._executors.scheduling import Measure
from .._host.batch_spec import BatchSpec
from .._host.kernel_scope import kernel_scope
from .._host.maps import ElementCaller, HostMap
from .._host.vectorized import ChunkCaller
from .._jax import avals as _avals
from .._jax import mlir as _mlir
from .._jax.rule_tables import Primitive
from .._support.environment import env_num_threads
from .params import AnyParam, InOrder, kernel_ids

HostFn = Callable[..., tuple[np.ndarray, ...]]
MeshAxes = tuple[str, ...]


def host_function(
    *,
    kernel: AnyParam,
    result_avals: tuple[Any, ...],
    spec: BatchSpec,
    executor: Executor | InOrder,
    progress: bool | None,
    devices: frozenset[Any] = frozenset(),
) -> HostFn:
    """The host side of one equation: NumPy operands in, NumPy results out.

    ``devices``: those of the program whose host callback runs it (none when
    eager); its kernels never run a JAX program there (:mod:`.._host.kernel_scope`).
    """
    fn, in_tree, out_tree = kernel.host_call()
    # What the param says, read here once (it is frozen), not at every call.
    name, max_chunk, max_in_flight = kernel.name, kernel.max_chunk, kernel.max_in_flight
    asynchronous = kernel.asynchronous
    in_order = isinstance(executor, InOrder)
    runs_on = _runs_on(executor)
    last = Measure()  # the times of this equation's last map (scheduling.py)
    out_core = [(a.shape, a.dtype) for a in result_avals]
    caller: ElementCaller | ChunkCaller
    if kernel.vectorized:
        caller = ChunkCaller(fn, name, in_tree, out_tree, out_core, spec.shape)
    else:
        caller = ElementCaller(
            fn,
            name,
            in_tree,
            out_tree,
            out_core,
            spec.shape,
            accumulate=[k for k in range(len(result_avals)) if spec.summed(k)],
        )

    def run(*operands: np.ndarray) -> tuple[np.ndarray, ...]:
        flat_map = HostMap(caller, spec, operands, kernel_scope(devices, name))
        if asynchronous:  # coroutines on the event loop (_async_kernels)
            run_async_map(flat_map, max_in_flight=max_in_flight, progress=progress)
        else:
            run_map(
                runs_on,
                flat_map,
                progress=progress,
                max_chunk=max_chunk,
                in_order=in_order,
                last=last,
            )
        return flat_map.finish()

    return run


def _runs_on(executor: Executor | InOrder) -> Executor:
    """Where a map runs: ``executor=``, out of its ``InOrder``."""
    return executor.executor if isinstance(executor, InOrder) else executor


#: Per module being lowered, by (block, kernels, params): the operands and
#: results of its equations.
_LOWERED: weakref.WeakKeyDictionary[Any, dict[Any, list[tuple[Any, Any]]]] = (
    weakref.WeakKeyDictionary()
)
_LOWERED_LOCK = threading.Lock()


def threadmap_lowering(
    bind: Callable[..., Sequence[Any]], ctx: Any, *args: Any, **params: Any
) -> Sequence[Any]:
    """The lowering rule of ``threadmap_p``, whose ``bind`` lowers the body of
    a per-shard call (off the partitioner's path)."""
    # An equation equal to one lowered before it in the same block (the same
    # kernels, by identity, and params, on operands computed alike: jax.jacfwd's
    # fwd and jax.grad's, each on its own m built from p) reuses its results:
    # it is pure, as pure_callback is, and XLA never merges two host callbacks.
    place = _mlir.lowering_place(ctx)
    if place is None:
        return _lower(bind, ctx, *args, **params)
    module, block = place
    key = (block, kernel_ids(params["kernel"]), tuple(sorted(params.items())))
    try:
        hash(key)  # (never the module)
    except TypeError:  # a param that does not hash: lowered on its own
        return _lower(bind, ctx, *args, **params)
    with _LOWERED_LOCK:  # (one module is lowered by one thread)
        earlier = _LOWERED.setdefault(module, {}).setdefault(key, [])
    for operands, results in earlier:
        if all(map(_mlir.computed_alike, operands, args)):
            return list(results)
    results = _lower(bind, ctx, *args, **params)
    earlier.append((args, results))
    return list(results)


def _lower(
    bind: Callable[..., Sequence[Any]], ctx: Any, *args: Any, **params: Any
) -> Sequence[Any]:
    avals_in, avals_out = ctx.avals_in, ctx.avals_out
    if _runs_on(params["executor"]) is None:
        # The shared pool's size is read once per map, where it runs (a changed
        # value is followed); a bad value also fails here, as the jitted call
        # is made, rather than inside its program's host callback.
        env_num_threads()
    # A host callback never sees an operand or result that holds no data: an
    # accelerator's runtime aborts the process on one (libtpu checks its byte
    # offset), and no element of an empty batch needs a kernel call. Such
    # results are lowered as zeros (a sum over an empty batch is 0), such
    # operands are rebuilt empty on the host.
    data_out = [k for k, a in enumerate(avals_out) if _holds_data(a)]
    if params["spec"].size == 0 or not data_out:
        return _mlir.lower_zeros(ctx, args, avals_out)
    data_in = [k for k, a in enumerate(avals_in) if _holds_data(a)]
    devices = _mlir.lowering_devices(ctx)
    per_shard = _lower_per_shard(bind, ctx, args, params, devices)
    if per_shard is not None:
        return per_shard
    host = _without_empty(
        host_function(**params, devices=devices), ctx, data_in, data_out
    )
    callback_out = [avals_out[k] for k in data_out]
    sharding = _mlir.callback_op_sharding(
        ctx.module_context.axis_context, None, callback_out
    )
    # The callback's own context: emit_python_callback types the custom call
    # from the context's avals.
    callback_ctx = dataclasses.replace(
        ctx, avals_in=[avals_in[k] for k in data_in], avals_out=callback_out
    )
    results, _, _ = _mlir.emit_python_callback(
        callback_ctx,
        host,
        None,
        [args[k] for k in data_in],
        callback_ctx.avals_in,
        callback_out,
        has_side_effect=False,
        returns_token=False,
        sharding=sharding,
    )
    return _with_zeros(ctx, args, data_out, results)


def _with_zeros(
    ctx: Any, args: Sequence[Any], data_out: list[int], results: Sequence[Any]
) -> Sequence[Any]:
    """The callback's ``results`` (those ``data_out``), with zeros for the
    results that hold no data."""
    avals_out = ctx.avals_out
    if len(data_out) == len(avals_out):
        return results
    empty = [a for a in avals_out if not _holds_data(a)]
    zeros, filled = iter(_mlir.lower_zeros(ctx, args, empty)), iter(results)
    return [
        next(filled) if k in data_out else next(zeros) for k in range(len(avals_out))
    ]


def _holds_data(aval: Any) -> bool:
    return math.prod(aval.shape) > 0  # (aval.size is missing on some avals)


def _without_empty(
    host: HostFn, ctx: Any, data_in: list[int], data_out: list[int]
) -> HostFn:
    """``host`` for a callback that passes only the operands ``data_in`` and
    returns only the results ``data_out``: the others hold no data. ``host``
    itself when nothing is left out."""
    avals_in = ctx.avals_in
    if len(data_in) == len(avals_in) and len(data_out) == len(ctx.avals_out):
        return host
    empty = {
        k: np.empty(a.shape, a.dtype)
        for k, a in enumerate(avals_in)
        if k not in data_in
    }

    def run(*operands: np.ndarray) -> tuple[np.ndarray, ...]:
        given = iter(operands)
        full = [empty[k] if k in empty else next(given) for k in range(len(avals_in))]
        outs = host(*full)
        return tuple(outs[k] for k in data_out)

    return run


def _lower_per_shard(
    bind: Callable[..., Sequence[Any]],
    ctx: Any,
    args: Sequence[Any],
    params: dict[str, Any],
    devices: frozenset[Any],
) -> list[Any] | None:
    """Under jit on several devices: one host call per device, each on its own
    block (docs/sharding.md); ``None`` elsewhere (one host callback maps every
    element). ``bind``: the call's body off the partitioner's path."""
    spec: BatchSpec = params["spec"]
    if not spec.shape or not all(map(_holds_data, [*ctx.avals_in, *ctx.avals_out])):
        return None  # (per shard only where every operand and result holds data)
    mesh = _mlir.per_shard_mesh(ctx)
    if mesh is None:
        return None
    plan = _Plan(spec, ctx.avals_in, params["result_avals"])
    plan.explicit = _explicit_axes(mesh)  # (the partitioner's mesh has none)
    host = _ShardHost(params, devices)
    plan.index = _mlir.register_host_callback(ctx, host)
    return _mlir.lower_partitioned(
        ctx,
        args,
        lambda *xs: list(bind(*xs, **params)),
        partition=plan.partition,
        infer=plan.infer,
        rule=plan.rule(),
    )


class _Plan:
    """The sharding rules of one equation's ``custom_partitioning`` call."""

    def __init__(self, spec: BatchSpec, avals_in: Sequence[Any], results: Any):
        self.spec = spec
        self.ndims = [len(a.shape) for a in avals_in]
        self.results = tuple(results)  # one element's result avals
        self.index = -1  # of the host callback, in the program
        self.explicit: set[str] = set()  # the mesh's explicit axes

    def rule(self) -> str:
        """The Shardy rule: each level one factor, every other axis its own."""
        spec = self.spec

        def operand(k: int, ndim: int) -> str:
            names = [f"o{k}x{d}" for d in range(ndim)]
            for level, d in enumerate(spec.in_axes[k]):
                if d is not None:
                    names[d] = f"b{level}"
            return " ".join(names)

        def result(k: int, ndim: int) -> str:
            kept = [f"b{lv}" for lv in self.spec.kept(k)]
            return " ".join(kept + [f"r{k}x{d}" for d in range(ndim)])

        ins = ", ".join(operand(k, n) for k, n in enumerate(self.ndims))
        outs = ", ".join(result(k, len(a.shape)) for k, a in enumerate(self.results))
        return f"{ins} -> {outs}"

    def levels(
        self, mesh: Any, arg_shapes: Sequence[Any], chosen: Sequence[Any] | None = None
    ) -> list[MeshAxes]:
        """Per level, the mesh axes its elements are split over.

        First those of the results' batch axes in the shardings ``chosen`` by
        XLA, then those of the first batched operand sharded at a level. Mesh
        axes that shard an element's own axes of a batched operand are left
        out (that operand is gathered along them). When no level is sharded,
        the mesh's other axes (of size > 1) go on the first level whose block
        they divide, else on the largest level, in blocks padded at the end.
        Else, explicit ones go on the first level whose block they divide (a
        local slice of the data; the results are gathered back over them, to
        keep their type); automatic ones, and where no level fits, are not
        split: the devices along such an axis map the same elements, as XLA
        computes a jax.numpy function there, and nothing is gathered whatever
        the results' sharding (a split proposed to GSPMD was gathered back
        where ``out_shardings`` asked for the batch's own, issue 58).
        """
        levels: list[MeshAxes] = [()] * len(self.spec.shape)
        taken = self._core_axes(arg_shapes)
        for lv, names in self._sharded(arg_shapes, chosen or ()):
            if names and not levels[lv] and not taken & set(names):
                levels[lv] = names
                taken.update(names)
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        anywhere = not any(levels)
        for name in mesh.axis_names:
            if name in taken or sizes[name] == 1:
                continue
            blocks = self._blocks(sizes, levels)
            fits = [lv for lv, b in enumerate(blocks) if b % sizes[name] == 0]
            if anywhere or (fits and name in self.explicit):
                lv = fits[0] if fits else int(np.argmax(blocks))
                levels[lv] = (*levels[lv], name)
        return levels

    def _core_axes(self, arg_shapes: Sequence[Any]) -> set[str]:
        """The mesh axes that shard an element's own axes of a batched operand."""
        core: set[str] = set()
        for shape, axes in zip(arg_shapes, self.spec.in_axes, strict=True):
            if all(d is None for d in axes):
                continue
            for d, entry in enumerate(_spec_entries(shape)):
                if d not in axes:
                    core.update(_names(entry))
        return core

    def _sharded(
        self, arg_shapes: Sequence[Any], chosen: Sequence[Any]
    ) -> list[tuple[int, MeshAxes]]:
        """``(level, mesh axes)`` of each batch axis of the results (in the
        shardings XLA chose), then of the operands."""
        found: list[tuple[int, MeshAxes]] = []
        for k, result in enumerate(chosen):
            entries = _spec_entries(result)
            found.extend(
                (lv, _names(entries[i]))
                for i, lv in enumerate(self.spec.kept(k))
                if i < len(entries)
            )
        for shape, axes in zip(arg_shapes, self.spec.in_axes, strict=True):
            entries = _spec_entries(shape)
            found.extend(
                (lv, _names(entries[d]))
                for lv, d in enumerate(axes)
                if d is not None and d < len(entries)
            )
        return found

    def _blocks(self, sizes: dict[str, int], levels: list[MeshAxes]) -> list[int]:
        return [
            math.ceil(n / math.prod(sizes[a] for a in lv))
            for n, lv in zip(self.spec.shape, levels, strict=True)
        ]

    def _result_shardings(self, mesh: Any, levels: list[MeshAxes]) -> list[Any]:
        return [
            NamedSharding(
                mesh,
                P(
                    *(_entry(levels[lv]) for lv in self.spec.kept(k)),
                    *[None] * len(a.shape),
                ),
            )
            for k, a in enumerate(self.results)
        ]

    def infer(self, mesh: Any, arg_shapes: Sequence[Any], result_shape: Any) -> Any:
        del result_shape
        return self._result_shardings(mesh, self.levels(mesh, arg_shapes))

    def partition(
        self, mesh: Any, arg_shapes: Sequence[Any], result_shape: Any
    ) -> tuple[Any, Callable[..., Any], Any, Any]:
        chosen = result_shape if isinstance(result_shape, (list, tuple)) else None
        levels = self.levels(mesh, arg_shapes, chosen)
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        arg_shardings = []
        for ndim, axes in zip(self.ndims, self.spec.in_axes, strict=True):
            entries: list[Any] = [None] * ndim
            for level, d in enumerate(axes):
                if d is not None:
                    entries[d] = _entry(levels[level])
            arg_shardings.append(NamedSharding(mesh, P(*entries)))
        block = self._blocks(sizes, levels)
        block_avals = tuple(
            (
                tuple(block[lv] for lv in self.spec.kept(k)) + tuple(a.shape),
                np.dtype(a.dtype).str,
            )
            for k, a in enumerate(self.results)
        )
        index = self.index

        def per_device(*blocks: Any) -> list[Any]:
            # Traced on the partitioner's mesh, not on a jax.set_mesh (use_mesh)
            # context's explicit one (whose typed values XLA cannot lower here).
            with _mlir.on_mesh(mesh):
                where = jax.numpy.stack(
                    [jax.lax.axis_index(lv) if lv else 0 for lv in levels]
                ).astype(np.int32)
                outs = shard_callback_p.bind(
                    where, *blocks, index=index, result_avals=block_avals
                )
                return [self._sum(k, o, levels) for k, o in enumerate(outs)]

        return (
            mesh,
            per_device,
            self._result_shardings(mesh, levels),
            tuple(arg_shardings),
        )

    def _sum(self, k: int, out: Any, levels: list[MeshAxes]) -> Any:
        axes = tuple(a for lv in self.spec.summed(k) for a in levels[lv])
        return jax.lax.psum(out, axes) if axes else out


class _ShardHost:
    """The host side of every device's call: maps the real elements of its
    block (``where``: the block's position along each level) and pads the
    results with zeros to the block's shape (XLA drops the padding)."""

    def __init__(self, params: dict[str, Any], devices: frozenset[Any]):
        self.params, self.devices = params, devices
        self.spec: BatchSpec = params["spec"]
        self.results = [
            (tuple(a.shape), np.dtype(a.dtype)) for a in params["result_avals"]
        ]
        self.hosts: dict[tuple[int, ...], HostFn] = {}

    def host(self, shape: tuple[int, ...]) -> HostFn:
        host = self.hosts.get(shape)
        if host is None:
            spec = BatchSpec(shape, self.spec.in_axes, self.spec.out_sum)
            host = host_function(**{**self.params, "spec": spec}, devices=self.devices)
            host = self.hosts.setdefault(shape, host)
        return host

    def __call__(
        self, where: np.ndarray, *blocks: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        spec = self.spec
        block = [0] * len(spec.shape)
        for x, axes in zip(blocks, spec.in_axes, strict=True):
            for level, d in enumerate(axes):
                if d is not None:
                    block[level] = x.shape[d]
        real = tuple(
            max(0, min(b, n - int(i) * b))
            for b, n, i in zip(block, spec.shape, where, strict=True)
        )
        if real == tuple(block):
            return self.host(real)(*blocks)
        outs: Sequence[np.ndarray] = ()
        if 0 not in real:  # (a block of padding only maps nothing)
            trimmed = [
                x[tuple(_slice(axes, d, real) for d in range(x.ndim))]
                for x, axes in zip(blocks, spec.in_axes, strict=True)
            ]
            outs = self.host(real)(*trimmed)
        padded = []
        for k, (core, dtype) in enumerate(self.results):
            kept = spec.kept(k)
            full = np.zeros(tuple(block[lv] for lv in kept) + core, dtype)
            if outs:
                full[tuple(slice(0, real[lv]) for lv in kept)] = outs[k]
            padded.append(full)
        return tuple(padded)


def explicit_result_shardings(
    avals: Sequence[Any], spec: BatchSpec, results: Sequence[Any]
) -> list[Any] | None:
    """The results' shardings where a batch level of the operands is sharded
    over explicit mesh axes (sharding in types): each kept level on the mesh
    axes of the first batched operand sharded there, the element's own axes
    whole. ``None`` where no level is (the results' default type)."""
    plan = _Plan(spec, avals, results)
    mesh = next((a.sharding.mesh for a in avals if any(_spec_entries(a))), None)
    free = set() if mesh is None else _explicit_axes(mesh)
    levels: list[MeshAxes] = [()] * len(spec.shape)
    for lv, names in plan._sharded(avals, ()):
        if names and not levels[lv] and set(names) <= free:
            levels[lv] = names
            free -= set(names)
    return plan._result_shardings(mesh, levels) if any(levels) else None


def _explicit_axes(mesh: Any) -> set[str]:
    types = getattr(mesh, "axis_types", None) or ()
    explicit = jax.sharding.AxisType.Explicit
    return {n for n, t in zip(mesh.axis_names, types, strict=False) if t == explicit}


def _slice(axes: Sequence[int | None], d: int, real: tuple[int, ...]) -> slice:
    """The real elements along axis ``d`` of an operand with batch ``axes``."""
    level = list(axes).index(d) if d in axes else None
    return slice(None) if level is None else slice(0, real[level])


def _spec_entries(shape: Any) -> tuple[Any, ...]:
    """The partition spec entries of a value's (or a sharding's) sharding."""
    sharding = getattr(shape, "sharding", shape)
    return tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()


def _names(entry: Any) -> MeshAxes:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: MeshAxes) -> Any:
    """A partition spec's entry for ``axes``: ``None``, one name, or a tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


#: One device's host call inside the partition function: its operands are the
#: block's position along each level and its blocks of the operands.
shard_callback_p = Primitive("threadmap_shard_callback")
shard_callback_p.multiple_results = True


def _shard_callback_abstract_eval(*avals: Any, index: int, result_avals: Any) -> Any:
    del avals, index
    return [
        _avals.shaped_array(tuple(s), np.dtype(d), frozenset()) for s, d in result_avals
    ]


shard_callback_p.def_abstract_eval(_shard_callback_abstract_eval)
_mlir.register_lowering(shard_callback_p, _mlir.shard_callback_lowering)
