"""The flat map on the host: views in, kernel per element, results written in place.

The host callback receives the operands as NumPy arrays in the layout of the
jaxpr: batched operands carry their batch axes wherever vmap left them, and
unbatched operands carry none. For each operand we build one strided view of shape
``batch_shape + core_shape`` (zero strides for the levels it is not mapped at), so
nothing is moved, copied or tiled. Outputs are allocated once and every element is
written in place.

Adjacent batch levels whose strides line up in every view are merged, so the usual
case (all operands batched the same way, or unbatched) is indexed with a single
integer per element, and the element loop is specialised for the common kernel
signatures so that its cost per element stays close to a bare Python loop.

Outputs summed over some batch levels (the cotangents of operands not batched at
those levels) are the business of :mod:`.summing`, which this module calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._support.errors import KernelError, describe, kernel_traceback
from . import packing as _packing
from . import shipped_once as _shipped_once
from . import summing as _summing
from .batch_spec import Axes, BatchSpec
from .kernel_scope import KernelScope
from .loops import ChunkFn, element_loop
from .vectorized import ChunkCaller, KernelCaller, PiecePlan

_LEAF_TYPES = (np.ndarray, np.generic, float, int, bool, complex)


# --- views ----------------------------------------------------------------------------


def operand_view(x: Any, axes: Axes, batch_shape: tuple[int, ...]) -> np.ndarray:
    """A read-only view of ``x`` with shape ``batch_shape + core_shape``."""
    x = np.asarray(x)
    core_axes = [d for d in range(x.ndim) if d not in axes]
    if None not in axes:  # batched at every level: a transpose (faster)
        view = x.transpose([*axes, *core_axes])
        view.flags.writeable = False
        return view
    strides = tuple(0 if a is None else x.strides[a] for a in axes) + tuple(
        x.strides[d] for d in core_axes
    )
    shape = tuple(batch_shape) + tuple(x.shape[d] for d in core_axes)
    return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=False)


def merge_groups(
    shape: tuple[int, ...], views: Sequence[np.ndarray]
) -> list[list[int]]:
    """Groups of adjacent batch dims that every view can index as one.

    Merging keeps the C-order flat index, so flat index ``i`` of the merged shape
    is flat index ``i`` of ``shape``.
    """
    groups: list[list[int]] = [[0]] if shape else []
    for d in range(1, len(shape)):
        prev = groups[-1][-1]
        if all(v.strides[prev] == v.strides[d] * shape[d] for v in views):
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


def merge_view(v: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """``v`` (batch dims first) with the batch dims of each group merged into one."""
    nb = sum(len(g) for g in groups)
    if nb == len(groups):  # nothing to merge
        return v
    shape = tuple(math.prod([v.shape[d] for d in g]) for g in groups)
    strides = tuple(v.strides[g[-1]] for g in groups) + v.strides[nb:]
    return np.lib.stride_tricks.as_strided(
        v, shape + v.shape[nb:], strides, writeable=v.flags.writeable
    )


# --- one element ----------------------------------------------------------------------


class ElementCaller(KernelCaller):
    """Calls a function on one element's views, checks its result, stores it.

    Also builds the loops that do this for a chunk of elements. Picklable (it
    holds the function, its tree structures and output declarations only), so
    that process and Dask workers run the very same loops. Its arguments:
    :class:`.vectorized.KernelCaller`'s (``fn``: what runs per element, the
    user's kernel or a derivative adapter).
    """

    #: The call and unpacking sources of the last loop built (``loops.py``).
    loop_sources: tuple[int, str | None, tuple[str, str] | None] | None = None

    # -- messages ----------------------------------------------------------------

    def error(self, flat: int | None, what: str, cause: Any = None) -> KernelError:
        index = None
        where = ""
        if flat is not None and self.batch_shape:
            index = tuple(int(i) for i in np.unravel_index(flat, self.batch_shape))
            where = f" at batch index {index} (batch shape {self.batch_shape})"
        return KernelError(
            f"threadmap kernel {self.name!r}{where} {what}",
            index=index,
            kernel_name=self.name,
            cause=cause,
        )

    def kernel_raised(self, e: BaseException, flat: int | None) -> KernelError:
        """The error for a kernel that raised ``e``, chained to ``e``.

        Its message ends with the kernel's innermost frames, so that the line
        that raised shows under jit and from worker processes too.
        """
        if isinstance(e, KernelError) and e.kernel_name == self.name and e.index:
            return e  # already has its index (e.g. from a remote chunk)
        return self.error(flat, f"raised {describe(e)}{kernel_traceback(e)}", cause=e)

    # -- one element, general path -----------------------------------------------

    def call(self, leaves: list[Any]) -> Any:
        return self.apply(leaves)

    def result_leaves(self, result: Any, flat: int | None) -> list[Any]:
        if self.single_leaf and isinstance(result, _LEAF_TYPES):
            return [result]
        leaves, tree = jax.tree_util.tree_flatten(result)
        if tree != self.out_tree:
            raise self.error(
                flat,
                f"{self.structure_mismatch(tree)} Return a pytree with the same "
                "structure as result_shape_dtypes.",
            )
        return leaves

    def store(
        self, out: np.ndarray, i: Any, value: Any, k: int, flat: int | None
    ) -> None:
        """Checks one output leaf of one element and writes it at ``out[i]``."""
        shape, dtype = self.out_core[k]
        value = self.as_declared(
            value,
            k,
            shape,
            lambda what, cause=None: self.error(flat, what, cause),
            f" (dtype {dtype}). Return one element's result, without batch axes.",
        )
        if k in self.accumulate:
            out[i] += value
        else:
            out[i] = value

    def store_leaf(
        self, out: np.ndarray, i: Any, value: Any, k: int, flat: int | None, result: Any
    ) -> None:
        """:meth:`store` for leaf ``k`` of a ``result`` of several leaves.

        A value that is itself a container (a tuple where an array is declared)
        is a structure mismatch of the whole result, reported as such.
        """
        if not isinstance(value, _LEAF_TYPES):
            self.result_leaves(result, flat)  # raises on a mismatch
        self.store(out, i, value, k, flat)

    def loop(
        self,
        in_v: Sequence[np.ndarray],
        out_v: Sequence[np.ndarray],
        shape: tuple[int, ...],
        flat_of: Sequence[int] | None = None,
    ) -> ChunkFn:
        """A function running elements ``[start, stop)`` of views with batch
        ``shape``.

        The loop is generated for this kernel's signature (:mod:`.loops`); this
        caller's ``call``, ``result_leaves`` and ``store`` are its checked slow
        paths. ``flat_of[j]`` maps local index ``j`` to the flat batch index (for
        messages), when the views hold a gathered subset of the batch.
        """
        return element_loop(self, in_v, out_v, shape, flat_of)


# --- the map of one host call ---------------------------------------------------------


class HostMap:
    """The views and output buffers of one host call, run in chunks.

    ``HostMap(caller, spec, operands)`` makes the map its caller needs: an
    :class:`ElementMap` (one kernel call per element) or a :class:`ChunkMap`
    (one call per rectangular piece, ``vectorized``); both share these views,
    outputs and partial sums, and are what the executor layer runs:
    ``run_chunk`` runs work units in this process, ``pack``/``store_packed``
    ship them to executors that pickle work. When some outputs are summed over
    batch levels, ``sums`` is true: every
    chunk (local or shipped) adds into a partial sum of its own, and partials are
    added into the outputs in chunk order, so memory stays a few partials per
    worker and the result does not depend on which thread ran which chunk, as
    long as the chunk bounds do not (the executor layer's rule for such maps).

    Args:
        caller: Calls, checks and stores one element.
        spec: The equation's batch spec.
        operands: The host callback's operands, in the jaxpr's layout.
        scope: Where the kernels' own JAX calls run (:mod:`.kernel_scope`), entered
            around each chunk by the executor layer; ``None``: nowhere special.
    """

    vectorized = False

    def __new__(
        cls,
        caller: ElementCaller | ChunkCaller,
        spec: BatchSpec,
        operands: Sequence[Any],
        scope: KernelScope | None = None,
    ) -> HostMap:
        del scope
        if cls is HostMap:  # the map of this caller, chosen once
            cls = ChunkMap if isinstance(caller, ChunkCaller) else ElementMap
        return super().__new__(cls)

    def __init__(
        self,
        caller: ElementCaller | ChunkCaller,
        spec: BatchSpec,
        operands: Sequence[Any],
        scope: KernelScope | None = None,
    ):
        self.caller = caller
        self.name = caller.name
        self.scope = scope
        self.spec = spec
        self.n = spec.size
        self.sums = any(spec.out_sum)
        batch = spec.shape or (1,)  # an unbatched call is a batch of one
        in_views = [
            operand_view(x, axes, spec.shape)
            for x, axes in zip(operands, spec.in_axes, strict=True)
        ]
        self.outs, out_views, sums = _summing.new_outputs(spec, caller.out_core)
        if not spec.shape:
            in_views = [v[None] for v in in_views]
            out_views = [o[None] for o in out_views]
        self._groups = merge_groups(batch, in_views + out_views)
        self.in_v = [merge_view(v, self._groups) for v in in_views]
        self.out_v = [merge_view(o, self._groups) for o in out_views]
        self.shape = tuple(math.prod([batch[d] for d in g]) for g in self._groups)
        self._summed_dims = _summing.summed_dims(self._groups, sums)
        self.partials = _summing.PartialSums(
            spec, self.outs, sums, lambda v: merge_view(v, self._groups)
        )
        self._shared: dict[int, int] | None = None  # see shared()

    @property
    def element_bytes(self) -> int:
        """Bytes of one element's operands and results (for chunk sizes)."""
        views = [*self.in_v, *self.out_v]
        nb = len(self.shape)
        return sum(math.prod(v.shape[nb:]) * v.itemsize for v in views)

    def split(self, max_elements: int) -> int:
        """Work units of ``max_elements`` at most: elements, unless vectorized."""
        del max_elements
        return self.n

    @property
    def run_chunk(self) -> ChunkFn:
        """What runs work units ``[start, stop)`` in this thread, as
        ``run_chunk(start, stop, job)``, stopping before the next one once
        ``job.failed`` is true (read once per map)."""
        raise NotImplementedError

    def shared(self) -> list[np.ndarray]:
        """The large operands that every element reads whole, which an executor
        that pickles work receives once per map (see ``_executors/shipping.py``);
        the tasks that :meth:`pack` makes from now on refer to them."""
        self._shared, arrays = _shipped_once.shared_operands(self.in_v, self.shape)
        return arrays

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """Units ``[start, stop)``, packed for a worker in another process."""
        raise NotImplementedError

    def store_packed(self, start: int, stop: int, outs: Any) -> None:
        """Stores the outputs of a packed chunk (see :mod:`.packing`)."""
        raise NotImplementedError

    def finish(self) -> tuple[np.ndarray, ...]:
        return tuple(self.outs)


class ElementMap(HostMap):
    """A host map that calls the kernel once per element (generated loops)."""

    caller: ElementCaller
    _loop: ChunkFn | None = None

    @property
    def run_chunk(self) -> ChunkFn:
        """The generated loop itself (nothing between it and the job), or, for
        a map summed on the host, :meth:`_run_summed`."""
        if self.sums:
            return self._run_summed
        if self._loop is None:  # made once, when the map is started
            self._loop = self.caller.loop(self.in_v, self.out_v, self.shape)
        return self._loop

    def _run_summed(self, start: int, stop: int, job: Any) -> None:
        """Runs elements ``[start, stop)`` into partial sums of their own."""
        partials = self.partials.new()
        out_v = self.partials.views(self.out_v, partials)
        self.caller.loop(self.in_v, out_v, self.shape)(start, stop, job)
        self.partials.fold(start, stop, partials)

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """Elements ``[start, stop)``, packed for a worker in another process."""
        return _packing.pack(
            self.caller,
            self.in_v,
            self.shape,
            start,
            stop,
            self.partials.rows(start, stop),
            self._shared,
        )

    def store_packed(self, start: int, stop: int, outs: Any) -> None:
        """Stores the outputs of a packed chunk (see :mod:`.packing`)."""
        partials = self.partials.new()
        self._store_rows(start, stop, outs, partials)
        if self.sums:
            self.partials.fold(start, stop, partials)

    def _store_rows(
        self,
        start: int,
        stop: int,
        outs: Sequence[np.ndarray],
        partials: list[np.ndarray | None],
    ) -> None:
        """Elements ``[start, stop)`` of a packed chunk: one row each, or sums."""
        if len(self.shape) == 1:
            index: Any = slice(start, stop)
        else:
            index = np.unravel_index(np.arange(start, stop), self.shape)
        for o, p, r, rows in zip(
            self.out_v, partials, outs, self.partials.rows(start, stop), strict=True
        ):
            if p is None or rows is None:
                o[index] = r
            else:  # the chunk's sums, one per distinct row
                _summing.PartialSums.add_rows(p, rows, r)


class ChunkMap(HostMap):
    """A host map that calls a vectorized kernel once per rectangular piece."""

    caller: ChunkCaller
    vectorized = True
    #: The map's pieces, once :meth:`split` has cut it.
    plan: PiecePlan | None = None

    @property
    def run_chunk(self) -> ChunkFn:
        return self._run_pieces

    def split(self, max_elements: int) -> int:
        """Cuts a vectorized map into pieces; returns how many (the work units)."""
        self.plan = PiecePlan(self.shape, max(1, max_elements))
        return self.plan.count

    def _run_pieces(self, start: int, stop: int, job: Any) -> None:
        """Runs pieces ``[start, stop)`` in this thread; stops before the next
        one once ``job.failed`` is true, as the element loops do."""
        partials = self.partials.new()
        out_v = self.partials.views(self.out_v, partials)
        for piece in range(start, stop):
            if job.failed:
                return
            index, first, k = self._piece(piece)
            leaves = self.plan.leaves(self.in_v, index, k)  # type: ignore[union-attr]
            self._store_piece(out_v, index, k, self.caller.call(leaves, first, k))
        if self.sums:
            self.partials.fold(start, stop, partials)

    def _piece(self, i: int) -> tuple[tuple[Any, ...], int, int]:
        assert self.plan is not None, "split() first"
        return self.plan.piece(i)

    def _store_piece(
        self,
        out_v: Sequence[np.ndarray],
        index: tuple[Any, ...],
        k: int,
        values: Sequence[np.ndarray],
    ) -> None:
        """Writes one piece's results (or adds them, for summed outputs)."""
        assert self.plan is not None
        rect = self.plan.rect(k)
        first_dim = len(self.shape) - len(rect)  # the merged dim of rect's axis 0
        for o, dims, value in zip(out_v, self._summed_dims, values, strict=True):
            dst = o[index]
            value = value.reshape(rect + value.shape[1:])
            if dims:
                _summing.add_piece(dst, value, len(rect), first_dim, dims)
            else:
                dst[...] = value

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """Pieces ``[start, stop)``, packed for a worker in another process."""
        pieces = []
        for i in range(start, stop):
            index, first, k = self._piece(i)
            leaves = self.plan.leaves(self.in_v, index, k)  # type: ignore[union-attr]
            pieces.append((first, k, leaves))
        return _packing.RemotePieces(self.caller, pieces, self._shared)

    def store_packed(self, start: int, stop: int, outs: Any) -> None:
        """Stores the outputs of a packed chunk (see :mod:`.packing`)."""
        partials = self.partials.new()
        out_v = self.partials.views(self.out_v, partials)
        for i, values in zip(range(start, stop), outs, strict=True):
            index, _, k = self._piece(i)
            self._store_piece(out_v, index, k, values)
        if self.sums:
            self.partials.fold(start, stop, partials)
