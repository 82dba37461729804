"""Element loops generated for each kernel signature, as dataclasses generates methods.

A loop runs elements ``[start, stop)`` of views whose batch dims are merged as far
as the layout allows (``shape``): row by row along the last dim, with each
operand's row view taken once per row, and an operand that is constant along the
row (stride 0: not batched at that level) indexed once per row, not per element.
The kernel call is written out for the signature: positional and keyword leaves,
and tuples, lists and dicts of them, built as literals rather than unflattened.
Results that are one leaf, or a tuple, list or dict of leaves, are unpacked and
stored without flattening; a leaf whose type and dtype are exactly the declared
ones is written at once, and anything else goes through the caller's checked
store. Other signatures fall back to the caller's general ``call`` and
``result_leaves``.

The map's ``failed`` (``c``, its job) is read before each element: a failure
stops the chunk there. So the cost per element is the kernel call, one index
per batched operand, a type check and a write per result, and that one check.
A plain closure for the commonest signatures (``fn(*args)``, one argument list
refilled per element) measured 11-42% slower per element
(``benchmarks/plain_loop.py``, numbers in docs/architecture-design.md), so the loops
stay generated.
"""

from __future__ import annotations

import functools
import keyword
import linecache
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from .._support.errors import PASS_THROUGH

#: Runs elements ``[start, stop)`` of a job, stopping before the next element
#: once the job's ``failed`` is true.
ChunkFn = Callable[[int, int, Any], None]


class Caller(Protocol):
    """What a generated loop needs of ``maps.ElementCaller``."""

    fn: Callable[..., Any]
    name: str
    in_tree: Any
    out_tree: Any
    out_core: list[tuple[tuple[int, ...], np.dtype]]
    accumulate: frozenset[int]
    #: The call and unpacking sources of the last loop built, by operand count.
    loop_sources: tuple[int, str | None, tuple[str, str] | None] | None

    def call(self, leaves: list[Any]) -> Any: ...

    def result_leaves(self, result: Any, flat: int | None) -> list[Any]: ...

    def store(
        self, out: np.ndarray, i: Any, value: Any, k: int, flat: int | None
    ) -> None: ...

    def store_leaf(
        self, out: np.ndarray, i: Any, value: Any, k: int, flat: int | None, result: Any
    ) -> None: ...

    def kernel_raised(self, e: BaseException, flat: int | None) -> BaseException: ...


class _Leaf:
    """A placeholder leaf: unflattening a treedef with these shows its containers."""

    def __init__(self, expr: str):
        self.expr = expr


def _literal(node: Any) -> str | None:
    """Source building ``node`` from its placeholder leaves, or ``None`` if the
    containers are not plain tuples, lists, dicts (with literal keys) or None."""
    if isinstance(node, _Leaf):
        return node.expr
    if node is None:
        return "None"
    if type(node) in (tuple, list):
        return _sequence_literal(node)
    if type(node) is dict and all(type(k) in (str, int) for k in node):
        return _dict_literal(node)
    return None


def _sequence_literal(node: tuple[Any, ...] | list[Any]) -> str | None:
    parts = [_literal(x) for x in node]
    if any(p is None for p in parts):
        return None
    inner = ", ".join(parts)  # type: ignore[arg-type]
    if type(node) is list:
        return f"[{inner}]"
    return f"({inner},)" if parts else "()"


def _dict_literal(node: dict[Any, Any]) -> str | None:
    parts = [_literal(v) for v in node.values()]
    if any(p is None for p in parts):
        return None
    items = ", ".join(f"{k!r}: {p}" for k, p in zip(node, parts, strict=True))
    return "{" + items + "}"


def _placeholders(tree: Any, names: Sequence[str]) -> Any:
    """``tree`` unflattened with placeholder leaves; ``None`` if its node types
    refuse them (a custom pytree whose unflatten checks its leaves)."""
    try:
        return jax.tree_util.tree_unflatten(tree, [_Leaf(n) for n in names])
    except Exception:  # noqa: BLE001 - any refusal means: use the general path
        return None


def call_source(in_tree: Any, leaf_exprs: Sequence[str]) -> str | None:
    """``fn(...)`` for one element, the leaves given as expressions; ``None``
    when the arguments are not literals of tuples, lists and dicts."""
    node = _placeholders(in_tree, leaf_exprs)
    if node is None:
        return None
    args, kwargs = node
    parts = [_literal(a) for a in args]
    for name, value in kwargs.items():
        if not (isinstance(name, str) and name.isidentifier()):
            return None
        if keyword.iskeyword(name):
            return None
        literal = _literal(value)
        parts.append(None if literal is None else f"{name}={literal}")
    if any(p is None for p in parts):
        return None
    return f"fn({', '.join(p for p in parts if p is not None)})"


