"""Derivative rules of ``threadmap_p``: threaded JVP and VJP kernels.

The design follows how JAX differentiates its own primitives (``mul``,
``dot_general``): rules on the primitive, and derivative computations that are
equations of the *same* primitive, not a stack of ``custom_jvp``/``custom_vjp``
wrappers around the call.

- The kernel param of a primal equation carries the user's derivative kernels
  (:class:`Rules`, attached with ``jax_threadmap.kernel(...).defjvp/.defvjp``).
- The JVP rule binds the primal equation again, and computes the output tangent
  with a second ``threadmap`` equation over ``(primals, tangents)`` that runs
  the JVP kernel. That equation is linear in its tangent operands; the primal
  operands are residuals. Its batch spec extends the primal one (each tangent
  has the layout of its primal), so every later ``vmap`` level folds into it
  like into the primal, through the one batching rule of ``threadmap_p``.
- The transpose rule of that linear equation runs the VJP kernel as a third
  ``threadmap`` equation over ``(primals, output cotangent)``. Its results carry
  the full batch shape; for each operand, the levels at which the operand is not
  batched are summed and the others are moved back to the operand's own axes,
  so ``grad(lambda x: vmap(f, in_axes=(0, None))(x, y).sum())`` never tiles
  ``y`` in the forward pass.

Under ``jax.grad`` the linear equation is traced and transposed, never run, so a
VJP kernel alone is enough for reverse mode; running it (``jax.jvp``,
``jax.jacfwd``, ``jax.linearize``) needs the JVP kernel and fails while
compiling otherwise, as JAX's own ``custom_lin`` does for ``custom_vjp``.

Why not ``custom_jvp``/``custom_vjp`` around the call: their rules are Python
functions traced per call site, the ``vmap`` of a ``custom_vjp`` backward pass
is batched with the ``pure_callback`` rules this package replaces, and the
jaxpr shows opaque custom-call wrappers instead of ``threadmap`` equations.
Rules on the primitive give one equation per derivative kernel, at any nesting
of ``vmap``, ``jit``, ``grad`` and ``jacfwd``/``jacrev``.

Derivative equations have no derivatives of their own (hessians and ``grad`` of
``grad`` raise), except that they are linear in their tangent operands, which
is all ``jax.linear_transpose`` and ``vmap`` of ``jvp`` need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat, _executor
from ._batch_spec import BatchSpec
from ._primitive import Kernel, kernel_name, threadmap_p

Zero = _compat.Zero

# --- the params -----------------------------------------------------------------


class Rules:
    """A primal kernel with its derivative kernels.

    It is the ``fn`` of a primal equation's :class:`Kernel` param, so the rules
    travel with the equation through every transformation. It compares by
    identity: ``jax_threadmap.kernel`` keeps one per set of rules, so params of
    repeated calls are equal and caches hit.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        jvp: Callable[..., Any] | None,
        vjp: Callable[..., Any] | None,
    ):
        self.fn = fn
        self.jvp = jvp
        self.vjp = vjp
        # `kernel_name` reads these, so jaxprs and errors show the user's kernel.
        self.__qualname__ = self.__name__ = kernel_name(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Rules({self.__qualname__}, jvp={self.jvp!r}, vjp={self.vjp!r})"


class DerivativeKernel(Kernel):
    """The kernel param of a JVP or VJP equation.

    Its host adapter (``_JvpHost`` or ``_VjpHost``) is a frozen dataclass, so
    the params of repeated traces are equal by value and caches hit.
    """

    host: _JvpHost | _VjpHost

    def __init__(self, host: _JvpHost | _VjpHost):
        # Kernel is a frozen dataclass; `fn` is derived from `host` below.
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "name", host.name)

    @property
    def fn(self) -> Callable[..., Any]:
        # Read by the lowering: a JVP equation without a JVP kernel can be traced
        # and transposed (grad) but not compiled (jvp, jacfwd, linearize).
        if isinstance(self.host, _JvpHost) and self.host.rules.jvp is None:
            raise TypeError(_missing_rule_message(self.host.rules, "jvp"))
        return self.host

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DerivativeKernel) and other.host == self.host

    def __hash__(self) -> int:
        return hash(self.host)


