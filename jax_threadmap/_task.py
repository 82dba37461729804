"""One background call and its shared outcome: what backs an ``AsyncArray``.

``async_call(fn, result_shape_dtypes, *args)`` (in :mod:`._async`) makes one
:class:`Task`: ``fn`` runs exactly once on a small shared pool, and its outcome
(the placed ``jax.Array`` leaves, or the exception) is shared by every array of
its result. This module also holds the checks of a call's result against its
declaration (:func:`leaf_specs`, :func:`check_result`) and its placement on
device (:func:`place`).

Thread bounds: the pool has :func:`default_async_threads` daemon workers at most,
however many calls are pending. A thread that needs a value whose call has not
started yet runs that call itself instead of waiting on work queued behind it,
so a call that waits on another call's arrays cannot deadlock a full pool.

The dispatch mechanism (:mod:`._dispatch`) keeps per-call state on the task
(its gates) and is told when a call ends through :func:`set_gate_release`, so
that this module does not depend on how dispatch works.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _compat, _executor, _validate
from ._executor import available_cpus
from ._validate import env_positive_int, shape_dtype_of

logger = logging.getLogger("jax_threadmap._async")

logger = logging.getLogger(__name__)

ENV_ASYNC_THREADS = "JAX_THREADMAP_ASYNC_THREADS"


def default_async_threads() -> int:
    """The number of worker threads of the pool that runs ``async_call``.

    ``JAX_THREADMAP_ASYNC_THREADS`` when set, else ``min(32, cpus + 4)``: the
    calls are mostly I/O (network, disk) or native code that releases the GIL,
    so a few more threads than cores pay off, as in CPython's
    ``ThreadPoolExecutor`` default; the cap keeps hundreds of pending arrays
    from becoming hundreds of threads. The pool is separate from the one that
    runs ``threadmap`` kernels, so a kernel that waits on an ``AsyncArray``
    never waits on work queued behind itself.
    """
    n = env_positive_int(
        ENV_ASYNC_THREADS, "the number of threads that run jax_threadmap.async_call"
    )
    return min(32, available_cpus() + 4) if n is None else n


worker_state = threading.local()


def submit_background(fn: Callable[[], None]) -> None:
    """Runs ``fn`` in the background, on the async pool of the shared threads.

    Its own bound (``default_async_threads``), separate from threadmap's pools,
    so that a kernel that waits on an ``AsyncArray`` never waits on work queued
    behind itself. The threads are daemons, never joined at exit: calls still
    running then are reported by :func:`_at_exit`.
    """

    def run() -> None:
        # Named for what it runs now, as tracebacks and profilers show it.
        thread = threading.current_thread()
        name, thread.name = thread.name, f"jax_threadmap-async ({thread.name})"
        worker_state.in_pool = True
        try:
            fn()
        except BaseException:  # Task.run routes errors; this is a last resort
            logger.exception("jax_threadmap: an async call escaped its task")
        finally:
            worker_state.in_pool = False
            thread.name = name

    pool = _executor.get_pool(default_async_threads(), purpose="async_call")
    _executor.run_in_background(pool, run)


# --- what the dispatch mechanism is told ----------------------------------------------

#: A function ``(task, gates)`` that releases the gate programs of a task when its
#: call ends (with ``task.host`` or ``task.error_text`` set); set by the dispatch
#: mechanism (:mod:`._dispatch`), so that tasks need not import it.
GateRelease = Callable[["Task", dict], None]


def _no_gates(task: Task, gates: dict) -> None:
    del task, gates


_gate_release_fn: GateRelease = _no_gates


def set_gate_release(fn: GateRelease) -> None:
    """Installs the mechanism's handler for the gates of a finished call."""
    global _gate_release_fn
    _gate_release_fn = fn


def _gate_release(task: Task, gates: dict) -> None:
    _gate_release_fn(task, gates)


def _after_fork_in_child() -> None:
    # The async pool is reset with the other shared pools (_executor). Calls that
    # had not started yet run in the thread that first needs them (Task.wait).
    # The lock of the set of live calls may have been held by a thread that does
    # not exist in the child: a fresh one.
    global live_lock
    live_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- one call, shared by the arrays of its result -------------------------------------

PENDING, RUNNING, FINISHING, FINISHED = (
    "pending",
    "running",
    "finishing",
    "finished",
)

# How long a finished call waits for its gate programs to copy its data before it
# copies the data again for result() (see Task._finish).
_PLACE_AFTER_GATES_S = 2.0

