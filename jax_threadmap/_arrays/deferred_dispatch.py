"""Deferred dispatch: a program on pending data is dispatched when the data lands.

The one mechanism of async dispatch, on every platform. A program waiting in the
device's queue for data would hold the queue (a TPU runs its programs in order),
so nothing of ours ever waits there: a jitted call whose arguments include
pending ``AsyncArray`` s is not run at once:

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
  error (``AsyncCallFailed: ...``);
- a program on the results of a ``ProgramRun`` is deferred in turn (a chain);
- the program reads its arguments as they were at the call, whatever later
  calls do to them (a donation, ``delete()``, a write to a NumPy array), as JAX's
  runtime promises for the programs it has enqueued: NumPy arrays are copied
  and ``jax.Array`` s kept at the call (:meth:`Readers.freeze`, :func:`_kept`:
  an alias on the CPU, a copy elsewhere; jit's C++ fast path donates without
  passing any hook, so no later point could copy), and an
  ``AsyncArray`` is let go of (:class:`Readers`) before a later program is handed
  it.

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

import collections
import concurrent.futures
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
from .outcomes import wait_polling
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
    ``jax.Ref`` s, only plain array outputs (no tokens, no PRNG keys), and not
    dispatched by the async pool."""
    if getattr(worker_state, "in_pool", False) or program.mut is not None:
        return False
    return all(
        hasattr(a, "dtype") and not is_extended(a.dtype)
        for a in program.out_handler.out_avals
    )


def output_specs(program: Any) -> list[LeafSpec]:
    """The leaves of the program's outputs: their avals and shardings."""
    handler = program.out_handler
    return [
        LeafSpec(f"[{k}]", tuple(aval.shape), aval.dtype, aval, sharding)
        for k, (aval, sharding) in enumerate(
            zip(handler.out_avals, handler.out_shardings, strict=True)
        )
    ]


class Held:
    """A copy of a ready ``jax.Array`` (``original``; ``None`` for a copy of a
    call's array) that the pending deferred programs reading it share."""

    __slots__ = ("original", "copy")

    def __init__(self, original: Any, copy: Any):
        self.original, self.copy = original, copy


def _kept(a: jax.Array) -> jax.Array:
    """What a deferred program reads for the ready array ``a``: on one CPU
    device, an alias of its buffer (DLPack: XLA's CPU client then copies at a
    later donation instead of donating, and ``a.delete()`` leaves the alias:
    no copy unless a conflict comes); elsewhere, a copy (dispatched, not
    waited for)."""
    if len(a.devices()) == 1 and next(iter(a.devices())).platform == "cpu":
        try:
            alias = jax.dlpack.from_dlpack(a)
        except Exception:  # noqa: BLE001 - a dtype or layout DLPack refuses: copy
            alias = None
        if alias is not None and alias.sharding == a.sharding:
            if alias.dtype == a.dtype and alias.shape == a.shape:
                return alias
    return jax.device_put(a, may_alias=False)


class _Dispatching(threading.local):
    #: The program run this thread dispatches (see :meth:`Readers.settle`).
    run: ProgramRun | None = None


_dispatching = _Dispatching()


