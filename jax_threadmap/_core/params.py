"""The kernel params of ``threadmap_p``: what each equation runs per element.

Like JAX's ``_FlatCallback``, each is a frozen dataclass that carries a function
together with its tree structures, so params of repeated calls compare equal
(jit caches hit) and travel with the equation through every transformation:

- :class:`KernelParam`: the user's kernel (a primal equation), with the JVP and
  VJP kernels that ``jax_threadmap.kernel(...).defjvp/.defvjp`` attached (a
  :class:`RuleKernel` where such a kernel has rules of its own).
- :class:`DerivativeParam`: a derivative equation. Its :class:`Node` is the
  JVP or VJP kernel of another node (the user's kernel, or a derivative kernel
  of it, at any order), or one of the three kernels of a VJP given with
  residuals (:class:`ResidualRule`: its ``fwd``, its ``bwd``, and the linear
  map between them); the param says which of the node's leaves are operands
  (the others are zeros built on the host) and which of its outputs it returns.

Each (an :data:`AnyParam`) provides ``name`` (shown in jaxprs and messages),
``vectorized``, ``max_chunk``, ``asynchronous`` (``async def``), ``max_in_flight``
and ``host_call()``: ``(fn, in_tree, out_tree)``, the function the host runs per
element, with the trees it takes and returns. The ``executor`` param is the one
passed to ``threadmap``, or an :class:`InOrder` of it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._support.validate import callable_name, is_coroutine_function
from .derivative_calls import DerivativeCall
from .rule_messages import missing_rule_message

Fn = Callable[..., Any]


@dataclasses.dataclass(frozen=True, eq=False)
class ByIdentity:
    """A kernel that cannot be hashed (a callable dataclass): equal only to itself."""

    fn: Fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def hashable(fn: Fn) -> Fn:
    """``fn``, or ``ByIdentity(fn)`` when ``fn`` cannot be hashed."""
    try:
        hash(fn)
    except TypeError:
        return ByIdentity(fn)
    return fn


def _unwrap(fn: Fn) -> Fn:
    return fn.fn if isinstance(fn, ByIdentity) else fn


@dataclasses.dataclass(frozen=True)
class InOrder:
    """``executor=InOrder(executor)``: the map runs its elements one per claim,
    in index order, on every thread of ``executor`` at once, as
    ``ThreadPoolExecutor.map`` does. No decision reads a clock.

    For maps whose elements wait for each other (at a barrier, for replies that
    come once every request is out): such a map finishes whenever each group of
    elements that wait for each other has no more elements than ``executor``
    has threads. Without it, a large map takes chunks of several elements sized
    from timings, and a thread may wait at one element of a group for another
    queued behind it in its own chunk, for good (docs/executors.md).

    Args:
        executor: Where the elements run, as for [`threadmap`][jax_threadmap.threadmap]:
            ``None`` (the shared pool), an int (a shared pool of that many
            threads) or a ``concurrent.futures.Executor``.

    Examples:
        >>> import threading
        >>> import jax, jax.numpy as jnp
        >>> from jax_threadmap import InOrder, threadmap
        >>> pairs = [threading.Barrier(2, timeout=60) for _ in range(32)]
        >>> def meet(i):  # elements 2k and 2k + 1 wait for each other
        ...     pairs[int(i) // 2].wait()
        ...     return i
        >>> f = jax.vmap(lambda i: threadmap(
        ...     meet, jax.ShapeDtypeStruct((), jnp.int32), i, executor=InOrder(4)))
        >>> int(f(jnp.arange(64, dtype=jnp.int32)).sum())
        2016
    """

    executor: Any = None


@dataclasses.dataclass(frozen=True)
class KernelParam:
    """A user kernel with its trees and derivative kernels.

    Attributes:
        fn: The kernel, called per element as ``fn(*args, **kwargs)``.
        in_tree: Treedef of ``(args, kwargs)``.
        out_tree: Treedef of the kernel's result.
        jvp: The JVP kernel, or ``None``.
        vjp: The VJP kernel, a :class:`ResidualRule` (``fwd``/``bwd``), or
            ``None``.
        vectorized: Whether the kernels take a chunk of elements (a leading axis)
            instead of one element.
        max_chunk: For vectorized kernels, the most elements per chunk, or
            ``None`` for an automatic length.
        wrapped: Whether the call came from a ``jax_threadmap.kernel`` (which
            takes ``.defjvp``/``.defvjp``) rather than a bare ``threadmap``; only
            the message for a missing derivative differs.
        max_in_flight: For ``async def`` kernels (and derivative kernels), the
            most elements in flight at once, or ``None`` for the default.
    """

    fn: Fn
    in_tree: Any
    out_tree: Any
    jvp: Fn | None = None
    vjp: Fn | ResidualRule | None = None
    vectorized: bool = False
    max_chunk: int | None = None
    wrapped: bool = False
    max_in_flight: int | None = None

    @property
    def name(self) -> str:
        return callable_name(_unwrap(self.fn))

    @property
    def asynchronous(self) -> bool:
        return is_coroutine_function(_unwrap(self.fn))

    def __repr__(self) -> str:
        return _with_chunking(self.name, self)

    @property
    def num_positional(self) -> int:
        """The number of positional-argument leaves (they come first)."""
        return self.in_tree.children()[0].num_leaves

    def host_call(self) -> tuple[Fn, Any, Any]:
        return _unwrap(self.fn), self.in_tree, self.out_tree


def _with_chunking(name: str, kernel: KernelParam) -> str:
    """``name``, marked when the kernel is vectorized (as jaxprs show it)."""
    if not kernel.vectorized:
        return name
    bound = "" if kernel.max_chunk is None else f"<={kernel.max_chunk}"
    return f"{name}[vectorized{bound}]"


def _flat_tree(n: int, *, kwargs: bool) -> Any:
    """Treedef of n flat positional leaves: ``((*,)*n, {})`` or ``(*,)*n``."""
    leaves = tuple(range(n))
    return jax.tree_util.tree_structure((leaves, {}) if kwargs else leaves)


@functools.lru_cache(maxsize=64)  # per abstract value of the rules: a hit calls nothing
def is_differentiable(dtype: Any) -> bool:
    return bool(jax.numpy.issubdtype(dtype, np.inexact))


@dataclasses.dataclass(frozen=True)
class RuleKernel:
    """A derivative kernel with derivative kernels of its own, as params carry it.

    ``defjvp``/``defvjp`` given a ``jax_threadmap.kernel`` store it as this
    frozen record (its function and its own rules, recursively), taken when the
    call is bound: hashable, equal for equal functions, and pickled by reference
    to its functions, like the rest of a param.

    Attributes:
        fn: The derivative kernel.
        jvp: Its own JVP kernel (a function or a ``RuleKernel``), or ``None``.
        vjp: Its own VJP kernel, a :class:`ResidualRule`, or ``None``.
        chunking: Its own ``(vectorized, max_chunk)``: a kernel made with
            ``vectorized=`` takes chunks even where the primal kernel does not.
    """

    fn: Fn
    jvp: Fn | None = None
    vjp: Fn | ResidualRule | None = None
    chunking: tuple[bool, int | None] = (False, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _unwrap(self.fn)(*args, **kwargs)


Aval = tuple[tuple[int, ...], np.dtype]


def _tangent(aval: Aval) -> Aval:
    shape, dtype = aval
    return shape, np.dtype(dtype) if is_differentiable(dtype) else jax.dtypes.float0


@dataclasses.dataclass(frozen=True)
class ResidualRule:
    """Rules given with ``fwd`` and its residuals, as params carry them.

    ``defvjp(fwd, bwd, residuals=...)`` and ``defjvp(fwd, jvp, residuals=...)``
    store it in place of a VJP kernel, taken when the call is bound (as
    :class:`RuleKernel`). ``fwd`` runs instead of the kernel where a derivative
    may follow and returns ``(out, res)``; ``bwd`` maps ``(res, cotangent)`` to
    one cotangent per positional argument and ``jvp`` maps ``(res, *tangents)``
    to the output's tangent, so what ``fwd`` computed (a factorization) is not
    computed again.

    Attributes:
        fwd: ``fwd(*args, **kwargs) -> (out, res)``: a function or a
            :class:`RuleKernel`.
        bwd: ``bwd(res, ct, **kwargs) -> (ct_arg, ...)``: a function or a
            :class:`RuleKernel`; ``None`` with a ``jvp`` alone.
        res_tree: Treedef of the residuals.
        res_avals: Per residual leaf, its ``(shape, dtype)`` for one element.
        jvp: ``jvp(res, *tangents, **kwargs) -> tangent``, or ``None`` (then
            forward mode runs the kernel's JVP kernel, if any, on the primals).
        directions: Whether ``jvp`` takes the tangent directions of a ``vmap``
            over the tangents alone as leading axes (see :class:`DerivativeParam`).
    """

    fwd: Fn
    bwd: Fn | None
    res_tree: Any
    res_avals: tuple[Aval, ...]
    jvp: Fn | None = None
    directions: bool = False

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """Per residual leaf, its name in messages: ``residuals[0]['lu']``."""
        tree = jax.tree_util.tree_unflatten(self.res_tree, range(len(self.res_avals)))
        paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        return tuple("residuals" + jax.tree_util.keystr(path) for path, _ in paths)


#: The kinds of a derived :class:`Node`: the rules of its base (``"jvp"``,
#: ``"vjp"``) and, for a base whose VJP is a :class:`ResidualRule`, its
#: ``"fwd"``, its ``"bwd"`` and ``"lin"`` (a JVP over the base's leaves and the
#: residuals, whose transpose is ``bwd``).
KINDS = ("jvp", "vjp", "fwd", "bwd", "lin")


@dataclasses.dataclass(frozen=True)
class Node:
    """A kernel at some order: the user's, or a derivative kernel of another node.

    Every node takes one element's positional arguments and keyword arguments and
    returns a pytree, and its own rules follow the same conventions
    (``jvp(*args, *tangents, **kwargs)``, ``vjp(*args, cotangent, **kwargs)``).
    A derived node's leaves are the base leaves it keeps, then the new ones (one
    tangent per positional leaf of the base, or one cotangent per output leaf),
    which are the positional arguments that it adds:

    - ``jvp`` of base ``B``: arguments ``(*B.args, *B.tangents)``, result like
      ``B``'s (its tangent);
    - ``vjp`` of base ``B``: arguments ``(*B.args, B.cotangent)``, result a tuple
      with one cotangent per positional argument of ``B``;
    - where ``B``'s VJP is a :class:`ResidualRule`: ``fwd`` (``B``'s leaves,
      result ``(B.out, res)``), ``bwd`` (leaves ``res``, ``B``'s keyword
      leaves, then ``B.cotangent``; result as ``vjp``'s) and ``lin`` (``B``'s
      leaves, ``res``, then ``B.tangents``; result as ``jvp``'s, computed by
      the residual rule's ``jvp`` on ``(res, *B.tangents)``, or else by
      ``B``'s JVP kernel on ``(*B.args, *B.tangents)``; its transpose is
      ``bwd``).

    Attributes:
        kernel: The user's kernel at the root (its executor and chunking apply).
        in_avals: Per leaf, its ``(shape, dtype)`` for one element.
        out_avals: Per output leaf, its ``(shape, dtype)`` for one element.
        base: The node this one is a derivative kernel of; ``None`` at the root.
        kind: One of :data:`KINDS`: which kernel of ``base`` this node runs.
    """

    kernel: KernelParam
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    base: Node | None = None
    kind: str = ""

    def __post_init__(self) -> None:
        # What the rules and the host read of a node, worked out once as it is
        # made (each a cached property): the readers, in other modules, then
        # read fields rather than call into this one (docs/architecture.md).
        for name in _WORKED_OUT:
            getattr(self, name)

    def derive(self, kind: str) -> Node:
        """The node that runs this node's ``kind`` kernel (one of :data:`KINDS`)."""
        ins, outs = self.in_avals, self.out_avals
        tangents = tuple(_tangent(ins[i]) for i in self.positional)
        cotangents = tuple(map(_tangent, outs))
        if kind == "jvp":
            return Node(self.kernel, ins + tangents, cotangents, self, kind)
        if kind == "vjp":
            return Node(self.kernel, ins + cotangents, tangents, self, kind)
        res = self.residual_rule.res_avals
        if kind == "fwd":
            return Node(self.kernel, ins, outs + res, self, kind)
        if kind == "lin":
            return Node(self.kernel, ins + res + tangents, cotangents, self, kind)
        assert kind == "bwd", kind
        keywords = tuple(ins[i] for i in self.keywords)
        return Node(self.kernel, res + keywords + cotangents, tangents, self, kind)

    @functools.cached_property
    def residual_rule(self) -> ResidualRule:
        """This node's VJP given with residuals (``defvjp(fwd, bwd, ...)``)."""
        rule = self.rule("vjp")
        assert isinstance(rule, ResidualRule), rule
        return rule

    @functools.cached_property
    def rule_object(self) -> Any:
        """What this node runs: a ``KernelParam``, a ``RuleKernel``, a plain
        function, or ``None`` when its base has no such rule."""
        base = self.base
        if base is None:
            return self.kernel
        if self.kind in ("fwd", "bwd"):
            return getattr(base.residual_rule, self.kind)
        if self.residual_jvp:
            return base.residual_rule.jvp
        return base.rule("jvp" if self.kind == "lin" else self.kind)

    @functools.cached_property
    def residual_jvp(self) -> bool:
        """Whether this is a ``lin`` node run by ``defjvp(fwd, jvp, ...)``'s
        ``jvp``, which takes the residuals instead of the primals."""
        base = self.base
        return self.kind == "lin" and base is not None and bool(base.residual_rule.jvp)

    def rule(self, kind: str) -> Any:
        """This node's own ``kind`` rule (``"jvp"`` or ``"vjp"``: a function,
        a ``RuleKernel`` or, for ``"vjp"``, a ``ResidualRule``), or ``None``."""
        obj = self.rule_object
        if isinstance(obj, (KernelParam, RuleKernel)):
            return getattr(obj, kind)
        return None

    @property
    def is_kernel(self) -> bool:
        """Whether what this node runs takes rules of its own: the user's kernel,
        or a derivative kernel that is a ``jax_threadmap.kernel``."""
        return isinstance(self.rule_object, (KernelParam, RuleKernel))

    @property
    def residuals(self) -> bool:
        """Whether this node's VJP is given with residuals (``fwd``/``bwd``)."""
        return isinstance(self.rule("vjp"), ResidualRule)

    def missing_rule(self) -> str:
        """Why this derived node, whose base lacks its rule, cannot run: the
        base's missing rule, named as at first order."""
        assert self.base is not None and self.rule_object is None
        which = {"lin": "jvp", "bwd": "vjp"}.get(self.kind, self.kind)
        return missing_rule_message(self.base, which)

    @property
    def name(self) -> str:
        obj = self.rule_object
        if obj is None:
            assert self.base is not None
            kind = "jvp" if self.kind == "lin" else self.kind
            return f"{kind}({self.base.name})"
        if isinstance(obj, (KernelParam, RuleKernel)):
            obj = obj.fn
        return callable_name(_unwrap(obj))

    @functools.cached_property
    def num_base(self) -> int:
        """The number of leaves before the new ones (all, at the root and for
        ``fwd``): the leaves the node is not linear in."""
        base = self.base
        if base is None:
            return len(self.in_avals)
        if self.kind == "lin":
            return len(base.in_avals) + len(base.residual_rule.res_avals)
        if self.kind == "bwd":
            return len(base.residual_rule.res_avals) + len(base.keywords)
        return len(base.in_avals)

    @functools.cached_property
    def positional(self) -> tuple[int, ...]:
        """The leaf indices of the positional-argument leaves, in order."""
        base = self.base
        if base is None:
            return tuple(range(self.kernel.num_positional))
        new = tuple(range(self.num_base, len(self.in_avals)))
        if self.kind == "fwd":
            return base.positional
        if self.kind == "bwd":
            return tuple(range(len(base.residual_rule.res_avals))) + new
        if self.residual_jvp:
            return tuple(range(len(base.in_avals), self.num_base)) + new
        return base.positional + new

    @functools.cached_property
    def keywords(self) -> tuple[int, ...]:
        """The leaf indices of the keyword-argument leaves."""
        base = self.base
        if base is None:
            return tuple(range(self.kernel.num_positional, len(self.in_avals)))
        if self.kind == "bwd":
            start = len(base.residual_rule.res_avals)
            return tuple(range(start, start + len(base.keywords)))
        return base.keywords

    @functools.cached_property
    def unused(self) -> frozenset[int]:
        """Leaves the kernel never sees (a ``lin`` node's residuals, or its
        primals where ``jvp`` takes the residuals)."""
        used = set(self.positional) | set(self.keywords)
        return frozenset(i for i in range(len(self.in_avals)) if i not in used)

    @functools.cached_property
    def args_tree(self) -> Any:
        """Treedef of the tuple of positional arguments."""
        base = self.base
        if base is None:
            return self.kernel.in_tree.children()[0]
        if self.kind == "fwd":
            return base.args_tree
        base_args = base.args_tree.children()
        if self.residual_jvp:
            res_tree = base.residual_rule.res_tree
            return jax.tree_util.treedef_tuple([res_tree, *base_args])
        if self.kind in ("jvp", "lin"):
            return jax.tree_util.treedef_tuple(base_args + base_args)
        if self.kind == "vjp":
            return jax.tree_util.treedef_tuple([*base_args, base.out_tree])
        res_tree = base.residual_rule.res_tree
        return jax.tree_util.treedef_tuple([res_tree, base.out_tree])

    @functools.cached_property
    def kwargs_tree(self) -> Any:
        if self.base is None:
            return self.kernel.in_tree.children()[1]
        return self.base.kwargs_tree

    @functools.cached_property
    def out_tree(self) -> Any:
        base = self.base
        if base is None:
            return self.kernel.out_tree
        if self.kind == "fwd":
            res_tree = base.residual_rule.res_tree
            return jax.tree_util.treedef_tuple([base.out_tree, res_tree])
        return base.args_tree if self.kind in ("vjp", "bwd") else base.out_tree

    @functools.cached_property
    def function(self) -> Fn:
        """The function this node runs per element."""
        obj = self.rule_object
        return _unwrap(obj.fn if isinstance(obj, (KernelParam, RuleKernel)) else obj)


