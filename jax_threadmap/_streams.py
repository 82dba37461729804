"""Programs that wait for pending data go on an execution stream of their own.

XLA's CPU client runs the programs of one *execution stream* in the order they
were dispatched (each waits for the previous one of its stream, whatever their
data), and by default a thread's programs form one stream, keyed by the thread's
id. So after ``y = f(x)`` with ``x`` pending, everything the same thread
dispatched next would wait for ``x``. jaxlib lets a thread choose the stream of
the programs it dispatches (``jaxlib.xla_client.execution_stream_id``): a
dispatch on pending data puts its gate programs and its own program on the
thread's *pending stream*, and puts the thread back on its usual stream as soon
as that program is enqueued. Data dependencies are kept by the buffers
themselves, so only the ordering changes: later programs that do not use the
pending results run at once; the programs of one thread that wait for pending
data still run in their order.

The switch back must happen on the dispatching thread after XLA took the
program, which is after every Python hook of the dispatch has run; it happens
when JAX's Python frame that runs the compiled program returns, seen by a
one-shot profile function (``sys.setprofile``, this thread only). Where that
frame is not found (another dispatch path), where a profiler is already set, or
where the JAX hooks are missing, nothing switches and the thread's programs stay
in one stream (:func:`unavailable` says why).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from types import CodeType, FrameType
from typing import Any

from . import _compat

#: A thread's pending stream is this plus its ``threading.get_ident()``: far
#: above the ids XLA derives from thread ids, so that a pending stream never
#: merges with a thread's usual stream; and since the OS reuses the idents of
#: threads that ended, XLA's table of streams grows with the threads alive at
#: once, not with every thread that ever dispatched.
FIRST_PENDING_STREAM = 1 << 62

#: How many frames up from the argument handler to look for the frame that runs
#: the compiled program (about 4 in jax 0.6.2 ... 0.12).
MAX_FRAMES_UP = 32


class _State(threading.local):
    def __init__(self) -> None:
        #: This thread's pending stream.
        self.stream = FIRST_PENDING_STREAM + threading.get_ident() % (1 << 61)
        #: The frame whose return puts the thread back, while switched.
        self.until: FrameType | None = None


_state = _State()


def unavailable() -> str | None:
    """Why programs on pending data share their thread's stream, or ``None``."""
    return _compat.dispatch_streams_unavailable()


@functools.cache
def _running_code() -> CodeType:
    # ExecuteReplicated.__call__ is wrapped (by JAX's profiler) in some releases.
    call = inspect.unwrap(_compat.get("ExecuteReplicated").__call__)
    return call.__code__


def _executing_frame() -> FrameType | None:
    code = _running_code()
    frame: FrameType | None = sys._getframe(1)
    for _ in range(MAX_FRAMES_UP):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def switch_for_this_dispatch() -> bool:
    """Puts what this thread dispatches on its pending stream, until the program runs.

    Called by the argument handler of a dispatch on pending data, before its gate
    programs are dispatched. Returns whether it switched (or already had, for
    this dispatch).
    """
    state = _state
    if state.until is not None:
        return True
    if unavailable() is not None or sys.getprofile() is not None:
        return False
    frame = _executing_frame()
    if frame is None:
        return False
    get_stream = _compat.get("get_execution_stream_id")
    set_stream = _compat.get("set_execution_stream_id")
    usual = get_stream()
    state.until = frame

    def back_after(event_frame: FrameType, event: str, arg: Any) -> None:
        del arg
        if event == "return" and event_frame is frame:
            sys.setprofile(None)
            set_stream(usual)
            state.until = None

    set_stream(state.stream)
    sys.setprofile(back_after)
    return True


def after_fork_in_child() -> None:
    """The child's thread starts on its usual stream."""
    _state.until = None
