"""Program runs: :data:`RUNS`, the one hooks object that wraps every run of a
compiled program from Python (on the hooks of :mod:`.hooks`), through which the
async layer defers the runs on pending data and kernels are kept off the
devices whose programs wait for them (:meth:`ProgramRuns.refuse`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from .hooks import ASYNC_DISPATCH, get, missing_for

#: ``runs_unavailable()``: why the runs of compiled programs cannot be wrapped
#: (then dispatch on pending data blocks), or ``None``. (The table's own lookup,
#: called directly: no function of this module between the caller and the table.)
runs_unavailable: Callable[[], str | None] = functools.partial(
    missing_for, ASYNC_DISPATCH
)


#: On the wrapper: JAX's own method it wraps.
_ORIGINAL = "__jax_threadmap_original__"


class HeldDeviceError(RuntimeError):
    """A program would run on a device whose queue waits for the caller.

    Raised when code that a device's program waits for (a kernel, called from
    that program's host callback) runs a JAX program on that device: the
    device runs programs in order, so the new one could never start, and the
    caller would wait for it forever.
    """


class _Refused(threading.local):
    #: Devices a program run from this thread must not use.
    devices: frozenset[Any] = frozenset()
    #: Why (what waits on them), for the error.
    why: str = ""


class ProgramRuns:
    """The one hooks object for JAX's runs of compiled programs from Python.

    Installed when first needed (:meth:`install`: by the first ``AsyncArray``,
    or the first kernel scope with held devices), it wraps
    ``ExecuteReplicated.__call__``: JAX runs a jitted program from Python there
    (its C++ fast path aside, which never sees an ``AsyncArray``), the argument
    handlers first, then XLA's execute. Each run first refuses a program on a
    device that this thread must not use (:meth:`refuse`, the kernel scope's
    channel), then goes through :attr:`around` where one is set (the async
    layer's): ``around(run, program, args, ordered_effects)`` must return
    ``run(program, *args)``.
    """

    def __init__(self) -> None:
        #: What this thread's programs must not use (:meth:`refuse`), read
        #: as an attribute (``refused.devices``) on every kernel's first call.
        self.refused = _Refused()
        #: What every run goes through (the async layer's), once set.
        self.around: Callable[..., Any] | None = None

    def install(self, around: Callable[..., Any] | None = None) -> None:
        """Wraps the runs (once; not where :func:`runs_unavailable` says why);
        sets :attr:`around` if given."""
        if runs_unavailable() is not None:
            return
        if around is not None:
            self.around = around
        cls = get("ExecuteReplicated")
        if hasattr(cls.__call__, _ORIGINAL):
            return
        run = cls.__call__
        refused = self.refused

        @functools.wraps(run)
        def __call__(program: Any, *args: Any) -> Any:
            if refused.devices:
                self._check_devices(program)
            around = self.around
            if around is None:
                return run(program, *args)
            return around(run, program, args, program.ordered_effects)

        setattr(__call__, _ORIGINAL, run)
        cls.__call__ = __call__

    def refuse(self, devices: frozenset[Any], why: str) -> tuple[frozenset[Any], str]:
        """Until :meth:`restore` is given what this returns, programs run from
        this thread on ``devices`` raise :class:`HeldDeviceError` (``why`` says
        what waits on them) instead of being dispatched. Nested calls add up.
        Reaches the programs that JAX runs from Python, not those of its C++
        fast path."""
        refused = self.refused
        outer = (refused.devices, refused.why)
        refused.devices, refused.why = refused.devices | devices, why
        return outer

    def restore(self, outer: tuple[frozenset[Any], str]) -> None:
        """Ends the :meth:`refuse` that returned ``outer``."""
        self.refused.devices, self.refused.why = outer

    def _check_devices(self, program: Any) -> None:
        refused = self.refused
        used = set(program._local_devices) & refused.devices
        if used:
            names = ", ".join(sorted(str(d) for d in used))
            raise HeldDeviceError(
                f"a JAX program ({program.name}) would run on {names}, whose program "
                f"is waiting for {refused.why}: the device runs programs in order, "
                "so this one could never start. Run JAX inside kernels on the host "
                "(the default for arrays a kernel makes; jax.device_put(x, "
                "jax.devices('cpu')[0]) for arrays from elsewhere, or "
                "jax.jit(f, backend='cpu')), or do this work outside the kernel."
            )


#: The hooks object (one per process: JAX's class is wrapped once).
RUNS = ProgramRuns()
