"""Derivative rules of ``threadmap_p``: threaded JVP and VJP kernels, at any order.

The JVP rule binds the equation again and computes the output tangent with a
second ``threadmap`` equation that runs the kernel's JVP kernel (a
:class:`~.params.DerivativeParam` of the derived :class:`~.params.Node`),
linear in its tangent operands; the transpose rule of such an equation runs the
dual kernel (the VJP kernel for a JVP equation, and back) as a third. A
derivative kernel that is a ``jax_threadmap.kernel`` brings its own rules, so
the same two rules give the next order: the JVP of a VJP equation runs the VJP
kernel's JVP kernel, and so on. All of them fold under ``vmap`` through the one
batching rule. ``docs/architecture-design.md`` explains the design.

The rules receive ``bind`` (``threadmap_p.bind``) where :mod:`.primitive`
registers them, so this module does not import the primitive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from .._host import summing as _summing
from .._host.batch_spec import Axes, BatchSpec
from .._jax import avals as _avals
from .._jax import hooks as _hooks
from .._jax import rule_tables as _tables
from .._support import validate as _validate
from . import directions as _directions
from .params import (
    DerivativeParam,
    KernelParam,
    Node,
    ResidualRule,
    is_differentiable,
)
from .rule_messages import no_derivative_rule_message, no_rules_message

Zero = _tables.Zero
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


def _kwarg_names(in_tree: Any) -> list[str]:
    """Each keyword-argument leaf as messages name it (with its path)."""
    args = jax.tree_util.tree_unflatten(in_tree, range(in_tree.num_leaves))
    paths = jax.tree_util.tree_flatten_with_path(args)[0]
    return [_validate.arg_name(path) for path, _ in paths if path[0].idx == 1]


def _is_zero(t: Any) -> bool:
    """Whether a tangent is zero: symbolic, float0, or not an operand (``None``)."""
    return t is None or type(t) is Zero or _avals.typeof(t).dtype == jax.dtypes.float0


def _check_kwargs_not_differentiated(
    kernel: KernelParam, kw_tangents: Sequence[Any]
) -> None:
    for name, t in zip(_kwarg_names(kernel.in_tree), kw_tangents, strict=True):
        if not _is_zero(t):
            raise TypeError(
                f"threadmap kernel {kernel.name!r}: {name} depends "
                "on the variable being differentiated, but keyword arguments are "
                "not differentiable (they get no tangent and no cotangent). Pass "
                "it positionally, or wrap it in jax.lax.stop_gradient if its "
                "derivative should be ignored."
            )


def _equation_view(
    kernel: Any, primals: Sequence[Any], result_avals: Sequence[Any], spec: BatchSpec
) -> tuple[Node, tuple[bool, ...], tuple[bool, ...]]:
    """``(node, present, keep)`` of an equation; a primal one gets its root node."""
    if isinstance(kernel, DerivativeParam):
        return kernel.node, kernel.present, kernel.keep
    node = Node(
        kernel,
        tuple(
            (_core_shape(aval.shape, ax), aval.dtype)
            for aval, ax in zip(map(_avals.typeof, primals), spec.in_axes, strict=True)
        ),
        tuple((tuple(a.shape), a.dtype) for a in result_avals),
    )
    return node, (True,) * len(primals), (True,) * len(result_avals)


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
    """JVP of a ``threadmap`` equation: the equation again (or, for a kernel
    whose VJP has residuals, its ``fwd`` equation), and a tangent equation."""
    _hooks.require(_hooks.DERIVATIVES, "Differentiating a threadmap kernel")
    node, present, keep = _equation_view(kernel, primals, result_avals, spec)
    eqn = dict(kernel=kernel, result_avals=result_avals, spec=spec, **params)
    num_base = sum(present[: node.num_base])
    if node.base is not None and all(map(_is_zero, tangents[:num_base])):
        # A derivative equation is linear in its new leaves: where only those
        # have tangents, its JVP is the equation itself, no new kernel needed.
        return _linear_jvp(bind, primals, tangents, num_base, eqn)
    if isinstance(kernel, DerivativeParam) and kernel.directions:
        kernel, spec, result_avals = _directions.unfold(
            kernel, spec, result_avals, primals
        )
        eqn = dict(kernel=kernel, result_avals=result_avals, spec=spec, **params)
    _check_has_rules(kernel, node)
    leaf_tangents = _per_leaf(present, tangents)
    _check_kwargs_not_differentiated(
        node.kernel, [leaf_tangents[i] for i in node.keywords]
    )
    positional = [leaf_tangents[i] for i in node.positional]
    live = tuple(not _is_zero(t) for t in positional)
    # Per result of this equation: whether it has a tangent (is not an integer).
    out_mask = [is_differentiable(a.dtype) for a in result_avals]
    if not any(live) or not any(out_mask):
        outs = bind(*primals, **eqn)
        return outs, [Zero(_avals.typeof(o).to_tangent_aval()) for o in outs]
    _, tangent_ops = partition_list(live, positional)
    leaf_axes = _per_leaf(present, spec.in_axes)
    _, tangent_axes = partition_list(live, [leaf_axes[i] for i in node.positional])
    _, live_avals = partition_list(out_mask, result_avals)
    tangent_eqn = dict(
        keep=tuple(merge_lists(keep, [False] * keep.count(False), out_mask)),
        result_avals=tuple(live_avals),
        out_sum=_kept_sums(spec, out_mask),
    )
    if isinstance(node.rule("vjp"), ResidualRule):
        outs, tangent_outs = _residual_jvp(
            bind, node, primals, (live, tangent_ops, tangent_axes), tangent_eqn, eqn
        )
    else:
        outs = bind(*primals, **eqn)
        tangent_outs = bind(
            *primals,
            *tangent_ops,
            kernel=DerivativeParam(
                node.derive("jvp"), present + live, tangent_eqn["keep"]
            ),
            result_avals=tangent_eqn["result_avals"],
            spec=BatchSpec(
                spec.shape, spec.in_axes + tuple(tangent_axes), tangent_eqn["out_sum"]
            ),
            **params,
        )
    zero_outs = [Zero(_avals.typeof(o).to_tangent_aval()) for o in outs]
    dead_outs, _ = partition_list(out_mask, zero_outs)
    return outs, merge_lists(out_mask, dead_outs, list(tangent_outs))


def _residual_jvp(
    bind: Bind,
    node: Node,
    primals: Sequence[Any],
    tangents: tuple[tuple[bool, ...], Sequence[Any], Sequence[Axes]],
    tangent_eqn: dict[str, Any],
    eqn: dict[str, Any],
) -> tuple[Sequence[Any], Sequence[Any]]:
    """The JVP of an equation whose kernel's VJP has residuals, as JAX's
    ``custom_vjp`` does it: the ``fwd`` equation gives the outputs and the
    residuals (batched like outputs, kept where JAX keeps arrays), and a ``lin``
    equation, linear in the tangents, gives the tangents. Reverse mode transposes
    ``lin`` into the ``bwd`` equation over the residuals and never runs it;
    running it runs ``defjvp(fwd, jvp, ...)``'s ``jvp`` on the residuals, or
    else the kernel's JVP kernel, which needs the primals: they are operands
    only then. Under ``jacfwd`` only ``lin`` gets the directions' level, so
    ``fwd`` runs once per element for all of them."""
    live, tangent_ops, tangent_axes = tangents
    kernel, spec, result_avals = eqn["kernel"], eqn["spec"], eqn["result_avals"]
    _, present, keep = _equation_view(kernel, primals, result_avals, spec)
    res_avals = [
        _avals.ShapedArray(shape, dtype)
        for shape, dtype in node.residual_rule.res_avals
    ]
    n_out, n_res = len(result_avals), len(res_avals)
    fwd_outs = bind(
        *primals,
        **{
            **eqn,
            "kernel": DerivativeParam(
                node.derive("fwd"), present, keep + (True,) * n_res
            ),
            "result_avals": tuple(result_avals) + tuple(res_avals),
            "spec": BatchSpec(
                spec.shape,
                spec.in_axes,
                spec.out_sum + ((),) * n_res if spec.out_sum else (),
            ),
        },
    )
    outs, res = fwd_outs[:n_out], fwd_outs[n_out:]
    lin = node.derive("lin")
    # The primals (but the keyword arguments, which bwd takes) only for a JVP
    # kernel that takes them.
    on_primals = lin.rule_object is not None and not lin.residual_jvp
    drop = () if on_primals else node.positional
    lin_base = tuple(here and i not in drop for i, here in enumerate(present))
    _, base_ops = partition_list(lin_base, _per_leaf(present, primals))
    _, base_axes = partition_list(lin_base, _per_leaf(present, spec.in_axes))
    res_axes = [tuple(range(len(spec.shape)))] * n_res  # batched at every level
    tangent_outs = bind(
        *base_ops,
        *res,
        *tangent_ops,
        kernel=DerivativeParam(
            lin, lin_base + (True,) * n_res + live, tangent_eqn["keep"]
        ),
        result_avals=tangent_eqn["result_avals"],
        spec=BatchSpec(
            spec.shape,
            tuple(base_axes) + tuple(res_axes) + tuple(tangent_axes),
            tangent_eqn["out_sum"],
        ),
        **{k: v for k, v in eqn.items() if k not in ("kernel", "result_avals", "spec")},
    )
    return outs, tangent_outs


def _per_leaf(present: Sequence[bool], operands: Sequence[Any]) -> list[Any]:
    """Per leaf of a node, its operand, or ``None`` where it is not one."""
    return merge_lists(present, [None] * list(present).count(False), operands)


def _check_has_rules(kernel: Any, node: Node) -> None:
    """A clear error, before anything is bound, for a kernel with no rules at all.

    (With only a VJP kernel the JVP equation is bound all the same: reverse mode
    transposes it without running it, and running it names the missing rule.)
    """
    if node.rule("jvp") is not None or node.rule("vjp") is not None:
        return
    if node.base is None:
        raise TypeError(no_derivative_rule_message(kernel.name, kernel.wrapped))
    if node.rule_object is None:  # its base lacks the rule (no kernel to give rules)
        raise TypeError(node.missing_rule())
    raise TypeError(no_rules_message(node))


def _kept_sums(spec: BatchSpec, mask: Sequence[bool]) -> tuple[tuple[int, ...], ...]:
    """``spec.out_sum`` for the outputs in ``mask`` (a tangent is summed like
    its output)."""
    if not spec.out_sum:
        return ()
    return tuple(spec.summed(k) for k, m in enumerate(mask) if m)


def _linear_jvp(
    bind: Bind,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    num_base: int,
    eqn: dict[str, Any],
) -> tuple[Sequence[Any], Sequence[Any]]:
    """JVP of a derivative equation where only its linear operands (the ones
    after the first ``num_base``) have tangents: the equation of those tangents."""
    kernel: DerivativeParam = eqn["kernel"]
    spec: BatchSpec = eqn["spec"]
    outs = bind(*primals, **eqn)
    live = [not _is_zero(t) for t in tangents[num_base:]]
    if not any(live):
        return outs, [Zero(_avals.typeof(o).to_tangent_aval()) for o in outs]
    nb = kernel.node.num_base
    new_present = iter(live)
    present = kernel.present[:nb] + tuple(
        here and next(new_present) for here in kernel.present[nb:]
    )
    _, linear = partition_list(live, tangents[num_base:])
    _, linear_axes = partition_list(live, spec.in_axes[num_base:])
    return outs, bind(
        *primals[:num_base],
        *linear,
        **{
            **eqn,
            "kernel": dataclasses.replace(kernel, present=present),
            "spec": BatchSpec(
                spec.shape, spec.in_axes[:num_base] + tuple(linear_axes), spec.out_sum
            ),
        },
    )


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
    """Transpose of a derivative equation: a ``threadmap`` equation running the
    dual kernel (the VJP kernel for a JVP equation, the JVP kernel for a VJP one,
    ``bwd`` for the JVP over residuals: see :func:`_dual`).

    Each result carries the batch levels at which its operand is batched, in the
    operand's own axes; the host sums the levels at which it is not. The
    equation is the same whatever the executor.
    """
    _hooks.require(_hooks.DERIVATIVES, "Differentiating a threadmap kernel")
    if isinstance(kernel, KernelParam):  # only derivative equations are linear
        raise TypeError(no_derivative_rule_message(kernel.name, kernel.wrapped))
    node, present = kernel.node, kernel.present
    num_base = sum(present[: node.num_base])
    base_ops, linear_ops = args[:num_base], args[num_base:]
    if any(map(_tables.is_undefined_primal, base_ops)):
        raise TypeError(_not_linear_message(node))
    if kernel.directions:
        kernel, spec, _ = _directions.unfold(kernel, spec, result_avals, args)
    undefined = [_tables.is_undefined_primal(t) for t in linear_ops]
    out: list[Any] = [
        Zero(t.aval) if u else None for t, u in zip(linear_ops, undefined, strict=True)
    ]
    # Per result of this equation: whether it has a nonzero cotangent.
    has_ct = [ct is not None and type(ct) is not Zero for ct in cts]
    dual, slots, pick = _dual(kernel, has_ct, undefined)
    if not any(has_ct) or not slots:
        return [None] * num_base + out
    base: tuple[Sequence[Any], Sequence[Axes]]
    base = ([base_ops[i] for i in pick], [spec.in_axes[i] for i in pick])
    if isinstance(dual.node.rule_object, ResidualRule):
        dual, base = _residual_dual(bind, dual, base, spec, params)
    results = _bind_dual(bind, dual, slots, base, cts, has_ct, linear_ops, spec, params)
    for s, ct in zip(slots, results, strict=True):
        out[s] = _to_operand(ct, spec.in_axes[num_base + s], linear_ops[s].aval)
    return [None] * num_base + out


def _not_linear_message(node: Node) -> str:
    return (
        f"threadmap kernel {node.name!r}: JAX asked for the transpose with "
        "respect to an operand that the equation is not linear in."
    )


def _bind_dual(
    bind: Bind,
    dual: DerivativeParam,
    slots: Sequence[int],
    base: tuple[Sequence[Any], Sequence[Axes]],
    cts: Sequence[Any],
    has_ct: Sequence[bool],
    linear_ops: Sequence[Any],
    spec: BatchSpec,
    params: dict[str, Any],
) -> Sequence[Any]:
    """Binds the dual equation over the ``base`` operands it takes (with their
    axes): the cotangents of the linear operands in ``slots``, each summed over
    the levels at which its operand is not batched."""
    base_ops, base_axes = base
    num_base = len(spec.in_axes) - len(linear_ops)
    axes = [spec.in_axes[num_base + s] for s in slots]
    linear = [linear_ops[s].aval for s in slots]
    _, ct_ops = partition_list(has_ct, cts)
    ct_axes = [_result_axes(spec, k) for k, h in enumerate(has_ct) if h]
    return bind(
        *base_ops,
        *ct_ops,
        kernel=dual,
        result_avals=tuple(
            _avals.ShapedArray(_core_shape(a.shape, ax), a.dtype)
            for a, ax in zip(linear, axes, strict=True)
        ),
        spec=BatchSpec(
            spec.shape,
            tuple(base_axes) + tuple(ct_axes),
            tuple(map(_summing.summed_levels, axes)),
        ),
        **params,
    )


def _dual(
    kernel: DerivativeParam, has_ct: Sequence[bool], undefined: Sequence[bool]
) -> tuple[DerivativeParam, list[int], list[int]]:
    """The param of the transpose of ``kernel``'s equation, the linear operands
    (by index among them) whose cotangents it returns, and the base operands
    (by index among them) it takes, in its order.

    The dual node has this node's outputs as its new leaves, and returns the
    cotangents of this node's new leaves: it takes the cotangents that exist and
    returns those of the linear operands that JAX asks for. It is

    - for a JVP kernel, the VJP kernel of the same base, and the other way round
      (the same base leaves);
    - for ``lin`` (a JVP over residuals), ``bwd``: the residuals and the keyword
      arguments of ``lin``'s base leaves;
    - for ``bwd``, which is linear in its cotangent, its own VJP kernel, whose
      cotangent of that cotangent is the transpose whatever its value: the
      value is left out (zeros), and so are the cotangents of the residuals.
    """
    node, present, keep = kernel.node, kernel.present, kernel.keep
    cts = iter(has_ct)
    ct_present = tuple(k and next(cts) for k in keep)
    linear_present = present[node.num_base :]
    dual, base_present, pick, lead = _dual_node(node, present)
    wanted = iter(undefined)
    linear_keep = tuple(
        here and next(wanted) and is_differentiable(aval[1])
        for here, aval in zip(linear_present, dual.out_avals[len(lead) :], strict=True)
    )
    new_leaves = [m for m, here in enumerate(linear_present) if here]
    slots = [s for s, m in enumerate(new_leaves) if linear_keep[m]]
    param = DerivativeParam(dual, base_present + ct_present, lead + linear_keep)
    return param, slots, pick


def _dual_node(
    node: Node, present: tuple[bool, ...]
) -> tuple[Node, tuple[bool, ...], list[int], tuple[bool, ...]]:
    """:func:`_dual`'s node, which of its base leaves are operands, which base
    operands of ``node``'s equation those are (in its order), and the outputs
    it leaves out before the cotangents of ``node``'s new leaves."""
    base, nb = node.base, node.num_base
    assert base is not None
    pick = list(range(sum(present[:nb])))
    if node.kind == "lin":
        operand = _slots(present[:nb])
        leaves = [*range(len(base.in_avals), nb), *base.keywords]
        pick = [i for i in (operand[j] for j in leaves) if i is not None]
        return base.derive("bwd"), tuple(present[i] for i in leaves), pick, ()
    if node.kind == "bwd":
        absent = (False,) * (len(present) - nb)  # the cotangent's value
        lead = (False,) * (nb - len(node.keywords))  # the residuals' cotangents
        return node.derive("vjp"), present[:nb] + absent, pick, lead
    dual = base.derive("vjp" if node.kind == "jvp" else "jvp")
    return dual, present[:nb], pick, ()


