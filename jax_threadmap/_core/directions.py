"""``defjvp(fwd, jvp, residuals=..., directions=True)``: a ``vmap`` level at
which a ``lin`` equation's tangents are batched and its residuals are not (the
directions of ``jax.jacfwd``) is folded into the tangents and results as their
leading core axis (:func:`fold`), so ``jvp`` runs once per element. The JVP and
transpose of a folded equation are those of the unfolded one under ``vmap``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._host.batch_spec import Axes, BatchSpec
from .._jax import avals as _avals
from .._jax import primitive_rules as _rules
from .params import DerivativeParam


def _shape(x: Any) -> tuple[int, ...]:
    """The shape of an operand, or of an undefined one (a transpose's)."""
    return (x.aval if _rules.is_undefined_primal(x) else _avals.typeof(x)).shape


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


def _unfold(
    eqn: dict[str, Any], operands: Sequence[Any]
) -> tuple[dict[str, Any], list[int | None], list[int]]:
    """The equation with its last folded level unfolded (one element of it),
    the axis of that level in each operand, and in each result."""
    kernel, spec = eqn["kernel"], eqn["spec"]
    num_base = sum(kernel.present[: kernel.node.num_base])
    in_axes: list[int | None] = [None] * num_base + [
        _first_core(len(_shape(x)), axes)
        for x, axes in zip(operands[num_base:], spec.in_axes[num_base:], strict=True)
    ]
    inner_axes = [
        axes if c is None else tuple(None if a is None else a - (a > c) for a in axes)
        for axes, c in zip(spec.in_axes, in_axes, strict=True)
    ]
    inner = {
        **eqn,
        "kernel": dataclasses.replace(kernel, directions=kernel.directions[1:]),
        "spec": BatchSpec(spec.shape, tuple(inner_axes), spec.out_sum),
        "result_avals": tuple(
            _avals.ShapedArray(a.shape[1:], a.dtype) for a in eqn["result_avals"]
        ),
    }
    out_axes = [len(spec.out_batch_shape(k)) for k in range(len(eqn["result_avals"]))]
    return inner, in_axes, out_axes


def unfolded_jvp(
    bind: Callable[..., Sequence[Any]],
    primals: Sequence[Any],
    tangents: Sequence[Any],
    eqn: dict[str, Any],
) -> tuple[Sequence[Any], Sequence[Any]]:
    """``vmap`` over the last folded level of the unfolded equation's JVP."""
    inner, in_axes, out_axes = _unfold(eqn, primals)
    n = len(primals)

    def one(*ops: Any) -> tuple[Any, Any]:
        return jax.jvp(lambda *p: bind(*p, **inner), ops[:n], ops[n:])

    tangents = [_rules.instantiate_zeros(t) for t in tangents]
    return jax.vmap(one, in_axes=(*in_axes, *in_axes), out_axes=(out_axes, out_axes))(
        *primals, *tangents
    )


def unfolded_transpose(
    bind: Callable[..., Sequence[Any]],
    cts: Sequence[Any],
    args: Sequence[Any],
    eqn: dict[str, Any],
) -> list[Any]:
    """``vmap`` over the last folded level of the unfolded equation's transpose."""
    inner, in_axes, out_axes = _unfold(eqn, args)
    undefined = [_rules.is_undefined_primal(x) for x in args]
    spec, avals = eqn["spec"], eqn["result_avals"]
    cts = [
        _instantiated(ct, spec.out_batch_shape(k) + a.shape, a.dtype)
        for k, (ct, a) in enumerate(zip(cts, avals, strict=True))
    ]
    known = [
        (x, ax) for x, ax, u in zip(args, in_axes, undefined, strict=True) if not u
    ]
    unknown = [(x, ax) for x, ax, u in zip(args, in_axes, undefined, strict=True) if u]

    def one(cts: list[Any], defined: list[Any]) -> Any:
        def f(*linear: Any) -> Any:
            it, known = iter(linear), iter(defined)
            return bind(*(next(it) if u else next(known) for u in undefined), **inner)

        sliced = [_without_axis(x.aval, ax) for x, ax in unknown]
        return jax.linear_transpose(f, *sliced)(list(cts))

    results = iter(
        jax.vmap(
            one,
            in_axes=(out_axes, [ax for _, ax in known]),
            out_axes=tuple(ax for _, ax in unknown),
        )(cts, [x for x, _ in known])
    )
    return [next(results) if u else None for u in undefined]


def _instantiated(ct: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    return jnp.zeros(shape, dtype) if ct is None or type(ct) is _rules.Zero else ct


def _without_axis(aval: Any, axis: int | None) -> jax.ShapeDtypeStruct:
    assert axis is not None  # an undefined operand is a tangent: it has the level
    shape = aval.shape
    return jax.ShapeDtypeStruct((*shape[:axis], *shape[axis + 1 :]), aval.dtype)
