"""Async dispatch: a jitted call with pending ``AsyncArray`` s returns at once.

One mechanism on every platform: deferred dispatch (:mod:`.deferred_dispatch`).
:mod:`.async_array` uses only :data:`mechanism`, :class:`Pending` and
:class:`ArrayKind`; of a call, only
``Task``'s public methods are used. :class:`Dispatch` sends each run on
``AsyncArray`` s where it belongs (deferred until its data lands, or run at
once where it must wait for the data: blocking) and makes its array outputs
``AsyncArray`` s whatever the timing (:class:`Results`). A program with ordered
effects waits for its pending data at dispatch: JAX dispatches a thread's
program with an ordered effect only once its previous one has run, and (before
jax 0.12) fails every later one after one failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._jax import program_runs as _program_runs
from .._support.environment import ENV_ASYNC_DISPATCH, async_dispatch_mode
from . import deferred_dispatch as _deferred_dispatch
from .leaves import LeafSpec
from .task import Task


class Pending(NamedTuple):
    """An ``AsyncArray`` handed to a dispatch: its call, the leaf of the call's
    result it is, and the array (its shape, dtype, and value once there).

    Made by :mod:`.async_array` (the array's owner), so that dispatch reaches
    the call and leaf by these fields, never by the array's private ones.
    """

    task: Task
    leaf: int
    array: Any


class ArrayKind(NamedTuple):
    """What dispatch needs of :mod:`.async_array` (the array's owner), set by
    it as :attr:`Dispatch.kind` at its import: the array type, the ``Pending``
    of an array, and the arrays of a call."""

    type: Any
    pending_of: Callable[[Any], Pending]
    arrays_of: Callable[[Task], Any]


class Dispatch:
    """Async dispatch: what a program run with ``AsyncArray`` arguments does.

    It reads the switch, installs the hook on program runs
    when the first ``AsyncArray`` is made, and defers a run on pending data
    (:mod:`.deferred_dispatch`) or runs it blocking; either way its array
    outputs are ``AsyncArray`` s (:meth:`around`).
    """

    def __init__(self) -> None:
        self.readers = _deferred_dispatch.Readers()
        self.kind: ArrayKind | None = None
        self._lock = threading.Lock()
        self._prepared = False  # whether prepare() ran

    def status(self) -> str | None:
        """Why dispatch on pending data is blocking, or ``None``. (The switch
        is parsed once per change of its value, :func:`async_dispatch_mode`.)"""
        if async_dispatch_mode() == "off":
            return f"disabled by {ENV_ASYNC_DISPATCH}=0"
        reason = _program_runs.runs_unavailable()
        if reason is None:
            return None
        return f"unavailable in jax {jax.__version__}: {reason}"

    def prepare(self) -> None:
        """Installs the hook on program runs (once; at the first async call).

        No ``AsyncArray`` exists before that, so no dispatch on pending data can
        happen earlier, and a process that never makes one runs JAX untouched.
        """
        if self._prepared:
            return
        with self._lock:
            if not self._prepared:
                _program_runs.RUNS.install(self.around)
                self._prepared = True

    # -- every run of a compiled program from Python, once prepared --

    def around(self, run: Any, program: Any, args: tuple, effects: Any) -> Any:
        """A run with ``AsyncArray`` arguments returns ``AsyncArray`` s: deferred
        until its data lands, or run now (blocking) and its array outputs
        wrapped; any other run is JAX's."""
        kind = self.kind
        if kind is None or not any(type(a) is kind.type for a in args):
            return run(program, *args)
        reads = [kind.pending_of(a) if type(a) is kind.type else None for a in args]
        if not effects and self._defers(program, reads):
            return _deferred_dispatch.defer(
                lambda frozen: run(program, *frozen),
                program,
                args,
                reads,
                kind.arrays_of,
                self.readers,
            )
        return self._results(run(program, *args))

    def _defers(self, program: Any, reads: list[Pending | None]) -> bool:
        if all(r is None or r.task.future.done() for r in reads):
            return False
        if self.status() is not None:
            return False
        if _deferred_dispatch.processes() > 1:
            # Every process must dispatch its programs in the same order (their
            # collectives meet): deferring one would reorder them.
            return False
        if not program._local_devices:
            return False
        return _deferred_dispatch.deferrable(program)

    def _results(self, outs: list[Any]) -> list[Any]:
        """The outputs of a run on ``AsyncArray`` s: its arrays as ``AsyncArray``
        s of a call that has landed, the rest (tokens) as they are."""
        assert self.kind is not None
        at = [k for k, o in enumerate(outs) if isinstance(o, jax.Array)]
        if not at:
            return outs
        leaves = [outs[k] for k in at]
        made = self.kind.arrays_of(Results(leaves))
        outs = list(outs)
        for k, array in zip(at, made, strict=True):
            outs[k] = array
        return outs

    # -- at dispatch, in the thread that runs the program --

    def arrays_for(self, xs: list[Pending]) -> list[jax.Array]:
        """One jax.Array per x, its value: waits for it (a run that reaches the
        argument handlers was not deferred, or its data has landed). A run that
        donates it (``donate_argnums``) deletes it: the call's value is that
        ``jax.Array``, so later uses fail as for a donated ``jax.Array``."""
        return [self._landed(x) for x in xs]

    def _landed(self, x: Pending) -> jax.Array:
        """The value of ``x``, once the deferred programs called before this
        one that read it no longer need it (a later donation)."""
        value = x.array.result()
        self.settle(x.task)
        return value

    def settle(self, task: Task) -> None:
        """Before ``task``'s values are handed on (to a program that may donate
        them, or to ``delete()``): the pending deferred programs that read them
        no longer need them (:meth:`.deferred_dispatch.Readers.settle`)."""
        if self.readers.by_source:
            self.readers.settle(task)


class Results(Task):
    """The call behind the ``AsyncArray`` results of a program run with
    ``AsyncArray`` arguments that was not deferred: it has landed when made,
    with the run's outputs (``jax.Array`` s, still being computed)."""

    __slots__ = ()
    stands_for_an_array = True  # print(y) shows y's values, as for a jax.Array

    def __init__(self, leaves: list[jax.Array]):
        specs = [
            LeafSpec(f"[{k}]", leaf.shape, leaf.dtype, leaf.aval, leaf.sharding)
            for k, leaf in enumerate(leaves)
        ]
        super().__init__(
            None,  # nothing to run: a wrapped outcome
            (),
            {},
            name="a jitted call on AsyncArrays",
            api="jit",
            treedef=_deferred_dispatch.treedef_of(len(leaves)),
            specs=specs,
        )
        self._claim(None)
        self._publish_placed(leaves)


mechanism = Dispatch()
