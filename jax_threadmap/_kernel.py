"""The public ``kernel`` decorator: a threadmap call with threaded derivatives."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from . import _api, _compat
from ._autodiff import Rules

F = TypeVar("F", bound=Callable[..., Any])


class KernelFunction:
    """A per-element NumPy kernel, callable like ``threadmap(fn, ...)``.

    Made by :func:`kernel`; see there. Calling it binds one ``threadmap``
    equation; :meth:`defjvp` and :meth:`defvjp` attach the threaded kernels that
    ``jax.jvp`` / ``jax.grad`` and friends run for it.

    Attributes:
        fn: The primal kernel.
        result_shape_dtypes: One element's result, as given to :func:`kernel`.
        jvp: The JVP kernel, or ``None``.
        vjp: The VJP kernel, or ``None``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        result_shape_dtypes: Any,
        *,
        executor: _api.Executor = None,
        options: dict[str, Any] | None = None,
    ):
        if not callable(fn):
            raise TypeError(
                "jax_threadmap.kernel(result_shape_dtypes) must be applied to a "
                f"callable kernel. Got {fn!r} of type {type(fn).__name__}."
            )
        functools.update_wrapper(self, fn)
        self.result_shape_dtypes = result_shape_dtypes
        self._executor = executor
        self._options = dict(options or {})
        # One Rules object per set of rules, so that repeated calls give equal
        # primitive params (jit caches hit) and each call sees the current rules.
        self._rules = Rules(fn, None, None)

    @property
    def fn(self) -> Callable[..., Any]:
        return self._rules.fn

    @property
    def jvp(self) -> Callable[..., Any] | None:
        return self._rules.jvp

    @property
    def vjp(self) -> Callable[..., Any] | None:
        return self._rules.vjp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Same as ``threadmap(fn, result_shape_dtypes, *args, **kwargs)``."""
        for name in _api.RESERVED_KWARGS:
            if name in kwargs:
                raise TypeError(
                    f"{self._rules.__qualname__}: {name!r} is an option of "
                    f"jax_threadmap.kernel(..., {name}=...), set once for the "
                    "kernel, and cannot be passed per call or reach the kernel. "
                    f"Got {name}={kwargs[name]!r}."
                )
        return _threadmap(self, args, kwargs)

    def defjvp(self, jvp: F) -> F:
        """Attaches the JVP kernel: for ``jax.jvp``, ``jacfwd`` and ``linearize``.

        Args:
            jvp: ``jvp(*primals, *tangents, **kwargs)``: one element's positional
                arguments, then one tangent per positional argument (same
                pytree structure; float0 zeros for integer and bool leaves), then
                the keyword arguments. Returns the tangent of the output, a
                pytree like ``result_shape_dtypes`` (any value, e.g. ``None``,
                for integer outputs).

        Returns:
            ``jvp`` itself, so ``defjvp`` can be used as a decorator.
        """
        self._rules = Rules(self.fn, _check_rule(jvp, "defjvp"), self.vjp)
        return jvp

    def defvjp(self, vjp: F) -> F:
        """Attaches the VJP kernel: for ``jax.grad``, ``vjp`` and ``jacrev``.

        Args:
            vjp: ``vjp(*primals, cotangent, **kwargs)``: one element's positional
                arguments, then the cotangent of the output (a pytree like
                ``result_shape_dtypes``; float0 zeros for integer outputs), then
                the keyword arguments. Returns a tuple with one cotangent per
                positional argument, each a pytree like the argument or ``None``
                for zeros (integer leaves are ignored).

        Returns:
            ``vjp`` itself, so ``defvjp`` can be used as a decorator.
        """
        self._rules = Rules(self.fn, self.jvp, _check_rule(vjp, "defvjp"))
        return vjp

    def __repr__(self) -> str:
        rules = [n for n, r in (("jvp", self.jvp), ("vjp", self.vjp)) if r]
        return (
            f"<jax_threadmap kernel {self._rules.__qualname__}"
            f"{' with ' + ' and '.join(rules) if rules else ''}>"
        )


def _check_rule(rule: Any, method: str) -> Any:
    if not callable(rule):
        raise TypeError(
            f"{method} expects a callable derivative kernel. Got {rule!r} of type "
            f"{type(rule).__name__}."
        )
    return rule


def _threadmap(kf: KernelFunction, args: tuple, kwargs: dict) -> Any:
    """The one call into ``threadmap``; its options travel as keywords."""
    return _api.threadmap(
        kf._rules,
        kf.result_shape_dtypes,
        *args,
        executor=kf._executor,
        **kf._options,
        **kwargs,
    )


def kernel(
    result_shape_dtypes: Any,
    *,
    executor: _api.Executor = None,
    progress: bool | None = None,
) -> Callable[[Callable[..., Any]], KernelFunction]:
    """Makes a threaded kernel whose derivatives are threaded kernels too.

    ``kernel(result_shape_dtypes)(fn)`` returns a function ``f`` with
    ``f(*args, **kwargs) == threadmap(fn, result_shape_dtypes, *args, **kwargs)``,
    to which :meth:`KernelFunction.defjvp` and :meth:`KernelFunction.defvjp`
    attach derivative kernels: unbatched NumPy kernels, like ``fn``, that run as
    ``threadmap`` equations and fold under ``vmap`` like the primal.

    - With ``defjvp``: ``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``.
    - With ``defvjp``: ``jax.grad``, ``jax.vjp``, ``jax.jacrev``.
    - Both work under ``jit`` and any nesting of ``vmap``.

    Positional arguments are differentiable; keyword arguments are not (they
    reach the derivative kernels as keywords, and a keyword argument that depends
    on the differentiated variable raises). Integer and bool arguments get
    float0 cotangents, as JAX expects. Higher-order derivatives raise.

    Args:
        result_shape_dtypes: A pytree of objects with ``.shape`` and ``.dtype``
            (e.g. :class:`jax.ShapeDtypeStruct`) describing one element's result.
        executor: As for :func:`~jax_threadmap.threadmap`; used by the primal
            and the derivative equations.
        progress: Passed to ``threadmap`` as ``progress=`` when not ``None``
            (only where ``threadmap`` has that option).

    Returns:
        A decorator turning a kernel ``fn`` into a :class:`KernelFunction`.

    Raises:
        TypeError: ``result_shape_dtypes`` is a function (the decorator was used
            without parentheses), or ``executor``/``progress`` are invalid.

    Example:
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
    _compat.require(_compat.DERIVATIVES, "jax_threadmap.kernel")
    if callable(result_shape_dtypes) and not hasattr(result_shape_dtypes, "shape"):
        raise TypeError(
            "jax_threadmap.kernel takes result_shape_dtypes and returns a "
            "decorator; use it with parentheses: "
            "@jax_threadmap.kernel(jax.ShapeDtypeStruct(shape, dtype)). "
            f"Got the callable {result_shape_dtypes!r}."
        )
    executor = _api.check_executor(executor, api="jax_threadmap.kernel")
    options: dict[str, Any] = {}
    if progress is not None:
        if "progress" not in _api.RESERVED_KWARGS:
            raise TypeError(
                "jax_threadmap.kernel: this version of threadmap has no progress "
                f"option. Got progress={progress!r}; leave it as None."
            )
        options["progress"] = progress

    def decorate(fn: Callable[..., Any]) -> KernelFunction:
        return KernelFunction(
            fn, result_shape_dtypes, executor=executor, options=options
        )

    return decorate
