"""``threadmap_p``: the primitive and its rules.

One equation per call site, however many ``vmap`` levels wrap it: the batching
rule rebinds ``threadmap_p`` with the batch spec grown by one level and never
moves or tiles an operand. The lowering emits one host callback, which runs the
flat map of :mod:`jax_threadmap._host` on the executor named in the params. The
eager impl compiles the primitive alone, so both paths run the same code. The
derivative rules live in :mod:`jax_threadmap._autodiff`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

from . import _compat
from ._batch_spec import BatchSpec
from ._errors import ExecutorError, KernelError
from ._executor import run_map, workers_of
from ._host import ElementLoop, FlatMap

threadmap_p = _compat.Primitive("threadmap")
threadmap_p.multiple_results = True


@dataclasses.dataclass(frozen=True, eq=False)
class Kernel:
    """A user kernel as a primitive param: equal and hashed by the function itself.

    Two ``threadmap`` calls with the same function give equal params, so a jitted
    function is not recompiled and eager calls hit the compilation cache.
    """

    fn: Callable[..., Any]
    name: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Kernel) and other.fn is self.fn

    def __hash__(self) -> int:
        return hash(id(self.fn))

    def __repr__(self) -> str:
        return self.name


def kernel_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None and isinstance(fn, functools.partial):
        return f"partial({kernel_name(fn.func)})"
    return name or type(fn).__name__


def _threadmap_abstract_eval(
    *avals, kernel, result_avals, in_tree, out_tree, spec, executor, progress
):
    del kernel, in_tree, out_tree, executor, progress
    if len(avals) != len(spec.in_axes):
        raise ValueError(
            f"threadmap_p got {len(avals)} operands but its batch spec describes "
            f"{len(spec.in_axes)}."
        )
    # Inside shard_map, results vary over every mesh axis an operand varies over.
    varying = frozenset().union(*map(_compat.varying_axes, avals))
    return [
        _compat.shaped_array(spec.out_batch_shape(k) + tuple(a.shape), a.dtype, varying)
        for k, a in enumerate(result_avals)
    ]


_last_error = threading.local()


def _threadmap_impl(*args, **params):
    # On CPU the host callback runs on this thread; when it fails we re-raise its
    # own exception (type, batch index, cause) instead of XLA's string copy of it.
    _last_error.value = None
    try:
        return _compat.apply_primitive(threadmap_p, *args, **params)
    except _compat.JaxRuntimeError:
        err, _last_error.value = _last_error.value, None
        if err is not None:
            raise err from err.__cause__
        raise


def _threadmap_batching_rule(args, dims, *, spec: BatchSpec, **params):
    size = None
    norm_dims = []
    for x, d in zip(args, dims, strict=True):
        if d is None:
            norm_dims.append(None)
            continue
        d = d % x.ndim
        norm_dims.append(d)
        size = x.shape[d]
    assert size is not None  # the rule only runs with at least one batched operand
    outs = threadmap_p.bind(*args, spec=spec.grow(size, norm_dims), **params)
    return outs, [0] * len(outs)


def _threadmap_lowering(
    ctx, *args, kernel, result_avals, in_tree, out_tree, spec, executor, progress
):
    loop = ElementLoop(
        kernel.fn,
        kernel.name,
        in_tree,
        out_tree,
        [(a.shape, a.dtype) for a in result_avals],
        spec.shape,
        accumulate=[k for k in range(len(result_avals)) if spec.summed(k)],
    )
    flat_map = FlatMap(loop, spec)

    def callback(*operands):
        try:
            prepared = flat_map.prepare(operands, workers_of(executor))
            job = run_map(executor, prepared, name=kernel.name, progress=progress)
            if job.error is not None:
                raise _host_error(job.error, kernel.name)
            return prepared.finish()
        except BaseException as e:
            _last_error.value = e
            raise

    sharding = _compat.callback_op_sharding(
        ctx.module_context.axis_context, None, ctx.avals_out
    )
    results, _, _ = _compat.emit_python_callback(
        ctx,
        callback,
        None,
        list(args),
        ctx.avals_in,
        ctx.avals_out,
        has_side_effect=False,
        returns_token=False,
        sharding=sharding,
    )
    return results


def _host_error(e: BaseException, name: str) -> BaseException:
    """The error a failed map raises: kernel errors as they are, the rest wrapped."""
    if isinstance(e, (KernelError, ExecutorError, KeyboardInterrupt, SystemExit)):
        return e
    if isinstance(e, concurrent.futures.BrokenExecutor):
        err = ExecutorError(
            f"The executor running threadmap kernel {name!r} broke while the map ran "
            f"({type(e).__name__}: {e}); a worker probably died. The map was "
            "abandoned; pass a working executor to the next call."
        )
    else:
        err = ExecutorError(
            f"threadmap kernel {name!r}: the executor failed with "
            f"{type(e).__name__}: {e}"
        )
    err.__cause__ = e
    return err


threadmap_p.def_impl(_threadmap_impl)
threadmap_p.def_abstract_eval(_threadmap_abstract_eval)
_compat.register_batching_rule(threadmap_p, _threadmap_batching_rule)
_compat.register_lowering(threadmap_p, _threadmap_lowering, cacheable=False)
_compat.require_devices_during_lowering(threadmap_p)
