"""The ``kernel`` decorator: :class:`KernelFunction`, the derivative kernels
attached to it, and the params they become at each call (``threadmap`` itself
is ``binding.py``; the checks of ``defjvp``/``defvjp``, ``rule_checks.py``)."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

import jax
import numpy as np

from .._coroutines import async_kernels as _async_kernels
from .._jax import hooks as _hooks
from .._support import validate as _validate
from .._support.validate import RESERVED_KWARGS
from .binding import bind as _bind
from .binding import check_executor
from .params import InOrder, ResidualRule, RuleKernel, hashable
from .rule_checks import DerivativeKernel
from .rule_checks import check_rule as _check_rule
from .rule_checks import check_shared_fwd as _check_shared_fwd
from .rule_checks import fwd_rule as _fwd_rule
from .rule_checks import one_fwd_message as _one_fwd_message

#: What a kernel call returns, for type checkers: ``jax.Array`` for one
#: ``jax.ShapeDtypeStruct``, a tuple of them for a tuple, else ``Any`` (a pytree).
R = TypeVar("R")

#: Counts the changes of any kernel's rules (``defjvp``, ``defvjp``): the params
#: a kernel built for its calls hold its derivative kernels' rules too, so any
#: change makes every kernel build its params again
#: (:meth:`KernelFunction._rule_params`).
_rule_changes = itertools.count()
_rules_version = next(_rule_changes)


def _rules_changed() -> None:
    """Counts a change of a kernel's rules, once it is made."""
    global _rules_version
    _rules_version = next(_rule_changes)


def _rule_param(
    rule: Callable[..., Any] | None, outer: tuple[KernelFunction[Any], ...]
) -> Callable[..., Any] | None:
    """A derivative kernel as the param carries it: a ``jax_threadmap.kernel``
    becomes a :class:`~.params.RuleKernel` with its own rules, taken now."""
    if rule is None:
        return None
    if not isinstance(rule, KernelFunction):
        return hashable(rule)
    if rule in outer:
        chain = " -> ".join(_validate.callable_name(k.fn) for k in (*outer, rule))
        raise TypeError(
            f"jax_threadmap.kernel {_validate.callable_name(rule.fn)} is among its "
            f"own derivative kernels ({chain}). Each order takes more arguments "
            "than the one before, so each needs a kernel of its own."
        )
    return RuleKernel(
        hashable(rule.fn), *rule._params((*outer, rule)), rule._vectorized
    )


