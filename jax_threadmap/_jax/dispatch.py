"""Async dispatch: the transfer server whose pulls are the gates, the name of
the logger to filter, and the wrapper around every run of a compiled program
(on the hooks of :mod:`.hooks`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .hooks import ASYNC_DISPATCH, DISPATCH_STREAMS, get, missing_for, or_missing

start_transfer_server: Callable[..., Any] | None = or_missing(
    "start_transfer_server", None
)
# The callback logger's name (its module's), for `_async/dispatch.py` to filter.
CALLBACK_LOGGER_NAME: str = getattr(
    or_missing("callback_logger", None), "name", "jax._src.callback"
)


def dispatch_streams_unavailable() -> str | None:
    """Why dispatches on pending data cannot get a stream of their own, or ``None``."""
    return missing_for(DISPATCH_STREAMS)


#: On the wrapper: the wrapper it calls, and JAX's own method it wraps.
_AROUND, _ORIGINAL = "__jax_threadmap_around__", "__jax_threadmap_original__"


def wrap_program_runs(around: Callable[..., Any]) -> bool:
    """Makes every run of a compiled program from Python go through ``around``.

    JAX runs a jitted program from Python (its C++ fast path aside, which never
    sees an ``AsyncArray``) in ``ExecuteReplicated.__call__``: the argument
    handlers first, then XLA's execute. After this, that call is
    ``around(run, program, args, ordered_effects)``, which must return
    ``run(program, *args)``; ``ordered_effects`` are the program's ordered
    effects. A second call replaces the first one's ``around``. Returns whether
    the hook is there (:func:`dispatch_streams_unavailable` says why not).
    """
    if dispatch_streams_unavailable() is not None:
        return False
    cls = get("ExecuteReplicated")
    run = getattr(cls.__call__, _ORIGINAL, cls.__call__)
    if getattr(cls.__call__, _AROUND, None) is around:
        return True

    @functools.wraps(run)
    def __call__(self: Any, *args: Any) -> Any:
        return around(run, self, args, self.ordered_effects)

    setattr(__call__, _AROUND, around)
    setattr(__call__, _ORIGINAL, run)
    cls.__call__ = __call__
    return True


def async_dispatch_unavailable() -> str | None:
    """Why this JAX cannot dispatch on pending arrays, or ``None`` if it can."""
    return missing_for(ASYNC_DISPATCH)
