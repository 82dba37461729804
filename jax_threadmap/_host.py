"""The flat map on the host: views in, kernel per element, results written in place.

The host callback receives the operands as NumPy arrays in the layout of the
jaxpr: batched operands carry their batch axes wherever vmap left them, and
unbatched operands carry none. For each operand we build one strided view of shape
``batch_shape + core_shape`` (zero strides for the levels it is not mapped at), so
nothing is moved, copied or tiled. Outputs are allocated once with the full batch
shape and every element is written in place.

Adjacent batch levels whose strides line up in every view are merged, so the usual
case (all operands batched the same way, or unbatched) is indexed with a single
integer per element, and the element loop is specialised for the common kernel
signatures so that its cost per element stays close to a bare Python loop.

For executors that pickle work (process pools, Dask), :meth:`FlatMap.remote_task`
packs one chunk's slices of the operands into a :class:`RemoteChunk`, which runs
the same element loop in the worker and sends the chunk's outputs back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._batch_spec import BatchSpec
from ._errors import KernelError

_LEAF_TYPES = (np.ndarray, np.generic, float, int, bool, complex)


def operand_view(x: np.ndarray, axes: Sequence[int | None], batch_shape) -> np.ndarray:
    """A read-only view of ``x`` with shape ``batch_shape + core_shape``."""
    x = np.asarray(x)
    present = {a for a in axes if a is not None}
    core_axes = [d for d in range(x.ndim) if d not in present]
    strides = tuple(0 if a is None else x.strides[a] for a in axes) + tuple(
        x.strides[d] for d in core_axes
    )
    shape = tuple(batch_shape) + tuple(x.shape[d] for d in core_axes)
    return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=False)


def merge_batch_dims(shape: tuple[int, ...], views: Sequence[np.ndarray]):
    """Merges adjacent batch dims that every view can index as one.

    Merging keeps the C-order flat index, so flat index ``i`` of the merged shape
    is flat index ``i`` of ``shape``. Returns the merged shape and the views.
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


