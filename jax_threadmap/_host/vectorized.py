"""Vectorized kernels: one call per chunk of elements instead of one per element.

A vectorized kernel receives every operand with one leading axis of length ``k``,
a chunk of the flat batch, and returns each result with that leading axis. The
chunks are *pieces* of the merged batch shape ``S`` (see ``maps.HostMap``) that
are rectangular: a range ``j0:j1`` of one dim ``p`` with the dims before ``p``
fixed and the dims after it whole. So each operand's chunk is
``view[prefix + (slice(j0, j1),)].reshape(k, *core)``: a strided view when the
operand's layout allows it (unbatched operands keep stride 0, so they are never
copied), else a copy of just that chunk. Nothing is ever tiled to the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._support.errors import PASS_THROUGH, KernelError, describe, kernel_traceback
from .._support.result_casts import ResultCastError, check_result_cast


class PiecePlan:
    """Cuts a merged batch shape into rectangular pieces of at most ``max_elements``.

    ``p`` is the outermost dim whose inner block (``prod(S[p+1:])`` elements)
    fits in ``max_elements``; a piece is ``c`` consecutive indices of dim ``p``
    (fewer at the end of a row), the dims before ``p`` fixed.
    """

    def __init__(self, shape: tuple[int, ...], max_elements: int):
        self.shape = shape
        blocks = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        self.p = next(d for d, b in enumerate(blocks) if b <= max_elements)
        self.block = blocks[self.p]
        self.c = max(1, min(shape[self.p], max_elements // self.block))
        self.parts = -(-shape[self.p] // self.c)  # pieces per row of dim p
        self.count = math.prod(shape[: self.p]) * self.parts
        # (operand, k) -> the chunk of k elements of an operand that every piece
        # of k elements shares (see leaves()).
        self._same: dict[tuple[int, int], np.ndarray] = {}

    def piece(self, i: int) -> tuple[tuple[Any, ...], int, int]:
        """``(index, first, k)``: the views' index of piece ``i``, its first flat
        element and its number of elements."""
        row, part = divmod(i, self.parts)
        prefix = []
        rest = row
        for n in reversed(self.shape[: self.p]):  # the C-order index of row
            rest, j = divmod(rest, n)
            prefix.append(j)
        j0 = part * self.c
        j1 = min(self.shape[self.p], j0 + self.c)
        first = (row * self.shape[self.p] + j0) * self.block
        return (*reversed(prefix), slice(j0, j1)), first, (j1 - j0) * self.block

    def leaves(
        self, views: Sequence[np.ndarray], index: tuple[Any, ...], k: int
    ) -> list[np.ndarray]:
        """The operands' chunks of the piece at ``index`` of ``k`` elements.

        An operand with stride 0 over dims ``0..p`` (batched only inside a
        piece's rows, as an inner operand of an outer product) has the same
        chunk in every piece of ``k`` elements: it is made once per map and
        length and shared, read-only, by the pieces of every thread.
        """
        nb = len(self.shape)
        leaves = []
        for i, view in enumerate(views):
            if any(view.strides[: self.p + 1]):
                leaves.append(chunk_of(view, index, k, nb))
                continue
            chunk = self._same.get((i, k))
            if chunk is None:  # two threads may both make it: either is right
                chunk = self._same[(i, k)] = chunk_of(view, index, k, nb)
            leaves.append(chunk)
        return leaves

    def rect(self, k: int) -> tuple[int, ...]:
        """The batch shape of a piece of ``k`` elements, before its reshape."""
        return (k // self.block, *self.shape[self.p + 1 :])


def chunk_of(view: np.ndarray, index: tuple[Any, ...], k: int, nb: int) -> np.ndarray:
    """One operand's chunk: a view where its layout allows, else a (read-only) copy."""
    part = view[index]
    out = part.reshape((k, *part.shape[nb - len(index) + 1 :]))
    # The views are read-only, so a writeable result is a copy: make it read-only
    # too, so that kernels see the same flags either way.
    out.flags.writeable = False
    return out


class KernelCaller:
    """What a caller of a kernel holds, per element (``maps.ElementCaller``) or
    per chunk (:class:`ChunkCaller`). Picklable, so that process and Dask
    workers run the same checks.

    Args:
        fn: The kernel (or a derivative adapter).
        name: The kernel's name, for messages.
        in_tree: Treedef of ``(args, kwargs)`` as ``fn`` takes them.
        out_tree: Treedef of ``fn``'s result.
        out_core: ``(shape, dtype)`` of each output leaf for one element.
        batch_shape: The (unmerged) batch shape, for batch indices in messages.
        accumulate: Outputs whose elements are added into their view (summed
            outputs) rather than written, by an element caller (a vectorized
            map sums its chunks' results itself).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        in_tree: Any,
        out_tree: Any,
        out_core: Sequence[tuple[tuple[int, ...], Any]],
        batch_shape: tuple[int, ...],
        accumulate: Sequence[int] = (),
    ):
        self.fn = fn
        self.name = name
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.out_core = [(tuple(s), np.dtype(d)) for s, d in out_core]
        self.batch_shape = tuple(batch_shape)
        self.accumulate = frozenset(accumulate)
        # Fast paths: arguments of one leaf each; a result of one leaf.
        leaves = list(range(in_tree.num_leaves))
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        flat = all(isinstance(a, int) for a in args) and all(
            isinstance(v, int) for v in kwargs.values()
        )
        # When every argument is one leaf the kernel is called without unflattening.
        self.num_args: int | None = len(args) if flat else None
        self.kw_names: tuple[str, ...] = tuple(kwargs) if flat else ()
        self.single_leaf = out_tree.num_leaves == 1 and out_tree.num_nodes == 1

    def apply(self, leaves: list[Any]) -> Any:
        """``fn`` called on the flat leaves of its arguments."""
        if self.num_args is not None:
            if self.kw_names:
                kw = dict(zip(self.kw_names, leaves[self.num_args :], strict=True))
                return self.fn(*leaves[: self.num_args], **kw)
            return self.fn(*leaves)
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, leaves)
        return self.fn(*args, **kwargs)

    def structure_mismatch(self, tree: Any) -> str:
        """The start of the message for a result of structure ``tree``."""
        return (
            f"returned a value of structure {tree}, but result_shape_dtypes has "
            f"structure {self.out_tree}."
        )

    def as_declared(
        self,
        value: Any,
        j: int,
        expected: tuple[int, ...],
        fail: Callable[..., KernelError],
        hint: str,
    ) -> np.ndarray:
        """Output ``j``'s ``value`` as an array of shape ``expected`` whose
        values its declared dtype holds: the one check of an element's and a
        chunk's results. ``fail(what, cause)`` makes the error (naming the
        element or the chunk); ``hint`` ends the message of a wrong shape."""
        dtype = self.out_core[j][1]
        if type(value) is not np.ndarray:
            try:
                value = np.asarray(value)
            except Exception as e:
                raise fail(
                    f"returned a value of type {type(value).__name__} for output "
                    f"{j}, which is not convertible to an array of shape "
                    f"{expected} and dtype {dtype}.",
                    e,
                ) from e
        if value.shape != expected:
            raise fail(
                f"returned shape {value.shape} for output {j}, expected {expected}"
                + hint
            )
        if value.dtype != dtype:
            try:
                check_result_cast(value, dtype)
            except ResultCastError as e:
                raise fail(
                    f"returned {e.got} for output {j}, expected {dtype} (shape "
                    f"{expected}); {e.reason}. {e.fix}"
                ) from None
        return value


class ChunkCaller(KernelCaller):
    """Calls a vectorized kernel on one chunk and checks its results (see
    :class:`KernelCaller` for the arguments)."""

    def error(
        self, first: int, k: int, what: str, cause: BaseException | None = None
    ) -> KernelError:
        """A ``KernelError`` naming the chunk's range of batch indices."""
        index = None
        where = ""
        if self.batch_shape:
            index = _index(first, self.batch_shape)
            last = _index(first + k - 1, self.batch_shape)
            where = (
                f" on the chunk of batch indices {index} to {last} (flat "
                f"{first}..{first + k - 1} of batch shape {self.batch_shape})"
            )
        return KernelError(
            f"threadmap kernel {self.name!r} (vectorized){where} {what}",
            index=index,
            kernel_name=self.name,
            cause=cause,
        )

    def call(self, leaves: list[np.ndarray], first: int, k: int) -> list[np.ndarray]:
        """Runs the kernel on one chunk; returns its result leaves, checked."""
        try:
            result = self.apply(leaves)
        except PASS_THROUGH:
            raise
        except BaseException as e:
            what = f"raised {describe(e)}{kernel_traceback(e)}"
            raise self.error(first, k, what, e) from e
        if self.single_leaf and type(result) is np.ndarray:
            return [self._checked(result, 0, first, k)]
        values, tree = jax.tree_util.tree_flatten(result)
        if tree != self.out_tree:
            raise self.error(
                first,
                k,
                f"{self.structure_mismatch(tree)} Return a pytree with the same "
                "structure, each leaf with a leading axis of the chunk's length.",
            )
        return [self._checked(v, j, first, k) for j, v in enumerate(values)]

    def _checked(self, value: Any, j: int, first: int, k: int) -> np.ndarray:
        shape, dtype = self.out_core[j]
        if type(value) is np.ndarray and value.dtype == dtype:  # the usual case
            if value.shape == (k, *shape):
                return value
        return self.as_declared(
            value,
            j,
            (k, *shape),
            lambda what, cause=None: self.error(first, k, what, cause),
            f": the chunk's length {k}, then one element's shape {shape}. A "
            "vectorized kernel returns every result with the leading axis of its "
            "operands.",
        )


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))
