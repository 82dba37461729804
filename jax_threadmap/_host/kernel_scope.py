"""Where JAX calls inside a kernel run: on the host, never on a held device.

A kernel is host code, called from a host callback of a device program (or
eagerly). On an accelerator, the program that called it holds its device until
the callback returns, and the device runs programs in order: a JAX program that
the kernel runs there (a jitted function, an eager ``jnp`` call, an inner
``threadmap``) could never start, and the kernel would wait for it forever.

So, where the default backend is not the CPU, every kernel runs in a
:class:`KernelScope`, entered by each thread that works on the map, around all
its chunks (and around each step of an ``async def`` kernel):

- ``jax.default_device`` is the host's CPU: arrays a kernel makes, and programs
  on them, run on the host, as the kernel's own NumPy code does;
- programs on the *held* devices (those of the program that called the map,
  and those held by the maps around it in this thread) raise
  :class:`~.._jax.program_runs.HeldDeviceError` at once, naming the device and the
  kernel, instead of hanging. A held scope uses the platform name ``"cpu"`` as
  its default device and an unheld one the device object: ``default_device``
  is part of JAX's jit cache key, so a program that passed the check in one
  kind of scope is not run by JAX's C++ fast path (which the check cannot see)
  in the other.

On a machine whose default backend is the CPU nothing is held and nothing is
entered: the CPU client runs many programs at once, and kernels that call JAX
work as they are.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from .._jax.program_runs import RUNS


@functools.cache
def _host_device() -> Any:
    """The default backend's platform if it is the CPU (then no scope is
    needed), else the host's first CPU device (``None`` where JAX has no CPU
    backend: ``JAX_PLATFORMS=tpu``)."""
    if jax.default_backend() == "cpu":
        return "cpu"
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def _holds(device: Any) -> bool:
    """Whether a device's program waits in its host callbacks with its queue
    held: an accelerator's does (the CPU client runs many programs at once)."""
    return device.platform != "cpu"


class KernelScope:
    """What a kernel's JAX calls may use (see the module docstring).

    Args:
        held: The devices whose programs wait for this map's kernels.
        name: The kernel's name, for the error.
    """

    __slots__ = ("held", "_default", "_why")

    def __init__(self, held: frozenset[Any], name: str):
        self.held = held
        host = _host_device()
        # A held scope keys JAX's jit cache apart from an unheld one (see above).
        self._default = None if host is None else ("cpu" if held else host)
        self._why = f"the results of threadmap kernel {name!r}"

    def entered(self) -> _Entered:
        """A context manager that runs its body (kernel code, on any thread) in
        this scope; one per entry (entries on several threads at once)."""
        return _Entered(self)


class _Entered:
    """One entry of a :class:`KernelScope` (a few microseconds: an ``async def``
    kernel enters at every step)."""

    __slots__ = ("_scope", "_device", "_outer")

    def __init__(self, scope: KernelScope):
        self._scope = scope
        self._device: Any = None
        self._outer: tuple[frozenset[Any], str] | None = None

    def __enter__(self) -> None:
        scope = self._scope
        if scope._default is not None:
            self._device = jax.default_device(scope._default)
            self._device.__enter__()
        if scope.held:
            self._outer = RUNS.refuse(scope.held, scope._why)

    def __exit__(self, *exc: object) -> None:
        if self._outer is not None:
            RUNS.restore(self._outer)
        if self._device is not None:
            self._device.__exit__(*exc)


def kernel_scope(program_devices: frozenset[Any], name: str) -> KernelScope | None:
    """The scope of a map's kernels, or ``None`` where none is needed.

    Args:
        program_devices: The devices of the program whose host callback runs
            the map (none for an eager map).
        name: The kernel's name.
    """
    refused = RUNS.refused.devices  # by the maps around this one
    if _host_device() == "cpu" and not refused:
        return None
    held = frozenset(filter(_holds, program_devices)) | refused
    if held:
        # The wrapper that refuses them (installed once; a no-op elsewhere).
        RUNS.install()
    return KernelScope(held, name)
