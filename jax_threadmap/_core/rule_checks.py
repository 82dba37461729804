"""The checks of ``defjvp``/``defvjp``'s arguments, and their messages (which
name the signature each derivative kernel is expected to have)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from .._support import validate as _validate

#: A JVP or VJP kernel: ``defjvp``/``defvjp`` return the function they are given.
DerivativeKernel = TypeVar("DerivativeKernel", bound=Callable[..., Any])


def check_rule(
    rule: DerivativeKernel, method: str, fn: Callable[..., Any]
) -> DerivativeKernel:
    """Checks a derivative kernel, and refuses a ``custom_jvp`` rule with the
    signature expected instead."""
    expected = _expected_rule(method, fn)
    if not callable(rule):
        raise TypeError(
            f"{method} expects a callable derivative kernel, {expected}. Got "
            f"{rule!r} of type {type(rule).__name__}."
        )
    if method == "defjvp" and _positional_names(rule)[:2] == ["primals", "tangents"]:
        raise TypeError(
            f"{method}: {_validate.callable_name(rule)} looks like a jax.custom_jvp "
            "rule, jvp(primals, tangents) -> (primal_out, tangent_out). A "
            f"jax_threadmap JVP kernel is {expected}: one element's primals and "
            "tangents as separate arguments, returning only the tangent."
        )
    return rule


def _positional_names(f: Callable[..., Any]) -> list[str]:
    """The names of ``f``'s positional parameters; empty when it cannot tell."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _expected_rule(method: str, fn: Callable[..., Any]) -> str:
    """The signature of ``fn``'s derivative kernel, for messages; ``"fwd/bwd"``:
    of both kernels of ``defvjp(fwd, bwd, residuals=...)``."""
    primals = _positional_names(fn) or ["*primals"]
    tangents = ", ".join("*tangents" if p[0] == "*" else f"{p}_dot" for p in primals)
    if method == "defjvp":
        return f"jvp({', '.join(primals)}, {tangents}, **kwargs) -> tangent_out"
    cts = ", ".join(f"ct_{p.lstrip('*')}" for p in primals)
    cts = f"({cts},)" if len(primals) == 1 else f"({cts})"
    if method.startswith("fwd/"):
        fwd = f"fwd({', '.join(primals)}, **kwargs) -> (out, residuals) and "
        if method == "fwd/jvp":
            return fwd + f"jvp(residuals, {tangents}, **kwargs) -> tangent_out"
        return fwd + f"bwd(residuals, ct_out, **kwargs) -> {cts}"
    return f"vjp({', '.join(primals)}, ct_out, **kwargs) -> {cts}"


def fwd_rule(
    fwd: Any, rule: Any, residuals: Any, fn: Callable[..., Any], method: str
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``fwd`` and ``defvjp``'s ``bwd`` or ``defjvp``'s ``jvp``, checked with
    their ``residuals``."""
    one = _expected_rule(method, fn)
    role = "bwd" if method == "defvjp" else "jvp"
    two = _expected_rule(f"fwd/{role}", fn)
    if rule is None:
        raise TypeError(
            f"{method}: residuals= goes with a forward and a {role} kernel, "
            f"{method}(fwd, {role}, residuals=...), where {two}. A single kernel, "
            f"{one}, gets the primals and keeps no residuals. Got one kernel and "
            f"residuals={residuals!r}."
        )
    if residuals is None:
        custom_jvp = (
            " (it is not jax.custom_jvp's defjvps(*tangent_fns))"
            if method == "defjvp"
            else ""
        )
        raise TypeError(
            f"{method}(fwd, {role}) needs residuals=: one element's residuals "
            "(what fwd returns beside the output), a pytree of "
            "jax.ShapeDtypeStruct, e.g. residuals=(jax.ShapeDtypeStruct((3, 3), "
            f"jnp.float32),), or () for none; {two}. Or pass one kernel, {one}, "
            f"which gets the primals{custom_jvp}."
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(residuals)[0]:
        where = "residuals" + jax.tree_util.keystr(path)
        _validate.shape_dtype_of(leaf, where, f"{method}(fwd, {role}, residuals=...)")
    for name, given in (("fwd", fwd), (role, rule)):
        if not callable(given):
            raise TypeError(
                f"{method} expects callable fwd and {role} kernels, {two}. Got "
                f"{name}={given!r} of type {type(given).__name__}."
            )
    return fwd, rule


def check_shared_fwd(kernel: Any, fwd: Any, residuals: Any, method: str) -> None:
    """``defjvp(fwd, jvp, ...)`` and ``defvjp(fwd, bwd, ...)`` share one ``fwd``:
    a second one with another ``fwd`` or other residuals is refused."""
    same_res = _residual_layout(residuals) == _residual_layout(kernel.residuals)
    if fwd is kernel.fwd and same_res:
        return
    other = "defvjp(fwd, bwd" if method == "defjvp" else "defjvp(fwd, jvp"
    raise TypeError(
        f"{method}: {_validate.callable_name(kernel.fn)} already has "
        f"{other}, residuals=...) with fwd={_validate.callable_name(kernel.fwd)} "
        f"and residuals={kernel.residuals!r}; both rules run on the residuals of "
        f"one fwd, so they must share it. Got fwd={_validate.callable_name(fwd)} "
        f"and residuals={residuals!r}. Pass the same fwd and residuals to both."
    )


def _residual_layout(residuals: Any) -> tuple[Any, list[tuple[Any, Any]]]:
    leaves, tree = jax.tree_util.tree_flatten(residuals)
    return tree, [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]


def one_fwd_message(fn: Callable[..., Any]) -> str:
    name = _validate.callable_name(fn)
    return (
        f"defvjp: {name} has defjvp(fwd, jvp, residuals=...), whose jvp is "
        "transposed by a bwd over the same residuals, not by a VJP kernel on the "
        f"primals. Attach {_expected_rule('fwd/bwd', fn)} with defvjp(fwd, bwd, "
        "residuals=...), the same fwd and residuals; or first attach a JVP kernel "
        "that takes the primals (defjvp(jvp))."
    )
