"""Async dispatch: a jitted call with pending ``AsyncArray`` s returns at once.

The one file to swap to change the mechanism: :mod:`.async_array` uses only
:data:`mechanism`, :class:`Pending`, :func:`bind_arrays`,
:func:`async_dispatch_status` and :class:`AsyncCallFailed`; of a call, only
``Task``'s public methods are used. One class per job: :class:`Dispatch` sends
each run on ``AsyncArray`` s where it belongs (deferred by
:mod:`.deferred_dispatch`, gated by :class:`.gates.Gates`, or blocking) and
makes its array outputs ``AsyncArray`` s whatever the timing (:class:`Results`).
A program with ordered effects waits for its pending data at dispatch: JAX
dispatches a thread's program with an ordered effect only once its previous one
has run, and (before jax 0.12) fails every later one after one failed.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._jax import program_runs as _program_runs
from .._support import fork as _fork
from .._support.environment import ENV_ASYNC_DISPATCH, async_dispatch_mode
from . import deferred_dispatch as _deferred_dispatch
from . import dispatch_streams as _dispatch_streams
from .gates import EXIT_DRAIN_S, GATE_PLATFORMS, Gates
from .gates import MAX_WAITING_PROGRAMS as MAX_WAITING_PROGRAMS
from .gates import AsyncCallFailed as AsyncCallFailed
from .gates import Pending as Pending
from .leaves import LeafSpec
from .task import Task, worker_state


class ArrayKind(NamedTuple):
    """What dispatch needs of :mod:`.async_array` (the array's owner), handed
    down by it (:func:`bind_arrays`): the array type, the ``Pending`` of an
    array, and the arrays of a call."""

    type: Any
    pending_of: Callable[[Any], Pending]
    arrays_of: Callable[[Task], Any]


class Dispatch:
    """Async dispatch: what a program run with ``AsyncArray`` arguments does.

    It reads the switch (once per change), installs the hooks when the first
    ``AsyncArray`` is made, and sends a run where it belongs: deferred
    (:mod:`.deferred_dispatch`) where that is the mechanism, else run with gate
    programs (:class:`Gates`) or blocking; either way its array outputs are
    ``AsyncArray`` s (:meth:`around`).
    """

    def __init__(self) -> None:
        self.gates = Gates()
        self.readers = _deferred_dispatch.Readers()
        self.kind: ArrayKind | None = None
        #: The switch's text and mode, as last read (:meth:`mode`).
        self._env: tuple[str | None, str] = (None, "")
        self._lock = threading.Lock()
        # Whether prepare() ran, and whether program runs are wrapped (then a
        # dispatch on pending data gets a stream of its own).
        self._prepared = False
        self._wrapped = False

    def mode(self) -> str:
        """``JAX_THREADMAP_ASYNC_DISPATCH``'s mode, parsed once per change."""
        raw = os.environ.get(ENV_ASYNC_DISPATCH, "")
        if raw != self._env[0]:
            self._env = (raw, async_dispatch_mode())
        return self._env[1]

    def counts(self) -> tuple[dict[Any, int], int]:
        """The gate programs waiting per device, and the calls lent a slot."""
        return self.gates.counts()

    def clean_up_at_exit(self, timeout: float = EXIT_DRAIN_S) -> None:
        """Lets failed gate programs finish; leaves JAX no failed exit token."""
        self.gates.clean_up_at_exit(timeout)

    def status(self) -> str | None:
        """Why dispatch on the default backend is blocking, or ``None``."""
        if self.mode() == "off":
            return f"disabled by {ENV_ASYNC_DISPATCH}=0"
        device = jax.devices()[0]
        if not self.defers_on(device.platform):
            self.gates.start(device)  # the first dispatch would: a refusal says so
        if self.defers_on(device.platform):
            reason = self.in_thread_order()
        else:
            reason = self.gates.unavailable()
        return (
            None
            if reason is None
            else f"unavailable in jax {jax.__version__}: {reason}"
        )

    def defers_on(self, platform: str) -> bool:
        """Whether programs on ``platform`` are deferred: on accelerators, where
        asked for, and where the gates cannot run (no transfer server: its
        hooks are missing, or the machine refuses its loopback socket)."""
        return (
            self.mode() == "deferred"
            or platform not in GATE_PLATFORMS
            or self.gates.unavailable() is not None
        )

    def in_thread_order(self) -> str | None:
        """Why dispatches on pending data keep their thread's stream (and
        cannot be deferred), or ``None``."""
        reason = _program_runs.dispatch_streams_unavailable()
        if reason is None and self._prepared and not self._wrapped:
            reason = "the runs of compiled programs could not be wrapped"
        return reason

    def prepare(self) -> None:
        """Installs the hooks on program runs (once; at the first async call).

        No ``AsyncArray`` exists before that, so no dispatch on pending data can
        happen earlier, and a process that never makes one runs JAX untouched.
        """
        if self._prepared:
            return
        with self._lock:
            if not self._prepared:
                self._wrapped = _program_runs.RUNS.install(around)
                self._prepared = True

    # -- every run of a compiled program from Python, once prepared --

    def around(self, run: Any, program: Any, args: tuple, effects: Any) -> Any:
        """A run with ``AsyncArray`` arguments returns ``AsyncArray`` s: deferred
        where that is the mechanism, else run (:func:`.dispatch_streams.around`)
        and its array outputs wrapped; any other run is JAX's."""
        kind = self.kind
        if kind is None or not any(type(a) is kind.type for a in args):
            return _dispatch_streams.around(run, program, args, effects)
        reads = [kind.pending_of(a) if type(a) is kind.type else None for a in args]
        if not effects and self._defers(program, reads):
            return _deferred_dispatch.defer(
                functools.partial(self._run_deferred, run, program, effects),
                program,
                args,
                reads,
                kind.arrays_of,
                self.readers,
            )
        return self._results(_dispatch_streams.around(run, program, args, effects))

    def _run_deferred(
        self, run: Any, program: Any, effects: Any, args: list[Any]
    ) -> list[Any]:
        return _dispatch_streams.around(run, program, tuple(args), effects)

    def _defers(self, program: Any, reads: list[Pending | None]) -> bool:
        if all(r is None or r.task.future.done() for r in reads):
            return False
        mode = self.mode()
        if mode == "off" or self.in_thread_order():
            return False
        if _deferred_dispatch.processes() > 1:
            # Every process must dispatch its programs in the same order (their
            # collectives meet): deferring one would reorder them.
            return False
        devices = program._local_devices
        if not devices:
            return False
        if mode == "auto" and all(d.platform in GATE_PLATFORMS for d in devices):
            if devices[0].client not in self.gates.servers:
                self.gates.start(devices[0])  # if it cannot start, defer instead
            if self.gates.unavailable() is None:
                return False  # gate programs
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

    # -- at dispatch, in the thread that calls the jitted function --

    def arrays_for(self, xs: list[Pending], shardings: list[Any]) -> list[Any]:
        """One jax.Array per x: the value if there, else a pending one.

        Where async dispatch is off or its bound is reached, waits for the data
        of ``xs`` (blocking dispatch): never for another call.
        """
        out: list[Any] = [None] * len(xs)
        todo = []
        for i, x in enumerate(xs):
            # Blocking for a sharded load asked for in another layout.
            if x.task.future.done() or not x.task.serves(shardings[i], x.shape):
                out[i] = self._landed(x)
            else:
                todo.append(i)
        if todo and self._may_dispatch():
            own_stream = self._wrapped and not self.in_thread_order()
            self.gates.fill(xs, shardings, todo, out, own_stream)
        for i in todo:
            if out[i] is None:  # blocking dispatch: its own data
                out[i] = self._landed(xs[i])
        for x, array in zip(xs, out, strict=True):  # later uses fail if donated
            _dispatch_streams.note_handed(array, x.task.donation_of(x.leaf))
        return out

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

    def _may_dispatch(self) -> bool:
        if _dispatch_streams.ordered_effects():
            # JAX dispatches a program with an ordered effect only once the
            # previous one with that effect has run, and a failed one fails
            # every later one (before jax 0.12): wait for the data here, in
            # Python, and a failed call raises at this dispatch instead.
            return False
        if getattr(worker_state, "in_pool", False):
            # A call run by the pool that needs another call's value runs that
            # call itself (see Task.wait) rather than queue behind busy workers.
            return False
        return self.mode() == "auto" and self.gates.unavailable() is None

    def after_fork(self) -> None:
        # Servers, gates and programs in flight belong to the parent.
        self.gates.after_fork()


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
            treedef=_treedef(len(leaves)),
            specs=specs,
        )
        self._claim(None)
        self._publish_placed(leaves)


