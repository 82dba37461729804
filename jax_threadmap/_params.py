"""The kernel params of ``threadmap_p``: what each equation runs per element.

Like JAX's ``_FlatCallback``, each is a frozen dataclass that carries a function
together with its tree structures, so params of repeated calls compare equal
(jit caches hit) and travel with the equation through every transformation.
There are three siblings, one per kind of equation:

- :class:`KernelParam`: the user's kernel (a primal equation), with the JVP and
  VJP kernels that ``jax_threadmap.kernel(...).defjvp/.defvjp`` attached.
- :class:`JvpParam`: the JVP equation of a primal one; calls
  ``jvp(*primals, *tangents, **kwargs)`` on flat operand leaves.
- :class:`VjpParam`: the transpose of a JVP equation; calls
  ``vjp(*primals, cotangent, **kwargs)`` on flat operand leaves.

Each provides ``name`` (shown in jaxprs and messages) and :meth:`host_call`: the
function the host runs per element, with the trees it takes and returns.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from ._event_loop import is_coroutine_function
from ._validate import callable_name

Fn = Callable[..., Any]


class HostCall(Protocol):
    """What the lowering needs of a kernel param."""

    @property
    def name(self) -> str: ...

    @property
    def vectorized(self) -> bool: ...

    @property
    def max_chunk(self) -> int | None: ...

    @property
    def asynchronous(self) -> bool:
        """Whether what runs per element is ``async def`` (a coroutine each)."""
        ...

    @property
    def max_in_flight(self) -> int | None: ...

    def host_call(self) -> tuple[Fn, Any, Any]:
        """``(fn, in_tree, out_tree)``: what runs per element, and its trees."""
        ...


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
class KernelParam:
    """A user kernel with its trees and derivative kernels.

    Attributes:
        fn: The kernel, called per element as ``fn(*args, **kwargs)``.
        in_tree: Treedef of ``(args, kwargs)``.
        out_tree: Treedef of the kernel's result.
        jvp: The JVP kernel, or ``None``.
        vjp: The VJP kernel, or ``None``.
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
    vjp: Fn | None = None
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


def is_differentiable(dtype: Any) -> bool:
    return bool(jax.numpy.issubdtype(dtype, np.inexact))


def tangent_dtype(dtype: Any) -> np.dtype:
    return np.dtype(dtype) if is_differentiable(dtype) else jax.dtypes.float0


def _zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    z = np.zeros(shape, dtype)
    z.flags.writeable = False  # like the other inputs of a kernel
    return z


class _OfPrimal:
    """What a derivative equation's param takes from its primal kernel."""

    primal: KernelParam

    @property
    def name(self) -> str:
        raise NotImplementedError  # each param type names its kernel

    @property
    def vectorized(self) -> bool:
        return self.primal.vectorized

    @property
    def max_chunk(self) -> int | None:
        return self.primal.max_chunk

    @property
    def max_in_flight(self) -> int | None:
        return self.primal.max_in_flight

    def __repr__(self) -> str:
        return _with_chunking(self.name, self.primal)


@dataclasses.dataclass(frozen=True, repr=False)  # _OfPrimal's repr
class JvpParam(_OfPrimal):
    """The JVP equation of ``primal``: ``jvp(*primals, *tangents, **kwargs)``.

    Operands: every primal leaf, then the tangent leaves that exist. Positional
    leaves without one (symbolic zeros, integer inputs) get zeros on the host, so
    no zeros are built or moved on the device. Results: the tangents of the
    differentiable outputs.

    Attributes:
        primal: The primal equation's kernel.
        tangent_slots: Per positional leaf, its tangent operand's index among the
            tangents, or ``None``.
        out_avals: Per output leaf of the primal, its ``(shape, dtype)``.
    """

    primal: KernelParam
    tangent_slots: tuple[int | None, ...]
    out_avals: tuple[tuple[tuple[int, ...], np.dtype], ...]

    @property
    def out_mask(self) -> tuple[bool, ...]:
        """Per output leaf, whether it has a tangent (is not an integer)."""
        return tuple(is_differentiable(d) for _, d in self.out_avals)

    @property
    def name(self) -> str:
        jvp = self.primal.jvp
        return callable_name(jvp) if jvp is not None else f"jvp({self.primal.name})"

    @property
    def num_primals(self) -> int:
        return self.primal.in_tree.num_leaves

    def host_call(self) -> tuple[Fn, Any, Any]:
        if self.primal.jvp is None:
            # Traced and transposed (grad) without one; running it needs one.
            raise TypeError(missing_rule_message(self.primal, "jvp"))
        n_in = self.num_primals + sum(s is not None for s in self.tangent_slots)
        n_out = sum(self.out_mask)
        return self, _flat_tree(n_in, kwargs=True), _flat_tree(n_out, kwargs=False)

    def __call__(self, *leaves: np.ndarray) -> Any:
        primal = self.primal
        n = self.num_primals
        primals, tangent_ops = leaves[:n], leaves[n:]
        args, kwargs = jax.tree_util.tree_unflatten(primal.in_tree, primals)
        tangent_leaves = [
            _zeros(primals[i].shape, tangent_dtype(primals[i].dtype))
            if slot is None
            else tangent_ops[slot]
            for i, slot in enumerate(self.tangent_slots)
        ]
        tangents = jax.tree_util.tree_unflatten(
            primal.in_tree.children()[0], tangent_leaves
        )
        assert primal.jvp is not None
        result = primal.jvp(*args, *tangents, **kwargs)
        if inspect.iscoroutine(result):  # an async def JVP kernel
            return _then(result, self._tangents)
        return self._tangents(result)

    @property
    def asynchronous(self) -> bool:
        return is_coroutine_function(self.primal.jvp)

    def _tangents(self, result: Any) -> tuple[Any, ...]:
        """The JVP kernel's result as the equation's flat outputs."""
        primal = self.primal
        try:
            out = primal.out_tree.flatten_up_to(result)
        except (ValueError, TypeError) as e:
            raise TypeError(
                f"the JVP kernel must return the tangent of the output, a pytree "
                f"with the structure of result_shape_dtypes ({primal.out_tree}); "
                f"got {jax.tree_util.tree_structure(result)} ({e})."
            ) from None
        return tuple(x for x, keep in zip(out, self.out_mask, strict=True) if keep)