class Readers:
    """What the pending deferred programs read, and the order they were called in.

    A program reads its arguments as they were at its call, whatever later
    calls do to them (JAX's runtime promises that for the programs it has
    enqueued; a deferred one is not enqueued yet):

    - a ready ``jax.Array`` is kept at the call (:meth:`freeze`, :func:`_kept`:
      an alias on the CPU, else a copy dispatched and not waited for), once for
      all the pending programs that read it: jit's C++ fast path donates
      without passing any hook, so no later point could copy at the conflict;
    - before a call's array, or such a copy, is handed to a program
      (:meth:`settle`), which may donate it, the pending programs called
      earlier that read it are let go of it (:meth:`ProgramRun.let_go`):
      dispatched first if their data has landed, else given one new copy
      between them (the only other copy: at the conflict). An ``AsyncArray``
      argument never takes the fast path, so all its handing passes here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The pending deferred programs, in call order, by what they read: a
        #: call (its arrays) or a :class:`Held` copy. Read without the lock:
        #: whether there are any.
        self.by_source: dict[Any, list[ProgramRun]] = {}
        #: The shared copies of ready arrays, by ``id`` of the original.
        self._held: dict[int, Held] = {}

    def freeze(
        self, args: tuple[Any, ...], reads: list[Any]
    ) -> tuple[list[Any], list[Any]]:
        """``args`` as they are now, and what each reads (a :class:`Held` for a
        ready ``jax.Array``; NumPy arrays are copied, as JAX copies them at
        dispatch; an ``AsyncArray``, whose ``reads`` entry is not ``None``, as is)."""
        frozen: list[Any] = []
        held: list[Any] = []
        for a, read in zip(args, reads, strict=True):
            h = None
            if read is not None:
                pass
            elif isinstance(a, np.ndarray):
                a = np.array(a, copy=True)
            elif isinstance(a, jax.Array) and not is_extended(a.dtype):
                with self._lock:
                    h = self._held.get(id(a))
                if h is None or h.original is not a or h.copy.is_deleted():
                    h = Held(a, _kept(a))
                    with self._lock:
                        self._held[id(a)] = h
                a = h.copy
            frozen.append(a)
            held.append(h)
        return frozen, held

    def add(self, run: ProgramRun, sources: list[Any]) -> None:
        """``run`` reads ``sources`` (calls, copies) until it finishes."""
        with self._lock:
            for source in sources:
                self.by_source.setdefault(source, []).append(run)
        run.future.add_done_callback(lambda _: self._remove(run))

    def _remove(self, run: ProgramRun) -> None:
        with self._lock:
            for source, runs in list(self.by_source.items()):
                if run in runs:
                    runs.remove(run)
                if not runs:
                    del self.by_source[source]
                    if isinstance(source, Held) and source.original is not None:
                        if self._held.get(id(source.original)) is source:
                            del self._held[id(source.original)]

    def settle(self, source: Any) -> None:
        """Before ``source``'s arrays are handed to a program: the pending
        programs called before it that read them no longer need them."""
        me = _dispatching.run
        with self._lock:
            runs = list(self.by_source.get(source, ()))
        made: dict[Any, Held] = {}
        for run in runs:
            if run is me:
                break  # those called later read after this one
            run.let_go(source, made, self)


def defer(
    dispatch: Callable[[tuple[Any, ...]], list[jax.Array]],
    program: Any,
    args: tuple[Any, ...],
    reads: list[Any],
    arrays_of: Callable[[Task], Any],
    readers: Readers,
) -> Any:
    """The program's results, as arrays of a :class:`ProgramRun` that runs
    ``dispatch`` with its arguments once its pending ones land.

    ``reads``: for each argument that is an ``AsyncArray``, its ``Pending`` (its
    call and leaf), else ``None``; ``arrays_of``: the ``AsyncArray`` s of a call.
    """
    frozen, held = readers.freeze(args, reads)
    reads = [r if r is not None else h for r, h in zip(reads, held, strict=True)]
    inputs = [r.task for r in reads if _is_call(r) and not r.task.future.done()]
    run = ProgramRun(
        dispatch,
        readers,
        frozen,
        reads,
        inputs,
        f"`{program.name}`",
        output_specs(program),
    )
    sources = [r.task if _is_call(r) else r for r in reads if r is not None]
    readers.add(run, list(dict.fromkeys(sources)))
    outs = arrays_of(run)
    run.submit()
    return outs


def _is_call(read: Any) -> bool:
    """Whether ``read`` is a call's array (a ``Pending``), not a :class:`Held`."""
    return read is not None and not isinstance(read, Held)


#: :func:`_key` of a read that does not read the source.
_OTHER = object()


def _key(read: Any, source: Any) -> Any:
    """Which of ``source``'s arrays ``read`` reads: its leaf (a call's), ``None``
    (a copy), or :data:`_OTHER`."""
    if read is source:
        return None
    if _is_call(read) and read.task is source:
        return read.leaf
    return _OTHER