def unpack_source(out_tree: Any) -> tuple[str, str] | None:
    """``(condition, unpacking)`` of a result ``r`` into ``q0, q1, ...``.

    For a tuple, list or dict of leaves, the condition holds when ``r`` has
    that structure. ``None`` for a single leaf (whose result is checked by the
    caller's slow path, which also catches containers) and other structures.
    """
    n = out_tree.num_leaves
    names = [f"q{k}" for k in range(n)]
    node = _placeholders(out_tree, names)
    if node is None or isinstance(node, _Leaf):
        return None
    if type(node) in (tuple, list) and all(isinstance(x, _Leaf) for x in node):
        cond = f"type(r) is {type(node).__name__} and len(r) == {n}"
        return cond, f"{', '.join(names)}, = r"
    if (
        type(node) is dict
        and all(isinstance(x, _Leaf) for x in node.values())
        and all(type(k) in (str, int) for k in node)
    ):
        keys = ", ".join(repr(k) for k in node)
        cond = f"type(r) is dict and r.keys() == {{{keys}}}"
        return cond, "; ".join(f"{x.expr} = r[{k!r}]" for k, x in node.items())
    return None


def _invoke(consts: tuple[bool, ...], call: str | None) -> str:
    """The expression calling the kernel on element ``j`` of the row."""
    elems = [f"e{k}" if const else f"w{k}[j, ...]" for k, const in enumerate(consts)]
    if call is None:
        return f"general_call([{', '.join(elems)}])"
    for k, elem in enumerate(elems):
        call = call.replace(f"A{k}_", elem)
    return call


def _fast_check(q: str, k: int, exact: bool) -> str:
    """Whether result leaf ``q`` can be written as it is: exactly the declared type."""
    check = f"type({q}) is ndarray and {q}.dtype is D{k} and {q}.shape == S{k}"
    return f"type({q}) is X{k} or ({check})" if exact else check


def _store_lines(
    unpack: tuple[str, str] | None,
    exact: tuple[bool, ...],
    accumulate: tuple[bool, ...],
    flat: str,
) -> list[str]:
    """The statements storing result ``r`` of element ``j`` (at loop-body depth)."""
    n_out = len(exact)
    general = [f"qs = result_leaves(r, {flat})"] + [
        f"store(p{k}, j, qs[{k}], {k}, {flat})" for k in range(n_out)
    ]

    def write(k: int, q: str) -> str:
        return f"p{k}[j] {'+=' if accumulate[k] else '='} {q}"

    if unpack is None and n_out == 1:  # one leaf: a fast write, else checked
        return [
            f"if {_fast_check('r', 0, exact[0])}:",
            f"    {write(0, 'r')}",
            "else:",
            *[f"    {g}" for g in general],
        ]
    if unpack is None:
        return general
    cond, body = unpack
    lines = [f"if {cond}:", f"    {body}"]
    for k in range(n_out):
        lines += [
            f"    if {_fast_check(f'q{k}', k, exact[k])}:",
            f"        {write(k, f'q{k}')}",
            "    else:",
            f"        store_leaf(p{k}, j, q{k}, {k}, {flat}, r)",
        ]
    return lines + ["else:", *[f"    {g}" for g in general]]


@functools.lru_cache(maxsize=256)
def _source(
    consts: tuple[bool, ...],
    call: str | None,
    unpack: tuple[str, str] | None,
    exact: tuple[bool, ...],
    accumulate: tuple[bool, ...],
    gathered: bool,
) -> str:
    """The source of the loop builder of one signature (cached: signatures repeat).

    Args:
        consts: Per operand, whether it is read once per row (else per element).
        call: The kernel call with ``A<k>_`` for operand ``k``, or ``None`` for
            the caller's general call.
        unpack: See :func:`unpack_source`; ``None`` for the general path.
        exact: Per output, whether a NumPy scalar of its dtype is stored at once.
        accumulate: Per output, whether elements add into it (summed outputs).
        gathered: Whether ``flat_of`` maps local indices to flat batch indices.
    """
    n_in, n_out = len(consts), len(exact)
    flat = "int(flat_of[base + j])" if gathered else "base + j"
    row_reads = [
        f"e{k} = v{k}[prefix + (0, Ellipsis)]" if const else f"w{k} = v{k}[prefix]"
        for k, const in enumerate(consts)
    ]
    body = [
        "try:",
        f"    r = {_invoke(consts, call)}",
        "except PASS_THROUGH:",
        "    raise",
        "except BaseException as e:",
        f"    raise kernel_raised(e, {flat}) from e",
        *_store_lines(unpack, exact, accumulate, flat),
    ]
    lines = [
        "def build(fn, views, outs, shape, flat_of, caller, exacts, dtypes, shapes):",
        "    ndarray = np.ndarray",
        "    store, result_leaves = caller.store, caller.result_leaves",
        "    store_leaf = caller.store_leaf",
        "    kernel_raised, general_call = caller.kernel_raised, caller.call",
        "    last, outer = shape[-1], shape[:-1]",
        *[f"    v{k} = views[{k}]" for k in range(n_in)],
        *[
            f"    o{k}, X{k}, D{k}, S{k} = outs[{k}], exacts[{k}], dtypes[{k}], "
            f"shapes[{k}]"
            for k in range(n_out)
        ],
        "    def chunk(start, stop, c):",
        "        row, j = divmod(start, last)",
        "        prefix = _unravel(row, outer) if outer else ()",
        "        while start < stop:",
        "            base = row * last",
        "            end = min(stop - base, last)",
        *[f"            {line}" for line in row_reads],
        *[f"            p{k} = o{k}[prefix]" for k in range(n_out)],
        "            for j in range(j, end):",
        "                if c.failed:",
        "                    return",
        *[f"                {line}" for line in body],
        "            start = base + end",
        "            row, j = row + 1, 0",
        "            if outer:  # (a call per row only where rows have an index)",
        "                prefix = _next(prefix, outer)",
        "    return chunk",
    ]
    return "\n".join(lines) + "\n"


