"""Every run of a compiled program from Python, as the async layer sees it.

:func:`around` wraps each run (through ``_jax.program_runs.RUNS``). It
keeps, per thread, where the thread is in nested runs (a gate program dispatched by an
argument handler runs inside the run that asked for it), so that:

- **Streams.** A dispatch on pending data goes on a new execution stream
  (:func:`switch_stream`), so that nothing else of its thread waits for that
  data; the run whose argument handler switched puts the thread back on its
  usual stream when it returns, whatever happens. A thread-local level says
  which run switched; no frame is read.
- **Ordered effects.** The argument handler learns the running program's
  ordered effects (:func:`ordered_effects`): such a program waits for its data
  at dispatch.
- **Donation.** The arrays handed to the run for ``AsyncArray`` s are noted
  (:func:`note_handed`); one that the run deleted was donated
  (``donate_argnums``), and its ``AsyncArray`` is told, whether its data had
  landed (its own buffer was donated) or not (the gate program's output was):
  later uses fail either way, as for a donated ``jax.Array``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from .._jax import hooks as _hooks
from .._support import fork as _fork

#: The first execution stream of dispatches on pending data; each dispatch takes
#: the next. Far above the ids XLA derives from thread ids. XLA forgets a stream
#: once its last program has run, so fresh ids cost nothing (measured on jax
#: 0.6.2 and 0.12: 200,000 dispatches on as many streams, memory unchanged).
FIRST_PENDING_STREAM = 1 << 62


class _Thread(threading.local):
    """Where this thread is in running compiled programs (see :func:`around`)."""

    def __init__(self) -> None:
        #: How many runs of compiled programs are in progress in this thread
        #: (nested: a gate program dispatched by an argument handler).
        self.depth = 0
        #: The level of the run whose dispatch switched the stream (0: none).
        self.switched_at = 0
        #: The entered ``execution_stream_id`` context of the switch; its exit
        #: puts the thread back on its usual stream.
        self.switch: Any = None
        #: The ordered effects of the innermost run.
        self.effects: Any = ()
        #: The arrays handed to the innermost run for AsyncArrays, each with
        #: what to call if the run donates it.
        self.handed: list[tuple[Any, Callable[[], None]]] = []


_thread = _Thread()
_stream_ids = itertools.count(FIRST_PENDING_STREAM)


def around(run: Any, program: Any, args: tuple, effects: Any) -> Any:
    """Every run of a compiled program from Python (``RUNS.around``).

    Puts the thread back on its usual stream when the run whose argument handler
    switched it returns, whatever happens; tells the handler the program's
    ordered effects; tells the ``AsyncArray`` s whose arrays the run donated.
    """
    state = _thread
    level = state.depth + 1
    outer, outer_handed = state.effects, state.handed
    state.depth, state.effects, state.handed = level, effects, []
    try:
        return run(program, *args)
    finally:
        handed = state.handed
        state.depth, state.effects, state.handed = level - 1, outer, outer_handed
        if state.switched_at == level:
            state.switched_at = 0
            put_back()
        for array, donated in handed:
            if array.is_deleted():  # XLA deletes donated inputs at the run
                donated()


def note_handed(array: Any, donated: Callable[[], None]) -> None:
    """Notes ``array``, handed to the current run; ``donated()`` if it donates it."""
    if _thread.depth:
        _thread.handed.append((array, donated))


def ordered_effects() -> Any:
    """The ordered effects of the program this thread is running (or ``()``)."""
    return _thread.effects


def switch_stream(enabled: bool) -> bool:
    """Puts what this thread dispatches next on a new stream (if ``enabled``).

    Inside a run of a compiled program (a jitted call), the run's end puts the
    thread back (:func:`around`): returns ``False``. Outside one (``device_put``
    of a pending array), returns ``True``: the caller puts it back
    (:func:`put_back`) after its gate programs.
    """
    state = _thread
    if state.switched_at or not enabled:
        return False
    # (Called from the table: a Missing hook raises by name when called.)
    state.switch = _hooks.RESOLVED["execution_stream_id"](next(_stream_ids))
    state.switch.__enter__()
    if state.depth:
        state.switched_at = state.depth
        return False
    return True


def put_back() -> None:
    """Puts the thread back on its usual stream (after :func:`switch_stream`)."""
    switch, _thread.switch = _thread.switch, None
    switch.__exit__(None, None, None)


@_fork.in_child
def _after_fork_in_child() -> None:
    # The forking thread (the child's only one) is in no run of a program here.
    global _thread
    _thread = _Thread()
