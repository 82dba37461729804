"""Exceptions raised by jax_threadmap."""

from __future__ import annotations

from typing import Any


class ThreadmapError(RuntimeError):
    """Base class of the errors that jax_threadmap raises at run time.

    Args:
        message: The full message.
        cause: The exception that led to this one, if any; chained as
            ``__cause__`` (as ``raise ... from cause`` would), also when the error
            is recorded first and raised later by another thread.
    """

    def __init__(self, message: str, *, cause: BaseException | None = None):
        super().__init__(message)
        if cause is not None:
            self.__cause__ = cause


class KernelError(ThreadmapError):
    """A kernel raised, or returned a value that does not match its declaration.

    Attributes:
        index: The batch index (a tuple, outermost vmap level first) of the element
            that failed, or ``None`` for an unbatched call.
        kernel_name: The kernel's name.

    The original exception, if any, is chained as ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        index: tuple[int, ...] | None,
        kernel_name: str,
        cause: BaseException | None = None,
    ):
        super().__init__(message, cause=cause)
        self.index = index
        self.kernel_name = kernel_name

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the attributes when sent across processes (the cause stays behind).
        return (_rebuild_kernel_error, (str(self), self.index, self.kernel_name))


def _rebuild_kernel_error(
    message: str, index: tuple[int, ...] | None, kernel_name: str
) -> KernelError:
    return KernelError(message, index=index, kernel_name=kernel_name)


class ExecutorError(ThreadmapError):
    """The executor could not run the map (shut down, or a worker died)."""
