"""Chunks packed for executors that pickle work (process pools, Dask), and run in
their workers; the shipping of the tasks is ``_executors/shipping.py``.

A worker in another process cannot read the host callback's buffers, so each task
carries its chunk's slices of the operands: batched operands ship only the
elements the chunk reads (each once, even when several elements read it), and
unbatched operands ship one copy. In the worker, the task rebuilds views of
those slices and runs the same element loop as the threads of this process do,
then sends back the chunk's outputs, one row per element, with the measured
seconds per element (the executor sizes later tasks from it).

The kernel's caller travels pickled on its own inside each task (:class:`_Task`):
a worker that cannot load it (its module does not import there) returns why as
the task's error (:class:`KernelNotLoaded`), and the pool lives on.

An operand that every element reads whole (unbatched) and that is large
(``shipped_once.py``) is not packed in each task: the shipper sends it once
per map, and the tasks hold a ``Shared`` marker in its place, resolved in the
worker from what the task is called with.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from . import summing as _summing
from .loops import ChunkFn
from .shipped_once import Shared, resolve


class KernelNotLoaded(RuntimeError):
    """A worker process could not load the kernel of the task it was sent (the
    task's error, raised in the worker, so that the pool lives on)."""


def _not_loaded_message(e: BaseException) -> str:
    where = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])
    return (
        f"The worker process {os.getpid()} could not load the kernel it was "
        f"sent: {type(e).__name__}: {e}. A worker imports the kernel's module "
        "again (and, when started with 'spawn' or 'forkserver', the main "
        "script): define the kernel in a module that every worker can import. "
        f"In the worker:\n{where}"
    )


