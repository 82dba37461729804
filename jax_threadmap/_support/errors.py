"""Exceptions raised by jax_threadmap."""

from __future__ import annotations

import os
import pickle
import traceback
from typing import Any, NoReturn


class ThreadmapError(RuntimeError):
    """Base class of the errors that jax_threadmap raises at run time.

    Args:
        message: The full message.
        cause: The exception that led to this one, if any; chained as
            ``__cause__`` (as ``raise ... from cause`` would), also when the error
            is recorded first and raised later by another thread.

    Examples:
        Catch every run-time failure of a map, kernel or executor:

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax_threadmap import ThreadmapError, threadmap
        >>> def kernel(x):
        ...     raise OSError("the solver's license expired")
        >>> try:
        ...     threadmap(kernel, jax.ShapeDtypeStruct((), jnp.float32), 1.0)
        ... except ThreadmapError as e:
        ...     print(type(e).__name__, "caused by", repr(e.__cause__))
        KernelError caused by OSError("the solver's license expired")
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

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax_threadmap import KernelError, threadmap
        >>> def checked_sqrt(x):
        ...     if x < 0:
        ...         raise ValueError(f"negative: {x}")
        ...     return np.sqrt(x)
        >>> f = jax.vmap(lambda x: threadmap(
        ...     checked_sqrt, jax.ShapeDtypeStruct((), jnp.float32), x))
        >>> try:
        ...     f(jnp.array([1.0, -2.0, 4.0]))
        ... except KernelError as e:
        ...     print(e.index, e.kernel_name, "negative: -2.0" in str(e))
        (1,) checked_sqrt True
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
        # Keeps the attributes when sent across processes, and the cause where it
        # pickles (without its traceback, which the message quotes).
        cause = self.__cause__
        try:
            pickle.dumps(cause)
        except Exception:  # noqa: BLE001 - any failure to pickle: leave it behind
            cause = None
        return (_rebuild_kernel_error, (str(self), self.index, self.kernel_name, cause))


def _rebuild_kernel_error(
    message: str,
    index: tuple[int, ...] | None,
    kernel_name: str,
    cause: BaseException | None = None,
) -> KernelError:
    e = KernelError(message, index=index, kernel_name=kernel_name, cause=cause)
    e._shipped_cause = cause  # type: ignore[attr-defined]
    return e


def restore_shipped_cause(e: KernelError) -> None:
    """Makes the kernel's own exception the cause again of a ``KernelError``
    received from a process pool, which puts its remote traceback there; that
    traceback becomes the cause's cause."""
    cause = getattr(e, "_shipped_cause", None)
    if cause is not None and e.__cause__ is not cause:
        if cause.__cause__ is None:
            cause.__cause__ = e.__cause__
        e.__cause__ = cause


class ExecutorError(ThreadmapError):
    """The executor could not run the map (shut down, or a worker died).

    Examples:
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax_threadmap import ExecutorError, threadmap
        >>> pool = ThreadPoolExecutor(2)
        >>> pool.shutdown()
        >>> try:
        ...     threadmap(np.sqrt, jax.ShapeDtypeStruct((), jnp.float32), 4.0,
        ...               executor=pool)
        ... except ExecutorError as e:
        ...     print(type(e).__name__)
        ExecutorError
    """


#: The innermost kernel frames quoted in a KernelError's message, and the longest
#: source line quoted. Under jit the message is all of the error that crosses
#: XLA's runtime (the traceback and cause stay behind), and the same holds for
#: errors pickled back from other processes.
_TRACEBACK_FRAMES = 6
_TRACEBACK_LINE = 200
# The package's root (this module is in its _support folder).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

#: Raised by a kernel, these stop the map and reach the caller as themselves, as
#: from a plain loop. Any other exception, BaseException subclasses included, is
#: the kernel's error and becomes a KernelError with the batch index.
PASS_THROUGH = (KeyboardInterrupt, SystemExit)


def describe(e: BaseException) -> str:
    """``'TypeName: message'`` for ``e``, as a traceback shows it, with Python's
    own fallback text when the exception's ``__str__`` fails."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the error
        text = "<exception str() failed>"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def kernel_traceback(e: BaseException) -> str:
    """The innermost frames of ``e`` outside this package, formatted as Python does.

    Empty when there are none (the error was raised by this package's own code,
    e.g. a derivative adapter checking what the kernel returned).
    """
    frames = [
        (frame, line)
        for frame, line in traceback.walk_tb(e.__traceback__)
        if not frame.f_code.co_filename.startswith(_PACKAGE_DIR)
    ]
    if not frames:
        return ""
    shown = traceback.StackSummary.extract(iter(frames[-_TRACEBACK_FRAMES:]))
    lines = ["\nKernel traceback (most recent call last):"]
    if len(frames) > len(shown):
        lines.append(f"  ... {len(frames) - len(shown)} earlier frame(s)")
    for f in shown:
        lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}')
        source = (f.line or "").strip()
        if len(source) > _TRACEBACK_LINE:
            source = source[: _TRACEBACK_LINE - 3] + "..."
        if source:
            lines.append(f"    {source}")
    return "\n".join(lines)


def add_note(error: BaseException, note: str, replaces: str) -> None:
    """Adds jax_threadmap's ``note`` to ``error``, dropping notes that start with
    ``replaces``: one exception object raised by two background calls (a cached
    error, say) carries the note of the call whose use raised it, once.

    Does nothing on Python < 3.11 (no notes), or for an exception that refuses.
    """
    if not hasattr(error, "add_note"):
        return
    try:
        notes = getattr(error, "__notes__", None)
        if notes is not None:
            notes[:] = [n for n in notes if not str(n).startswith(replaces)]
        error.add_note(note)
    except Exception:  # an exception that refuses notes still reaches uses
        pass


class KeptError:
    """An exception raised again, the same object, at every use of a result.

    As ``Future.result()`` does, every use raises the same exception object;
    :meth:`reraise` restores, each time, the traceback, notes and chain it had
    when kept, so that repeated uses (and JAX's traceback-filtering note, added
    at each API boundary it crosses; on Python 3.10 a marker chained into
    ``__cause__`` instead) do not pile up.
    """

    __slots__ = ("error", "_traceback", "_notes", "_chain")

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self._traceback: Any = None
        self._notes: list[str] | None = None
        self._chain: tuple[Any, Any, bool] = (None, None, False)
        try:
            self._traceback = error.__traceback__
            self._chain = (
                error.__cause__,
                error.__context__,
                error.__suppress_context__,
            )
            if hasattr(error, "__notes__"):
                self._notes = list(error.__notes__)
        except Exception:  # an exception that refuses these still reaches uses
            pass

    def reraise(self) -> NoReturn:
        error = self.error
        try:
            if self._notes is not None:
                error.__notes__ = list(self._notes)  # type: ignore[attr-defined]
            cause, context, suppress = self._chain
            error.__cause__, error.__context__ = cause, context
            error.__suppress_context__ = suppress
        except Exception:  # an exception that refuses attributes: raised as it is
            pass
        raise error.with_traceback(self._traceback)