def _residual_dual(
    bind: Bind,
    dual: DerivativeParam,
    base: tuple[Sequence[Any], Sequence[Axes]],
    spec: BatchSpec,
    params: dict[str, Any],
) -> tuple[DerivativeParam, tuple[Sequence[Any], Sequence[Axes]]]:
    """The dual of a ``bwd`` equation (see :func:`_dual`) whose own VJP is given
    with residuals: its ``fwd`` equation for the residuals, at a zero cotangent
    (the transpose does not depend on it), then the param of its ``bwd`` over
    them, and the base operands that takes."""
    node = dual.node.base  # the bwd node
    assert node is not None
    rule = node.residual_rule
    base_ops, base_axes = base
    n_out, n_res = len(node.out_avals), len(rule.res_avals)
    leaves = dual.present[: len(node.in_avals)]  # the cotangent is left out
    res = bind(
        *base_ops,
        kernel=DerivativeParam(
            node.derive("fwd"), leaves, (False,) * n_out + (True,) * n_res
        ),
        result_avals=tuple(_avals.ShapedArray(*aval) for aval in rule.res_avals),
        spec=BatchSpec(spec.shape, tuple(base_axes), ()),
        **params,
    )
    # The keyword arguments among the base operands, which bwd takes too.
    operand = _slots(leaves)
    keywords = [operand[i] for i in node.keywords if leaves[i]]
    present = (
        (True,) * n_res
        + tuple(leaves[i] for i in node.keywords)
        + dual.present[len(node.in_avals) :]
    )
    all_levels = tuple(range(len(spec.shape)))
    return DerivativeParam(node.derive("bwd"), present, dual.keep), (
        [*res, *(base_ops[k] for k in keywords if k is not None)],
        [*(all_levels,) * n_res, *(base_axes[k] for k in keywords if k is not None)],
    )


def _result_axes(spec: BatchSpec, k: int) -> Axes:
    """Per batch level, the axis of result ``k`` that carries it (kept levels come
    first, in order), or ``None`` where the host summed it away."""
    rank = {level: r for r, level in enumerate(spec.kept(k))}
    return tuple(rank.get(level) for level in range(len(spec.shape)))


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
    summed = _avals.varying_axes(_avals.typeof(ct)) - _avals.varying_axes(aval)
    if summed:
        ct = jax.lax.psum(ct, tuple(sorted(summed)))
    return ct
