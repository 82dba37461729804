"""What a background call's end and the waits for it say, and the wait itself.

The errors of a call given up on (timeout, ``cancel()``), the note on a
loader's own error and the text the programs deferred on it raise; and the waits.

Every wait of the async layer for a call's value is :func:`wait_polling`: a wait
in slices of :data:`POLL_S`, so that Ctrl-C (``KeyboardInterrupt``) reaches the
main thread within a slice wherever it waits (``result()``, ``np.asarray(x)``,
a blocking dispatch). Waits inside XLA (a ``jax.Array`` computed from pending
data, read before the data is there) are not ours: docs/async.md, "Contract",
says where they are. The errors here are those of a wait that cannot succeed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from typing import Any

import jax

from .._support.errors import add_note
from .leaves import describe_error

logger = logging.getLogger("jax_threadmap._async")

# The start of the note added to a loader's exception (once per call).
_NOTE_START = "This error was raised by"

#: The longest a wait in Python sleeps at once. Lock waits are interruptible on
#: POSIX anyway; the slices keep Ctrl-C prompt on every platform, and cost
#: nothing measurable (a wake-up per slice).
POLL_S = 0.5


def wait_polling(future: concurrent.futures.Future, timeout: float | None) -> bool:
    """Waits for ``future`` in slices of :data:`POLL_S`; returns whether done."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if left <= 0:
            return future.done()
        try:  # a wait on the future's own condition (no waiter object made)
            future.exception(timeout=left)
        except concurrent.futures.TimeoutError:
            continue
        except concurrent.futures.CancelledError:
            pass
        return True


def in_loop_error(what: str) -> RuntimeError:
    """A wait on the event loop's thread, which would block every loader."""
    return RuntimeError(
        f"{what} was used inside an async def loader, on jax_threadmap's "
        "event loop, before its value arrived: waiting there would "
        "block every async def loader (maybe the one that computes "
        "it). Wait in a thread instead: await asyncio.to_thread("
        "x.result), or pass the array on without its value."
    )


def forked_error(what: str) -> RuntimeError:
    """A wait in a forked child for a call that ran in the parent."""
    return RuntimeError(
        f"{what} was being computed by a thread of the parent process "
        "when this process was forked, so its value will never arrive "
        "here. Create the arrays after the fork, or wait for them "
        "(block_until_ready) before forking."
    )


def not_ready_error(what: str, timeout: float) -> TimeoutError:
    """``result(timeout=...)`` ran out; the call goes on."""
    return TimeoutError(
        f"{what} was not ready within timeout={timeout:g} s. The call "
        "keeps running and the array stays usable: call result() "
        "again, with a longer timeout or none."
    )


def timed_out(name: str, api: str, timeout: float, cancels: bool) -> TimeoutError:
    """The error of a call whose ``timeout`` passed; ``cancels``: a coroutine."""
    return TimeoutError(
        f"{name}, which {_by(api)} ran, did not return within "
        f"timeout={timeout:g} s and was given up on ("
        + (
            "its coroutine is cancelled)."
            if cancels
            else "its thread runs on until it returns; what it returns is dropped)."
        )
    )


def cancelled(name: str, api: str) -> BaseException:
    """The error of a call given up on by ``AsyncArray.cancel()``."""
    return concurrent.futures.CancelledError(
        f"{name}, which {_by(api)} ran, was cancelled (AsyncArray.cancel)."
    )


def note_on(error: BaseException, name: str, api: str, n: int, part: str) -> None:
    """Adds (once) the note naming the call to the loader's own ``error``."""
    what = (
        f"for {part}; every use of the array"
        if part
        else f"to compute {n} array(s); every use of any of those arrays"
    )
    add_note(
        error,
        f"{_NOTE_START} {name}, which {_by(api)} ran {what} raises it.",
        _NOTE_START,
    )


def _by(api: str) -> str:
    """Who ran a call: ``jax_threadmap.async_call``, or for a program whose
    dispatch was deferred (``api`` a phrase), ``jax_threadmap's deferred dispatch``."""
    return f"jax_threadmap.{api}" if api.isidentifier() else f"jax_threadmap's {api}"


def failure_text(error: BaseException, name: str, api: str, *, part: str) -> str:
    """What the programs deferred on a failed call's arrays raise (``part``:
    the part of a larger call that failed, a shard; "": none)."""
    text = describe_error(error)
    where = f"for {part} " if part else ""
    return f"{name}, which {_by(api)} ran, failed {where}with {text}"


def traced_error(name: str) -> Exception:
    """JAX's error for a data_callback that returns a tracer."""
    return jax.errors.UnexpectedTracerError(
        "jax.make_array_from_callback cannot be called within a traced context "
        "(jax_threadmap.async_array_from_callback: the data_callback "
        f"{name} returned a tracer). Call it outside jit, with concrete data."
    )


#: What JAX prefixes to a runtime error's text (kept, for errors that read as JAX's).
_JAX_PREFIX = "INTERNAL: "

#: The failed calls whose dependents' failure was logged (once per call). No
#: lock (so nothing to reset at fork): a dict's setdefault is atomic, in
#: free-threaded builds too.
_reported: weakref.WeakKeyDictionary[Any, object] = weakref.WeakKeyDictionary()


def dependents_failed(
    root: Any, text: str, cause: BaseException | None, done: bool
) -> jax.errors.JaxRuntimeError:
    """The error of a deferred program whose input failed (``text``, passed on
    unchanged along a chain; ``root``: the call whose failure it is). Logged
    once per ``root`` (unless the program is ``done`` already), before the
    program fails: a thread waiting for its results may go on (and end) as
    soon as it has."""
    error = jax.errors.JaxRuntimeError(f"{_JAX_PREFIX}AsyncCallFailed: {text}")
    error.__cause__ = cause
    mine = object()
    if not done and _reported.setdefault(root, mine) is mine:
        logger.warning(
            "jax_threadmap: the jitted programs dispatched on the arrays of "
            "%s (%s) were not run, and their results raise this error when "
            "used: %s",
            root.name,
            root.api,
            text,
        )
    return error
