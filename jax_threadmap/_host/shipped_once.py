"""Operands shipped once per map to an executor that pickles work (process
pools, Dask): which ones (:func:`shared_operands`: large, read whole by every
element), how they reach the workers (:func:`share`: Dask's scatter, or files
that a process pool's workers map, :class:`MappedFile`), and how a task in the
worker reads them (:func:`resolve`). The tasks hold a :class:`Shared` marker in
their place (``packing.py``); the shipper is ``_executors/shipping.py``.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: Bytes from which an operand read whole by every element is shipped once per
#: map (see :func:`shared_operands`) rather than in every task.
SHARE_BYTES = 64 * 1024


class Shared:
    """Stands in a packed task for the map's shared operand ``i``."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def shared_operands(
    in_v: Sequence[np.ndarray], shape: tuple[int, ...]
) -> tuple[dict[int, int], list[np.ndarray]]:
    """The operands that every element reads whole and that are large.

    Returns ``(index, arrays)``: operand -> position in ``arrays``, and the one
    element of each such operand (views ``in_v`` with batch shape ``shape``).
    """
    nb = len(shape)
    index: dict[int, int] = {}
    arrays: list[np.ndarray] = []
    for i, v in enumerate(in_v):
        if any(v.strides[d] != 0 and shape[d] > 1 for d in range(nb)):
            continue  # batched: each task ships the elements it reads
        element = v[(0,) * nb + (Ellipsis,)]
        if element.nbytes >= SHARE_BYTES:
            index[i] = len(arrays)
            arrays.append(element)
    return index, arrays


def resolve(x: Any) -> np.ndarray:
    """A shared operand as a task receives it, as an array: the array pickled
    with the task, or data scattered to a Dask worker (which Dask hands the task
    as it is), or the array a :class:`MappedFile` maps."""
    return x.open() if isinstance(x, MappedFile) else np.asarray(x)


class Sharing:
    """How one map's shared operands reach an executor's workers.

    Every task of the map is submitted as ``executor.submit(task, *args)``;
    :meth:`close` ends the sharing once the map is over.

    Args:
        args: What each task receives for the shared operands: the arrays
            themselves (pickled with each task), Dask futures of data scattered
            to every worker, or :class:`MappedFile` handles.
        close: Releases what the sharing holds (scattered data, files).
    """

    def __init__(self, args: list[Any], close: Callable[[], None] | None = None):
        self.args = args
        self._close = close

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def share(executor: concurrent.futures.Executor, arrays: list[np.ndarray]) -> Sharing:
    """Ships ``arrays`` to ``executor``'s workers once for a map.

    - A Dask ``ClientExecutor``: ``client.scatter(..., broadcast=True)``, one
      copy per worker; each task names the scattered data.
    - A process pool (workers on this host): one file per array in the
      temporary folder, which each worker maps read-only on first use (no copy
      through the pool's pipes), removed after the map.
    - Any other executor: the arrays travel with each task, as a last resort.
    """
    if not arrays:
        return Sharing([])
    client = getattr(executor, "_client", None)  # distributed.ClientExecutor
    if client is not None and hasattr(client, "scatter"):
        futures = client.scatter(list(arrays), broadcast=True, hash=False)
        return Sharing(list(futures), lambda: client.cancel(futures))
    if isinstance(executor, concurrent.futures.ProcessPoolExecutor):
        try:
            return _in_files(arrays)
        except OSError:  # no room in the temporary folder: with each task
            pass
    return Sharing(list(arrays))


def _in_files(arrays: list[np.ndarray]) -> Sharing:
    paths: list[str] = []
    handles = []
    try:
        for a in arrays:
            # A name used once: a worker's mapping of a finished map's file
            # must never be taken for a new one.
            fd, path = tempfile.mkstemp(prefix=f"jax_threadmap-{uuid.uuid4().hex}-")
            paths.append(path)
            with os.fdopen(fd, "wb") as f:
                f.write(np.ascontiguousarray(a).data)
            handles.append(MappedFile(path, a.shape, a.dtype))
    except BaseException:
        _remove(paths)
        raise
    return Sharing(handles, lambda: _remove(paths))


def _remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:  # gone already; or still mapped, on Windows
            pass


#: In a worker process: the files of shared operands it has mapped, by path. No
#: lock: a dict's get, setdefault and pop are atomic (free-threaded builds too);
#: a forked child keeps the mappings (read-only, valid there).
_mapped: dict[str, np.ndarray] = {}


class MappedFile:
    """A shared operand in a file that workers on this host map read-only.

    A worker maps each file once, on the first task of the map that reads it,
    and keeps the mapping until a task of a later map finds the file removed.
    """

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype):
        self.path = path
        self.shape = shape
        self.dtype = dtype

    def open(self) -> np.ndarray:
        array = _mapped.get(self.path)
        if array is None:
            for gone in [p for p in list(_mapped) if not os.path.exists(p)]:
                _mapped.pop(gone, None)  # maps that are over
            with open(self.path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            array = np.frombuffer(m, self.dtype).reshape(self.shape)
            # Two threads that map the file at once: both use the first mapping.
            array = _mapped.setdefault(self.path, array)
        return array