@dataclasses.dataclass(frozen=True, repr=False)  # _OfPrimal's repr
class VjpParam(_OfPrimal):
    """The transpose of a JVP equation: ``vjp(*primals, cotangent, **kwargs)``.

    Operands: every primal leaf, then the output cotangent leaves that exist (the
    others get zeros on the host). Results: the cotangents of the positional
    leaves in ``wanted``; ``None`` from the kernel, for a whole argument or one
    leaf, means zeros.

    Attributes:
        primal: The primal equation's kernel.
        ct_slots: Per output leaf, its cotangent operand's index, or ``None``.
        out_zeros: Per output leaf, the ``(shape, dtype)`` of its zero cotangent.
        wanted: The positional leaves whose cotangents are returned.
    """

    primal: KernelParam
    ct_slots: tuple[int | None, ...]
    out_zeros: tuple[tuple[tuple[int, ...], np.dtype], ...]
    wanted: tuple[int, ...]

    @property
    def name(self) -> str:
        return callable_name(self.primal.vjp)

    def host_call(self) -> tuple[Fn, Any, Any]:
        n_in = self.primal.in_tree.num_leaves + sum(
            s is not None for s in self.ct_slots
        )
        n_out = len(self.wanted)
        return self, _flat_tree(n_in, kwargs=True), _flat_tree(n_out, kwargs=False)

    def __call__(self, *leaves: np.ndarray) -> Any:
        primal = self.primal
        n = primal.in_tree.num_leaves
        primals, ct_ops = leaves[:n], leaves[n:]
        args, kwargs = jax.tree_util.tree_unflatten(primal.in_tree, primals)
        ct_leaves = [
            _zeros(shape, dtype) if slot is None else ct_ops[slot]
            for slot, (shape, dtype) in zip(self.ct_slots, self.out_zeros, strict=True)
        ]
        ct = jax.tree_util.tree_unflatten(primal.out_tree, ct_leaves)
        assert primal.vjp is not None
        result = primal.vjp(*args, ct, **kwargs)
        if inspect.iscoroutine(result):  # an async def VJP kernel
            return _then(result, lambda r: self._cotangents(args, primals, r))
        return self._cotangents(args, primals, result)

    @property
    def asynchronous(self) -> bool:
        return is_coroutine_function(self.primal.vjp)

    def _cotangents(
        self, args: tuple[Any, ...], primals: Sequence[np.ndarray], result: Any
    ) -> tuple[Any, ...]:
        """The VJP kernel's result as the equation's flat outputs."""
        flat = self._flat_cotangents(args, result)
        return tuple(
            _zeros(primals[j].shape, primals[j].dtype) if flat[j] is None else flat[j]
            for j in self.wanted
        )

    def _flat_cotangents(self, args: tuple[Any, ...], result: Any) -> list[Any]:
        """One cotangent (or ``None``) per positional leaf, from the kernel's tuple."""
        if not isinstance(result, (tuple, list)) or len(result) != len(args):
            raise TypeError(
                f"the VJP kernel must return a tuple with one cotangent per "
                f"positional argument ({len(args)}), e.g. `return (ct_x,)` for one "
                f"argument; got {_describe(result)}."
            )
        flat: list[Any] = []
        arg_trees = self.primal.in_tree.children()[0].children()
        for i, (tree, r) in enumerate(zip(arg_trees, result, strict=True)):
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
        return flat


AnyParam = KernelParam | JvpParam | VjpParam


async def _then(result: Any, finish: Callable[[Any], Any]) -> Any:
    """``finish(await result)``: a derivative adapter around an async def kernel."""
    return finish(await result)


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"a value of type {type(x).__name__}"


def missing_rule_message(kernel: KernelParam, which: str) -> str:
    name = kernel.name
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
