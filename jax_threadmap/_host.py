"""The flat map on the host: views in, kernel per element, results written in place.

The host callback receives the operands as NumPy arrays in the layout of the
jaxpr: batched operands carry their batch axes wherever vmap left them, and
unbatched operands carry none. For each operand we build one strided view of shape
``batch_shape + core_shape`` (zero strides for the levels it is not mapped at), so
nothing is moved, copied or tiled. Outputs are allocated once with the full batch
shape and every element is written in place.

Adjacent batch levels whose strides line up in every view are merged, so the usual
case (all operands batched the same way, or unbatched) is indexed with a single
integer per element.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _executor
from ._batch_spec import BatchSpec
from ._errors import ExecutorError, KernelError

_LEAF_TYPES = (np.ndarray, np.generic, float, int, bool, complex)


def operand_view(x: np.ndarray, axes: Sequence[int | None], batch_shape) -> np.ndarray:
    """A read-only view of ``x`` with shape ``batch_shape + core_shape``."""
    x = np.asarray(x)
    present = [a for a in axes if a is not None]
    core_axes = [d for d in range(x.ndim) if d not in set(present)]
    strides = tuple(0 if a is None else x.strides[a] for a in axes) + tuple(
        x.strides[d] for d in core_axes
    )
    shape = tuple(batch_shape) + tuple(x.shape[d] for d in core_axes)
    return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=False)


def _merge_batch_dims(shape: tuple[int, ...], views: Sequence[np.ndarray]):
    """Merges adjacent batch dims that every view can index as one.

    Returns the merged shape and, for each view, a view with that batch shape.
    """
    nb = len(shape)
    if nb <= 1:
        return shape, list(views)
    groups: list[list[int]] = [[0]]
    for d in range(1, nb):
        prev = groups[-1][-1]
        if all(v.strides[prev] == v.strides[d] * shape[d] for v in views):
            groups[-1].append(d)
        else:
            groups.append([d])
    new_shape = tuple(int(np.prod([shape[d] for d in g])) for g in groups)
    merged = []
    for v in views:
        strides = tuple(v.strides[g[-1]] for g in groups) + v.strides[nb:]
        merged.append(
            np.lib.stride_tricks.as_strided(
                v, new_shape + v.shape[nb:], strides, writeable=v.flags.writeable
            )
        )
    return new_shape, merged


class FlatMap:
    """Everything one host call needs to run a kernel over a flat batch index.

    Args:
        fn: The user's kernel.
        name: The kernel's name, for messages.
        in_tree: Treedef of ``(args, kwargs)``.
        out_tree: Treedef of the kernel's result.
        out_core: ``(shape, dtype)`` of each output leaf for one element.
        spec: The batch spec.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        in_tree,
        out_tree,
        out_core: Sequence[tuple[tuple[int, ...], np.dtype]],
        spec: BatchSpec,
    ):
        self.fn = fn
        self.name = name
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.out_core = [(tuple(s), np.dtype(d)) for s, d in out_core]
        self.spec = spec
        # Fast call path when every positional and keyword argument is one leaf.
        args, kwargs = jax.tree_util.tree_unflatten(
            in_tree, list(range(in_tree.num_leaves))
        )
        flat_args = all(isinstance(a, int) for a in args)
        flat_kwargs = all(isinstance(v, int) for v in kwargs.values())
        self.num_args = len(args) if flat_args and flat_kwargs else None
        self.kw_names = tuple(kwargs) if self.num_args is not None else ()
        self.single_leaf = out_tree.num_leaves == 1 and out_tree.num_nodes == 1

    # -- running -----------------------------------------------------------------

    def __call__(
        self, operands: Sequence[np.ndarray], executor: Any
    ) -> tuple[np.ndarray, ...]:
        spec = self.spec
        batch_shape = spec.shape
        in_views = [
            operand_view(x, axes, batch_shape)
            for x, axes in zip(operands, spec.in_axes, strict=True)
        ]
        outs = [np.empty(batch_shape + s, d) for s, d in self.out_core]
        n = spec.size
        if n == 0:
            return tuple(outs)
        shape, views = _merge_batch_dims(batch_shape, in_views + outs)
        in_v, out_v = views[: len(in_views)], views[len(in_views) :]
        if len(shape) <= 1:
            chunk = self._chunk_fn_1d(in_v, out_v, len(shape) == 0)
        else:
            chunk = self._chunk_fn_nd(in_v, out_v, shape)
        if len(shape) == 0:
            job = _executor.Job(1, chunk)
            job.run_chunk(0, 1)  # one element: no pool round trip
        else:
            job = _executor.Job(n, chunk)
            if executor is None or isinstance(executor, int):
                _executor.get_pool(executor).run(job)
            elif isinstance(executor, concurrent.futures.Executor):
                _executor.run_on_executor(executor, job)
            else:  # validated in the API; guard against direct binds
                raise TypeError(f"Unsupported executor {executor!r}.")
        if job.error is not None:
            raise self._wrap_pool_error(job.error)
        return tuple(outs)

    def _wrap_pool_error(self, e: BaseException) -> BaseException:
        if isinstance(e, (KernelError, KeyboardInterrupt, SystemExit)):
            return e
        if isinstance(e, concurrent.futures.BrokenExecutor):
            err = ExecutorError(
                f"The executor running threadmap kernel {self.name!r} broke while the "
                f"map ran ({type(e).__name__}: {e}); a worker probably died. "
                "The map was abandoned; the next call needs a working executor."
            )
        else:
            err = ExecutorError(
                f"threadmap kernel {self.name!r}: the executor failed with "
                f"{type(e).__name__}: {e}"
            )
        err.__cause__ = e
        return err

    def _call(self, leaves: list[Any]) -> Any:
        if self.num_args is not None:
            if self.kw_names:
                kw = dict(zip(self.kw_names, leaves[self.num_args :], strict=True))
                return self.fn(*leaves[: self.num_args], **kw)
            return self.fn(*leaves)
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, leaves)
        return self.fn(*args, **kwargs)

    def _result_leaves(self, result: Any, flat: int | None) -> list[Any]:
        if self.single_leaf and isinstance(result, _LEAF_TYPES):
            return [result]
        leaves, tree = jax.tree_util.tree_flatten(result)
        if tree != self.out_tree:
            raise self._error(
                flat,
                f"returned a value of structure {tree}, but result_shape_dtypes has "
                f"structure {self.out_tree}. Return a pytree with the same structure "
                "as result_shape_dtypes.",
            )
        return leaves

    def _store(self, out: np.ndarray, ii, value: Any, k: int, flat) -> None:
        shape, dtype = self.out_core[k]
        if type(value) is not np.ndarray:
            try:
                value = np.asarray(value)
            except Exception as e:
                raise self._error(
                    flat,
                    f"returned a value of type {type(value).__name__} for output "
                    f"{k}, which is not convertible to an array of shape {shape} "
                    f"and dtype {dtype}.",
                ) from e
        if value.shape != shape:
            raise self._error(
                flat,
                f"returned shape {value.shape} for output {k}, expected {shape} "
                f"(dtype {dtype}). Return one element's result, without batch axes.",
            )
        if value.dtype != dtype and not np.can_cast(value.dtype, dtype, "same_kind"):
            raise self._error(
                flat,
                f"returned dtype {value.dtype} for output {k}, expected {dtype} "
                f"(shape {shape}); {value.dtype} does not convert to {dtype} without "
                "changing kind. Cast the result, or declare the dtype you return.",
            )
        out[ii] = value

    def _error(self, flat: int | None, what: str) -> KernelError:
        index = None
        where = ""
        if flat is not None and self.spec.shape:
            index = tuple(int(i) for i in np.unravel_index(flat, self.spec.shape))
            where = f" at batch index {index} (batch shape {self.spec.shape})"
        return KernelError(
            f"threadmap kernel {self.name!r}{where} {what}",
            index=index,
            kernel_name=self.name,
        )

    def _raise_from_kernel(self, e: Exception, flat: int | None):
        msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise self._error(flat, f"raised {msg}") from e

    def _element(self, in_v, out_v, ii, flat) -> None:
        """Runs one element; ``ii`` indexes the (merged) views."""
        try:
            result = self._call([v[ii] for v in in_v])
        except Exception as e:
            self._raise_from_kernel(e, flat)
        if self.single_leaf and isinstance(result, _LEAF_TYPES):
            self._store(out_v[0], ii, result, 0, flat)
        else:
            for k, val in enumerate(self._result_leaves(result, flat)):
                self._store(out_v[k], ii, val, k, flat)

    def _chunk_fn_1d(self, in_v, out_v, scalar: bool):
        element = self._element

        def chunk(start: int, stop: int, job) -> None:
            if scalar:
                element(in_v, out_v, (), None)
                return
            for i in range(start, stop):
                if job.failed:
                    return
                element(in_v, out_v, (i, Ellipsis), i)

        return chunk

    def _chunk_fn_nd(self, in_v, out_v, shape):
        element = self._element

        def chunk(start: int, stop: int, job) -> None:
            cols = [c.tolist() for c in np.unravel_index(np.arange(start, stop), shape)]
            for i, ii in zip(range(start, stop), zip(*cols, strict=True), strict=True):
                if job.failed:
                    return
                element(in_v, out_v, (*ii, Ellipsis), i)

        return chunk
