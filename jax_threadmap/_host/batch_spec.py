"""The batch spec: which vmap levels a `threadmap` equation carries, and where.

A `threadmap` equation starts unbatched. Each `vmap` level that reaches it adds
one entry: the level's size goes in front of ``shape`` (so ``shape`` lists levels
outermost first, like the output's leading axes), and every operand records the
position of that level's axis in its own array, or ``None`` when the operand is
not mapped at that level. Batched operands are never moved or tiled in the jaxpr;
the host side reads them through strided (and, for missing levels, zero-stride)
views.

It lives on the lowest floor of its users: the host's views and sums read it
(:mod:`.maps`, :mod:`.summing`), and the primitive's rules above grow it
(``_core``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

Axes = tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """Batch shape and per-operand batch axes of one `threadmap` equation.

    Attributes:
        shape: The batch shape, outermost vmap level first.
        in_axes: One tuple per operand, one entry per level (aligned with
            ``shape``): the axis of the operand's array that carries that level,
            or ``None`` where the operand is unbatched at that level.
        out_sum: Empty, or one tuple per output: the levels that the host sums
            away for that output (the output lacks those batch axes). Used by
            reverse-mode derivatives, for the cotangents of operands that are not
            batched at some levels.
    """

    shape: tuple[int, ...]
    in_axes: tuple[Axes, ...]
    out_sum: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def unbatched(cls, num_operands: int) -> BatchSpec:
        return cls((), ((),) * num_operands)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def grow(self, size: int, dims: Sequence[int | None]) -> BatchSpec:
        """Returns the spec with one more (outermost) level of ``size``.

        Args:
            size: The size of the new vmap axis.
            dims: For each operand, the position of the new axis in the operand
                as the batching rule receives it (non-negative), or ``None``.
        """
        new_axes = []
        for axes, d in zip(self.in_axes, dims, strict=True):
            if d is None:
                new_axes.append((None, *axes))
            else:
                shifted = tuple(None if a is None else a + (a >= d) for a in axes)
                new_axes.append((d, *shifted))
        # The new level is outermost and never summed: older level numbers shift.
        out_sum = tuple(tuple(level + 1 for level in levels) for levels in self.out_sum)
        return BatchSpec((size, *self.shape), tuple(new_axes), out_sum)

    def summed(self, k: int) -> tuple[int, ...]:
        """The levels summed away in output ``k``."""
        return self.out_sum[k] if self.out_sum else ()

    def kept(self, k: int) -> list[int]:
        """The levels that output ``k`` keeps as batch axes (not summed away)."""
        summed = self.summed(k)
        return [level for level in range(len(self.shape)) if level not in summed]

    def out_batch_shape(self, k: int) -> tuple[int, ...]:
        """The batch axes of output ``k``: ``shape`` without its summed levels."""
        return tuple(self.shape[level] for level in self.kept(k))

    def out_levels(self, n: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per output of ``n``: :meth:`summed` and :meth:`out_batch_shape`."""
        return [(self.summed(k), self.out_batch_shape(k)) for k in range(n)]

    def __str__(self) -> str:
        # Short, readable form for `jax.make_jaxpr`: one entry per operand, ``-``
        # where the operand is unbatched at that level.
        def fmt(axes: Axes) -> str:
            if all(a is None for a in axes):
                return "-"
            inner = ", ".join("-" if a is None else str(a) for a in axes)
            return f"({inner},)" if len(axes) == 1 else f"({inner})"

        ops = ", ".join(fmt(a) for a in self.in_axes)
        summed = ""
        if any(self.out_sum):
            summed = f", out_sum={self.out_sum}"
        return f"BatchSpec(shape={self.shape}, in_axes=[{ops}]{summed})"

    __repr__ = __str__