class KernelFunction(Generic[R]):
    """A per-element NumPy kernel, callable like ``threadmap(fn, ...)``.

    Made by [`kernel`][jax_threadmap.kernel]; see there. Calling it binds one
    ``threadmap`` equation;
    [`defjvp`][jax_threadmap.KernelFunction.defjvp] and
    [`defvjp`][jax_threadmap.KernelFunction.defvjp] attach the threaded kernels
    that ``jax.jvp`` / ``jax.grad`` and friends run for it.

    Attributes:
        fn: The primal kernel.
        result_shape_dtypes: One element's result, as given to
            [`kernel`][jax_threadmap.kernel].
        jvp: The JVP kernel (on the primals, or on ``fwd``'s residuals), or
            ``None``.
        vjp: The VJP kernel, or ``None``.
        fwd: The forward kernel of ``defvjp(fwd, bwd, residuals=...)`` and
            ``defjvp(fwd, jvp, residuals=...)``, or ``None``.
        bwd: Its backward kernel, or ``None``.
        residuals: Its residuals' declaration, or ``None``.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import jax_threadmap
        >>> @jax_threadmap.kernel(jax.ShapeDtypeStruct((), jnp.float32))
        ... def cube(x):
        ...     return x**3
        >>> cube
        <jax_threadmap kernel cube>
        >>> jax.vmap(cube)(jnp.arange(3.0))
        Array([0., 1., 8.], dtype=float32)
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        result_shape_dtypes: Any,
        *,
        executor: int | concurrent.futures.Executor | InOrder | None = None,
        progress: bool | None = None,
        vectorized: bool | int = False,
        max_in_flight: int | None = None,
    ):
        _validate.check_callable(
            fn,
            "jax_threadmap.kernel(result_shape_dtypes)",
            "the decorated kernel",
            "Apply the decorator to a function.",
        )
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.result_shape_dtypes = result_shape_dtypes
        self.jvp: Callable[..., Any] | None = None
        self.vjp: Callable[..., Any] | None = None
        self.fwd: Callable[..., Any] | None = None
        self.bwd: Callable[..., Any] | None = None
        self.residuals: Any = None
        self._jvp_on_residuals = False  # defjvp(fwd, jvp, residuals=...)
        self._directions = False  # defjvp(..., directions=True)
        self._executor = executor
        self._progress = progress
        self._vectorized = _validate.check_vectorized(
            vectorized, "jax_threadmap.kernel"
        )
        self._max_in_flight = max_in_flight
        #: ``(version, x64)`` -> the params of the rules (:meth:`_rule_params`).
        self._rules: tuple[tuple[int, bool], tuple[Any, Any]] | None = None
        self._check_async(fn, "kernel")

    def _check_async(self, fn: Callable[..., Any], what: str) -> None:
        """Refuses an ``async def`` kernel (or derivative kernel) with an
        executor or ``vectorized`` (see ``_coroutines.async_kernels``)."""
        _async_kernels.check_async_kernel(
            fn,
            executor=self._executor,
            vectorized=self._vectorized[0],
            api="jax_threadmap.kernel",
            what=what,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        """Same as ``threadmap(fn, result_shape_dtypes, *args, **kwargs)``."""
        for name in RESERVED_KWARGS:
            if name in kwargs:
                raise TypeError(
                    f"{_validate.callable_name(self.fn)}: {name!r} is an option of "
                    f"jax_threadmap.kernel(..., {name}=...), set once for the "
                    "kernel, and cannot be passed per call or reach the kernel. "
                    f"Got {name}={kwargs[name]!r}."
                )
        jvp, vjp = self._rule_params()
        result: R = _bind(
            self.fn,
            self.result_shape_dtypes,
            args,
            kwargs,
            executor=self._executor,
            progress=self._progress,
            vectorized=self._vectorized,
            max_in_flight=self._max_in_flight,
            jvp=jvp,
            vjp=vjp,
            wrapped=True,
        )
        return result

    def _rule_params(self) -> tuple[Any, Any]:
        """The JVP and VJP params of a call, built (the residuals checked) once
        per change of any kernel's rules and per ``jax_enable_x64``, against
        which the residuals' dtypes are checked; not at every call."""
        x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]
        key = (_rules_version, x64)
        built = self._rules
        if built is None or built[0] != key:
            self._rules = built = (key, self._params(()))
        return built[1]

    def _params(
        self, outer: tuple[KernelFunction[Any], ...]
    ) -> tuple[Callable[..., Any] | None, Callable[..., Any] | ResidualRule | None]:
        """The JVP and VJP params of this kernel's rules (``outer``: the kernels
        whose derivative kernel it is): ``fwd``/``bwd`` (and ``defjvp``'s
        ``jvp`` over the same residuals) become a :class:`~.params.ResidualRule`,
        their residuals checked now (with the ``jax_enable_x64`` of this call)."""
        jvp = _rule_param(self.jvp, outer)
        if self.fwd is None:
            return jvp, _rule_param(self.vjp, outer)
        api = "defvjp(fwd, bwd, " if self.bwd else "defjvp(fwd, jvp, "
        avals, tree = _validate.result_avals(
            self.residuals, api + "residuals=...)", name="residuals"
        )
        fwd = _rule_param(self.fwd, outer)
        assert fwd is not None
        on_residuals = self._jvp_on_residuals
        rule = ResidualRule(
            fwd,
            _rule_param(self.bwd, outer),
            tree,
            tuple((tuple(a.shape), np.dtype(a.dtype)) for a in avals),
            jvp if on_residuals else None,
            self._directions,
        )
        return (None if on_residuals else jvp), rule

    @overload
    def defjvp(self, jvp: DerivativeKernel, /) -> DerivativeKernel: ...

    @overload
    def defjvp(
        self,
        fwd: Callable[..., Any],
        jvp: Callable[..., Any],
        /,
        *,
        residuals: Any,
        directions: bool = False,
    ) -> None: ...

    def defjvp(
        self,
        jvp_or_fwd: Callable[..., Any],
        jvp: Callable[..., Any] | None = None,
        /,
        *,
        residuals: Any = None,
        directions: bool = False,
    ) -> Any:
        """Attaches the forward-mode rule: for ``jax.jvp``, ``jacfwd``, ``linearize``.

        Either one JVP kernel, which gets the primals, or a forward kernel
        ``fwd`` that returns residuals beside the output (as for
        ``defvjp(fwd, bwd, residuals=...)``, and the same ``fwd`` when both are
        given) and a ``jvp`` that gets them instead of the primals. ``fwd`` then
        runs once per element for the output and every tangent direction
        (``jax.jacfwd``, ``vmap`` of ``jax.jvp``, each application of
        ``jax.linearize``), and only ``jvp`` runs per direction. Attaching one
        form replaces the other.

        Args:
            jvp_or_fwd: The JVP kernel, alone; or, followed by ``jvp``, ``fwd``:

                - ``jvp(*primals, *tangents, **kwargs)`` (alone): one element's
                  positional arguments, then one tangent per positional argument
                  (same pytree structure; float0 zeros for integer and bool
                  leaves), then the keyword arguments. Returns the tangent of the
                  output, a pytree like ``result_shape_dtypes`` (any value, e.g.
                  ``None``, for integer outputs).
                - ``fwd(*primals, **kwargs)``: returns ``(out, res)``, as for
                  ``defvjp``.
                - ``jvp(res, *tangents, **kwargs)`` (after ``fwd``): the
                  residuals of the same element, the tangents, and the keyword
                  arguments; returns the tangent of the output.

                Each is a plain function, or a [`kernel`][jax_threadmap.kernel]
                whose own ``defjvp``/``defvjp`` give the second order (its
                arguments: those listed here).
            jvp: The JVP kernel over the residuals, after ``fwd``.
            residuals: With ``fwd`` and ``jvp``: one element's residuals, as for
                ``defvjp``.
            directions: With ``fwd`` and ``jvp``: ``jvp`` takes every tangent
                direction of an element at once (of ``jax.jacfwd``, ``vmap`` of
                ``jax.jvp``): its tangents get leading axes, one per such
                ``vmap``, and it returns the output's tangent with the same
                leading axes (``res @ t[..., None]`` does). One call per element.

        Returns:
            ``jvp`` itself, so ``defjvp`` can be used as a decorator; ``None``
            for ``fwd`` and ``jvp``.

        Raises:
            TypeError: ``residuals`` missing with two kernels, or given with
                one; a ``fwd`` or ``residuals`` other than those of
                ``defvjp(fwd, bwd, residuals=...)`` already attached.

        Examples:
            >>> import jax, jax.numpy as jnp, numpy as np
            >>> import jax_threadmap
            >>> @jax_threadmap.kernel(jax.ShapeDtypeStruct((), jnp.float32))
            ... def square(x):
            ...     return x * x
            >>> @square.defjvp
            ... def square_jvp(x, tx):
            ...     return 2 * x * tx
            >>> jax.jvp(jax.vmap(square), (jnp.arange(3.0),), (jnp.ones(3),))[1]
            Array([0., 2., 4.], dtype=float32)

            With residuals: ``fwd`` computes ``exp`` once per element, for the
            output and every direction of ``jax.jacfwd``.

            >>> @jax_threadmap.kernel(jax.ShapeDtypeStruct((2,), jnp.float32))
            ... def expm(x):
            ...     return np.exp(x)
            >>> def expm_fwd(x):
            ...     e = np.exp(x)
            ...     return e, e
            >>> def expm_jvp(e, tx):
            ...     return e * tx
            >>> expm.defjvp(expm_fwd, expm_jvp,
            ...             residuals=jax.ShapeDtypeStruct((2,), jnp.float32))
            >>> jax.jacfwd(expm)(jnp.zeros(2))
            Array([[1., 0.],
                   [0., 1.]], dtype=float32)
        """
        if jvp is None and residuals is None:
            if directions:
                raise TypeError(
                    "defjvp: directions=True goes with defjvp(fwd, jvp, residuals="
                    "...), whose jvp takes the residuals; a single JVP kernel takes "
                    "one direction per call. Pass fwd and residuals=, or drop it."
                )
            self.jvp = _check_rule(jvp_or_fwd, "defjvp", self.fn)
            self._check_async(jvp_or_fwd, "JVP kernel")
            self._jvp_on_residuals = False
            if self.bwd is None:
                self.fwd = self.residuals = None
            _rules_changed()
            return jvp_or_fwd
        self.jvp = self._attach_fwd("defjvp", jvp_or_fwd, jvp, residuals)
        self._jvp_on_residuals = True
        self._directions = bool(directions)
        _rules_changed()
        return None

    @overload
    def defvjp(self, vjp: DerivativeKernel, /) -> DerivativeKernel: ...

    @overload
    def defvjp(
        self,
        fwd: Callable[..., Any],
        bwd: Callable[..., Any],
        /,
        *,
        residuals: Any,
    ) -> None: ...

    def defvjp(
        self,
        vjp_or_fwd: Callable[..., Any],
        bwd: Callable[..., Any] | None = None,
        /,
        *,
        residuals: Any = None,
    ) -> Any:
        """Attaches the reverse-mode rule: for ``jax.grad``, ``vjp`` and ``jacrev``.

        Either one VJP kernel, which gets the primals, or, like
        ``jax.custom_vjp``, a forward kernel ``fwd`` that returns residuals
        (a factorization, an intermediate result) beside the output and a
        backward kernel ``bwd`` that gets them instead of the primals. Where a
        derivative may follow (``jax.grad``, ``jax.vjp``), ``fwd`` runs instead
        of the kernel, so what it computes for the backward pass is computed
        once per element. Attaching one form replaces the other.

        Args:
            vjp_or_fwd: The VJP kernel, alone; or, followed by ``bwd``, the
                forward kernel ``fwd``:

                - ``vjp(*primals, cotangent, **kwargs)``: one element's
                  positional arguments, then the cotangent of the output (a
                  pytree like ``result_shape_dtypes``; float0 zeros for integer
                  outputs), then the keyword arguments. Returns a tuple with one
                  cotangent per positional argument, each a pytree like the
                  argument or ``None`` for zeros (integer leaves are ignored).
                - ``fwd(*primals, **kwargs)``: returns ``(out, res)``: one
                  element's output, as the kernel returns it, and its residuals,
                  a pytree like ``residuals``.
                - ``bwd(res, cotangent, **kwargs)`` (the argument ``bwd``): the
                  residuals of the same element, the cotangent of the output,
                  and the keyword arguments; returns what ``vjp`` returns.

                Each is a plain function, or a
                [`kernel`][jax_threadmap.kernel] (its ``result_shape_dtypes``:
                ``(out, residuals)`` for ``fwd``, a tuple with one entry per
                positional argument for ``vjp`` and ``bwd``) whose own
                ``defjvp``/``defvjp`` give the second order: ``defjvp`` for
                ``jax.hessian`` and other forward-over-reverse transforms,
                ``defvjp`` for ``jax.grad`` of ``jax.grad``. With ``fwd`` and
                ``bwd``, the second order differentiates both (the residuals
                are functions of the primals), as JAX differentiates
                ``jax.custom_vjp``'s.
            bwd: The backward kernel, after ``fwd``; ``None`` with a VJP kernel.
            residuals: With ``fwd`` and ``bwd`` (and only then): one element's
                residuals, a pytree of
                [`jax.ShapeDtypeStruct`](https://docs.jax.dev/en/latest/_autosummary/jax.ShapeDtypeStruct.html)
                (or anything with ``.shape`` and ``.dtype``; ``()`` for none).
                Under ``vmap`` they are batched like the outputs. ``None`` (the
                default) goes with a VJP kernel.

        Returns:
            ``vjp`` itself, so that ``defvjp`` can be used as a decorator; ``None``
            for ``fwd`` and ``bwd``.

        Raises:
            TypeError: ``residuals`` missing with ``fwd`` and ``bwd``, given
                with one kernel, or not a pytree of shapes and dtypes; a kernel
                that is not callable. At run time, a ``fwd``
                whose residuals differ from ``residuals`` in structure, shape,
                or in a dtype that cannot hold their values raises a
                ``KernelError`` naming the residual and the batch index.

        Examples:
            >>> import jax, jax.numpy as jnp, numpy as np
            >>> import jax_threadmap
            >>> @jax_threadmap.kernel(jax.ShapeDtypeStruct((), jnp.float32))
            ... def square(x):
            ...     return x * x
            >>> @square.defvjp
            ... def square_vjp(x, ct):
            ...     return (2 * x * ct,)
            >>> jax.grad(lambda x: jax.vmap(square)(x).sum())(jnp.arange(3.0))
            Array([0., 2., 4.], dtype=float32)

            With residuals: ``fwd`` inverts each 2 x 2 matrix once, ``bwd``
            uses the inverse.

            >>> S = jax.ShapeDtypeStruct
            >>> @jax_threadmap.kernel(S((2,), jnp.float32))
            ... def solve(a, b):
            ...     return np.linalg.solve(a, b)
            >>> def solve_fwd(a, b):
            ...     inv = np.linalg.inv(a)
            ...     x = inv @ b
            ...     return x, (inv, x)
            >>> def solve_bwd(res, ct):
            ...     inv, x = res
            ...     ct_b = inv.T @ ct
            ...     return -np.outer(ct_b, x), ct_b
            >>> solve.defvjp(solve_fwd, solve_bwd,
            ...              residuals=(S((2, 2), jnp.float32), S((2,), jnp.float32)))
            >>> a = jnp.array([[[2.0, 0.0], [0.0, 4.0]]] * 3)
            >>> b = jnp.ones((3, 2))
            >>> jax.grad(lambda b: jax.vmap(solve)(a, b).sum())(b)
            Array([[0.5 , 0.25],
                   [0.5 , 0.25],
                   [0.5 , 0.25]], dtype=float32)
        """
        if bwd is None and residuals is None:
            vjp = vjp_or_fwd
            if self._jvp_on_residuals:
                raise TypeError(_one_fwd_message(self.fn))
            self.vjp = _check_rule(vjp, "defvjp", self.fn)
            self._check_async(vjp, "VJP kernel")
            self.fwd = self.bwd = self.residuals = None
            _rules_changed()
            return vjp
        self.bwd = self._attach_fwd("defvjp", vjp_or_fwd, bwd, residuals)
        self.vjp = None
        _rules_changed()
        return None

    def _attach_fwd(
        self, method: str, fwd: Any, rule: Any, residuals: Any
    ) -> Callable[..., Any]:
        """``defjvp(fwd, jvp, ...)``/``defvjp(fwd, bwd, ...)``: ``fwd`` and its
        ``residuals`` attached, checked with ``rule`` (returned, checked): the
        same as the other such rule's, if it has one."""
        fwd, rule = _fwd_rule(fwd, rule, residuals, self.fn, method)
        if self._jvp_on_residuals if method == "defvjp" else self.bwd is not None:
            _check_shared_fwd(self, fwd, residuals, method)
        self._check_async(fwd, "fwd kernel")
        self._check_async(rule, "bwd kernel" if method == "defvjp" else "JVP kernel")
        self.fwd, self.residuals = fwd, residuals
        return rule

    def __repr__(self) -> str:
        jvp = "fwd/jvp" if self._jvp_on_residuals else "jvp"
        rules = [
            n
            for n, r in ((jvp, self.jvp), ("vjp", self.vjp), ("fwd/bwd", self.bwd))
            if r
        ]
        return (
            f"<jax_threadmap kernel {_validate.callable_name(self.fn)}"
            f"{' with ' + ' and '.join(rules) if rules else ''}>"
        )


