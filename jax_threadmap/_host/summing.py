"""Outputs summed over batch levels on the host: how a summed output works.

The transpose rule (:func:`.._core.autodiff.transpose_rule`) asks, from the program
alone, which batch levels the host sums each output over: the levels at which
the operand whose cotangent it is was not batched (:func:`summed_levels`). It
records them in the equation's spec (:attr:`.batch_spec.BatchSpec.out_sum`).
Everything after that decision lives here too:

- the output buffer holds only the kept levels, zero-filled, and is seen with
  the full batch shape through a view with stride 0 at the summed levels
  (:func:`new_outputs`), so every element of those levels adds into one place;
- every chunk adds into a partial sum of its own (:class:`PartialSums`), and
  the partials are added into the outputs in chunk order, so that the result
  does not depend on which thread ran which chunk (the executor layer gives
  such maps fixed chunk bounds); memory stays a few partials per worker;
- a per-element loop adds with ``+=`` (``loops`` writes that line for the
  outputs in ``accumulate``); a vectorized piece adds its values, reduced over
  the summed dims inside the piece (:func:`add_piece`);
- a chunk shipped to another process (:mod:`.packing`) sums in the worker, one
  sum per distinct output row it adds into (:func:`remote_outputs`,
  :func:`remote_sums`), and the host adds those rows into the chunk's partial
  (:meth:`PartialSums.add_rows`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from .batch_spec import BatchSpec


def summed_levels(axes: Sequence[int | None]) -> tuple[int, ...]:
    """The decision: the batch levels the host sums the cotangent of an operand
    over, given the operand's axis at each level (``None``: not batched there).
    The transpose rule records these in the equation's spec."""
    return tuple(level for level, axis in enumerate(axes) if axis is None)


def new_outputs(
    spec: BatchSpec, out_core: Sequence[tuple[tuple[int, ...], np.dtype]]
) -> tuple[list[np.ndarray], list[np.ndarray], list[tuple[int, ...]]]:
    """Per output: its buffer, its view with the full batch shape, and the
    levels summed away in it.

    A buffer holds its output's kept batch levels and core shape, zeros when it
    is summed (elements add into it). In its view the levels summed away get
    stride 0, so every element of those levels adds into the same place.
    """
    outs, views, sums = [], [], []
    levels = spec.out_levels(len(out_core))
    for (core, dtype), (summed, batch) in zip(out_core, levels, strict=True):
        buf = (np.zeros if summed else np.empty)(batch + core, dtype)
        outs.append(buf)
        views.append(summed_view(buf, spec.shape, summed))
        sums.append(summed)
    return outs, views, sums


def summed_view(
    buf: np.ndarray, shape: tuple[int, ...], summed: tuple[int, ...]
) -> np.ndarray:
    """``buf`` seen with the full batch ``shape``, stride 0 at the ``summed`` levels."""
    if not summed:
        return buf
    nb = len(shape)
    kept_ndim = nb - len(summed)
    kept = iter(buf.strides[:kept_ndim])
    strides = tuple(0 if level in summed else next(kept) for level in range(nb))
    return np.lib.stride_tricks.as_strided(
        buf, shape + buf.shape[kept_ndim:], strides + buf.strides[kept_ndim:]
    )


def summed_dims(
    groups: list[list[int]], sums: Sequence[tuple[int, ...]]
) -> list[set[int]]:
    """Per output, the merged dims it is summed over (a merged dim groups only
    levels that are all summed, or none, since their strides differ)."""
    return [{g for g, levels in enumerate(groups) if levels[0] in s} for s in sums]