class _Pickled:
    """A task's caller, pickled on its own (see :class:`_Task`)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data


class _Task:
    """A task that carries the map's caller (the kernel) pickled on its own,
    so that a worker that cannot load it reports why as the task's error. A
    ``ProcessPoolExecutor`` worker that fails to unpickle a whole task exits
    instead, and the pool breaks with no word of the cause (the worker's
    traceback goes to its stderr). A caller that pickle cannot ship by
    reference (a lambda) is left to the executor's own pickler (Dask's ships
    it by value)."""

    caller: Any
    #: Why the worker could not load the caller (set in the worker).
    not_loaded: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        caller = state.pop("caller")
        try:
            caller = _Pickled(pickle.dumps(caller, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001, S110 - left to the executor's pickler
            pass
        return (_restore, (type(self), caller, state))

    def _caller(self) -> Any:
        if self.not_loaded is not None:
            raise KernelNotLoaded(self.not_loaded)
        return self.caller


def _restore(cls: type[_Task], caller: Any, state: dict[str, Any]) -> _Task:
    task = cls.__new__(cls)
    task.__dict__.update(state)
    if isinstance(caller, _Pickled):
        try:
            caller = pickle.loads(caller.data)  # noqa: S301 - our own task
        except Exception as e:  # noqa: BLE001 - the task's error, in the worker
            caller, task.not_loaded = None, _not_loaded_message(e)
    task.caller = caller
    return task


class ElementLoops(Protocol):
    """Builds the loop that runs a chunk of elements (``maps.ElementCaller``)."""

    out_core: list[tuple[tuple[int, ...], np.dtype]]

    def loop(
        self,
        in_v: Sequence[np.ndarray],
        out_v: Sequence[np.ndarray],
        shape: tuple[int, ...],
        flat_of: Any = None,
    ) -> ChunkFn: ...


class _Alone:
    """The job of a chunk run in a worker process: the map's failure is seen in
    the process that shipped it."""

    failed = False


class RemoteChunk(_Task):
    """One chunk of a map, packed for a worker that does not share our memory.

    Calling it runs the element loop and returns ``(outputs, seconds_per_element)``:
    one row per element of the chunk, except for the outputs that the host sums,
    which come back as one sum per distinct output row the chunk adds into
    (added in element order, as the host's own loop does).

    Args:
        caller: The map's element caller (pickled on its own, see
            :class:`_Task`).
        data: Per operand, its distinct elements for this chunk (or its one
            element, for an operand that the chunk reads unbatched), or a
            :class:`Shared` marker for an operand shipped once per map (the
            task is then called with the map's shared operands).
        gathers: Per operand: ``None`` (one element, read by every element of
            the chunk), a slice (``data`` is the chunk's rows in order) or an
            index array (row of ``data`` for each element).
        flat_index: The flat batch index of each element, for messages.
        sums: Per output: ``None``, or for a summed output the index of the sum
            that each element adds into (``0 .. number of sums - 1``).
    """

    def __init__(
        self,
        caller: ElementLoops,
        data: list[Any],
        gathers: list[np.ndarray | slice | None],
        flat_index: np.ndarray,
        sums: list[np.ndarray | None],
    ):
        self.caller = caller
        self.data = data
        self.gathers = gathers
        self.flat_index = flat_index
        self.sums = sums

    def __call__(self, *shared: Any) -> tuple[list[np.ndarray], float]:
        caller = self._caller()
        n = len(self.flat_index)
        views = []
        for d, g in zip(self.data, self.gathers, strict=True):
            if isinstance(d, Shared):
                d = resolve(shared[d.i])
            if g is None:  # one element, read with stride 0
                v = np.lib.stride_tricks.as_strided(
                    d, (n, *d.shape), (0, *d.strides), writeable=False
                )
            else:
                v = d if isinstance(g, slice) else d[g]
                v.flags.writeable = False
            views.append(v)
        outs, views_out = [], []
        for (shape, dtype), index in zip(caller.out_core, self.sums, strict=True):
            out, view = _summing.remote_output(index, n, shape, dtype)
            outs.append(out)
            views_out.append(view)
        run = caller.loop(views, views_out, (n,), self.flat_index)
        t = time.perf_counter()  # the kernel's time, not the loop's making
        run(0, n, _Alone())
        seconds = (time.perf_counter() - t) / max(n, 1)
        outs = [
            _summing.remote_sums(o, index)
            for o, index in zip(outs, self.sums, strict=True)
        ]
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
    shared: dict[int, int] | None = None,
) -> RemoteChunk:
    """Packs elements ``[start, stop)`` of views ``in_v`` (batch shape ``shape``).

    ``sum_rows``: per output, ``None`` or (for a summed output) the row of the
    output that each element adds into. ``shared``: operand -> index of the
    map's shared operand that stands for it (see ``shipped_once.py``).
    """
    shared = shared or {}
    flat = np.arange(start, stop)
    sums = [_summing.remote_sum_index(rows) for rows in sum_rows]
    nb = len(shape)
    cols = np.unravel_index(flat, shape)
    data: list[Any] = []
    gathers: list[np.ndarray | slice | None] = []
    for i, v in enumerate(in_v):
        dims = [d for d in range(nb) if v.strides[d] != 0 and shape[d] > 1]
        if i in shared:
            data.append(Shared(shared[i]))
            gathers.append(None)
        elif not dims:
            data.append(_contiguous(v[(0,) * nb + (Ellipsis,)]))
            gathers.append(None)
        elif nb == 1:  # the chunk's rows, as they are
            data.append(_contiguous(v[start:stop]))
            gathers.append(slice(None))
        else:  # each distinct element once: the chunk's elements index into them
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
    """Calls a vectorized kernel on one chunk (``vectorized.ChunkCaller``)."""

    def call(
        self, leaves: list[np.ndarray], first: int, k: int
    ) -> list[np.ndarray]: ...


class RemotePieces(_Task):
    """Pieces of a vectorized map, packed for a worker in another process.

    Calling it runs the kernel once per piece and returns ``(results, seconds
    per piece)``, ``results`` holding each piece's checked result leaves.

    Args:
        caller: The map's chunk caller (pickled on its own, see
            :class:`_Task`).
        pieces: ``(first, k, leaves)`` per piece: its first flat element, its
            length and its operand chunks. A chunk that repeats one element
            (stride 0: an unbatched operand) ships as that element only.
        shared: Operand -> index of the map's shared operand that stands for
            it (see ``shipped_once.py``); the task is then called with the
            map's shared operands.
    """

    def __init__(
        self,
        caller: ChunkCall,
        pieces: list[tuple[int, int, list[np.ndarray]]],
        shared: dict[int, int] | None = None,
    ):
        self.caller = caller
        shared = shared or {}
        self.pieces = [
            (
                first,
                k,
                [
                    (True, Shared(shared[i])) if i in shared else _compact(x)
                    for i, x in enumerate(leaves)
                ],
            )
            for first, k, leaves in pieces
        ]

    def __call__(self, *shared: Any) -> tuple[list[list[np.ndarray]], float]:
        caller = self._caller()
        t = time.perf_counter()
        results = []
        for first, k, leaves in self.pieces:
            views = [_expand(x, k, shared) for x in leaves]
            results.append(caller.call(views, first, k))
        return results, (time.perf_counter() - t) / max(len(self.pieces), 1)


def _compact(x: np.ndarray) -> tuple[bool, Any]:
    """``(repeated, data)``: one element for a stride-0 chunk, else the chunk."""
    if x.shape[0] > 1 and x.strides[0] == 0:
        return True, np.array(x[0])
    return False, np.ascontiguousarray(x)


def _expand(packed: tuple[bool, Any], k: int, shared: Sequence[Any]) -> np.ndarray:
    repeated, data = packed
    if isinstance(data, Shared):
        data = resolve(shared[data.i])
    if repeated:
        return np.lib.stride_tricks.as_strided(
            data, (k, *data.shape), (0, *data.strides), writeable=False
        )
    data.flags.writeable = False
    return data