def _value(read: Any, source: Any) -> Any:
    """The array that ``read`` reads of ``source`` now."""
    if isinstance(source, Held):
        return source.copy
    return source.future.result()[read.leaf]


@functools.cache
def treedef_of(n: int) -> Any:
    """The tree of a program's ``n`` outputs (a list), as the calls of its
    results declare it."""
    return jax.tree_util.tree_structure(list(range(n)))


#: The failed calls whose dependents' failure was logged (once per call).
_reported: weakref.WeakSet[Task] = weakref.WeakSet()
_reported_lock = threading.Lock()


def _first_report(task: Task) -> bool:
    with _reported_lock:
        if task in _reported:
            return False
        _reported.add(task)
        return True


class _Failing(threading.local):
    #: The programs this thread is failing (:func:`_fail_along`), or ``None``.
    queue: collections.deque[tuple[ProgramRun, Task]] | None = None


_failing = _Failing()


def _fail_along(run: ProgramRun, task: Task) -> None:
    """``run._fail_for(task)``; a failure along a chain fails the next program
    from the done-callback of the last, so those are queued here rather than
    nested: a chain of any length fails (nesting overflowed the stack at a
    few hundred programs, and the rest never ended)."""
    queue = _failing.queue
    if queue is not None:
        queue.append((run, task))
        return
    _failing.queue = queue = collections.deque([(run, task)])
    try:
        while queue:
            failed, cause = queue.popleft()
            try:
                failed._fail_for(cause)
            except Exception:  # one program's failure must not stop the rest
                logger.exception("jax_threadmap: could not fail %s", failed)
    finally:
        _failing.queue = None