class PartialSums:
    """The partial sums of one map's chunks, added into its outputs in chunk order.

    Args:
        spec: The equation's batch spec.
        outs: The map's output buffers (see :func:`new_outputs`).
        sums: Per output, the levels summed away in it.
        merge: Merges a view with the full batch shape as the map's views are
            merged (``maps.merge_view`` with the map's groups).

    Lock rule: :attr:`_waiting` and :attr:`_folded` are read and written under
    :attr:`_lock` (chunks finish on many threads).
    """

    def __init__(
        self,
        spec: BatchSpec,
        outs: Sequence[np.ndarray],
        sums: Sequence[tuple[int, ...]],
        merge: Callable[[np.ndarray], np.ndarray],
    ):
        self.spec = spec
        self.outs = outs
        self.sums = sums
        self._merge = merge
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[int, list[np.ndarray | None]]] = {}
        self._folded = 0  # the outputs hold the partials of [0, _folded)

    def new(self) -> list[np.ndarray | None]:
        """A chunk's partials: zeros per summed output, ``None`` for the rest."""
        return [
            np.zeros_like(o) if summed else None
            for o, summed in zip(self.outs, self.sums, strict=True)
        ]

    def views(
        self, out_v: Sequence[np.ndarray], partials: list[np.ndarray | None]
    ) -> list[np.ndarray]:
        """The merged output views a chunk writes: its partials where summed."""
        return [
            out_v[k] if p is None else self._merge(self._full(p, k))
            for k, p in enumerate(partials)
        ]

    def _full(self, partial: np.ndarray, k: int) -> np.ndarray:
        view = summed_view(partial, self.spec.shape, self.sums[k])
        return view if self.spec.shape else view[None]

    def rows(self, start: int, stop: int) -> list[np.ndarray | None]:
        """Per output: ``None``, or for a summed output the row of its buffer
        (batch levels flattened) that each element of ``[start, stop)`` adds into."""
        flat = np.arange(start, stop)
        rows: list[np.ndarray | None] = []
        for k in range(len(self.outs)):
            summed = self.sums[k]
            if not summed:
                rows.append(None)
                continue
            cols = np.unravel_index(flat, self.spec.shape)
            kept = tuple(c for level, c in enumerate(cols) if level not in summed)
            rows.append(
                np.ravel_multi_index(kept, self.spec.out_batch_shape(k))
                if kept
                else np.zeros(len(flat), np.intp)
            )
        return rows

    @staticmethod
    def add_rows(partial: np.ndarray, rows: np.ndarray, sums: np.ndarray) -> None:
        """Adds a shipped chunk's sums (one per distinct row of ``rows``, in
        increasing order; see :func:`remote_sums`) into its partial."""
        partial.reshape(-1, *sums.shape[1:])[np.unique(rows)] += sums

    def fold(self, start: int, stop: int, partials: list[np.ndarray | None]) -> None:
        """Adds the partials of chunk ``[start, stop)`` into the outputs once
        every chunk before it has been added."""
        with self._lock:
            self._waiting[start] = (stop, partials)
            while self._folded in self._waiting:
                stop, done = self._waiting.pop(self._folded)
                for o, p in zip(self.outs, done, strict=True):
                    if p is not None:
                        o += p
                self._folded = stop


def add_piece(
    dst: np.ndarray, value: np.ndarray, rect_ndim: int, first_dim: int, dims: set[int]
) -> None:
    """Adds a vectorized piece's ``value`` into ``dst``, the summed output's
    view at the piece.

    ``value``'s first ``rect_ndim`` axes are the piece's rectangle, whose axis 0
    is merged dim ``first_dim`` of the map; ``dims`` are the merged dims the
    output is summed over (:func:`summed_dims`). A summed output adds, always:
    its summed dims may lie in the piece (reduced here) or in the piece's fixed
    index (stride 0 there, so every piece along them adds into the same place).
    """
    summed = tuple(i for i in range(rect_ndim) if first_dim + i in dims)
    kept = tuple(0 if i in summed else slice(None) for i in range(rect_ndim))
    dst[kept] += value.sum(axis=summed) if summed else value


def remote_sum_index(rows: np.ndarray | None) -> np.ndarray | None:
    """For a shipped chunk: per element, the index of the sum it adds into
    (``0 ..`` distinct rows - 1), from :meth:`PartialSums.rows`."""
    if rows is None:
        return None
    return np.unique(rows, return_inverse=True)[1].reshape(-1)


def remote_output(
    index: np.ndarray | None, n: int, shape: tuple[int, ...], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """In a worker: ``(buffer, view)`` of one output of a chunk of ``n``
    elements. A chunk whose elements all add into one sum adds in place
    (stride 0); others write one row per element (zeros, summed afterwards by
    :func:`remote_sums`)."""
    if index is not None and not index.any():
        out = np.zeros((1, *shape), dtype)
        view = np.lib.stride_tricks.as_strided(out, (n, *shape), (0, *out.strides[1:]))
        return out, view
    out = np.zeros((n, *shape), dtype)
    return out, out


def remote_sums(out: np.ndarray, index: np.ndarray | None) -> np.ndarray:
    """In a worker: a chunk's output as it goes back: one sum per distinct row
    for a summed output with more than one (added in element order), else as
    written."""
    if index is None or not index.any():
        return out
    sums = np.zeros((int(index.max()) + 1, *out.shape[1:]), out.dtype)
    np.add.at(sums, index, out)  # in element order
    return sums
