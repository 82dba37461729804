"""Derivative rules of ``threadmap_p``: threaded JVP and VJP kernels.

The JVP rule binds the primal equation again and computes the output tangent with
a second ``threadmap`` equation (a :class:`~._params.JvpParam`), linear in its
tangent operands; the transpose rule of that equation runs the VJP kernel as a
third (a :class:`~._params.VjpParam`). All three fold under ``vmap`` through the
one batching rule. ``docs/architecture.md`` explains the design.

The rules receive ``bind`` (``threadmap_p.bind``) from the rule table in
:mod:`._primitive`, so this module does not import the primitive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from .._host import summing as _summing
from .._jax import hooks as _compat
from .batch_spec import Axes, BatchSpec
from .params import (
    JvpParam,
    KernelParam,
    VjpParam,
    is_differentiable,
    missing_rule_message,
    tangent_dtype,
)

Zero = _compat.Zero
Bind = Callable[..., Sequence[Any]]
T = TypeVar("T")


# --- JAX's partition_list / merge_lists idiom -----------------------------------------


def partition_list(which: Sequence[bool], xs: Sequence[T]) -> tuple[list[T], list[T]]:
    """Splits ``xs`` by ``which``: ``(xs where False, xs where True)``."""
    false: list[T] = []
    true: list[T] = []
    for w, x in zip(which, xs, strict=True):
        (true if w else false).append(x)
    return false, true


def merge_lists(
    which: Sequence[bool], false: Sequence[T], true: Sequence[T]
) -> list[T]:
    """The inverse of :func:`partition_list`."""
    it_false, it_true = iter(false), iter(true)
    return [next(it_true) if w else next(it_false) for w in which]


def _slots(which: Sequence[bool]) -> tuple[int | None, ...]:
    """Per entry, its index among the ``True`` entries, or ``None``."""
    count = 0
    out: list[int | None] = []
    for w in which:
        out.append(count if w else None)
        count += bool(w)
    return tuple(out)


# --- messages -------------------------------------------------------------------------


def no_derivative_rule_message(kernel: KernelParam) -> str:
    name = kernel.name
    cannot = (
        f"threadmap kernel {name!r} has no derivative rule, so jax.grad, jax.jvp "
        "and friends cannot differentiate through it."
    )
    if kernel.wrapped:
        name = name.rpartition(".")[2]  # the decorated name: "f", not "g.<locals>.f"
        return (
            f"{cannot} It is a jax_threadmap.kernel without derivative kernels: "
            f"attach them with {name}.defvjp(vjp_kernel) (for jax.grad, jax.vjp, "
            "jax.jacrev; vjp_kernel(*primals, cotangent) returns a tuple with one "
            f"cotangent per positional argument) and/or {name}.defjvp(jvp_kernel) "
            "(for jax.jvp, jax.jacfwd, jax.linearize; jvp_kernel(*primals, "
            "*tangents) returns the tangent of the output)."
        )
    return (
        f"{cannot} Wrap the kernel with "
        "jax_threadmap.kernel(result_shape_dtypes)(fn) and attach threaded "
        "derivative kernels with .defjvp(...) and/or .defvjp(...), or wrap the call "
        "in jax.custom_jvp / jax.custom_vjp."
    )


def _higher_order_message(kernel: JvpParam | VjpParam) -> str:
    kind = "JVP" if isinstance(kernel, JvpParam) else "VJP"
    return (
        f"threadmap kernel {kernel.primal.name!r}: higher-order derivatives (for "
        "example jax.hessian, or jax.grad of jax.grad) are not supported, because "
        f"its {kind} kernel {kernel.name!r} has no derivative rule of its own. "
        "Differentiate once, or express the derivative with jax.numpy so that "
        "JAX can differentiate it again."
    )


def _kwarg_names(in_tree: Any) -> list[str]:
    """The keyword name (with path) of each keyword-argument leaf."""
    kwargs_tree = in_tree.children()[1]
    tree = jax.tree_util.tree_unflatten(kwargs_tree, range(kwargs_tree.num_leaves))
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        f"{path[0].key!r}"
        + (f" (at {jax.tree_util.keystr(tuple(path[1:]))})" if path[1:] else "")
        for path, _ in paths
    ]


def _is_zero(t: Any) -> bool:
    return type(t) is Zero or _compat.typeof(t).dtype == jax.dtypes.float0


def _check_kwargs_not_differentiated(
    kernel: KernelParam, kw_tangents: Sequence[Any]
) -> None:
    for name, t in zip(_kwarg_names(kernel.in_tree), kw_tangents, strict=True):
        if not _is_zero(t):
            raise TypeError(
                f"threadmap kernel {kernel.name!r}: keyword argument {name} depends "
                "on the variable being differentiated, but keyword arguments are "
                "not differentiable (they get no tangent and no cotangent). Pass "
                "it positionally, or wrap it in jax.lax.stop_gradient if its "
                "derivative should be ignored."
            )


# --- JVP ------------------------------------------------------------------------------


def jvp_rule(
    bind: Bind,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    *,
    kernel: Any,
    result_avals: tuple[Any, ...],
    spec: BatchSpec,
    **params: Any,
) -> tuple[Sequence[Any], Sequence[Any]]:
    """JVP of a ``threadmap`` equation: the primal again, and a JVP equation."""
    _compat.require(_compat.DERIVATIVES, "Differentiating a threadmap kernel")
    if isinstance(kernel, JvpParam):
        return _linear_jvp(
            bind,
            primals,
            tangents,
            kernel=kernel,
            result_avals=result_avals,
            spec=spec,
            **params,
        )
    if isinstance(kernel, VjpParam):
        raise TypeError(_higher_order_message(kernel))
    if kernel.jvp is None and kernel.vjp is None:
        raise TypeError(no_derivative_rule_message(kernel))
    outs = bind(*primals, kernel=kernel, result_avals=result_avals, spec=spec, **params)
    num_pos = kernel.num_positional
    _check_kwargs_not_differentiated(kernel, tangents[num_pos:])
    live = [not _is_zero(t) for t in tangents[:num_pos]]
    _, tangent_ops = partition_list(live, tangents[:num_pos])
    _, tangent_axes = partition_list(live, spec.in_axes[:num_pos])
    out_mask = tuple(is_differentiable(a.dtype) for a in result_avals)
    zero_outs = [Zero(_compat.typeof(o).to_tangent_aval()) for o in outs]
    if not tangent_ops or not any(out_mask):
        return outs, zero_outs
    _, live_avals = partition_list(out_mask, result_avals)
    tangent_outs = bind(
        *primals,
        *tangent_ops,
        kernel=JvpParam(
            kernel,
            _slots(live),
            tuple((tuple(a.shape), a.dtype) for a in result_avals),
        ),
        result_avals=tuple(live_avals),
        spec=BatchSpec(spec.shape, spec.in_axes + tuple(tangent_axes)),
        **params,
    )
    dead_outs, _ = partition_list(out_mask, zero_outs)
    return outs, merge_lists(out_mask, dead_outs, list(tangent_outs))


def _linear_jvp(
    bind: Bind,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    *,
    kernel: JvpParam,
    **params: Any,
) -> tuple[Sequence[Any], Sequence[Any]]:
    """JVP of a JVP equation, which is linear in its non-primal operands.

    Supported where the primal operands have zero tangents (``jax.grad`` or
    ``jax.jvp`` of a ``jax.jvp`` with respect to the tangent); anything else is
    a second derivative of the user's kernel.
    """
    n = kernel.num_primals
    if not all(_is_zero(t) for t in tangents[:n]):
        raise TypeError(_higher_order_message(kernel))
    outs = bind(*primals, kernel=kernel, **params)
    linear = [
        _compat.instantiate_zeros(t) if type(t) is Zero else t for t in tangents[n:]
    ]
    return outs, bind(*primals[:n], *linear, kernel=kernel, **params)


# --- transpose ------------------------------------------------------------------------


def transpose_rule(
    bind: Bind,
    cts: Sequence[Any],
    *args: Any,
    kernel: Any,
    result_avals: tuple[Any, ...],
    spec: BatchSpec,
    **params: Any,
) -> list[Any]:
    """Transpose of a JVP equation: a ``threadmap`` equation running the VJP kernel.

    Its results carry the batch levels at which their operand is batched, in the
    operand's own axes; the host sums the levels at which it is not. The
    equation is the same whatever the executor.
    """
    _compat.require(_compat.DERIVATIVES, "Differentiating a threadmap kernel")
    del result_avals
    jvp = _transposable(kernel)
    n = jvp.num_primals
    primals, tangent_ops = args[:n], args[n:]
    undefined = [_compat.is_undefined_primal(t) for t in tangent_ops]
    out: list[Any] = [
        Zero(t.aval) if u else None for t, u in zip(tangent_ops, undefined, strict=True)
    ]
    # Per output leaf of the kernel: its cotangent, if it has a nonzero one.
    num_dead = len(jvp.out_mask) - sum(jvp.out_mask)
    per_output = merge_lists(jvp.out_mask, [None] * num_dead, list(cts))
    has_ct = [ct is not None and type(ct) is not Zero for ct in per_output]
    if not any(undefined) or not any(has_ct):
        return [None] * n + out
    _, ct_ops = partition_list(has_ct, per_output)
    wanted, slots = _linear_leaves(jvp, undefined)
    axes = [spec.in_axes[n + s] for s in slots]
    avals = [tangent_ops[s].aval for s in slots]
    cts_out = bind(
        *primals,
        *ct_ops,
        kernel=VjpParam(
            jvp.primal,
            _slots(has_ct),
            tuple((shape, tangent_dtype(dtype)) for shape, dtype in jvp.out_avals),
            tuple(wanted),
        ),
        result_avals=tuple(
            _compat.ShapedArray(_core_shape(a.shape, ax), a.dtype)
            for a, ax in zip(avals, axes, strict=True)
        ),
        spec=BatchSpec(
            spec.shape,
            spec.in_axes[:n] + (tuple(range(len(spec.shape))),) * len(ct_ops),
            tuple(_summing.summed_levels(ax) for ax in axes),
        ),
        **params,
    )
    for s, ax, aval, ct in zip(slots, axes, avals, cts_out, strict=True):
        out[s] = _to_operand(ct, ax, aval)
    return [None] * n + out


def _linear_leaves(jvp: JvpParam, undefined: list[bool]) -> tuple[list[int], list[int]]:
    """The positional leaves whose tangent operand is a linear input, and
    those operands' slots."""
    wanted: list[int] = []
    slots: list[int] = []
    for leaf, slot in enumerate(jvp.tangent_slots):
        if slot is not None and undefined[slot]:
            wanted.append(leaf)
            slots.append(slot)
    return wanted, slots


