"""Async dispatch: a jitted call with pending ``AsyncArray`` s returns at once.

One mechanism on every platform, deferred dispatch: a program waiting in the
device's queue for data would hold the queue (a TPU runs its programs in order),
so nothing of ours ever waits there. :class:`Dispatch` runs a program handed
``AsyncArray`` s (:mod:`.async_array`, their owner, hands each as a
:class:`Pending`) and hands back the call whose arrays its array outputs become,
whatever the timing. A jitted call whose arguments include pending ones:

- returns at once (once compiled); its results are ``AsyncArray`` s of the
  program's output shapes, dtypes and shardings, whose call is a
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
  runtime promises for the programs it has enqueued (how: :class:`Readers`).

Not deferred (run at once: they wait for their data at dispatch, in Python, and
their outputs are the arrays of a landed call, :class:`Results`): programs with
ordered effects (JAX dispatches a thread's program with an ordered effect only
once its previous one has run, and before jax 0.12 fails every later one after
one failed), on ``jax.Ref`` s, or with outputs of extended dtypes (PRNG keys);
dispatches from the async pool's own threads (a call that needs another's value
runs it, :meth:`.task.Task.wait`); every program of a multi-process run (all
processes must dispatch in one order).

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
from typing import Any, NamedTuple

import jax
import numpy as np

from .._jax import program_runs as _program_runs
from .._jax.placement import alias_or_copy
from .._support import fork as _fork
from .._support.environment import ENV_ASYNC_DISPATCH, async_dispatch_mode
from . import outcomes as _outcomes
from .async_pool import landing, worker_state
from .leaves import LeafSpec, is_extended, output_specs
from .results import Results, treedef_of
from .task import Task

logger = logging.getLogger("jax_threadmap._async")


class Pending(NamedTuple):
    """An ``AsyncArray`` handed to a dispatch by :mod:`.async_array` (its
    owner): its call, the leaf of the call's result it is, and the array."""

    task: Task
    leaf: int
    array: Any


#: The ``api`` of a deferred program run, in messages and ``repr``.
API = "deferred dispatch"


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


class Held:
    """A copy of a ready ``jax.Array`` (``original``; ``None`` for a copy of a
    call's array) that the pending deferred programs reading it share."""

    __slots__ = ("original", "copy")

    def __init__(self, original: Any, copy: Any):
        self.original, self.copy = original, copy


class _ThisThread(threading.local):
    #: The program run this thread dispatches (see :meth:`Readers.settle`).
    run: ProgramRun | None = None
    #: The programs this thread is failing (:func:`_fail_along`), or ``None``.
    failing: collections.deque[tuple[ProgramRun, Task]] | None = None


#: What this thread is doing (nothing shared, so nothing to reset at fork).
_this_thread = _ThisThread()