class ElementLoop:
    """Calls a kernel per element and checks and stores its results.

    Picklable (it holds the kernel, its tree structures and output declarations
    only), so that process and Dask workers run the very same loop.

    Args:
        fn: The user's kernel.
        name: The kernel's name, for messages.
        in_tree: Treedef of ``(args, kwargs)``.
        out_tree: Treedef of the kernel's result.
        out_core: ``(shape, dtype)`` of each output leaf for one element.
        batch_shape: The (unmerged) batch shape, for batch indices in messages.
    """

    def __init__(
        self, fn, name, in_tree, out_tree, out_core, batch_shape, accumulate=()
    ):
        self.fn = fn
        # Outputs whose elements are added into their view rather than written.
        self.accumulate = frozenset(accumulate)
        self.name = name
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.out_core = [(tuple(s), np.dtype(d)) for s, d in out_core]
        self.batch_shape = tuple(batch_shape)
        args, kwargs = jax.tree_util.tree_unflatten(
            in_tree, list(range(in_tree.num_leaves))
        )
        flat = all(isinstance(a, int) for a in args) and all(
            isinstance(v, int) for v in kwargs.values()
        )
        # When every argument is one leaf the kernel is called without unflattening.
        self.num_args = len(args) if flat else None
        self.kw_names = tuple(kwargs) if flat else ()
        self.single_leaf = out_tree.num_leaves == 1 and out_tree.num_nodes == 1

    # -- messages ----------------------------------------------------------------

    def error(self, flat: int | None, what: str) -> KernelError:
        index = None
        where = ""
        if flat is not None and self.batch_shape:
            index = tuple(int(i) for i in np.unravel_index(flat, self.batch_shape))
            where = f" at batch index {index} (batch shape {self.batch_shape})"
        return KernelError(
            f"threadmap kernel {self.name!r}{where} {what}",
            index=index,
            kernel_name=self.name,
        )

    def kernel_raised(self, e: Exception, flat: int | None):
        """Raises the error for a kernel that raised ``e``, chained to ``e``."""
        if isinstance(e, KernelError) and e.kernel_name == self.name and e.index:
            raise e  # already has its index (e.g. from a remote chunk)
        msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise self.error(flat, f"raised {msg}") from e

    # -- one element, general path -------------------------------------------------

    def call(self, leaves: list[Any]) -> Any:
        if self.num_args is not None:
            if self.kw_names:
                kw = dict(zip(self.kw_names, leaves[self.num_args :], strict=True))
                return self.fn(*leaves[: self.num_args], **kw)
            return self.fn(*leaves)
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, leaves)
        return self.fn(*args, **kwargs)

    def result_leaves(self, result: Any, flat: int | None) -> list[Any]:
        if self.single_leaf and isinstance(result, _LEAF_TYPES):
            return [result]
        leaves, tree = jax.tree_util.tree_flatten(result)
        if tree != self.out_tree:
            raise self.error(
                flat,
                f"returned a value of structure {tree}, but result_shape_dtypes has "
                f"structure {self.out_tree}. Return a pytree with the same structure "
                "as result_shape_dtypes.",
            )
        return leaves

    def store(self, out: np.ndarray, i, value: Any, k: int, flat) -> None:
        """Checks one output leaf of one element and writes it at ``out[i]``."""
        shape, dtype = self.out_core[k]
        if type(value) is not np.ndarray:
            try:
                value = np.asarray(value)
            except Exception as e:
                raise self.error(
                    flat,
                    f"returned a value of type {type(value).__name__} for output "
                    f"{k}, which is not convertible to an array of shape {shape} "
                    f"and dtype {dtype}.",
                ) from e
        if value.shape != shape:
            raise self.error(
                flat,
                f"returned shape {value.shape} for output {k}, expected {shape} "
                f"(dtype {dtype}). Return one element's result, without batch axes.",
            )
        if value.dtype != dtype and not np.can_cast(value.dtype, dtype, "same_kind"):
            raise self.error(
                flat,
                f"returned dtype {value.dtype} for output {k}, expected {dtype} "
                f"(shape {shape}); {value.dtype} does not convert to {dtype} without "
                "changing kind. Cast the result, or declare the dtype you return.",
            )
        if k in self.accumulate:
            out[i] += value
        else:
            out[i] = value

    def element(self, in_v, out_v, ii, flat) -> None:
        """Runs one element; ``ii`` indexes the views."""
        try:
            result = self.call([v[ii] for v in in_v])
        except Exception as e:
            self.kernel_raised(e, flat)
        if self.single_leaf and isinstance(result, _LEAF_TYPES):
            self.store(out_v[0], ii, result, 0, flat)
        else:
            for k, val in enumerate(self.result_leaves(result, flat)):
                self.store(out_v[k], ii, val, k, flat)

    # -- loops ---------------------------------------------------------------------

    def loop_1d(self, in_v, out_v, flat_of=None) -> Callable[[int, int, Any], None]:
        """A chunk function over views with one (merged) batch dim.

        ``flat_of[j]`` maps local index ``j`` to the flat batch index (for
        messages), when the views hold a gathered subset of the batch.
        """
        fast = self._fast_loop_1d(in_v, out_v, flat_of)
        if fast is not None:
            return fast
        element = self.element

        def chunk(start: int, stop: int, job) -> None:
            for i in range(start, stop):
                if job.failed:
                    return
                element(in_v, out_v, (i, Ellipsis), _flat(flat_of, i))

        return chunk

    def _fast_loop_1d(self, in_v, out_v, flat_of):
        # One output leaf, positional leaves only, one or two operands: the
        # shapes of nearly every kernel. Each element costs the kernel call, one
        # index per operand, a type check and the write.
        if not (self.single_leaf and self.num_args is not None and not self.kw_names):
            return None
        if self.accumulate:
            return None
        if len(in_v) not in (1, 2):
            return None
        fn, out = self.fn, out_v[0]
        shape, dtype = self.out_core[0]
        # A result of exactly this type needs no conversion or check.
        exact = dtype.type if shape == () else None
        ndarray = np.ndarray
        slow_store, kernel_raised = self.store, self.kernel_raised
        result_leaves = self.result_leaves

        def check_store(r, i):
            if type(r) is ndarray and r.dtype is dtype and r.shape == shape:
                out[i] = r
            else:
                flat = _flat(flat_of, i)
                (value,) = result_leaves(r, flat)  # checks containers' structure
                slow_store(out, i, value, 0, flat)

        # `[i, ...]` gives a 0-d array (not a NumPy scalar) for 0-d operands, and
        # the same view as `[i]` otherwise. One and two operands get their own
        # loop: unpacking a list per element would cost as much as the rest.
        if len(in_v) == 1:
            (a,) = in_v

            def chunk(start, stop, job):
                for i in range(start, stop):
                    if job.failed:
                        return
                    try:
                        r = fn(a[i, ...])
                    except Exception as e:
                        kernel_raised(e, _flat(flat_of, i))
                    if type(r) is exact:
                        out[i] = r
                    else:
                        check_store(r, i)

            return chunk

        a, b = in_v

        def chunk(start, stop, job):
            for i in range(start, stop):
                if job.failed:
                    return
                ii = (i, Ellipsis)
                try:
                    r = fn(a[ii], b[ii])
                except Exception as e:
                    kernel_raised(e, _flat(flat_of, i))
                if type(r) is exact:
                    out[i] = r
                else:
                    check_store(r, i)

        return chunk

    def loop_nd(self, in_v, out_v, shape) -> Callable[[int, int, Any], None]:
        """A chunk function over views whose batch dims could not be merged.

        Runs the (fast) 1-D loop along the last batch dim, one row at a time, when
        rows are long enough to pay for setting up the row; else indexes each
        element with a tuple.
        """
        if shape[-1] >= 16:
            return self._loop_rows(in_v, out_v, shape)
        element = self.element

        def chunk(start: int, stop: int, job) -> None:
            cols = [c.tolist() for c in np.unravel_index(np.arange(start, stop), shape)]
            for i, ii in zip(range(start, stop), zip(*cols, strict=True), strict=True):
                if job.failed:
                    return
                element(in_v, out_v, (*ii, Ellipsis), i)

        return chunk

    def _loop_rows(self, in_v, out_v, shape):
        row = shape[-1]
        prefix_shape = shape[:-1]

        def chunk(start: int, stop: int, job) -> None:
            while start < stop and not job.failed:
                r, j = divmod(start, row)
                end = min(stop - r * row, row)
                prefix = tuple(int(p) for p in np.unravel_index(r, prefix_shape))
                run = self.loop_1d(
                    [v[prefix] for v in in_v],
                    [o[prefix] for o in out_v],
                    range(r * row, (r + 1) * row),
                )
                run(j, end, job)
                start = r * row + end

        return chunk