def loop_label(name: str, n_in: int, n_out: int, summed: int) -> str:
    """What tracebacks call the loop of kernel ``name``: its file name."""
    sums = f", {summed} summed" if summed else ""
    return (
        f"<threadmap loop for kernel {name!r} "
        f"({n_in} operand leaves, {n_out} result leaves{sums})>"
    )


@functools.lru_cache(maxsize=256)
def _compile(source: str, label: str) -> Callable[..., ChunkFn]:
    """Compiles a loop builder under the file name ``label`` (inside the
    package, so that kernel tracebacks leave its frame out), its source
    registered with :mod:`linecache` so that tracebacks show its lines."""
    filename = os.path.join(os.path.dirname(__file__), label)
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace: dict[str, Any] = {
        "np": np,
        "PASS_THROUGH": PASS_THROUGH,
        "_unravel": _unravel,
        "_next": _next,
    }
    code = compile(source, filename, "exec")
    exec(code, namespace)
    build: Callable[..., ChunkFn] = namespace["build"]
    return build


def _unravel(row: int, outer: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(outer):
        row, i = divmod(row, size)
        index.append(i)
    return tuple(reversed(index))


def _next(prefix: tuple[int, ...], outer: tuple[int, ...]) -> tuple[int, ...]:
    """The next row's index (an odometer over ``outer``)."""
    d = len(outer) - 1
    while d >= 0 and prefix[d] + 1 == outer[d]:  # the dims that carry
        d -= 1
    if d < 0:
        return (0,) * len(outer)
    return prefix[:d] + (prefix[d] + 1,) + (0,) * (len(outer) - 1 - d)


def element_loop(
    caller: Caller,
    in_v: Sequence[np.ndarray],
    out_v: Sequence[np.ndarray],
    shape: tuple[int, ...],
    flat_of: Any = None,
) -> ChunkFn:
    """The loop that runs elements ``[start, stop)`` of ``caller``'s kernel.

    Args:
        caller: Calls, checks and stores one element (the slow paths).
        in_v: One view per operand leaf, batch dims ``shape`` first.
        out_v: One view per output leaf, batch dims ``shape`` first.
        shape: The (merged) batch shape.
        flat_of: For views holding a gathered subset of the batch (1-D), the
            flat batch index of each element, for messages.
    """
    last = len(shape) - 1
    # Read once per row: constant along it (stride 0), or a row of one element.
    consts = tuple(bool(v.strides[last] == 0 or shape[last] == 1) for v in in_v)
    sources = caller.loop_sources
    if sources is None or sources[0] != len(in_v):  # once per caller, not per call
        sources = caller.loop_sources = (
            len(in_v),
            call_source(caller.in_tree, [f"A{k}_" for k in range(len(in_v))]),
            unpack_source(caller.out_tree),
        )
    source = _source(
        consts,
        sources[1],
        sources[2],
        tuple(s == () for s, _ in caller.out_core),
        tuple(k in caller.accumulate for k in range(len(out_v))),
        flat_of is not None,
    )
    label = loop_label(caller.name, len(in_v), len(out_v), len(caller.accumulate))
    build = _compile(source, label)
    return build(
        caller.fn,
        list(in_v),
        list(out_v),
        tuple(shape),
        flat_of,
        caller,
        [d.type if s == () else None for s, d in caller.out_core],
        [d for _, d in caller.out_core],
        [s for s, _ in caller.out_core],
    )