def _flat_tree(n: int, *, kwargs: bool) -> Any:
    """Treedef of n flat positional leaves: ``((*,)*n, {})`` or ``(*,)*n``."""
    leaves = tuple(range(n))
    return jax.tree_util.tree_structure((leaves, {}) if kwargs else leaves)


def _is_differentiable(dtype: Any) -> bool:
    return jax.numpy.issubdtype(dtype, np.inexact)


def _tangent_dtype(dtype: Any) -> np.dtype:
    return np.dtype(dtype) if _is_differentiable(dtype) else jax.dtypes.float0


# --- host adapters: what a derivative equation runs per element -------------------


@dataclasses.dataclass(frozen=True)
class _JvpHost:
    """Calls ``jvp(*primals, *tangents, **kwargs)`` on one element.

    Operands: every primal leaf, then the tangent leaves that exist. Positional
    leaves without one (symbolic zeros, integer inputs) get zeros here, on the
    host, so no zeros are built or moved on the device.
    """

    rules: Rules
    in_tree: Any  # treedef of the primal (args, kwargs)
    tangent_slots: tuple[int | None, ...]  # per positional leaf
    out_tree: Any
    out_avals: tuple[tuple[tuple[int, ...], np.dtype], ...]  # per output leaf
    name: str

    @property
    def out_mask(self) -> tuple[bool, ...]:
        """Per output leaf: whether it has a tangent (is not an integer)."""
        return tuple(_is_differentiable(d) for _, d in self.out_avals)

    def __call__(self, *leaves: np.ndarray) -> tuple[Any, ...]:
        n = self.in_tree.num_leaves
        primals, tangent_ops = leaves[:n], leaves[n:]
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, primals)
        tangent_leaves = [
            _zeros(primals[i].shape, _tangent_dtype(primals[i].dtype))
            if slot is None
            else tangent_ops[slot]
            for i, slot in enumerate(self.tangent_slots)
        ]
        tangents = jax.tree_util.tree_unflatten(
            self.in_tree.children()[0], tangent_leaves
        )
        result = self.rules.jvp(*args, *tangents, **kwargs)
        try:
            out = self.out_tree.flatten_up_to(result)
        except (ValueError, TypeError) as e:
            raise TypeError(
                f"the JVP kernel must return the tangent of the output, a pytree "
                f"with the structure of result_shape_dtypes ({self.out_tree}); "
                f"got {jax.tree_util.tree_structure(result)} ({e})."
            ) from None
        return tuple(x for x, keep in zip(out, self.out_mask, strict=True) if keep)


@dataclasses.dataclass(frozen=True)
class _VjpHost:
    """Calls ``vjp(*primals, cotangent, **kwargs)`` on one element.

    Operands: every primal leaf, then the output cotangent leaves that exist
    (the others get zeros here). Returns the cotangents of the positional leaves
    in ``wanted``; ``None`` from the kernel, for a whole argument or one leaf,
    means zeros.
    """

    rules: Rules
    in_tree: Any
    out_tree: Any
    ct_slots: tuple[int | None, ...]  # per output leaf
    out_zeros: tuple[tuple[tuple[int, ...], np.dtype], ...]  # per output leaf
    wanted: tuple[int, ...]  # positional leaves whose cotangent is returned
    name: str

    def __call__(self, *leaves: np.ndarray) -> tuple[Any, ...]:
        n = self.in_tree.num_leaves
        primals, ct_ops = leaves[:n], leaves[n:]
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, primals)
        ct_leaves = [
            _zeros(shape, dtype) if slot is None else ct_ops[slot]
            for slot, (shape, dtype) in zip(self.ct_slots, self.out_zeros, strict=True)
        ]
        ct = jax.tree_util.tree_unflatten(self.out_tree, ct_leaves)
        result = self.rules.vjp(*args, ct, **kwargs)
        if not isinstance(result, (tuple, list)) or len(result) != len(args):
            raise TypeError(
                f"the VJP kernel must return a tuple with one cotangent per "
                f"positional argument ({len(args)}), e.g. `return (ct_x,)` for one "
                f"argument; got {_describe(result)}."
            )
        flat: list[Any] = []
        for i, (tree, r) in enumerate(
            zip(self.in_tree.children()[0].children(), result, strict=True)
        ):
            if r is None:
                flat.extend([None] * tree.num_leaves)
                continue
            try:
                flat.extend(tree.flatten_up_to(r))
            except (ValueError, TypeError) as e:
                raise TypeError(
                    f"the VJP kernel returned a cotangent for positional argument "
                    f"{i} of structure {jax.tree_util.tree_structure(r)}, but the "
                    f"argument has structure {tree} ({e}). Return a pytree like "
                    "the argument, or None for zeros."
                ) from None
        return tuple(
            _zeros(primals[j].shape, primals[j].dtype) if flat[j] is None else flat[j]
            for j in self.wanted
        )