@functools.cache
def _treedef(n: int) -> Any:
    return jax.tree_util.tree_structure(list(range(n)))


mechanism = Dispatch()


def bind_arrays(
    array_type: type,
    pending_of: Callable[[Any], Pending],
    arrays_of: Callable[[Task], Any],
) -> None:
    """Called once by :mod:`.async_array` at its import: the array type, the
    ``Pending`` of an array, the arrays of a call (:class:`ArrayKind`)."""
    mechanism.kind = ArrayKind(array_type, pending_of, arrays_of)


def around(run: Any, program: Any, args: tuple, effects: Any) -> Any:
    """Every run of a compiled program from Python, once an async array exists
    (:data:`.program_runs.RUNS`): the mechanism's (:meth:`Dispatch.around`)."""
    return mechanism.around(run, program, args, effects)


def async_dispatch_status() -> str:
    """Says whether jitted calls with pending ``AsyncArray`` s return at once, and how.

    With ``"async"`` (the CPU), ``y = f(x)`` with ``x`` pending returns at once
    with ``AsyncArray`` results, and other work (of the same thread too) that
    does not use ``y`` does not wait for ``x`` (docs/async.md, "Ordering").
    Where the JAX hooks for that are missing, it is ``"async, in thread order
    (...)"``: calls still return at once, but every later program of the same
    thread runs once ``x`` has arrived. With ``"async, deferred (...)"`` (an
    accelerator; or a CPU without the gates' loopback transfer server, or
    ``JAX_THREADMAP_ASYNC_DISPATCH=deferred``), ``y = f(x)`` returns at once
    with ``AsyncArray`` results, and ``f`` 's program is dispatched from the host
    when ``x`` lands (docs/accelerators.md).

    Returns:
        ``"async"``, ``"async, in thread order (<reason>)"``, ``"async, deferred
        (...)"``, or ``"blocking: <reason>"`` (the reason names the switch or
        the missing JAX feature).

    Examples:
        >>> import jax_threadmap as jtm
        >>> jtm.async_dispatch_status().startswith("async")  # CPU, TPU: jax 0.6.2+
        True
    """
    reason = mechanism.status()
    if reason is not None:
        return f"blocking: {reason}"
    if mechanism.defers_on(jax.default_backend()):
        return (
            "async, deferred (a jitted call on pending data returns AsyncArrays at "
            "once; its program is dispatched from the host when the data lands)"
        )
    in_order = mechanism.in_thread_order()
    if in_order is not None:
        return (
            "async, in thread order (later programs of the thread that dispatched "
            f"on pending data wait for that data: {in_order})"
        )
    return "async"


@_fork.in_child
def _after_fork_in_child() -> None:
    # Servers, gates and programs in flight belong to the parent.
    mechanism.after_fork()
