"""Public names that are gone: each raises an ``AttributeError`` that names what
replaced it, as long as CHANGELOG.md lists it under "Removed" (a test checks)."""

from __future__ import annotations

from typing import Any, NoReturn

_DERIVATIVES = "read jvp, vjp, fwd, bwd and residuals"
#: Each removed name (of the package, or ``Class.attribute``) and what replaced it.
REMOVED: dict[str, str] = {
    "deferred_call": "call jax_threadmap.async_call where the work should start",
    "async_dispatch_status": "it is on unless JAX_THREADMAP_ASYNC_DISPATCH=0",
    "AsyncArray.from_future": "call jax_threadmap.async_call(future.result, shapes), "
    "or an async def loader that returns await asyncio.wrap_future(future)",
    "Shared.close": "a shared resource closes at exit; one that must close earlier "
    "is opened by the kernel that uses it (async with factory() as r:)",
    "Shared.is_open": "repr(handle) says whether it is open",
    "KernelFunction.reverse_rule": _DERIVATIVES,
    "KernelFunction.primal_jvp": _DERIVATIVES,
}


def error(name: str) -> AttributeError:
    return AttributeError(f"jax_threadmap.{name} was removed: {REMOVED[name]}.")


class _Gone:
    """A removed class attribute: reading it raises an `AttributeError` naming
    what replaced it."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> NoReturn:
        raise error(self.name)


def install(package: dict[str, Any]) -> None:
    """Puts the removed attributes on the classes in ``package`` (its globals)."""
    for name in REMOVED:
        cls, _, attr = name.rpartition(".")
        if cls:
            setattr(package[cls], attr, _Gone(name))


def package_getattr(name: str) -> NoReturn:
    """The package's ``__getattr__``."""
    if name in REMOVED:
        raise error(name)
    raise AttributeError(f"module 'jax_threadmap' has no attribute {name!r}")