def _zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    z = np.zeros(shape, dtype)
    z.flags.writeable = False  # like the other inputs of a kernel
    return z


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"a value of type {type(x).__name__}"


# --- messages -----------------------------------------------------------------------


def _missing_rule_message(rules: Rules, which: str) -> str:
    name = rules.__qualname__
    if which == "jvp":
        return (
            f"threadmap kernel {name!r} has a VJP kernel but no JVP kernel, so "
            "forward-mode derivatives (jax.jvp, jax.jacfwd, jax.linearize) cannot "
            "run. Attach one with "
            f"{name}.defjvp(jvp_kernel), where jvp_kernel(*primals, *tangents) "
            "returns the tangent of the output; or use reverse mode (jax.grad, "
            "jax.vjp, jax.jacrev)."
        )
    return (
        f"threadmap kernel {name!r} has a JVP kernel but no VJP kernel, so "
        "reverse-mode derivatives (jax.grad, jax.vjp, jax.jacrev) cannot be "
        f"computed. Attach one with {name}.defvjp(vjp_kernel), where "
        "vjp_kernel(*primals, cotangent) returns a tuple with one cotangent per "
        "positional argument; or use forward mode (jax.jvp, jax.jacfwd)."
    )


def no_derivative_rule_message(name: str) -> str:
    return (
        f"threadmap kernel {name!r} has no derivative rule, so jax.grad, "
        "jax.jvp and friends cannot differentiate through it. Wrap the kernel with "
        "jax_threadmap.kernel(result_shape_dtypes)(fn) and attach threaded "
        "derivative kernels with .defjvp(...) and/or .defvjp(...), or wrap the call "
        "in jax.custom_jvp / jax.custom_vjp."
    )


