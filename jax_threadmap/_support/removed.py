"""Public names that are gone: each raises an ``AttributeError`` that names what
replaced it, for as long as CHANGELOG.md lists it under "Removed"
(``tests/test_environment.py`` checks both ways)."""

from __future__ import annotations

from typing import Any, NoReturn

#: Each removed name (of the package, or ``Class.attribute`` of a public class)
#: and what to use instead.
REMOVED: dict[str, str] = {
    "deferred_call": "call jax_threadmap.async_call where the work should start",
    "async_dispatch_status": "async dispatch is on unless the environment variable "
    "JAX_THREADMAP_ASYNC_DISPATCH=0 turns it off",
    "AsyncArray.from_future": "call jax_threadmap.async_call(future.result, "
    "shapes), or async_call an async def loader that returns await "
    "asyncio.wrap_future(future) (docs/async.md)",
    "Shared.close": "a shared resource is closed at exit; one that must close "
    "earlier is opened by the kernel that uses it (async with factory() as r:)",
    "Shared.is_open": "repr(handle) says whether it is open",
    "KernelFunction.reverse_rule": "read jvp, vjp, fwd, bwd and residuals",
    "KernelFunction.primal_jvp": "read jvp, vjp, fwd, bwd and residuals",
}


def error(name: str) -> AttributeError:
    """The error for removed ``name`` (a key of :data:`REMOVED`)."""
    return AttributeError(f"jax_threadmap.{name} was removed: {REMOVED[name]}.")


class _Gone:
    """A class attribute that is gone: reading it raises :func:`error`."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> NoReturn:
        raise error(self.name)


def install(package: dict[str, Any]) -> None:
    """Puts the removed attributes of the classes in ``package`` (its globals)."""
    for name in REMOVED:
        cls, _, attr = name.rpartition(".")
        if cls:
            setattr(package[cls], attr, _Gone(name))


def package_getattr(name: str) -> NoReturn:
    """The package's ``__getattr__``: a removed name says what replaced it."""
    if name in REMOVED:
        raise error(name)
    raise AttributeError(f"module 'jax_threadmap' has no attribute {name!r}")
