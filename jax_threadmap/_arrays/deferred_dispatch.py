"""Deferred dispatch: a program on pending data is dispatched when the data lands.

On an accelerator a host callback holds the device's queue while it runs (a TPU
runs its programs in order), so the gate programs of :mod:`.async_dispatch`, which wait
in a host callback, would make every later program wait for the load. There, a
jitted call whose arguments include pending ``AsyncArray`` s is not run at once:

- the call returns at once (once compiled), and its results are ``AsyncArray`` s
  of the program's output shapes, dtypes and shardings, whose call is a
  :class:`ProgramRun`;
- when the last pending argument lands, the program is dispatched from the host
  (on the async pool, or in a thread that waits for a result first), and its
  outputs, ``jax.Array`` s still being computed on the device, become the
  results' values: nothing else waits, and nothing waits in the device's queue;
- programs that do not use the pending data run meanwhile, at once;
- when an argument's call fails, times out or is cancelled, the program never
  runs, and every use of its results raises ``JaxRuntimeError`` with that call's
  error (``AsyncCallFailed: ...``), as the gate programs' dependents do;
- a program on the results of a ``ProgramRun`` is deferred in turn (a chain).

Not deferred (they wait for their data at dispatch, in Python): programs with
ordered effects, programs on ``jax.Ref`` s, programs with outputs of extended
dtypes (PRNG keys), dispatches from the async pool's own threads (a call that
needs another's value runs it, :meth:`.task.Task.wait`), and every
program of a multi-process run (all processes must dispatch in one order).

At exit, the programs whose data has landed are dispatched (exit waits for
them, as for a call that is placing its values); those still waiting for data
are abandoned with their loads.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .async_pool import landing, worker_state
from .leaves import LeafSpec, is_extended
from .task import Task

logger = logging.getLogger("jax_threadmap._async")

#: The ``api`` of a deferred program run, in messages and ``repr``.
API = "deferred dispatch"

#: What JAX prefixes to a runtime error's text (kept, for errors that read as JAX's).
_JAX_PREFIX = "INTERNAL: "


@functools.cache
def processes() -> int:
    """``jax.process_count()``, read once (deferred dispatch is single-process)."""
    return jax.process_count()


def deferrable(program: Any) -> bool:
    """Whether ``program`` (JAX's ``ExecuteReplicated``) may be deferred: no
    ``jax.Ref`` s, only plain outputs, and not dispatched by the async pool."""
    if getattr(worker_state, "in_pool", False) or program.mut is not None:
        return False
    return not any(is_extended(a.dtype) for a in program.out_handler.out_avals)


def output_specs(program: Any) -> list[LeafSpec]:
    """The leaves of the program's outputs: their avals and shardings."""
    handler = program.out_handler
    return [
        LeafSpec(f"[{k}]", tuple(aval.shape), aval.dtype, aval, sharding)
        for k, (aval, sharding) in enumerate(
            zip(handler.out_avals, handler.out_shardings, strict=True)
        )
    ]


def frozen_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` as they are now: a NumPy array the caller writes to later must not
    change a program that runs later (JAX copies it at dispatch)."""
    return tuple(
        np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args
    )


#: The failed calls whose dependents' failure was logged (once per call).
_reported: weakref.WeakSet[Task] = weakref.WeakSet()
_reported_lock = threading.Lock()


def _first_report(task: Task) -> bool:
    with _reported_lock:
        if task in _reported:
            return False
        _reported.add(task)
        return True


class ProgramRun(Task):
    """The deferred run of one compiled program (see the module docstring).

    A call whose ``fn`` dispatches the program and returns its outputs, placed
    already; it starts once every input call (the calls of the pending
    arguments) has landed, and fails without running when one of them fails.
    Override points of :class:`.task.Task`: :meth:`_start` (wait for the
    inputs), :meth:`run` (a waiter helps the inputs, then dispatches),
    :meth:`_accept` (publish the outputs at once) and :meth:`failure_text`.

    Args:
        dispatch: Dispatches the program; called with no arguments once every
            input has landed; returns its outputs.
        inputs: The calls of the pending arguments.
        name: The program's name, for messages (``\\`jit(f)\\```).
        specs: The program's output leaves.
    """

    __slots__ = ("_inputs", "_inputs_lock", "_waiting", "_cause", "root", "_landed")
    stands_for_an_array = True  # print(y) shows y's values, as for a jax.Array

    def __init__(
        self,
        dispatch: Callable[[], list[jax.Array]],
        inputs: list[Task],
        name: str,
        specs: list[LeafSpec],
    ):
        treedef = jax.tree_util.tree_structure(list(range(len(specs))))
        super().__init__(
            dispatch, (), {}, name=name, api=API, treedef=treedef, specs=specs
        )
        self._inputs = tuple(dict.fromkeys(inputs))  # each call once, in order
        self._inputs_lock = threading.Lock()
        self._waiting = len(self._inputs)  # inputs not landed yet
        #: The text of the failed input, passed on unchanged along a chain.
        self._cause: str | None = None
        #: The call whose failure failed this program (itself an input, or the
        #: root of an input program's failure): reported once, whatever the chain.
        self.root: Task | None = None
        #: Whether every input landed (the dispatch is queued or running).
        self._landed = False

    def _start(self) -> None:
        """Starts the inputs that nothing started (a ``deferred_call``) and
        waits for them: the first to fail fails the program, the last one to
        land queues the dispatch."""
        for task in self._inputs:
            task.submit()
        for task in self._inputs:
            task.future.add_done_callback(functools.partial(self._input_done, task))

    def _input_done(self, task: Task, future: Any) -> None:
        if future.exception() is not None:
            self._fail_for(task)  # at once; a later failure changes nothing
        with self._inputs_lock:
            self._waiting -= 1
            last = self._waiting == 0
        if last and all(t.future.exception() is None for t in self._inputs):
            self._landed = True
            super()._start()  # on the pool, unless a waiter dispatches first

    @property
    def returned(self) -> bool:
        """Whether its data landed: its dispatch, queued or running, takes
        moments, and exit waits for it (a program runs to its end, as JAX's)."""
        return self._landed or super().returned

    def _fail_for(self, task: Task) -> None:
        """Gives up on the program: the call of one of its arguments failed."""
        text = task.failure_text()
        self._cause = text
        root = task.root if isinstance(task, ProgramRun) and task.root else task
        self.root = root
        error = jax.errors.JaxRuntimeError(f"{_JAX_PREFIX}AsyncCallFailed: {text}")
        error.__cause__ = task.future.exception()
        # Said before the failure is set: a thread waiting for the results may
        # go on (and end) as soon as it is.
        if not self.future.done() and _first_report(root):
            logger.warning(
                "jax_threadmap: the jitted programs dispatched on the arrays of "
                "%s (%s) were not run, and their results raise this error when "
                "used: %s",
                root.name,
                root.api,
                text,
            )
        self.give_up(error)

    def failure_text(self) -> str:
        """A chain passes the failed argument's error on, not its own wrapper."""
        return self._cause or super().failure_text()

    @landing  # exit waits for a dispatch in flight, and starts none
    def run(self, worker: Any = None) -> None:
        """Dispatches the program here once its inputs landed (a thread that
        waits for a result helps each input first, as for any call)."""
        for task in self._inputs:
            if not task.future.done():
                task.run()  # runs a call that has not started; no-op otherwise
        for task in self._inputs:
            try:
                task.future.exception()  # waits for it to land or fail
            except BaseException:  # noqa: BLE001 - cancelled: its callback fails us
                pass
        with self._inputs_lock:
            landed = self._waiting == 0
        if landed and self._cause is None:
            super().run(worker)  # no-op if the pool dispatched it already

    def _accept(self, out: Any) -> None:
        """The program's outputs are placed already: published at once."""
        self._publish_placed(list(out))
        return None