def _transposable(kernel: Any) -> JvpParam:
    """``kernel`` if it is a JVP equation's with a VJP kernel; else a clear error."""
    if isinstance(kernel, KernelParam):
        raise TypeError(no_derivative_rule_message(kernel))
    if not isinstance(kernel, JvpParam):
        raise TypeError(_higher_order_message(kernel))
    if kernel.primal.vjp is None:
        raise TypeError(missing_rule_message(kernel.primal, "vjp"))
    return kernel


def _core_shape(shape: Sequence[int], axes: Axes) -> tuple[int, ...]:
    batch = {a for a in axes if a is not None}
    return tuple(s for d, s in enumerate(shape) if d not in batch)


def _to_operand(ct: Any, axes: Axes, aval: Any) -> Any:
    """A cotangent (kept batch levels first, summed ones gone) in the operand's layout.

    The kept levels go back to the axis they have in the operand. Inside
    shard_map, an operand that is the same on every shard (not varying over some
    mesh axes the cotangent varies over) gets the sum of every shard's
    contribution, as JAX's ``pvary`` transposes to ``psum``.
    """
    kept = [a for a in axes if a is not None]  # operand axis of each kept level
    core = iter(range(len(kept), ct.ndim))
    perm = [kept.index(d) if d in kept else next(core) for d in range(ct.ndim)]
    if perm != list(range(ct.ndim)):
        ct = jax.lax.transpose(ct, perm)
    summed = _compat.varying_axes(_compat.typeof(ct)) - _compat.varying_axes(aval)
    if summed:
        ct = jax.lax.psum(ct, tuple(sorted(summed)))
    return ct
