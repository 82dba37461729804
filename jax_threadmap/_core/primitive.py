"""``threadmap_p``: the primitive and its rule table.

One equation per call site, however many ``vmap`` levels wrap it: the batching
rule rebinds ``threadmap_p`` with the batch spec grown by one level and never
moves or tiles an operand. The lowering emits one host callback; the eager impl
calls the same host function directly. Both run the flat map of
:mod:`.._host.maps` on the executor named in the params
(:func:`.._executors.runners.run_map`), or, for an ``async def`` kernel, as
coroutines on the event loop (:func:`.._coroutines.async_kernels.run_async_map`).
The derivative rules are in :mod:`.autodiff`; all six registrations are at the
bottom of this file.

Params of every equation:

- ``kernel``: a :mod:`.params` value, what runs per element (hashable);
- ``result_avals``: one element's result leaves;
- ``spec``: the :class:`~.._host.batch_spec.BatchSpec`;
- ``executor`` and ``progress``: as passed to ``threadmap``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._coroutines.async_kernels import run_async_map
from .._executors.runners import Executor, run_map
from .._executors.scheduling import Measure
from .._host.batch_spec import BatchSpec
from .._host.kernel_scope import kernel_scope
from .._host.maps import ElementCaller, HostMap
from .._host.vectorized import ChunkCaller
from .._jax import avals as _avals
from .._jax import primitive_rules as _rules
from .._support.environment import env_num_threads
from . import auto_shard as _auto_shard
from . import autodiff as _autodiff
from . import directions as _directions
from .params import AnyParam, InOrder, kernel_ids

threadmap_p = _rules.Primitive("threadmap")
threadmap_p.multiple_results = True


def host_function(
    *,
    kernel: AnyParam,
    result_avals: tuple[Any, ...],
    spec: BatchSpec,
    executor: Executor | InOrder,
    progress: bool | None,
    devices: frozenset[Any] = frozenset(),
) -> Callable[..., tuple[np.ndarray, ...]]:
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


def _threadmap_abstract_eval(
    *avals: Any,
    kernel: AnyParam,
    result_avals: tuple[Any, ...],
    spec: BatchSpec,
    executor: Executor | InOrder,
    progress: bool | None,
) -> list[Any]:
    del kernel, executor, progress
    if len(avals) != len(spec.in_axes):
        raise ValueError(
            f"threadmap_p got {len(avals)} operands but its batch spec describes "
            f"{len(spec.in_axes)}."
        )
    # Inside shard_map, results vary over every mesh axis an operand varies over.
    varying = frozenset().union(*map(_avals.varying_axes, avals))
    shapes = [
        spec.out_batch_shape(k) + tuple(a.shape) for k, a in enumerate(result_avals)
    ]
    # On explicit mesh axes, results keep the operands' batch sharding.
    shardings = _auto_shard.explicit_result_shardings(avals, spec, result_avals)
    if shardings is not None:
        return [
            _avals.ShapedArray(shape, a.dtype, sharding=sharding)
            for shape, a, sharding in zip(shapes, result_avals, shardings, strict=True)
        ]
    return [
        _avals.shaped_array(shape, a.dtype, varying)
        for shape, a in zip(shapes, result_avals, strict=True)
    ]


def _threadmap_impl(*args: Any, **params: Any) -> list[jax.Array]:
    if params["spec"].shape and any(map(_on_several_devices, args)):
        # Sharded operands: one host call per device on its own block, as
        # under jit (docs/sharding.md).
        return list(jax.jit(functools.partial(threadmap_p.bind, **params))(*args))
    # Eager: the host function runs here, on NumPy copies of the operands, so a
    # failing kernel raises its own error (type, batch index, cause).
    outs = host_function(**params)(*map(_host_operand, args))
    device = _committed_device(args)
    return [jax.device_put(o, device) for o in outs]


def _on_several_devices(a: Any) -> bool:
    # An uncommitted AsyncArray (a jax.Array) has no sharding yet: one device.
    sharding = getattr(a, "sharding", None) if isinstance(a, jax.Array) else None
    return sharding is not None and len(sharding.device_set) > 1


def _host_operand(a: Any) -> np.ndarray:
    """An eager operand as the kernel sees it under ``jit``: in JAX's canonical
    dtype (with x64 off, a Python float is float32 and a Python int int32)."""
    x = np.asarray(a)
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    return x if dtype == x.dtype else x.astype(dtype)


def _committed_device(args: Sequence[Any]) -> Any:
    """Where the results go: the committed operands' device, replicated over
    their mesh when they span several, else the default device (uncommitted)."""
    for a in args:
        if isinstance(a, jax.Array) and a.committed:
            sharding = a.sharding
            if len(sharding.device_set) == 1:
                return next(iter(sharding.device_set))
            if isinstance(sharding, jax.sharding.NamedSharding):
                return jax.sharding.NamedSharding(
                    sharding.mesh, jax.sharding.PartitionSpec()
                )
            return min(sharding.device_set, key=lambda d: int(d.id))  # type: ignore[attr-defined]
    return None


def _threadmap_batching_rule(
    args: Sequence[Any], dims: Sequence[int | None], *, spec: BatchSpec, **params: Any
) -> tuple[Sequence[Any], list[int]]:
    size = None
    norm_dims: list[int | None] = []
    for x, d in zip(args, dims, strict=True):
        if d is None:
            norm_dims.append(None)
            continue
        d = d % x.ndim
        norm_dims.append(d)
        size = x.shape[d]
    assert size is not None  # the rule only runs with at least one batched operand
    folded = _directions.fold(
        threadmap_p.bind, args, norm_dims, size, spec=spec, **params
    )
    if folded is not None:  # tangent directions, for a jvp that takes them
        return folded
    outs = threadmap_p.bind(*args, spec=spec.grow(size, norm_dims), **params)
    return outs, [0] * len(outs)


#: Per module being lowered, by (block, kernels, params): the operands and
#: results of its equations.
_LOWERED: weakref.WeakKeyDictionary[Any, dict[Any, list[tuple[Any, Any]]]] = (
    weakref.WeakKeyDictionary()
)
_LOWERED_LOCK = threading.Lock()


def _threadmap_lowering(ctx: Any, *args: Any, **params: Any) -> Sequence[Any]:
    # An equation equal to one lowered before it in the same block (the same
    # kernels, by identity, and params, on operands computed alike: jax.jacfwd's
    # fwd and jax.grad's, each on its own m built from p) reuses its results:
    # it is pure, as pure_callback is, and XLA never merges two host callbacks.
    place = _rules.lowering_place(ctx)
    if place is None:
        return _lower(ctx, *args, **params)
    module, block = place
    key = (block, kernel_ids(params["kernel"]), tuple(sorted(params.items())))
    try:
        hash(key)  # (never the module)
    except TypeError:  # a param that does not hash: lowered on its own
        return _lower(ctx, *args, **params)
    with _LOWERED_LOCK:  # (one module is lowered by one thread)
        earlier = _LOWERED.setdefault(module, {}).setdefault(key, [])
    for operands, results in earlier:
        if all(map(_rules.computed_alike, operands, args)):
            return list(results)
    results = _lower(ctx, *args, **params)
    earlier.append((args, results))
    return list(results)


def _lower(ctx: Any, *args: Any, **params: Any) -> Sequence[Any]:
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
        return _rules.lower_zeros(ctx, args, avals_out)
    data_in = [k for k, a in enumerate(avals_in) if _holds_data(a)]
    devices = _rules.lowering_devices(ctx)
    per_shard = _lower_per_shard(ctx, args, params, devices, data_in, data_out)
    if per_shard is not None:
        return per_shard
    host = host_function(**params, devices=devices)
    host = _without_empty(host, avals_in, data_in, data_out, len(avals_out))
    callback_out = [avals_out[k] for k in data_out]
    sharding = _rules.callback_op_sharding(
        ctx.module_context.axis_context, None, callback_out
    )
    # The callback's own context: emit_python_callback types the custom call
    # from the context's avals.
    callback_ctx = dataclasses.replace(
        ctx, avals_in=[avals_in[k] for k in data_in], avals_out=callback_out
    )
    results, _, _ = _rules.emit_python_callback(
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
    zeros, filled = iter(_rules.lower_zeros(ctx, args, empty)), iter(results)
    return [
        next(filled) if k in data_out else next(zeros) for k in range(len(avals_out))
    ]


def _lower_per_shard(
    ctx: Any,
    args: Sequence[Any],
    params: dict[str, Any],
    devices: frozenset[Any],
    data_in: list[int],
    data_out: list[int],
) -> Sequence[Any] | None:
    """Under jit on several devices: one host call per device, each on its own
    block (docs/sharding.md); ``None`` elsewhere, and where an operand or a
    result holds no data."""
    if len(data_in) < len(ctx.avals_in) or len(data_out) < len(ctx.avals_out):
        return None

    def make_host(spec: BatchSpec) -> Callable[..., tuple[np.ndarray, ...]]:
        return host_function(**{**params, "spec": spec}, devices=devices)

    return _auto_shard.lower(ctx, args, params, threadmap_p.bind, make_host)


def _holds_data(aval: Any) -> bool:
    return math.prod(aval.shape) > 0  # (aval.size is missing on some avals)


def _without_empty(
    host: Callable[..., tuple[np.ndarray, ...]],
    avals_in: Sequence[Any],
    data_in: list[int],
    data_out: list[int],
    n_out: int,
) -> Callable[..., tuple[np.ndarray, ...]]:
    """``host`` for a callback that passes only the operands ``data_in`` and
    returns only the results ``data_out`` (of ``n_out``): the others hold no
    data. ``host`` itself when nothing is left out."""
    if len(data_in) == len(avals_in) and len(data_out) == n_out:
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


threadmap_p.def_impl(_threadmap_impl)
threadmap_p.def_abstract_eval(_threadmap_abstract_eval)
_rules.register_rules(
    threadmap_p,
    _threadmap_lowering,
    _threadmap_batching_rule,
    functools.partial(_autodiff.jvp_rule, threadmap_p.bind),
    functools.partial(_autodiff.transpose_rule, threadmap_p.bind),
    cacheable=False,
    devices_during_lowering=True,
)
