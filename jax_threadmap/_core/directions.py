"""``defjvp(fwd, jvp, residuals=..., directions=True)``: a ``vmap`` level at
which a ``lin`` equation's tangents are batched and its residuals are not (the
directions of ``jax.jacfwd``) is folded into the tangents and results as their
leading core axis (:func:`fold`), so ``jvp`` runs once per element. The JVP and
transpose of a folded equation are those of the same equation with those levels
as batch levels (:func:`unfold`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from .._host.batch_spec import Axes, BatchSpec
from .._jax import avals as _avals
from .._jax import rule_tables as _tables
from .params import DerivativeParam


def _first_core(ndim: int, axes: Axes) -> int:
    """The first axis of an operand that no batch level carries."""
    return min(set(range(ndim)) - set(axes), default=ndim)


def fold(
    bind: Callable[..., Sequence[Any]],
    args: Sequence[Any],
    dims: Sequence[int | None],
    size: int,
    *,
    kernel: Any,
    spec: BatchSpec,
    result_avals: tuple[Any, ...],
    **params: Any,
) -> tuple[Sequence[Any], list[int]] | None:
    """The batching rule of a folding equation, or ``None``."""
    if not isinstance(kernel, DerivativeParam) or not kernel.folds:
        return None
    num_base = sum(kernel.present[: kernel.node.num_base])
    if any(d is not None for d in dims[:num_base]):
        return None
    ops, in_axes = list(args[:num_base]), list(spec.in_axes[:num_base])
    linear = zip(args[num_base:], dims[num_base:], spec.in_axes[num_base:], strict=True)
    for x, d, axes in linear:
        x = jnp.asarray(x)  # a Python number (a literal) has no shape
        c = _first_core(x.ndim - (d is not None), axes)  # the level goes there
        if d is None:  # the same tangent for every direction
            shape = (*x.shape[:c], size, *x.shape[c:])
            x = jnp.broadcast_to(jnp.expand_dims(x, c), shape)
        else:
            x = jnp.moveaxis(x, d, c)
        ops.append(x)
        in_axes.append(tuple(None if a is None else a + (a >= c) for a in axes))
    outs = bind(
        *ops,
        kernel=dataclasses.replace(kernel, directions=(size, *kernel.directions)),
        spec=BatchSpec(spec.shape, tuple(in_axes), spec.out_sum),
        result_avals=tuple(
            _avals.ShapedArray((size, *a.shape), a.dtype) for a in result_avals
        ),
        **params,
    )
    return outs, [len(spec.out_batch_shape(k)) for k in range(len(outs))]


def unfold(
    kernel: DerivativeParam,
    spec: BatchSpec,
    result_avals: tuple[Any, ...],
    operands: Sequence[Any],
) -> tuple[DerivativeParam, BatchSpec, tuple[Any, ...]]:
    """The same equation with its folded levels as its innermost batch levels
    (the axes they have in the tangents and results), for its JVP and transpose."""
    num_base, k = sum(kernel.present[: kernel.node.num_base]), len(kernel.directions)
    in_axes = [axes + (None,) * k for axes in spec.in_axes[:num_base]]
    for x, axes in zip(operands[num_base:], spec.in_axes[num_base:], strict=True):
        aval = x.aval if _tables.is_undefined_primal(x) else _avals.typeof(x)
        c = _first_core(len(aval.shape), axes)  # (undefined: a transpose's operand)
        in_axes.append(axes + tuple(range(c, c + k)))
    return (
        dataclasses.replace(kernel, directions=()),
        BatchSpec(spec.shape + kernel.directions, tuple(in_axes), spec.out_sum),
        tuple(_avals.ShapedArray(a.shape[k:], a.dtype) for a in result_avals),
    )