def _higher_order_message(kernel: DerivativeKernel) -> str:
    rules = kernel.host.rules
    kind = "JVP" if isinstance(kernel.host, _JvpHost) else "VJP"
    return (
        f"threadmap kernel {rules.__qualname__!r}: higher-order derivatives (for "
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


# --- the rules ------------------------------------------------------------------------


def _rules_of(kernel: Kernel) -> Rules:
    if isinstance(kernel, DerivativeKernel):
        raise TypeError(_higher_order_message(kernel))
    if isinstance(kernel.fn, Rules) and (
        kernel.fn.jvp is not None or kernel.fn.vjp is not None
    ):
        return kernel.fn
    raise TypeError(no_derivative_rule_message(kernel.name))


def _threadmap_jvp_rule(primals, tangents, *, kernel, **params):
    _compat.require(_compat.DERIVATIVES, "Differentiating a threadmap kernel")
    if isinstance(kernel, DerivativeKernel):
        return _linear_jvp(primals, tangents, kernel=kernel, **params)
    rules = _rules_of(kernel)
    in_tree, spec = params["in_tree"], params["spec"]
    result_avals = params["result_avals"]
    outs = threadmap_p.bind(*primals, kernel=kernel, **params)

    num_pos = in_tree.children()[0].num_leaves
    kw_tangents = tangents[num_pos:]
    for name, t in zip(_kwarg_names(in_tree), kw_tangents, strict=True):
        if not _is_zero(t):
            raise TypeError(
                f"threadmap kernel {kernel.name!r}: keyword argument {name} depends "
                "on the variable being differentiated, but keyword arguments are "
                "not differentiable (they get no tangent and no cotangent). Pass "
                "it positionally, or wrap it in jax.lax.stop_gradient if its "
                "derivative should be ignored."
            )
    slots: list[int | None] = []
    tangent_ops, tangent_axes = [], []
    for i in range(num_pos):
        if _is_zero(tangents[i]):
            slots.append(None)
        else:
            slots.append(len(tangent_ops))
            tangent_ops.append(tangents[i])
            tangent_axes.append(spec.in_axes[i])
    out_mask = tuple(_is_differentiable(a.dtype) for a in result_avals)
    zero_outs = [Zero(_compat.typeof(o).to_tangent_aval()) for o in outs]
    if not tangent_ops or not any(out_mask):
        return outs, zero_outs

    host = _JvpHost(
        rules=rules,
        in_tree=in_tree,
        tangent_slots=tuple(slots),
        out_tree=params["out_tree"],
        out_avals=tuple((tuple(a.shape), np.dtype(a.dtype)) for a in result_avals),
        name=kernel_name(rules.jvp) if rules.jvp is not None else f"jvp({kernel})",
    )
    tangent_outs = threadmap_p.bind(
        *primals,
        *tangent_ops,
        **_derivative_params(
            params,
            host=host,
            num_operands=len(primals) + len(tangent_ops),
            result_avals=tuple(
                a for a, keep in zip(result_avals, out_mask, strict=True) if keep
            ),
            spec=BatchSpec(spec.shape, spec.in_axes + tuple(tangent_axes)),
        ),
    )
    it = iter(tangent_outs)
    return outs, [
        next(it) if keep else z for keep, z in zip(out_mask, zero_outs, strict=True)
    ]


def _derivative_params(params, *, host, num_operands, result_avals, spec):
    """Params of a derivative equation: the primal's, with flat trees."""
    return {
        **params,
        "kernel": DerivativeKernel(host),
        "result_avals": tuple(result_avals),
        "in_tree": _flat_tree(num_operands, kwargs=True),
        "out_tree": _flat_tree(len(result_avals), kwargs=False),
        "spec": spec,
    }


def _is_zero(t: Any) -> bool:
    return type(t) is Zero or _compat.typeof(t).dtype == jax.dtypes.float0


def _num_primals(host: _JvpHost | _VjpHost) -> int:
    return host.in_tree.num_leaves


def _linear_jvp(primals, tangents, *, kernel, **params):
    """JVP of a derivative equation, which is linear in its non-primal operands.

    Supported where the primal operands have zero tangents (``jax.grad`` or
    ``jax.jvp`` of a ``jax.jvp`` with respect to the tangent); anything else is
    a second derivative of the user's kernel.
    """
    n = _num_primals(kernel.host)
    if not all(_is_zero(t) for t in tangents[:n]):
        raise TypeError(_higher_order_message(kernel))
    outs = threadmap_p.bind(*primals, kernel=kernel, **params)
    linear = [
        _compat.instantiate_zeros(t) if type(t) is Zero else t for t in tangents[n:]
    ]
    tangent_outs = threadmap_p.bind(*primals[:n], *linear, kernel=kernel, **params)
    return outs, tangent_outs


def _threadmap_transpose_rule(cts, *args, kernel, **params):
    _compat.require(_compat.DERIVATIVES, "Differentiating a threadmap kernel")
    if not isinstance(kernel, DerivativeKernel):
        raise TypeError(no_derivative_rule_message(kernel.name))
    host = kernel.host
    if not isinstance(host, _JvpHost):
        raise TypeError(_higher_order_message(kernel))
    rules = host.rules
    if rules.vjp is None:
        raise TypeError(_missing_rule_message(rules, "vjp"))
    n = _num_primals(host)
    primals, tangent_ops = args[:n], args[n:]
    if any(_compat.is_undefined_primal(p) for p in primals):
        raise TypeError(
            f"threadmap kernel {rules.__qualname__!r}: the JVP equation is not "
            "linear in its primal operands, so it cannot be transposed with "
            "respect to them."
        )
    spec = params["spec"]
    nones = [None] * n
    undefined = [_compat.is_undefined_primal(t) for t in tangent_ops]
    if not any(undefined) or all(type(ct) is Zero for ct in cts):
        return nones + [
            Zero(t.aval) if u else None
            for t, u in zip(tangent_ops, undefined, strict=True)
        ]

    # One cotangent per output leaf of the kernel; missing ones are zeros on host.
    ct_ops, ct_slots = [], []
    it = iter(cts)
    for keep in host.out_mask:
        ct = next(it) if keep else None
        if ct is None or type(ct) is Zero:
            ct_slots.append(None)
        else:
            ct_slots.append(len(ct_ops))
            ct_ops.append(ct)
    # The cotangent of each tangent operand that is a linear input.
    wanted = []
    for leaf, slot in enumerate(host.tangent_slots):
        if slot is not None and undefined[slot]:
            wanted.append(leaf)
    tangent_axes = spec.in_axes[n:]
    core_avals = []
    for leaf in wanted:
        slot = host.tangent_slots[leaf]
        aval = tangent_ops[slot].aval
        core_avals.append(
            _compat.ShapedArray(_core_shape(aval.shape, tangent_axes[slot]), aval.dtype)
        )
    vjp_host = _VjpHost(
        rules=rules,
        in_tree=host.in_tree,
        out_tree=host.out_tree,
        ct_slots=tuple(ct_slots),
        out_zeros=tuple(
            (shape, _tangent_dtype(dtype)) for shape, dtype in host.out_avals
        ),
        wanted=tuple(wanted),
        name=kernel_name(rules.vjp),
    )
    all_levels = tuple(range(len(spec.shape)))
    # The cotangent of an operand not batched at some levels is the sum over those
    # levels. Executors in this process sum on the host, so memory stays the
    # operand's size times the workers, not times the batch; executors in other
    # processes return per-element cotangents, summed here.
    host_sums = _executor.in_process(params["executor"])
    out_sum = tuple(
        tuple(
            level
            for level, a in enumerate(tangent_axes[host.tangent_slots[leaf]])
            if a is None
        )
        for leaf in wanted
    )
    cts_out = threadmap_p.bind(
        *primals,
        *ct_ops,
        **_derivative_params(
            params,
            host=vjp_host,
            num_operands=n + len(ct_ops),
            result_avals=core_avals,
            spec=BatchSpec(
                spec.shape,
                spec.in_axes[:n] + (all_levels,) * len(ct_ops),
                out_sum if host_sums else (),
            ),
        ),
    )
    out: list[Any] = [None] * len(tangent_ops)
    for leaf, ct in zip(wanted, cts_out, strict=True):
        slot = host.tangent_slots[leaf]
        ct = _to_operand_layout(ct, tangent_axes[slot], summed=host_sums)
        # Inside shard_map, an operand that is the same on every shard (not
        # varying over some mesh axes the cotangent varies over) gets the sum of
        # every shard's contribution, as JAX's `pvary` transposes to `psum`.
        aval = tangent_ops[slot].aval
        summed = _compat.varying_axes(_compat.typeof(ct)) - _compat.varying_axes(aval)
        if summed:
            ct = jax.lax.psum(ct, tuple(sorted(summed)))
        out[slot] = ct
    for slot, u in enumerate(undefined):
        if u and out[slot] is None:
            out[slot] = Zero(tangent_ops[slot].aval)
    return nones + out


def _core_shape(shape: Sequence[int], axes: Sequence[int | None]) -> tuple[int, ...]:
    batch = {a for a in axes if a is not None}
    return tuple(s for d, s in enumerate(shape) if d not in batch)


def _to_operand_layout(ct: Any, axes: Sequence[int | None], *, summed: bool) -> Any:
    """Cotangents (batch levels first) -> the operand's own layout.

    Levels at which the operand is not batched are summed (the operand was
    broadcast there), unless the host has ``summed`` them already; the others go
    back to the axis they have in the operand.
    """
    unbatched = tuple(k for k, a in enumerate(axes) if a is None)
    if unbatched and not summed:
        ct = jax.numpy.sum(ct, axis=unbatched)
    kept = [a for a in axes if a is not None]  # operand axis of each kept level
    ndim = ct.ndim
    core = iter(range(len(kept), ndim))
    perm = [kept.index(d) if d in kept else next(core) for d in range(ndim)]
    if perm != list(range(ndim)):
        ct = jax.lax.transpose(ct, perm)
    return ct


_compat.register_jvp(threadmap_p, _threadmap_jvp_rule)
_compat.register_transpose(threadmap_p, _threadmap_transpose_rule)