def _flat(flat_of, i):
    return i if flat_of is None else int(flat_of[i])


class _NeverFailed:
    failed = False


class RemoteChunk:
    """One chunk of a map, packed for a worker that does not share our memory.

    Holds only the chunk's slices of the batched operands (deduplicated: an
    operand mapped at some levels only ships each of its elements once) and one
    copy of each unbatched operand. Calling it runs the element loop and returns
    ``(outputs, seconds_per_element)``.
    """

    def __init__(self, loop: ElementLoop, data, gathers, flat_index, length):
        self.loop = loop
        self.data = data  # per operand: array of its distinct elements
        self.gathers = gathers  # per operand: None (one element) or local index
        self.flat_index = flat_index  # flat batch index of each local element
        self.length = length

    def __call__(self):
        loop, n = self.loop, self.length
        views = []
        for d, g in zip(self.data, self.gathers, strict=True):
            if g is None:  # unbatched: one element, read with stride 0
                views.append(
                    np.lib.stride_tricks.as_strided(
                        d, (n, *d.shape), (0, *d.strides), writeable=False
                    )
                )
            elif isinstance(g, slice):
                views.append(d)
            else:
                views.append(d[g])
        for v in views:
            v.flags.writeable = False
        outs = [np.empty((n, *s), dt) for s, dt in loop.out_core]
        t = time.perf_counter()
        loop.loop_1d(views, outs, self.flat_index)(0, n, _NeverFailed)
        return outs, (time.perf_counter() - t) / max(n, 1)


class FlatMap:
    """Everything one host call needs: the element loop and the batch layout."""

    def __init__(self, loop: ElementLoop, spec: BatchSpec):
        self.loop = loop
        self.spec = spec

    def prepare(
        self, operands: Sequence[np.ndarray], workers: int = 1
    ) -> PreparedMap | SummingMap:
        """Views of ``operands`` and fresh output buffers for one host call.

        ``workers`` (the executor's size) sets the number of chunks of a map with
        summed outputs.
        """
        spec = self.spec
        in_views = [
            operand_view(x, axes, spec.shape)
            for x, axes in zip(operands, spec.in_axes, strict=True)
        ]
        if any(spec.out_sum):
            return SummingMap(self.loop, spec, in_views, workers)
        outs = [np.empty(spec.shape + s, d) for s, d in self.loop.out_core]
        return PreparedMap(self.loop, spec, in_views, outs)


