"""What the host calls per element for a derivative equation, on worker threads.

A :class:`~.params.DerivativeParam` is the static description of a derivative
equation (part of the jit cache key); :class:`DerivativeCall` is made from it
once per lowered equation and runs it: it builds the kernel's arguments from
the operands (zeros built on the host for the leaves that are not operands),
calls the derivative kernel, and returns one value per result leaf, with the
residuals and tangents checked against what was declared so that a wrong one
is named. Everything that does not change per element (the function, where
each argument comes from, the zeros of an unbatched map) is worked out once
here, so that a derivative kernel costs about what the user's kernel costs per
call.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._host.loops import call_source
from .._support.result_casts import ResultCastError, check_result_cast

#: Where one leaf of a node comes from: an operand (its index), a zeros array
#: (its ``(shape, dtype)``), or nowhere (``None``: a leaf the kernel never sees).
Source = int | tuple[tuple[int, ...], Any] | None


class DerivativeCall:
    """Calls a derivative param's kernel on one element's (or chunk's) operands.

    Made by ``DerivativeParam.host_call``; pickled as its param (executors that
    pickle work rebuild it in the worker).
    """

    def __init__(self, param: Any):
        self.param = param
        node = param.node
        self.fn = node.function
        self.vectorized = param.vectorized
        ops = iter(range(sum(param.present)))
        # A tangent gets the folded directions as its leading axes.
        lead = [()] * node.num_base + [param.directions] * len(node.in_avals)
        sources: list[Source] = [
            next(ops) if here else (None if i in node.unused else (d + s, t))
            for i, (here, (s, t), d) in enumerate(
                zip(param.present, node.in_avals, lead, strict=False)
            )
        ]
        self.keywords = [sources[i] for i in node.keywords]
        self.args_tree, self.kwargs_tree = node.args_tree, node.kwargs_tree
        self.keep = (
            None if all(param.keep) else [k for k, w in enumerate(param.keep) if w]
        )
        self.asynchronous = param.asynchronous
        # Per argument leaf, positional then keyword: (operand index, or -1 and
        # the value: one element's zeros, built once, read-only and shared, or None).
        leaves = [*(sources[i] for i in node.positional), *self.keywords]
        self.plan = [self._plan(src) for src in leaves]
        # The call on those leaves, generated as the element loops' are (loops.py).
        tree = jax.tree_util.treedef_tuple([self.args_tree, self.kwargs_tree])
        source = call_source(tree, [f"A{k}_" for k in range(len(leaves))])
        self.call = _caller(source, self.args_tree, self.kwargs_tree)
        self.flat_result = _result_flattener(node)
        if param.directions:
            self.flat_result = _with_directions(
                self.flat_result, node, param.directions
            )
        #: Whether :meth:`direct` calls this kernel (worked out once).
        self.is_direct = self._as_they_come()

    def __reduce__(self) -> tuple[Any, ...]:
        return DerivativeCall, (self.param,)

    def _plan(self, src: Source) -> tuple[int, Any]:
        if isinstance(src, int):
            return src, None
        if src is None or self.vectorized:  # a chunk's zeros: per call
            return -1, src
        return -1, zeros(*src)

    def __call__(self, *operands: np.ndarray) -> Any:
        vec = self.vectorized  # (then a zeros leaf is made per chunk)
        chunk = operands[0].shape[:1] if vec and operands else ()
        args = [
            operands[i] if i >= 0 else zeros(chunk + v[0], v[1]) if vec and v else v
            for i, v in self.plan
        ]
        result = self.call(self.fn, args)
        if self.asynchronous and inspect.iscoroutine(result):
            return _then(result, lambda r: self._kept(self.flat_result(r, chunk)))
        return self._kept(self.flat_result(result, chunk))

    def _as_they_come(self) -> bool:
        """Whether the kernel's argument leaves are the operands as they come
        (no zeros, chunks or coroutines): then :meth:`direct` calls it."""
        plan = [(i, None) for i in range(sum(self.param.present))]
        return not (self.vectorized or self.asynchronous) and self.plan == plan

    def direct(self, *operands: np.ndarray) -> Any:
        """``__call__`` where the kernel's argument leaves are the operands as
        they come (:attr:`is_direct`)."""
        return self._kept(self.flat_result(self.call(self.fn, operands), ()))

    def _kept(self, out: list[Any]) -> tuple[Any, ...]:
        return tuple(out if self.keep is None else [out[k] for k in self.keep])


@functools.lru_cache(maxsize=256)
def _caller(source: str | None, args: Any, kwargs: Any) -> Callable[..., Any]:
    """``lambda fn, a: fn(...)`` from :func:`.._host.loops.call_source`'s
    ``source`` (the leaves ``A<k>_`` read from ``a[k]``), else unflattening
    the trees ``args`` and ``kwargs`` (containers that are not literals)."""
    if source is None:
        n = args.num_leaves
        return lambda fn, a: fn(*args.unflatten(a[:n]), **kwargs.unflatten(a[n:]))
    return eval("lambda fn, a: " + re.sub(r"A(\d+)_", r"a[\1]", source))


async def _then(result: Any, finish: Callable[[Any], Any]) -> Any:
    """``finish(await result)``: a derivative adapter around an async def kernel."""
    return finish(await result)


def zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    z = np.zeros(shape, dtype)
    z.flags.writeable = False  # like the other inputs of a kernel
    return z


def _result_flattener(node: Any) -> Callable[[Any, tuple[int, ...]], list[Any]]:
    """The function giving a node's kernel result as one value per output leaf."""
    if node.kind in ("vjp", "bwd"):
        return _cotangent_flattener(node)
    if node.kind == "fwd":
        return _forward_flattener(node)
    out_tree = node.out_tree
    what = "JVP kernel" + (
        " (of defjvp(fwd, jvp, residuals=...))" if node.residual_jvp else ""
    )
    if out_tree.num_leaves == 1 and out_tree.num_nodes == 1:
        # One leaf: the host's store checks it (and names a container in it).
        return lambda result, chunk: [result]

    def tangents(result: Any, chunk: tuple[int, ...]) -> list[Any]:
        try:
            return list(out_tree.flatten_up_to(result))
        except (ValueError, TypeError) as e:
            raise TypeError(
                f"the {what} must return the tangent of the output, a pytree "
                f"with the structure of result_shape_dtypes ({out_tree}); got "
                f"{jax.tree_util.tree_structure(result)} ({e})."
            ) from None

    return tangents


def _with_directions(
    flat: Callable[[Any, tuple[int, ...]], list[Any]], node: Any, lead: tuple[int, ...]
) -> Callable[[Any, tuple[int, ...]], list[Any]]:
    """``flat``, each tangent checked to have the directions' leading axes."""
    shapes = [lead + shape for shape, _ in node.out_avals]

    def checked(result: Any, chunk: tuple[int, ...]) -> list[Any]:
        out = flat(result, chunk)
        for k, (value, shape) in enumerate(zip(out, shapes, strict=True)):
            got = value.shape if type(value) is np.ndarray else np.shape(value)
            if value is not None and got != chunk + shape:
                raise TypeError(
                    "the JVP kernel of defjvp(fwd, jvp, residuals=..., "
                    f"directions=True) returned the tangent of output {k} with shape "
                    f"{got}, expected {chunk + shape}: its tangents "
                    f"came with {len(lead)} leading axes of directions {lead}, which "
                    "the tangent it returns must have too. Compute it for every "
                    "direction (res @ t[..., None] broadcasts over them), or drop "
                    "directions=True for one direction per call."
                )
        return out

    return checked


def _cotangent_flattener(node: Any) -> Callable[[Any, tuple[int, ...]], list[Any]]:
    """The function giving a VJP (or ``bwd``) kernel's tuple as one cotangent
    per positional leaf of the base (``None``, for an argument or a leaf, is
    zeros)."""
    what = "VJP" if node.kind == "vjp" else "bwd"
    arg_trees = node.base.args_tree.children()
    leaf = [t.num_leaves == 1 and t.num_nodes == 1 for t in arg_trees]
    every_leaf, out_avals = all(leaf), node.out_avals

    def flat(result: Any, chunk: tuple[int, ...]) -> list[Any]:
        if not isinstance(result, (tuple, list)) or len(result) != len(arg_trees):
            raise TypeError(
                f"the {what} kernel must return a tuple with one cotangent per "
                f"positional argument ({len(arg_trees)}), e.g. `return (ct_x,)` for "
                f"one argument; got {_describe(result)}."
            )
        if every_leaf:  # one leaf per argument: as they come (None: zeros)
            out = list(result)
        else:
            out = []
            for i, (tree, r) in enumerate(zip(arg_trees, result, strict=True)):
                if r is None:
                    out.extend([None] * tree.num_leaves)
                elif leaf[i]:
                    out.append(r)
                else:
                    try:
                        out.extend(tree.flatten_up_to(r))
                    except (ValueError, TypeError) as e:
                        raise TypeError(
                            f"the {what} kernel returned a cotangent for positional "
                            f"argument {i} of structure "
                            f"{jax.tree_util.tree_structure(r)}, but the argument has "
                            f"structure {tree} ({e}). Return a pytree like the "
                            "argument, or None for zeros."
                        ) from None
        for j, c in enumerate(out):
            if c is None:
                out[j] = zeros(chunk + out_avals[j][0], out_avals[j][1])
        return out

    return flat


def _forward_flattener(node: Any) -> Callable[[Any, tuple[int, ...]], list[Any]]:
    """The function giving a ``fwd`` kernel's ``(out, res)`` as one value per
    output leaf, then one per residual leaf; each residual checked against its
    declaration, so that a wrong one is named rather than as an output number."""
    rule, out_tree = node.base.residual_rule, node.base.out_tree
    res_tree, checks = rule.res_tree, list(zip(rule.names, rule.res_avals, strict=True))
    one_out = out_tree.num_leaves == 1 and out_tree.num_nodes == 1
    # A tuple of leaves (the common residuals) flattens as a tuple does.
    n_res = res_tree.num_leaves
    res_tuple = res_tree == jax.tree_util.tree_structure((0,) * n_res)
    users = " and ".join(
        kind for kind, r in (("jvp", rule.jvp), ("bwd", rule.bwd)) if r is not None
    )
    fix = (
        "Return one element's residual, without batch axes, of the declared shape "
        f"({users} {'receive' if ' and ' in users else 'receives'} it as declared)"
    )

    def flat(result: Any, chunk: tuple[int, ...]) -> list[Any]:
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(
                "the fwd kernel must return a pair (out, residuals): the output, a "
                "pytree like result_shape_dtypes, and the residuals, a pytree like "
                f"residuals= ({res_tree}); got {_describe(result)}."
            )
        out, res = result
        try:
            outs = [out] if one_out else out_tree.flatten_up_to(out)
        except (ValueError, TypeError) as e:
            raise TypeError(
                "the fwd kernel returned an output (the first of its pair) of "
                f"structure {jax.tree_util.tree_structure(out)}, but "
                f"result_shape_dtypes has structure {out_tree} ({e})."
            ) from None
        try:
            if res_tuple and type(res) is tuple and len(res) == n_res:
                values = res
            else:
                values = res_tree.flatten_up_to(res)
        except (ValueError, TypeError) as e:
            raise TypeError(
                "the fwd kernel returned residuals (the second of its pair) of "
                f"structure {jax.tree_util.tree_structure(res)}, but residuals= "
                f"declares {res_tree} ({e}). Return them as declared, or declare "
                "what fwd returns."
            ) from None
        for (name, (shape, dtype)), v in zip(checks, values, strict=True):
            shape = chunk + shape if chunk else shape
            if type(v) is not np.ndarray or v.dtype != dtype or v.shape != shape:
                _check_residual(v, name, shape, dtype, fix)
        return [*outs, *values]

    return flat


def _check_residual(
    value: Any, name: str, shape: tuple[int, ...], dtype: Any, fix: str
) -> None:
    """A residual as declared (shape, and a dtype that holds its values), or a
    ``TypeError`` that names it, what was declared, what came, and the fix."""
    spelled = f"jax.ShapeDtypeStruct({shape}, {np.dtype(dtype).name})"
    try:
        got = value if type(value) is np.ndarray else np.asarray(value)
    except Exception as e:  # noqa: BLE001 - named in the message
        raise TypeError(
            f"the fwd kernel returned {name} of type {type(value).__name__}, which "
            f"is not an array; residuals= declares {spelled}."
        ) from e
    if got.shape != shape:
        raise TypeError(
            f"the fwd kernel returned {name} of shape {got.shape}, but residuals= "
            f"declares {spelled}. {fix}, or declare shape {got.shape}."
        )
    if got.dtype != dtype:
        try:
            check_result_cast(got, np.dtype(dtype))
        except ResultCastError as e:
            raise TypeError(
                f"the fwd kernel returned {name} as {e.got}, but residuals= declares "
                f"{spelled}; {e.reason}. Declare the dtype that it returns, or "
                "convert it in the kernel."
            ) from None


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"a value of type {type(x).__name__}"