@overload
def kernel(
    result_shape_dtypes: jax.ShapeDtypeStruct,
    /,
    *,
    executor: int | concurrent.futures.Executor | InOrder | None = None,
    progress: bool | None = None,
    vectorized: bool | int = False,
    max_in_flight: int | None = None,
) -> Callable[[Callable[..., Any]], KernelFunction[jax.Array]]: ...


@overload
def kernel(
    result_shape_dtypes: tuple[jax.ShapeDtypeStruct, ...],
    /,
    *,
    executor: int | concurrent.futures.Executor | InOrder | None = None,
    progress: bool | None = None,
    vectorized: bool | int = False,
    max_in_flight: int | None = None,
) -> Callable[[Callable[..., Any]], KernelFunction[tuple[jax.Array, ...]]]: ...


@overload
def kernel(
    result_shape_dtypes: Any,
    /,
    *,
    executor: int | concurrent.futures.Executor | InOrder | None = None,
    progress: bool | None = None,
    vectorized: bool | int = False,
    max_in_flight: int | None = None,
) -> Callable[[Callable[..., Any]], KernelFunction[Any]]: ...


def kernel(
    result_shape_dtypes: Any,
    /,
    *,
    executor: int | concurrent.futures.Executor | InOrder | None = None,
    progress: bool | None = None,
    vectorized: bool | int = False,
    max_in_flight: int | None = None,
) -> Callable[[Callable[..., Any]], KernelFunction[Any]]:
    """Makes a threaded kernel whose derivatives are threaded kernels too.

    ``kernel(result_shape_dtypes)(fn)`` returns a function ``f`` with ``f(*args,
    **kwargs) == threadmap(fn, result_shape_dtypes, *args, **kwargs)``, to which
    [`KernelFunction.defjvp`][jax_threadmap.KernelFunction.defjvp] and
    [`KernelFunction.defvjp`][jax_threadmap.KernelFunction.defvjp] attach derivative
    kernels: unbatched NumPy kernels, like ``fn``, that run as ``threadmap`` equations
    and fold under ``vmap`` like the primal.

    - With ``defjvp``: ``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``; given
      ``fwd`` and ``jvp`` with residuals (the ``fwd`` of ``defvjp``), ``fwd``
      runs once per element for every tangent direction.
    - With ``defvjp``: ``jax.grad``, ``jax.vjp``, ``jax.jacrev``; given ``fwd`` and
      ``bwd`` with residuals, what ``fwd`` computes is reused by ``bwd``.
    - Both work under ``jit`` and any nesting of ``vmap``.

    Positional arguments are differentiable; keyword arguments are not (they
    reach the derivative kernels as keywords, and a keyword argument that depends
    on the differentiated variable raises). Integer and bool arguments get
    float0 cotangents, as JAX expects. A derivative kernel that is itself a
    ``jax_threadmap.kernel`` with rules of its own gives second-order derivatives
    (``jax.hessian``, ``jax.grad`` of ``jax.grad``, Hessian-vector products), and
    so on; a plain function gives the first order only.

    Args:
        result_shape_dtypes: A pytree of objects with ``.shape`` and ``.dtype``
            (e.g.
            [`jax.ShapeDtypeStruct`](https://docs.jax.dev/en/latest/_autosummary/jax.ShapeDtypeStruct.html))
            describing one element's result.
        executor: As for [`threadmap`][jax_threadmap.threadmap]; used by the primal
            and the derivative equations.
        progress: As for [`threadmap`][jax_threadmap.threadmap].
        vectorized: As for [`threadmap`][jax_threadmap.threadmap]; applies to the
            primal and the derivative kernels alike (each then takes and returns
            chunks with a leading axis, one cotangent or tangent per element).
        max_in_flight: As for [`threadmap`][jax_threadmap.threadmap]; bounds the
            primal and the derivative kernels that are ``async def`` (each may
            be ``async def`` or plain, independently of the others).

    Returns:
        A decorator turning a kernel ``fn`` into a
        [`KernelFunction`][jax_threadmap.KernelFunction].

    Raises:
        TypeError: ``result_shape_dtypes`` is a function (the decorator was used
            without parentheses), or ``executor``/``progress``/``max_in_flight``
            are invalid; an ``async def`` kernel (or derivative kernel, at
            ``defjvp``/``defvjp``) with an executor or ``vectorized``.
        ValueError: ``result_shape_dtypes`` has no leaves (``None``, ``()``).

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import jax_threadmap
        >>> @jax_threadmap.kernel(jax.ShapeDtypeStruct((3,), jnp.float32))
        ... def scaled_sin(x, a):  # one element: x (3,), a ()
        ...     return np.sin(x) * a
        >>> @scaled_sin.defvjp
        ... def scaled_sin_vjp(x, a, ct):
        ...     return ct * np.cos(x) * a, np.sum(ct * np.sin(x))
        >>> x, a = jnp.ones((5, 3)), jnp.float32(2.0)
        >>> g = jax.grad(lambda x: jax.vmap(scaled_sin, (0, None))(x, a).sum())
        >>> bool(jnp.allclose(g(x), 2 * jnp.cos(x)))
        True
    """
    _hooks.require(_hooks.DERIVATIVES, "jax_threadmap.kernel")
    if callable(result_shape_dtypes) and not hasattr(result_shape_dtypes, "shape"):
        raise TypeError(
            "jax_threadmap.kernel takes result_shape_dtypes and returns a "
            "decorator; use it with parentheses: "
            "@jax_threadmap.kernel(jax.ShapeDtypeStruct(shape, dtype)). "
            f"Got the callable {result_shape_dtypes!r}."
        )
    api = "jax_threadmap.kernel"
    _validate.check_has_results(result_shape_dtypes, api)
    executor = check_executor(executor, api=api)
    progress = _validate.check_progress(progress, api=api)
    _validate.check_vectorized(vectorized, api)
    max_in_flight = _async_kernels.check_max_in_flight(max_in_flight, api)

    def decorate(fn: Callable[..., Any]) -> KernelFunction[Any]:
        return KernelFunction(
            fn,
            result_shape_dtypes,
            executor=executor,
            progress=progress,
            vectorized=vectorized,
            max_in_flight=max_in_flight,
        )

    return decorate
