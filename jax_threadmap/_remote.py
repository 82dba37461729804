"""Chunks packed for executors that pickle work (process pools, Dask).

A worker in another process cannot read the host callback's buffers, so each task
carries its chunk's slices of the operands: batched operands ship only the
elements the chunk reads (each once, even when several elements read it), and
unbatched operands ship one copy. In the worker, the task rebuilds views of
those slices and runs the same element loop as the threads of this process do,
then sends back the chunk's outputs, one row per element, with the measured
seconds per element (the executor sizes later tasks from it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

#: Runs elements ``[start, stop)``; ``job.failed`` stops it early.
ChunkFn = Callable[[int, int, Any], None]


class ElementLoops(Protocol):
    """Builds the loop that runs a chunk of elements (``_host.ElementCaller``)."""

    out_core: list[tuple[tuple[int, ...], np.dtype]]

    def loop(
        self,
        in_v: Sequence[np.ndarray],
        out_v: Sequence[np.ndarray],
        shape: tuple[int, ...],
        flat_of: Any = None,
    ) -> ChunkFn: ...


class _NeverFailed:
    failed = False


class RemoteChunk:
    """One chunk of a map, packed for a worker that does not share our memory.

    Calling it runs the element loop and returns ``(outputs, seconds_per_element)``:
    one row per element of the chunk, except for the outputs that the host sums,
    which come back as one sum per distinct output row the chunk adds into
    (added in element order, as the host's own loop does).

    Args:
        loops: The map's element caller (pickled with the task).
        data: Per operand, its distinct elements for this chunk (or its one
            element, for an operand that the chunk reads unbatched).
        gathers: Per operand: ``None`` (one element, read by every element of
            the chunk), a slice (``data`` is the chunk's rows in order) or an
            index array (row of ``data`` for each element).
        flat_index: The flat batch index of each element, for messages.
        sums: Per output: ``None``, or for a summed output the index of the sum
            that each element adds into (``0 .. number of sums - 1``).
    """

    def __init__(
        self,
        loops: ElementLoops,
        data: list[np.ndarray],
        gathers: list[np.ndarray | slice | None],
        flat_index: np.ndarray,
        sums: list[np.ndarray | None],
    ):
        self.loops = loops
        self.data = data
        self.gathers = gathers
        self.flat_index = flat_index
        self.sums = sums

    def __call__(self) -> tuple[list[np.ndarray], float]:
        n = len(self.flat_index)
        views = []
        for d, g in zip(self.data, self.gathers, strict=True):
            if g is None:  # one element, read with stride 0
                v = np.lib.stride_tricks.as_strided(
                    d, (n, *d.shape), (0, *d.strides), writeable=False
                )
            else:
                v = d if isinstance(g, slice) else d[g]
                v.flags.writeable = False
            views.append(v)
        outs, views_out = [], []
        for (shape, dtype), index in zip(self.loops.out_core, self.sums, strict=True):
            if index is not None and not index.any():  # one sum: add in place
                out = np.zeros((1, *shape), dtype)
                view = np.lib.stride_tricks.as_strided(
                    out, (n, *shape), (0, *out.strides[1:])
                )
            else:  # the loop adds into zeros for summed outputs
                out = view = np.zeros((n, *shape), dtype)
            outs.append(out)
            views_out.append(view)
        t = time.perf_counter()
        self.loops.loop(views, views_out, (n,), self.flat_index)(0, n, _NeverFailed)
        seconds = (time.perf_counter() - t) / max(n, 1)
        for k, index in enumerate(self.sums):
            if index is not None and index.any():
                sums = np.zeros(
                    (int(index.max()) + 1, *outs[k].shape[1:]), outs[k].dtype
                )
                np.add.at(sums, index, outs[k])  # in element order
                outs[k] = sums
        return outs, seconds


def _contiguous(x: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray, which returns at least 1-d: an unbatched 0-d
    # operand would reach the kernel with shape (1,).
    return np.asarray(x, order="C")


def pack(
    loops: ElementLoops,
    in_v: Sequence[np.ndarray],
    shape: tuple[int, ...],
    start: int,
    stop: int,
    sum_rows: Sequence[np.ndarray | None],
) -> RemoteChunk:
    """Packs elements ``[start, stop)`` of views ``in_v`` (batch shape ``shape``).

    ``sum_rows``: per output, ``None`` or (for a summed output) the row of the
    output that each element adds into.
    """
    flat = np.arange(start, stop)
    sums = [
        None if rows is None else np.unique(rows, return_inverse=True)[1].reshape(-1)
        for rows in sum_rows
    ]
    if len(shape) == 1:
        data: list[np.ndarray] = []
        gathers: list[np.ndarray | slice | None] = []
        for v in in_v:
            if v.strides[0] == 0:
                data.append(_contiguous(v[0, ...]))
                gathers.append(None)
            else:
                data.append(_contiguous(v[start:stop]))
                gathers.append(slice(None))
        return RemoteChunk(loops, data, gathers, flat, sums)
    nb = len(shape)
    cols = np.unravel_index(flat, shape)
    data, gathers = [], []
    for v in in_v:
        dims = [d for d in range(nb) if v.strides[d] != 0 and shape[d] > 1]
        if not dims:
            data.append(_contiguous(v[(0,) * nb + (Ellipsis,)]))
            gathers.append(None)
            continue
        # Each distinct element once: the chunk's elements index into them.
        sub_shape = tuple(shape[d] for d in dims)
        key = np.ravel_multi_index(tuple(cols[d] for d in dims), sub_shape)
        uniq, inverse = np.unique(key, return_inverse=True)
        index: list[Any] = [0] * nb
        for d, s in zip(dims, np.unravel_index(uniq, sub_shape), strict=True):
            index[d] = s
        data.append(_contiguous(v[tuple(index)]))
        gathers.append(inverse.reshape(-1))
    return RemoteChunk(loops, data, gathers, flat, sums)


class ChunkCall(Protocol):
    """Calls a vectorized kernel on one chunk (``_vectorized.ChunkCaller``)."""

    def call(
        self, leaves: list[np.ndarray], first: int, k: int
    ) -> list[np.ndarray]: ...


class RemotePieces:
    """Pieces of a vectorized map, packed for a worker in another process.

    Calling it runs the kernel once per piece and returns ``(results, seconds
    per piece)``, ``results`` holding each piece's checked result leaves.

    Args:
        caller: The map's chunk caller (pickled with the task).
        pieces: ``(first, k, leaves)`` per piece: its first flat element, its
            length and its operand chunks. A chunk that repeats one element
            (stride 0: an unbatched operand) ships as that element only.
    """

    def __init__(
        self,
        caller: ChunkCall,
        pieces: list[tuple[int, int, list[np.ndarray]]],
    ):
        self.caller = caller
        self.pieces = [
            (first, k, [_compact(x) for x in leaves]) for first, k, leaves in pieces
        ]

    def __call__(self) -> tuple[list[list[np.ndarray]], float]:
        t = time.perf_counter()
        results = []
        for first, k, leaves in self.pieces:
            views = [_expand(x, k) for x in leaves]
            results.append(self.caller.call(views, first, k))
        return results, (time.perf_counter() - t) / max(len(self.pieces), 1)


def _compact(x: np.ndarray) -> tuple[bool, np.ndarray]:
    """``(repeated, data)``: one element for a stride-0 chunk, else the chunk."""
    if x.shape[0] > 1 and x.strides[0] == 0:
        return True, np.array(x[0])
    return False, np.ascontiguousarray(x)


def _expand(packed: tuple[bool, np.ndarray], k: int) -> np.ndarray:
    repeated, data = packed
    if repeated:
        return np.lib.stride_tricks.as_strided(
            data, (k, *data.shape), (0, *data.strides), writeable=False
        )
    data.flags.writeable = False
    return data


def pack_pieces(
    caller: ChunkCall, pieces: list[tuple[int, int, list[np.ndarray]]]
) -> RemotePieces:
    """Packs pieces ``(first, k, operand chunks)`` of a vectorized map."""
    return RemotePieces(caller, pieces)