class Readers:
    """What the pending deferred programs read, and the order they were called in.

    A program reads its arguments as they were at its call, whatever later
    calls do to them (JAX's runtime promises that for the programs it has
    enqueued; a deferred one is not enqueued yet):

    - a ready ``jax.Array`` is kept at the call (:meth:`freeze`,
      :func:`alias_or_copy`: an alias on the CPU, else a copy dispatched and
      not waited for), once for all the pending programs that read it: jit's
      C++ fast path donates without passing any hook, so no later point could
      copy at the conflict;
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
                    h = Held(a, alias_or_copy(a))
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
        me = _this_thread.run
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
    readers: Readers,
) -> ProgramRun:
    """The :class:`ProgramRun`, submitted, that runs ``dispatch`` with the
    program's arguments once its pending ones land (its results are its arrays).

    ``reads``: each ``AsyncArray`` argument's :class:`Pending`, else ``None``.
    Each call read is an input, even one that ended: one that failed before the
    call fails the program as a later failure would."""
    frozen, held = readers.freeze(args, reads)
    reads = [r if r is not None else h for r, h in zip(reads, held, strict=True)]
    inputs = [r.task for r in reads if _is_call(r)]
    run = ProgramRun(
        dispatch,
        readers,
        frozen,
        reads,
        inputs,
        f"`{program.name}`",
        output_specs(program.out_handler),
    )
    sources = [r.task if _is_call(r) else r for r in reads if r is not None]
    readers.add(run, list(dict.fromkeys(sources)))
    run.submit()
    return run


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
def _fail_along(run: ProgramRun, task: Task) -> None:
    """``run._fail_for(task)``; a failure along a chain fails the next program
    from the done-callback of the last, so those are queued here rather than
    nested: a chain of any length fails (nesting overflowed the stack at a
    few hundred programs, and the rest never ended)."""
    queue = _this_thread.failing
    if queue is not None:
        queue.append((run, task))
        return
    _this_thread.failing = queue = collections.deque([(run, task)])
    try:
        while queue:
            failed, cause = queue.popleft()
            try:
                failed._fail_for(cause)
            except Exception:  # one program's failure must not stop the rest
                logger.exception("jax_threadmap: could not fail %s", failed)
    finally:
        _this_thread.failing = None


def _input_done(ref: weakref.ref[ProgramRun], task: Task, future: Any) -> None:
    run = ref()
    if run is not None:
        run._input_done(task, future)


def _let_go_of_inputs(ref: weakref.ref[ProgramRun]) -> None:
    """A finished program reads nothing more: a chain does not keep what it read
    (the earlier programs' outputs, the copies of ready arrays)."""
    run = ref()
    if run is not None:
        with run._inputs_lock:
            run._inputs, run._reads, run._program_args = (), [], []


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
        inputs: The calls of the ``AsyncArray`` arguments.
        name: The program's name, for messages (``\\`jit(f)\\```).
        specs: The program's output leaves.
    """

    __slots__ = tuple(
        "_inputs _inputs_lock _waiting _cause root _landed _dispatch _readers "
        "_program_args _reads".split()
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
            coroutine=False,
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
        outer, _this_thread.run = _this_thread.run, self
        try:
            for h in held:  # it may donate them: the earlier readers first
                self._readers.settle(h)
            return self._dispatch(tuple(args))
        finally:
            _this_thread.run = outer
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
        # Through a weak reference: an input that lives on (weights) must not
        # keep the program and its outputs (a pending one is in the live set).
        me = weakref.ref(self)
        self.future.add_done_callback(lambda _: _let_go_of_inputs(me))
        for task in self._inputs:
            task.future.add_done_callback(functools.partial(_input_done, me, task))

    def _input_done(self, task: Task, future: Any) -> None:
        failed = future.exception() is not None
        if self._input_ended(task, failed):
            if failed:  # the first to fail; a later failure changes nothing
                _fail_along(self, task)
            else:
                super()._start()  # on the pool, unless a waiter dispatches first

    def _input_ended(self, task: Task, failed: bool) -> bool:
        """The one move of the inputs' count and cause, together under the
        lock: a waiter (:meth:`_run_one`) that sees no input waiting sees the
        failure too, though the program is failed later (queued along a chain,
        :func:`_fail_along`). Returns whether ``task`` is the first input to
        fail, or the last to land with none failed."""
        with self._inputs_lock:
            self._waiting -= 1
            if failed:
                if self._cause is not None:
                    return False
                self._cause = task.failure_text()
                # The root of an input program's failure, whatever the chain.
                root = task.root if isinstance(task, ProgramRun) else None
                self.root = root or task
                return True
            self._landed = self._waiting == 0 and self._cause is None
            return self._landed

    @property
    def returned(self) -> bool:
        """Whether its data landed: its dispatch, queued or running, takes
        moments, and exit waits for it (a program runs to its end, as JAX's)."""
        return self._landed or super().returned

    def _fail_for(self, task: Task) -> None:
        """Gives up on the program: the call of one of its arguments, ``task``,
        failed first (its cause and root are set, :meth:`_input_ended`)."""
        text, root = self._cause, self.root
        assert text is not None and root is not None
        cause = task.future.exception()
        error = _outcomes.dependents_failed(root, text, cause, self.future.done())
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
            if not task.future.done():  # landed, failed or cancelled
                _outcomes.wait_polling(task.future, None)
        with self._inputs_lock:  # the count and the cause move together
            landed = self._waiting == 0 and self._cause is None
        if landed and not self.started:  # (a pool thread woken for it, late)
            self._dispatch_landed(worker)

    @landing  # exit waits for a dispatch in flight, and starts none
    def _dispatch_landed(self, worker: Any) -> None:
        super().run(worker)  # no-op if the pool dispatched it already

    def _accept(self, out: Any) -> None:
        """The program's outputs are placed already: published at once."""
        self._publish_placed(list(out))
        return None


class Dispatch:
    """Async dispatch: what a program run with ``AsyncArray`` arguments does.

    It reads the switch, installs the array owner's hook on program runs when
    the first ``AsyncArray`` is made, and defers a run on pending data or runs
    it blocking (:meth:`run`); either way it hands back the call whose arrays
    the run's array outputs become.
    """

    def __init__(self) -> None:
        self.readers = Readers()
        self._installing = threading.Lock()
        self.prepared = False  # whether prepare() ran (read without the lock)

    def status(self) -> str | None:
        """Why dispatch on pending data is blocking, or ``None``. (The switch
        is parsed once per change of its value, :func:`async_dispatch_mode`.)"""
        if async_dispatch_mode() == "off":
            return f"disabled by {ENV_ASYNC_DISPATCH}=0"
        reason = _program_runs.runs_unavailable()
        if reason is None:
            return None
        return f"unavailable in jax {jax.__version__}: {reason}"

    def prepare(self, around: Callable[..., Any]) -> None:
        """Installs ``around`` as the hook on program runs (once; at the first
        async call): :mod:`.async_array`'s, which sends the runs with
        ``AsyncArray`` arguments to :meth:`run`.

        No ``AsyncArray`` exists before that, so no dispatch on pending data can
        happen earlier, and a process that never makes one runs JAX untouched.
        """
        if self.prepared:
            return
        with self._installing:
            if not self.prepared:
                _program_runs.RUNS.install(around)
                self.prepared = True

    def run(
        self,
        run: Any,
        program: Any,
        args: tuple,
        reads: list[Pending | None],
        effects: Any,
    ) -> tuple[Task | None, list[Any]]:
        """Runs ``program`` on ``args`` (``reads``: each ``AsyncArray``'s
        :class:`Pending`, else ``None``): deferred until its data lands, or now
        (blocking). Returns the call whose arrays the run's array outputs
        become (``None``: it has none), and the outputs, with ``None`` where
        those arrays go, in order (the rest, tokens, as they are)."""
        if not effects and self._defers(program, reads):
            deferred = defer(
                lambda frozen: run(program, *frozen), program, args, reads, self.readers
            )
            return deferred, [None] * len(deferred.specs)
        outs = list(run(program, *args))
        at = [k for k, o in enumerate(outs) if isinstance(o, jax.Array)]
        if not at:
            return None, outs
        landed = Results([outs[k] for k in at])
        for k in at:
            outs[k] = None
        return landed, outs

    def _defers(self, program: Any, reads: list[Pending | None]) -> bool:
        if all(r is None or r.task.future.done() for r in reads):
            return False
        if self.status() is not None:
            return False
        if processes() > 1:
            # Every process must dispatch its programs in the same order (their
            # collectives meet): deferring one would reorder them.
            return False
        if not program._local_devices:
            return False
        return deferrable(program)

    # -- at dispatch, in the thread that runs the program --

    def arrays_for(self, xs: list[Pending]) -> list[jax.Array]:
        """One jax.Array per x, its value: waits for it (a run that reaches the
        argument handlers was not deferred, or its data has landed). A run that
        donates it (``donate_argnums``) deletes it: the call's value is that
        ``jax.Array``, so later uses fail as for a donated ``jax.Array``."""
        values = []
        for x in xs:
            values.append(x.array.result())
            # The deferred programs called before this one that read it no
            # longer need it (a later donation).
            self.settle(x.task)
        return values

    def settle(self, task: Task) -> None:
        """Before ``task``'s values are handed on (to a program that may donate
        them, or to ``delete()``): the pending deferred programs that read them
        no longer need them (:meth:`Readers.settle`)."""
        if self.readers.by_source:
            self.readers.settle(task)


mechanism = Dispatch()


@_fork.in_child
def _after_fork_in_child() -> None:
    # The parent's pending programs never run here; a lock held at fork stays held.
    mechanism.readers, mechanism._installing = Readers(), threading.Lock()