# Calls submitted or running and not finished, for the report at exit.
live_lock = threading.Lock()
live: set[Task] = set()


class LeafSpec:
    """What one leaf must be: the declared dtype, the aval jit sees, the target."""

    __slots__ = ("path", "shape", "dtype", "aval", "sharding")

    def __init__(
        self, path: str, shape: tuple[int, ...], dtype: Any, aval: Any, sharding: Any
    ):
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.aval = aval
        self.sharding = sharding


class Task:
    """One call of ``fn`` (or one wrapped Future) and its shared outcome.

    Async dispatch (see :class:`_Dispatch`) adds the gates: one pulled 4-byte
    array per device on which a program was dispatched with this call's arrays
    while it ran. Under ``_lock``, gates are only added while the state is
    pending or running, and ``_settle`` offers exactly those that exist when it
    moves the state on, so every gate is offered once and none is missed.
    """

    __slots__ = (
        "_lock",
        "_state",
        "_submitted",
        "_pid",
        "_fn",
        "_args",
        "_kwargs",
        "name",
        "api",
        "treedef",
        "specs",
        "future",
        "runnable",
        "_traceback",
        "_notes",
        "_chain",
        "slot",
        "gates",
        "host",
        "error_text",
        "programs",
        "gates_ran",
        "solo",
        "offered",
        "__weakref__",
    )

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        args: Any,
        kwargs: Any,
        *,
        name: str,
        api: str,
        treedef: Any,
        specs: list[LeafSpec],
    ):
        self._lock = threading.Lock()
        self._state = PENDING
        self._submitted = False
        self._pid = os.getpid()
        self._fn = fn
        self._args = args
        self._kwargs = kwargs
        self.name = name
        self.api = api
        self.treedef = treedef
        self.specs: list[LeafSpec] = specs
        # Holds the list of placed leaves, or the exception of the call.
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        # False for a wrapped Future: there is nothing to run, only to wait for.
        self.runnable = fn is not None
        self._traceback: Any = None
        self._notes: list[str] | None = None
        self._chain: tuple[Any, Any, bool] = (None, None, False)
        # Async dispatch: the value the gates carry, the gates by device
        # ({device: (pull id, gate array)}), the checked leaves as NumPy arrays
        # for the gate programs, the error text they raise, and how many gate
        # programs that read this call are still to run.
        self.slot = 0
        self.gates: dict[Any, tuple[int, jax.Array]] = {}
        self.host: list[np.ndarray] | None = None
        self.error_text: str | None = None
        self.programs = 0
        self.gates_ran = threading.Event()
        # Whether every gate program that reads this call reads only this call.
        self.solo = True
        # Whether the gates were offered with the result (then never again).
        self.offered = False

    @property
    def state(self) -> str:
        return self._state

    def submit(self) -> None:
        """Queues the call on the shared pool (once)."""
        with self._lock:
            if not self.runnable or self._submitted or self._state != PENDING:
                return
            self._submitted = True
        with live_lock:
            live.add(self)
        submit_background(self.run)

    def _claim(self) -> bool:
        with self._lock:
            if self._state != PENDING:
                return False
            self._state = RUNNING
            self._pid = os.getpid()
        with live_lock:
            live.add(self)
        return True

    def run(self) -> None:
        """Runs the call, unless it has already started elsewhere."""
        if not self.runnable or not self._claim():
            return
        fn, args, kwargs = self._fn, self._args, self._kwargs
        # The arguments may be large (raw bytes, file handles): do not keep them.
        self._fn = self._args = self._kwargs = None
        assert fn is not None  # runnable
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:  # routed to every use, like a Future does
            self._fail(e, raised_by_fn=True)
            return
        self._finish(out)

    def on_source_done(self, source: concurrent.futures.Future) -> None:
        """Done-callback of a wrapped Future: checks and places its value."""
        if not self._claim():
            return
        try:
            out = source.result()
        except BaseException as e:
            self._fail(e, raised_by_fn=True)
            return
        self._finish(out)

    def _settle(self) -> dict[Any, tuple[int, jax.Array]]:
        """Ends the time in which gates can be added; returns the gates."""
        with self._lock:
            self._state = FINISHING
            return dict(self.gates)

    def _finish(self, out: Any) -> None:
        try:
            flat = check_result(self, out)
            gates = self._settle()
            if gates:
                # The gate programs copy from these, once their gate arrives.
                self.host = [
                    np.asarray(leaf, dtype=spec.aval.dtype, order="C")
                    for spec, leaf in zip(self.specs, flat, strict=True)
                ]
                _gate_release(self, gates)
                self.offered = True
                # Copying the same data twice at once (the gate programs for the
                # dependents, device_put for result()) slows the dependents by up
                # to 2x: let the gate programs go first when they can run now,
                # i.e. when they read no other call. Bounded, because XLA runs
                # them after programs that the same thread dispatched earlier,
                # which may wait for other calls.
                if self.solo:
                    self.gates_ran.wait(_PLACE_AFTER_GATES_S)
            leaves = place(self, flat)
        except BaseException as e:
            self._fail(e, raised_by_fn=False)
            return
        with self._lock:
            self._state = FINISHED
        with live_lock:
            live.discard(self)
        self.future.set_result(leaves)

    def _fail(self, error: BaseException, *, raised_by_fn: bool) -> None:
        if raised_by_fn and hasattr(error, "add_note"):  # Python >= 3.11
            verb = "ran" if self.runnable else "waited for"
            error.add_note(
                f"This error was raised by {self.name}, which "
                f"jax_threadmap.{self.api} {verb} to compute {len(self.specs)} "
                "array(s); every use of any of those arrays raises it."
            )
        self._traceback = error.__traceback__
        self._chain = (error.__cause__, error.__context__, error.__suppress_context__)
        if hasattr(error, "__notes__"):
            self._notes = list(error.__notes__)
        logger.debug("%s of %s failed: %r", self.api, self.name, error)
        gates = self._settle()
        if gates and not self.offered:  # _finish did not get as far
            self.error_text = (
                f"{self.name}, which jax_threadmap.{self.api} "
                f"{'ran' if self.runnable else 'waited for'}, failed with "
                f"{type(error).__name__}: {error}"
            )
            logger.warning(
                "%s; the jitted programs dispatched with its arrays raise this "
                "when their results are used.",
                self.error_text,
            )
            try:
                _gate_release(self, gates)
            except Exception:  # the call's own uses must still get the error
                logger.exception("jax_threadmap: could not release the gates")
        with self._lock:
            self._state = FINISHED
        with live_lock:
            live.discard(self)
        self.future.set_exception(error)

    def abandon(self) -> None:
        """At exit: fails the gates of a call that is still running."""
        with self._lock:
            if self._state in (FINISHING, FINISHED):
                return
            self._state = FINISHING
            gates = dict(self.gates)
        if gates:
            self.error_text = (
                f"{self.name}, which jax_threadmap.{self.api} "
                f"{'ran' if self.runnable else 'waited for'}, had not returned "
                "when the interpreter exited"
            )
            _gate_release(self, gates)

    def wait(self, timeout: float | None, what: str) -> list[jax.Array]:
        """Returns the placed leaves; raises the call's error or TimeoutError."""
        if not self.future.done():
            if timeout is None:
                # Run it here rather than wait on work queued behind busy (or
                # not yet started, or deferred) workers. No-op once started.
                self.run()
            else:
                self.submit()
            if self._state != PENDING and self._pid != os.getpid():
                raise RuntimeError(
                    f"{what} was being computed by a thread of the parent process "
                    "when this process was forked, so its value will never arrive "
                    "here. Create the arrays after the fork, or wait for them "
                    "(block_until_ready) before forking."
                )
            done, _ = concurrent.futures.wait([self.future], timeout=timeout)
            if not done:
                raise TimeoutError(
                    f"{what} was not ready within timeout={timeout} s. The call "
                    "keeps running and the array stays usable: call result() "
                    "again, with a longer timeout or none."
                )
        error = self.future.exception()
        if error is not None:
            # Every use raises the same exception object, as Future.result()
            # does: restore the worker's traceback and the notes each time, so
            # that repeated uses (and JAX's traceback-filtering note, added at
            # each API boundary it crosses) do not pile up. On Python 3.10 that
            # filter chains a marker into __cause__ instead: restore the chain too.
            if self._notes is not None:
                error.__notes__ = list(self._notes)  # type: ignore[attr-defined]
            error.__cause__, error.__context__, error.__suppress_context__ = self._chain
            raise error.with_traceback(self._traceback)
        return self.future.result()


