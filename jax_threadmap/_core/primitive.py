"""``threadmap_p``: the primitive and its rules, each registered beside it.

One equation per call site, however many ``vmap`` levels wrap it: the batching
rule rebinds ``threadmap_p`` with the batch spec grown by one level and never
moves or tiles an operand. The lowering (:mod:`.lowering`, registered here)
emits one host callback; the eager impl calls the same host function
(:func:`.lowering.host_function`) directly. The derivative rules are in
:mod:`.autodiff`, registered here too.

Params of every equation:

- ``kernel``: a :mod:`.params` value, what runs per element (hashable);
- ``result_avals``: one element's result leaves;
- ``spec``: the :class:`~.._host.batch_spec.BatchSpec`;
- ``executor`` and ``progress``: as passed to ``threadmap``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._executors.runners import Executor
from .._host.batch_spec import BatchSpec
from .._jax import avals as _avals
from .._jax import mlir as _mlir
from .._jax import rule_tables as _tables
from . import autodiff as _autodiff
from . import directions as _directions
from . import lowering as _lowering
from .params import AnyParam, InOrder

threadmap_p = _tables.Primitive("threadmap")
threadmap_p.multiple_results = True


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
    shardings = _lowering.explicit_result_shardings(avals, spec, result_avals)
    if shardings is not None:
        return [
            _avals.ShapedArray(shape, a.dtype, sharding=sharding)
            for shape, a, sharding in zip(shapes, result_avals, shardings, strict=True)
        ]
    return [
        _avals.shaped_array(shape, a.dtype, varying)
        for shape, a in zip(shapes, result_avals, strict=True)
    ]


threadmap_p.def_abstract_eval(_threadmap_abstract_eval)


def _threadmap_impl(*args: Any, **params: Any) -> list[jax.Array]:
    if params["spec"].shape and any(map(_on_several_devices, args)):
        # Sharded operands: one host call per device on its own block, as
        # under jit (docs/sharding.md).
        return list(jax.jit(functools.partial(threadmap_p.bind, **params))(*args))
    # Eager: the host function runs here, on NumPy copies of the operands, so a
    # failing kernel raises its own error (type, batch index, cause).
    outs = _lowering.host_function(**params)(*map(_host_operand, args))
    device = _committed_device(args)
    return [jax.device_put(o, device) for o in outs]


threadmap_p.def_impl(_threadmap_impl)


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


_tables.register_batching(threadmap_p, _threadmap_batching_rule)
# Rules kept in their own rooms, each given the bind it rebinds.
_tables.primitive_jvps[threadmap_p] = functools.partial(
    _autodiff.jvp_rule, threadmap_p.bind
)
_tables.primitive_transposes[threadmap_p] = functools.partial(
    _autodiff.transpose_rule, threadmap_p.bind
)
_mlir.register_lowering(
    threadmap_p,
    functools.partial(_lowering.threadmap_lowering, threadmap_p.bind),
    cacheable=False,
    devices_during_lowering=True,
)
