"""Program runs: the transfer server whose pulls are the async layer's gates,
the name of the logger to filter, and the wrapper around every run of a
compiled program from Python (on the hooks of :mod:`.hooks`), through which the
async layer sees its dispatches and kernels are kept off the devices whose
programs wait for them (:func:`refusing`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from .hooks import ASYNC_DISPATCH, DISPATCH_STREAMS, get, missing_for, or_missing

start_transfer_server: Callable[..., Any] | None = or_missing(
    "start_transfer_server", None
)
# The callback logger's name (its module's), for `_arrays/async_dispatch.py` to filter.
CALLBACK_LOGGER_NAME: str = getattr(
    or_missing("callback_logger", None), "name", "jax._src.callback"
)


#: ``dispatch_streams_unavailable()``: why dispatches on pending data cannot get
#: a stream of their own, or ``None``. (The table's own lookup, called directly:
#: no function of this module between the caller and the table.)
dispatch_streams_unavailable: Callable[[], str | None] = functools.partial(
    missing_for, DISPATCH_STREAMS
)


#: On the wrapper: JAX's own method it wraps.
_ORIGINAL = "__jax_threadmap_original__"


class ThisThread(threading.local):
    """What the wrapper of program runs reads of this thread (set by
    :func:`refusing`; read by ``_host/kernel_scope.py`` too)."""

    #: Devices a program run from this thread must not use.
    refused: frozenset[Any] = frozenset()
    #: Why (what waits on them), for the error.
    why: str = ""


#: This thread's :class:`ThisThread`.
this_thread = ThisThread()
#: The async layer's ``around`` (:func:`wrap_program_runs`), once it set one.
_around: list[Callable[..., Any]] = []


class HeldDeviceError(RuntimeError):
    """A program would run on a device whose queue waits for the caller.

    Raised when code that a device's program waits for (a kernel, called from
    that program's host callback) runs a JAX program on that device: the
    device runs programs in order, so the new one could never start, and the
    caller would wait for it forever.
    """


class refusing:  # noqa: N801 - used as a context manager, like contextlib's
    """While entered, programs run from this thread on ``devices`` raise
    :class:`HeldDeviceError` (``why`` says what waits on them) instead of
    being dispatched. Nested scopes add up. Reaches the programs that JAX runs
    from Python (:func:`wrap_program_runs`), not those of its C++ fast path."""

    __slots__ = ("_devices", "_why", "_outer")

    def __init__(self, devices: frozenset[Any], why: str):
        self._devices, self._why = devices, why
        self._outer: tuple[frozenset[Any], str] = (frozenset(), "")

    def __enter__(self) -> None:
        runs = this_thread
        self._outer = (runs.refused, runs.why)
        if self._devices:
            runs.refused, runs.why = runs.refused | self._devices, self._why

    def __exit__(self, *exc: object) -> None:
        this_thread.refused, this_thread.why = self._outer


def _check_devices(program: Any) -> None:
    used = set(program._local_devices) & this_thread.refused
    if used:
        names = ", ".join(sorted(str(d) for d in used))
        raise HeldDeviceError(
            f"a JAX program ({program.name}) would run on {names}, whose program "
            f"is waiting for {this_thread.why}: the device runs programs in order, so "
            "this one could never start. Run JAX inside kernels on the host (the "
            "default for arrays a kernel makes; jax.device_put(x, "
            "jax.devices('cpu')[0]) for arrays from elsewhere, or "
            "jax.jit(f, backend='cpu')), or do this work outside the kernel."
        )


def wrap_program_runs(around: Callable[..., Any] | None = None) -> bool:
    """Makes every run of a compiled program from Python go through the wrapper.

    JAX runs a jitted program from Python (its C++ fast path aside, which never
    sees an ``AsyncArray``) in ``ExecuteReplicated.__call__``: the argument
    handlers first, then XLA's execute. The wrapper first refuses a program on a
    device that this thread must not use (:func:`refusing`); then, if ``around``
    was given (by this call or an earlier one; a later one replaces it), the
    run is ``around(run, program, args, ordered_effects)``, which must return
    ``run(program, *args)``; ``ordered_effects`` are the program's ordered
    effects. Returns whether the hook is there
    (:func:`dispatch_streams_unavailable` says why not).
    """
    if dispatch_streams_unavailable() is not None:
        return False
    if around is not None:
        _around[:] = [around]
    cls = get("ExecuteReplicated")
    if hasattr(cls.__call__, _ORIGINAL):
        return True
    run = cls.__call__

    @functools.wraps(run)
    def __call__(self: Any, *args: Any) -> Any:
        if this_thread.refused:
            _check_devices(self)
        if not _around:
            return run(self, *args)
        return _around[0](run, self, args, self.ordered_effects)

    setattr(__call__, _ORIGINAL, run)
    cls.__call__ = __call__
    return True


#: ``async_dispatch_unavailable()``: why this JAX cannot dispatch on pending
#: arrays (no transfer server for the gates), or ``None`` if it can.
async_dispatch_unavailable: Callable[[], str | None] = functools.partial(
    missing_for, ASYNC_DISPATCH
)
