"""What a missing derivative kernel's error says: which derivatives need it, and
how to attach one (``defjvp``/``defvjp``, or making the rule a
``jax_threadmap.kernel`` first).

The messages read a kernel node (:class:`.params.Node`) through
:class:`RuleNode` only, so that the params, which raise them, import this
module and not the reverse.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax


class RuleNode(Protocol):
    """What a message reads of a kernel node (:class:`.params.Node`)."""

    @property
    def base(self) -> RuleNode | None: ...

    @property
    def kind(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def out_tree(self) -> Any: ...

    @property
    def out_avals(self) -> tuple[tuple[tuple[int, ...], Any], ...]: ...

    @property
    def residuals(self) -> bool:
        """Whether its VJP is given with residuals (``fwd``/``bwd``)."""
        ...

    @property
    def is_kernel(self) -> bool:
        """Whether what it runs is a ``jax_threadmap.kernel`` (takes rules)."""
        ...

    def rule(self, kind: str) -> Any: ...

    def derive(self, kind: str) -> RuleNode: ...


def missing_rule_message(node: RuleNode, which: str) -> str:
    """``node`` has no ``which`` rule ("jvp" or "vjp"), and one is needed."""
    if node.base is None:
        return _first_order_missing(node, which) + _hessian_hint(node, which)
    name, short = node.name, _short(node.name)
    mode, transforms = _MODES[which][0], _SECOND_ORDER[which]
    needs = f"{mode} mode through it (second-order derivatives such as {transforms})"
    if which == "jvp" and node.residuals:
        needs += f" ({short}'s fwd and bwd give reverse mode only)"
    return (
        f"threadmap kernel {name!r} ({_describe_node(node)}): {short} has no "
        f"def{which}, so {needs} cannot run. {_how_to_attach(node, [which])}"
    )


def no_rules_message(node: RuleNode) -> str:
    """A derived ``node`` has no rules at all and is differentiated."""
    name, short = node.name, _short(node.name)
    return (
        f"threadmap kernel {name!r} ({_describe_node(node)}) has no derivative "
        f"kernels of its own, so it cannot be differentiated: {short} has no "
        f"defjvp (for forward mode over it: {_SECOND_ORDER['jvp']}) and no defvjp "
        f"(for reverse mode over it: {_SECOND_ORDER['vjp']}). "
        f"{_how_to_attach(node, ['jvp', 'vjp'])}"
    )


def _hessian_hint(root: RuleNode, which: str) -> str:
    """Where forward mode through the user's kernel is asked for by a
    second-order transform: what that transform needs as well."""
    if which != "jvp" or root.rule("vjp") is None:
        return ""
    if root.residuals:
        fwd, bwd = _short(root.derive("fwd").name), _short(root.derive("bwd").name)
        return (
            " (jax.hessian, jax.jvp of jax.grad and other forward-over-reverse "
            f"derivatives need no JVP kernel of {root.name!r}: they differentiate "
            f"{fwd} and {bwd}, which need JVP kernels of their own: make them "
            f"jax_threadmap.kernels and attach one to each with {fwd}.defjvp and "
            f"{bwd}.defjvp.)"
        )
    vjp = root.derive("vjp")
    name = _short(vjp.name)
    if vjp.rule("jvp") is not None:  # a jax_threadmap.kernel with a defjvp
        return (
            " (Outside jax.jit, jax.hessian and other forward-over-reverse "
            "derivatives compute this kernel's own tangent as well, so they need "
            f"it too; under jax.jit, {name}.defjvp is enough.)"
        )
    return (
        " (For jax.hessian and other forward-over-reverse derivatives, the VJP "
        f"kernel {name} needs a JVP kernel of its own as well: make it a "
        f"jax_threadmap.kernel and attach one with {name}.defjvp.)"
    )


def _short(name: str) -> str:
    return name.rpartition(".")[2]  # the function's name: "f", not "g.<locals>.f"


def _describe_node(node: RuleNode) -> str:
    assert node.base is not None
    if node.kind in ("fwd", "bwd"):
        # bwd comes from defvjp; fwd from defjvp, defvjp or both (one fwd).
        rule, forms = node.base.rule("vjp"), []
        if node.kind == "fwd" and rule.jvp is not None:
            forms.append("defjvp(fwd, jvp, residuals=...)")
        if rule.bwd is not None:
            forms.append("defvjp(fwd, bwd, residuals=...)")
        return (
            f"the {node.kind} kernel of {node.base.name!r}, from {' and '.join(forms)}"
        )
    kind = "jvp" if node.kind == "lin" else node.kind
    return f"the {kind.upper()} kernel of {node.base.name!r}"


def _how_to_attach(node: RuleNode, which: list[str]) -> str:
    short = _short(node.name)
    attach = "; and/or ".join(
        f"{short}.def{w}({w}_kernel), where {_MODES[w][2]}" for w in which
    )
    if node.is_kernel:
        return f"Attach it with {attach}."
    result = jax.tree_util.tree_unflatten(
        node.out_tree,
        [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in node.out_avals],
    )
    return (
        f"Make {short} a jax_threadmap.kernel: "
        f"@jax_threadmap.kernel({result}) on its definition (its result for one "
        f"element), and attach {attach}."
    )


#: Per rule: its mode, the first-order transforms that need it, and what its
#: kernel takes and returns.
_MODES = {
    "jvp": (
        "forward",
        "jax.jvp, jax.jacfwd, jax.linearize",
        "jvp_kernel(*primals, *tangents) returns the tangent of the output",
    ),
    "vjp": (
        "reverse",
        "jax.grad, jax.vjp, jax.jacrev",
        "vjp_kernel(*primals, cotangent) returns a tuple with one cotangent per "
        "positional argument",
    ),
}


#: Per rule of a derivative kernel: the second-order transforms that need it.
_SECOND_ORDER = {
    "jvp": "jax.hessian, jax.jacfwd of jax.grad or of jax.jacfwd, and jax.jvp of "
    "jax.grad",
    "vjp": "jax.grad of jax.grad, and jax.jacrev of jax.grad or of jax.jacfwd",
}


def no_derivative_rule_message(name: str, wrapped: bool) -> str:
    """The user's kernel ``name`` has no rules at all (``wrapped``: it is a
    ``jax_threadmap.kernel``) and is differentiated."""
    cannot = (
        f"threadmap kernel {name!r} has no derivative rule, so jax.grad, jax.jvp "
        "and friends cannot differentiate through it."
    )
    if not wrapped:
        return (
            f"{cannot} Wrap the kernel with "
            "jax_threadmap.kernel(result_shape_dtypes)(fn) and attach threaded "
            "derivative kernels with .defjvp(...) and/or .defvjp(...), or wrap the "
            "call in jax.custom_jvp / jax.custom_vjp."
        )
    attach = " and/or ".join(
        f"{_short(name)}.def{w}({w}_kernel) (for {_MODES[w][1]}; {_MODES[w][2]})"
        for w in ("vjp", "jvp")
    )
    return (
        f"{cannot} It is a jax_threadmap.kernel without derivative kernels: "
        f"attach them with {attach}."
    )


def _first_order_missing(root: RuleNode, which: str) -> str:
    name, other = root.name, "vjp" if which == "jvp" else "jvp"
    (mode, transforms, signature), missing = _MODES[which], which.upper()
    attach, why = f"{name}.def{which}({which}_kernel), where {signature}", ""
    if not root.residuals:
        has = f"a {other.upper()} kernel"
    elif which == "jvp":
        has = "fwd and bwd kernels (defvjp(fwd, bwd, residuals=...))"
        why = ": fwd and bwd give reverse mode only, as for jax.custom_vjp"
    else:  # defjvp(fwd, jvp, residuals=...) without a bwd
        has, missing = "fwd and jvp kernels (defjvp(fwd, jvp, residuals=...))", "bwd"
        attach = (
            f"{name}.defvjp(fwd, bwd, residuals=...), the same fwd and residuals, "
            "where bwd(residuals, cotangent) returns a tuple with one cotangent per "
            "positional argument"
        )
    return (
        f"threadmap kernel {name!r} has {has} but no {missing} kernel, so "
        f"{mode}-mode derivatives ({transforms}) cannot run{why}. Attach one with "
        f"{attach}; or use {_MODES[other][0]} mode ({_MODES[other][1]})."
    )
