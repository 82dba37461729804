"""What a map says when its executor refuses its work, or the interpreter exits
under it: :func:`refused` (the error), :func:`at_shutdown` (is it the exit?),
:data:`interpreter_exiting` (set by :mod:`.runners`' exit hooks), :func:`said`.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from .._support.errors import ExecutorError

#: Set when the interpreter starts to exit (by ``runners``), for messages.
interpreter_exiting = threading.Event()


def said(e: BaseException) -> str:
    """``Type: message`` of an exception, without its final period."""
    return f"{type(e).__name__}: {str(e).rstrip().rstrip('.')}"


def at_shutdown(e: BaseException) -> bool:
    """Whether ``e``, raised by starting a thread or submitting work, came from an
    interpreter that is exiting (CPython's words: "... at interpreter shutdown")."""
    return interpreter_exiting.is_set() or "interpreter shutdown" in str(e)


def refused(executor: Any, e: BaseException) -> ExecutorError:
    """The error of a map whose executor refused its work."""
    if at_shutdown(e):
        return ExecutorError(
            "The interpreter is exiting: this threadmap was stopped before it "
            f"finished, because the executor {executor!r} refuses new work once "
            "the main thread has ended (concurrent.futures stops its executors at "
            "exit). Wait for maps on such executors before the end of the main "
            "thread.",
            cause=e,
        )
    if isinstance(e, concurrent.futures.BrokenExecutor):
        return ExecutorError(
            f"The executor {executor!r} passed as executor= is broken: "
            f"{said(e)}. A worker of it ended "
            "earlier (the error of the map that ran then said how); pass a new "
            "executor.",
            cause=e,
        )
    return ExecutorError(
        f"The executor {executor!r} passed as executor= refused new work: "
        f"{said(e)}. Pass an executor that is "
        "running, or executor=None for the shared pool.",
        cause=e,
    )