class ProgramRun(Task):
    """The deferred run of one compiled program (see the module docstring).

    A call whose ``fn`` dispatches the program and returns its outputs, placed
    already; it starts once every input call (the calls of the pending
    arguments) has landed, and fails without running when one of them fails.
    Override points of :class:`.task.Task`: :meth:`_start` (wait for the
    inputs), :meth:`run` (a waiter helps the inputs, then dispatches),
    :meth:`_accept` (publish the outputs at once) and :meth:`failure_text`.

    Args:
        dispatch: Dispatches the program with the arguments it is given, once
            every input has landed; returns its outputs.
        readers: What the pending programs read (:class:`Readers`).
        args: The program's arguments (:meth:`Readers.freeze`).
        reads: For each argument, what it reads: a call's array (``Pending``),
            a :class:`Held` copy, or ``None``.
        inputs: The calls of the pending arguments.
        name: The program's name, for messages (``\\`jit(f)\\```).
        specs: The program's output leaves.
    """

    __slots__ = (
        "_inputs",
        "_inputs_lock",
        "_waiting",
        "_cause",
        "root",
        "_landed",
        "_dispatch",
        "_readers",
        "_program_args",
        "_reads",
    )
    stands_for_an_array = True  # print(y) shows y's values, as for a jax.Array

    def __init__(
        self,
        dispatch: Callable[[tuple[Any, ...]], list[jax.Array]],
        readers: Readers,
        args: list[Any],
        reads: list[Any],
        inputs: list[Task],
        name: str,
        specs: list[LeafSpec],
    ):
        super().__init__(
            self._dispatch_now,
            (),
            {},
            name=name,
            api=API,
            treedef=treedef_of(len(specs)),
            specs=specs,
        )
        self._dispatch = dispatch
        self._readers = readers
        self._program_args = args
        self._reads = reads
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

    def _dispatch_now(self) -> list[jax.Array]:
        with self._inputs_lock:
            args, self._program_args = self._program_args, []
            held = [r for r in self._reads if isinstance(r, Held)]
        outer, _dispatching.run = _dispatching.run, self
        try:
            for h in held:  # it may donate them: the earlier readers first
                self._readers.settle(h)
            return self._dispatch(tuple(args))
        finally:
            _dispatching.run = outer
            for h in held:
                # A donated copy stands for the caller's array, deleted now
                # (later uses fail, as after a donation; JAX's runtime keeps
                # it for the programs enqueued before).
                if h.copy.is_deleted() and h.original is not None:
                    if not h.original.is_deleted():
                        h.original.delete()

    def let_go(self, source: Any, made: dict[Any, Held], readers: Readers) -> None:
        """Makes this program independent of ``source`` (a call or a
        :class:`Held` copy), before a program called later is handed it:
        dispatched here if its data has landed (it was called first), else
        reading a new copy, made once for all in ``made``."""
        with self._inputs_lock:
            waiting = bool(self._waiting) and not self.future.done()
            if waiting:
                for k, read in enumerate(self._reads):
                    key = _key(read, source)
                    if key is _OTHER:
                        continue
                    if key not in made:
                        try:
                            value = _value(read, source)
                            copy = jax.device_put(value, may_alias=False)
                        except Exception:  # noqa: BLE001 - deleted or failed: this
                            continue  # run fails on its own, at its dispatch
                        made[key] = Held(None, copy)
                        readers.add(self, [made[key]])
                    self._program_args[k] = made[key].copy
                    self._reads[k] = made[key]
        if not waiting:
            self.run()
            concurrent.futures.wait([self.future])  # the dispatch: moments

    def _start(self) -> None:
        """Waits for the inputs (each submitted when made): the first to fail
        fails the program, the last one to land queues the dispatch."""
        for task in self._inputs:
            task.future.add_done_callback(functools.partial(self._input_done, task))

    def _input_done(self, task: Task, future: Any) -> None:
        if future.exception() is not None:
            _fail_along(self, task)  # at once; a later failure changes nothing
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
        with self._inputs_lock:
            self._program_args = []  # the copies are not needed any more
        self.give_up(error)

    def failure_text(self) -> str:
        """A chain passes the failed argument's error on, not its own wrapper."""
        return self._cause or super().failure_text()

    def run(self, worker: Any = None) -> None:
        """Dispatches the program here once its inputs landed (a thread that
        waits for a result helps each input first, as for any call; that wait
        is no landing: exit does not wait for a load). The pending programs
        of a chain are helped in turn, the first first, not nested."""
        for run in self._chain():
            run._run_one(worker if run is self else None)

    def _chain(self) -> list[ProgramRun]:
        """This program and the pending programs it reads, each after those
        it reads (a walk with a stack of its own: chains of any length)."""
        order: list[ProgramRun] = []
        seen: set[ProgramRun] = set()
        stack: list[tuple[ProgramRun, bool]] = [(self, False)]
        while stack:
            run, expanded = stack.pop()
            if expanded:
                order.append(run)
            elif run not in seen:
                seen.add(run)
                stack.append((run, True))
                stack.extend(
                    (t, False)
                    for t in run._inputs
                    if isinstance(t, ProgramRun) and not t.future.done()
                )
        return order

    def _run_one(self, worker: Any) -> None:
        in_pool = getattr(worker_state, "in_pool", False)
        for task in self._inputs:
            # Not a call with a timeout (but in a pool thread), as Task.wait:
            # its timeout must hold for this waiter. A program: helped first.
            if isinstance(task, ProgramRun):
                continue
            if not task.future.done() and (task.timeout is None or in_pool):
                task.run()  # runs a call that has not started; no-op otherwise
                error = task.future.exception() if task.future.done() else None
                if isinstance(error, KeyboardInterrupt):
                    raise error  # Ctrl-C reached the call this thread ran
        for task in self._inputs:  # in slices: Ctrl-C reaches the wait
            wait_polling(task.future, None)  # landed, failed or cancelled
        with self._inputs_lock:
            landed = self._waiting == 0
        if landed and self._cause is None:
            self._dispatch_landed(worker)

    @landing  # exit waits for a dispatch in flight, and starts none
    def _dispatch_landed(self, worker: Any) -> None:
        super().run(worker)  # no-op if the pool dispatched it already

    def _accept(self, out: Any) -> None:
        """The program's outputs are placed already: published at once."""
        self._publish_placed(list(out))
        return None