# --- checks ---------------------------------------------------------------------------


def _path_str(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def leaf_specs(
    result_shape_dtypes: Any, device: Any, api: str
) -> tuple[Any, list[LeafSpec]]:
    """Validates ``result_shape_dtypes`` and ``device`` up front, at the call."""
    _compat.require(_compat.ASYNC_ARRAYS, f"jax_threadmap.{api}")
    target = _target_sharding(device, api)
    flat, treedef = jax.tree_util.tree_flatten_with_path(result_shape_dtypes)
    if not flat:
        raise ValueError(
            f"jax_threadmap.{api}: result_shape_dtypes has no array leaves (got "
            f"{result_shape_dtypes!r}). Pass the shapes and dtypes that the call "
            "returns, e.g. jax.ShapeDtypeStruct((3,), jnp.float32); for a call "
            "without array results use a concurrent.futures executor instead."
        )
    specs = []
    for path, leaf in flat:
        where = _path_str(path)
        shape, dtype = shape_dtype_of(
            leaf, f"result_shape_dtypes{where}", f"jax_threadmap.{api}"
        )
        sharding = target
        leaf_sharding = getattr(leaf, "sharding", None)
        if sharding is None and isinstance(leaf_sharding, jax.sharding.Sharding):
            sharding = leaf_sharding
        try:
            if sharding is not None:
                sharding.shard_shape(shape)
            aval = _compat.typeof(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(
                f"jax_threadmap.{api}: the target sharding {sharding} cannot hold "
                f"the array of shape {shape} declared at {where} of "
                f"result_shape_dtypes ({e}). Pass a device= or sharding that fits "
                "every leaf (e.g. a replicated one), or give each leaf its own "
                "sharding with jax.ShapeDtypeStruct(shape, dtype, sharding=...)."
            ) from e
        specs.append(LeafSpec(where, shape, dtype, aval, sharding))
    return treedef, specs


def _target_sharding(device: Any, api: str) -> jax.sharding.Sharding | None:
    if device is None or isinstance(device, jax.sharding.Sharding):
        return device
    if isinstance(device, jax.Device):
        return jax.sharding.SingleDeviceSharding(device)
    raise TypeError(
        f"jax_threadmap.{api}: device must be None, a jax.Device or a "
        f"jax.sharding.Sharding. Got device={device!r} of type "
        f"{type(device).__name__}. Pass e.g. device=jax.devices()[0]."
    )


def check_result(task: Task, out: Any) -> list[Any]:
    """Checks the call's result against its declaration; returns its leaves."""
    flat, treedef = jax.tree_util.tree_flatten(out)
    if treedef != task.treedef:
        raise ValueError(
            f"{task.name}, run by jax_threadmap.{task.api}, returned a value of "
            f"structure {treedef}, but result_shape_dtypes declares the "
            f"structure {task.treedef}. Make the function return that structure, "
            "or fix result_shape_dtypes."
        )
    problems = []
    for spec, leaf in zip(task.specs, flat, strict=True):
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            problems.append(
                f"at {spec.path}: a {type(leaf).__name__} without shape and dtype "
                f"(expected an array of shape {spec.shape} and dtype {spec.dtype})"
            )
            continue
        # Compare canonical dtypes: with x64 off, float64 and float32 both land
        # on device as float32, as they would in jnp.asarray.
        canonical = jax.dtypes.canonicalize_dtype
        if tuple(shape) != spec.shape or canonical(dtype) != canonical(spec.dtype):
            problems.append(
                f"at {spec.path}: shape {tuple(shape)} and dtype {np.dtype(dtype)} "
                f"(expected shape {spec.shape} and dtype {spec.dtype})"
            )
        elif np.dtype(dtype) != spec.aval.dtype:  # a cast on device_put (x64 off)
            try:
                _validate.check_result_cast(np.asarray(leaf), spec.aval.dtype)
            except _validate.ResultCastError as e:
                problems.append(
                    f"at {spec.path}: {e.got}, declared {spec.dtype} ({spec.aval.dtype}"
                    f" on device); {e.reason}"
                )
    if problems:
        raise ValueError(
            f"{task.name}, run by jax_threadmap.{task.api}, returned arrays that "
            "do not match result_shape_dtypes: "
            + "; ".join(problems)
            + ". Make the function return the declared shapes and dtypes, or fix "
            "result_shape_dtypes."
        )
    return flat


def place(task: Task, flat: list[Any]) -> list[jax.Array]:
    """Puts the checked leaves on their devices and waits until they are there."""
    placed = []
    for spec, leaf in zip(task.specs, flat, strict=True):
        if spec.sharding is not None:
            placed.append(jax.device_put(leaf, spec.sharding))
        elif isinstance(leaf, jax.Array):
            placed.append(leaf)
        else:
            placed.append(jax.device_put(leaf))
    # The copies to device run while we wait here, in a pool thread: done()
    # then means the data is on its device.
    return jax.block_until_ready(placed)
