"""Exceptions raised by jax_threadmap."""

from __future__ import annotations


class ThreadmapError(RuntimeError):
    """Base class of the errors that jax_threadmap raises at run time."""


class KernelError(ThreadmapError):
    """A kernel raised, or returned a value that does not match its declaration.

    Attributes:
        index: The batch index (a tuple, outermost vmap level first) of the element
            that failed, or ``None`` for an unbatched call.
        kernel_name: The kernel's name.

    The original exception, if any, is chained as ``__cause__``.
    """

    def __init__(
        self, message: str, *, index: tuple[int, ...] | None, kernel_name: str
    ):
        super().__init__(message)
        self.index = index
        self.kernel_name = kernel_name

    def __reduce__(self):  # keeps the attributes when sent across processes
        return (_rebuild_kernel_error, (str(self), self.index, self.kernel_name))


def _rebuild_kernel_error(message, index, kernel_name):
    return KernelError(message, index=index, kernel_name=kernel_name)


class ExecutorError(ThreadmapError):
    """The executor could not run the map (shut down, or a worker died)."""