class PreparedMap:
    """The views and output buffers of one host call, ready to run in chunks."""

    def __init__(self, loop: ElementLoop, spec: BatchSpec, in_views, outs):
        self.loop = loop
        self.n = spec.size
        self.outs = outs
        batch = spec.shape if spec.shape else (1,)
        if not spec.shape:  # one unbatched element: a batch of one
            in_views = [v[None] for v in in_views]
            outs = [o[None] for o in outs]
            self.n = 1
        shape, views = merge_batch_dims(batch, in_views + outs)
        self.shape = shape
        self.in_v = views[: len(in_views)]
        self.out_v = views[len(in_views) :]
        if len(shape) == 1:
            self.run_chunk = loop.loop_1d(self.in_v, self.out_v)
        else:
            self.run_chunk = loop.loop_nd(self.in_v, self.out_v, shape)

    fixed_chunk: int | None = None  # guided chunks

    def finish(self) -> tuple[np.ndarray, ...]:
        return tuple(self.outs)

    def remote_task(self, start: int, stop: int) -> RemoteChunk:
        """Packs elements ``[start, stop)`` for a worker in another process."""
        nb = len(self.shape)
        if nb == 1:
            data, gathers = [], []
            for v in self.in_v:
                if v.strides[0] == 0:
                    data.append(np.ascontiguousarray(v[0]))
                    gathers.append(None)
                else:
                    data.append(np.ascontiguousarray(v[start:stop]))
                    gathers.append(slice(None))
            flat = np.arange(start, stop)
            return RemoteChunk(self.loop, data, gathers, flat, stop - start)
        cols = np.unravel_index(np.arange(start, stop), self.shape)
        data, gathers = [], []
        for v in self.in_v:
            dims = [d for d in range(nb) if v.strides[d] != 0 and self.shape[d] > 1]
            if not dims:
                data.append(np.ascontiguousarray(v[(0,) * nb]))
                gathers.append(None)
                continue
            key = np.ravel_multi_index(
                tuple(cols[d] for d in dims), tuple(self.shape[d] for d in dims)
            )
            uniq, inverse = np.unique(key, return_inverse=True)
            sub = np.unravel_index(uniq, tuple(self.shape[d] for d in dims))
            index = [0] * nb
            for d, s in zip(dims, sub, strict=True):
                index[d] = s
            data.append(np.ascontiguousarray(v[tuple(index)]))
            gathers.append(inverse.reshape(-1))
        return RemoteChunk(
            self.loop, data, gathers, np.arange(start, stop), stop - start
        )

    def store_remote(self, start: int, stop: int, outs: list[np.ndarray]) -> None:
        """Writes a chunk's outputs (from :meth:`remote_task`) in place."""
        if len(self.shape) == 1:
            for o, r in zip(self.out_v, outs, strict=True):
                o[start:stop] = r
            return
        cols = np.unravel_index(np.arange(start, stop), self.shape)
        for o, r in zip(self.out_v, outs, strict=True):
            o[cols] = r


class SummingMap:
    """A map whose outputs are summed over some batch levels, on the host.

    Reverse-mode derivatives need, for an operand not batched at some ``vmap``
    levels, the sum of the per-element cotangents over those levels. Rather than
    writing every element's cotangent into a batch-sized buffer, each chunk adds
    its elements into a partial sum of the summed output's own size, and the
    partials are added in chunk order: memory stays O(workers x output), and the
    result does not depend on which thread ran which chunk, because chunks have
    fixed bounds (about two per worker).
    """

    def __init__(self, loop: ElementLoop, spec: BatchSpec, in_views, workers: int):
        self.loop = loop
        self.spec = spec
        self.n = spec.size
        self.in_v = in_views
        n_out = len(loop.out_core)
        self.summed = [bool(spec.summed(k)) for k in range(n_out)]
        self.outs = [
            (np.zeros if self.summed[k] else np.empty)(spec.out_batch_shape(k) + s, d)
            for k, (s, d) in enumerate(loop.out_core)
        ]
        self.fixed_chunk = max(1, -(-self.n // max(1, 2 * workers)))
        self._lock = threading.Lock()
        self._partials: dict[int, list[np.ndarray | None]] = {}
        self._next_fold = 0

    def _view(self, k: int, buf: np.ndarray) -> np.ndarray:
        """``buf`` (output ``k``'s own shape) seen with the full batch shape."""
        summed = self.spec.summed(k)
        kept = iter(range(len(self.spec.shape) - len(summed)))
        nb = len(self.spec.shape)
        strides = tuple(
            0 if level in summed else buf.strides[next(kept)] for level in range(nb)
        )
        kept_ndim = nb - len(summed)
        return np.lib.stride_tricks.as_strided(
            buf,
            self.spec.shape + buf.shape[kept_ndim:],
            strides + buf.strides[kept_ndim:],
        )

    def run_chunk(self, start: int, stop: int, job) -> None:
        partials = [
            np.zeros_like(o) if summed else None
            for o, summed in zip(self.outs, self.summed, strict=True)
        ]
        out_v = [
            self._view(k, p if p is not None else self.outs[k])
            for k, p in enumerate(partials)
        ]
        shape = self.spec.shape
        if len(shape) == 1:
            run = self.loop.loop_1d(self.in_v, out_v)
        else:
            run = self.loop.loop_nd(self.in_v, out_v, shape)
        run(start, stop, job)
        with self._lock:
            self._partials[start] = partials
            # Fold the partials that are next in chunk order, now.
            while self._next_fold in self._partials:
                done = self._partials.pop(self._next_fold)
                for o, p in zip(self.outs, done, strict=True):
                    if p is not None:
                        o += p
                self._next_fold += self.fixed_chunk

    def finish(self) -> tuple[np.ndarray, ...]:
        return tuple(self.outs)