#: The cached properties of a :class:`Node` worked out as it is made.
_WORKED_OUT = (
    *("rule_object", "function", "residual_jvp", "num_base", "positional"),
    *("keywords", "unused", "args_tree", "kwargs_tree", "out_tree"),
)


@dataclasses.dataclass(frozen=True, repr=False)
class DerivativeParam:
    """The param of a derivative equation: a derived node, with the leaves it
    gets as operands and the outputs it returns.

    Leaves that are not operands are zeros built on the host (symbolic-zero
    tangents, integer inputs, outputs without a cotangent), so no zeros are built
    or moved on the device. The equation is linear in the node's new leaves
    (tangents or cotangents); the base's leaves are residuals.

    Attributes:
        node: The derived node (``node.base`` is not ``None``).
        present: Per leaf of the node, whether it is an operand.
        keep: Per output leaf of the node, whether it is a result.
        directions: The sizes of the ``vmap`` levels folded into the new leaves
            and the results of a ``lin`` equation whose ``jvp`` takes them
            (``defjvp(..., directions=True)``): their leading core axes, the
            last folded first. Its rules unfold them (``autodiff.py``).
    """

    node: Node
    present: tuple[bool, ...]
    keep: tuple[bool, ...]
    directions: tuple[int, ...] = ()

    @property
    def folds(self) -> bool:
        """Whether a ``vmap`` level at which only the new leaves are batched is
        handed to the kernel as their leading axis (``directions=True``)."""
        base = self.node.base
        return (
            self.node.residual_jvp
            and base is not None
            and base.residual_rule.directions
        )

    @property
    def name(self) -> str:
        return self.node.name

    @functools.cached_property  # read by the host and the lowering
    def vectorized(self) -> bool:
        return self._chunking[0] or self.node.kernel.vectorized

    @property
    def max_chunk(self) -> int | None:
        return self._chunking[1] or self.node.kernel.max_chunk

    @property
    def _chunking(self) -> tuple[bool, int | None]:
        """The derivative kernel's own ``vectorized=`` (a ``jax_threadmap.kernel``)."""
        rule = self.node.rule_object
        return rule.chunking if isinstance(rule, RuleKernel) else (False, None)

    @functools.cached_property  # read by the host and the lowering
    def asynchronous(self) -> bool:
        return self.node.rule_object is not None and is_coroutine_function(
            self.node.function
        )

    @property
    def max_in_flight(self) -> int | None:
        return self.node.kernel.max_in_flight

    def __repr__(self) -> str:
        return _with_chunking(self.name, self.node.kernel)

    def host_call(self) -> tuple[Fn, Any, Any]:
        node = self.node
        if node.rule_object is None:
            # Traced and transposed without one; running it needs one.
            raise TypeError(node.missing_rule())
        n_in, n_out = sum(self.present), sum(self.keep)
        call = DerivativeCall(self)
        fn = call.direct if call.is_direct else call
        return fn, _flat_tree(n_in, kwargs=True), _flat_tree(n_out, kwargs=False)


AnyParam = KernelParam | DerivativeParam


def kernel_ids(param: Any) -> tuple[int, ...]:
    """The ids of the functions a kernel param runs (its kernels and rules):
    with the param, a key that compares kernels by identity, as docs/faq.md
    says (two that compare equal may compute different things)."""
    if isinstance(
        param, (KernelParam, RuleKernel, ResidualRule, Node, DerivativeParam)
    ):
        fields = (getattr(param, f.name) for f in dataclasses.fields(param))
        return sum(map(kernel_ids, fields), ())
    return (id(_unwrap(param)),) if callable(param) else ()
