"""Arrays whose values a background call is still computing.

``async_call(fn, result_shape_dtypes, *args)`` starts ``fn(*args)`` on a small
shared pool and returns at once a pytree of :class:`AsyncArray`. An
``AsyncArray`` knows its shape and dtype, so ``jax.jit`` traces and compiles with
it while ``fn`` still runs. When the compiled program is called, the
argument-sharding hook in :mod:`._compat` asks :class:`_Dispatch` for its
buffers: pending ones come from a gate program that runs once ``fn`` has
returned (async dispatch), or, where that is not possible, the hook waits.

One :class:`_Task` backs all the arrays of one call: ``fn`` runs exactly once, and
its outcome (the placed ``jax.Array`` leaves, or the exception) is shared.

Thread bounds: the pool has :func:`default_async_threads` daemon workers at most,
however many calls are pending. A thread that needs a value whose call has not
started yet runs that call itself instead of waiting on work queued behind it,
so a call that waits on another call's arrays cannot deadlock a full pool. At
exit, calls still running are reported and abandoned (:func:`_at_exit`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import itertools
import logging
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, overload

import jax
import numpy as np

from . import _compat, _executor, _validate
from ._executor import available_cpus
from ._validate import callable_name, env_positive_int, shape_dtype_of

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


_worker_state = threading.local()


def _submit(fn: Callable[[], None]) -> None:
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
        _worker_state.in_pool = True
        try:
            fn()
        except BaseException:  # _Task.run routes errors; this is a last resort
            logger.exception("jax_threadmap: an async call escaped its task")
        finally:
            _worker_state.in_pool = False
            thread.name = name

    pool = _executor.get_pool(default_async_threads(), purpose="async_call")
    _executor.run_in_background(pool, run)


def _after_fork_in_child() -> None:
    # The async pool is reset with the other shared pools (_executor). Calls that
    # had not started yet run in the thread that first needs them (_Task.wait);
    # the dispatch state (transfer server, programs) belongs to the parent.
    _dispatch.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- one call, shared by the arrays of its result -------------------------------------

_PENDING, _RUNNING, _FINISHING, _FINISHED = (
    "pending",
    "running",
    "finishing",
    "finished",
)

# How long a finished call waits for its gate programs to copy its data before it
# copies the data again for result() (see _Task._finish).
_PLACE_AFTER_GATES_S = 2.0

# Calls submitted or running and not finished, for the report at exit.
_live_lock = threading.Lock()
_live: set[_Task] = set()


class _LeafSpec:
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


class _Task:
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
        specs: list[_LeafSpec],
    ):
        self._lock = threading.Lock()
        self._state = _PENDING
        self._submitted = False
        self._pid = os.getpid()
        self._fn = fn
        self._args = args
        self._kwargs = kwargs
        self.name = name
        self.api = api
        self.treedef = treedef
        self.specs: list[_LeafSpec] = specs
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
            if not self.runnable or self._submitted or self._state != _PENDING:
                return
            self._submitted = True
        with _live_lock:
            _live.add(self)
        _submit(self.run)

    def _claim(self) -> bool:
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _RUNNING
            self._pid = os.getpid()
        with _live_lock:
            _live.add(self)
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
            self._state = _FINISHING
            return dict(self.gates)

    def _finish(self, out: Any) -> None:
        try:
            flat = _check(self, out)
            gates = self._settle()
            if gates:
                # The gate programs copy from these, once their gate arrives.
                self.host = [
                    np.asarray(leaf, dtype=spec.aval.dtype, order="C")
                    for spec, leaf in zip(self.specs, flat, strict=True)
                ]
                _dispatch.offer(self, gates)
                self.offered = True
                # Copying the same data twice at once (the gate programs for the
                # dependents, device_put for result()) slows the dependents by up
                # to 2x: let the gate programs go first when they can run now,
                # i.e. when they read no other call. Bounded, because XLA runs
                # them after programs that the same thread dispatched earlier,
                # which may wait for other calls.
                if self.solo:
                    self.gates_ran.wait(_PLACE_AFTER_GATES_S)
            leaves = _place(self, flat)
        except BaseException as e:
            self._fail(e, raised_by_fn=False)
            return
        with self._lock:
            self._state = _FINISHED
        with _live_lock:
            _live.discard(self)
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
                _dispatch.offer(self, gates)
            except Exception:  # the call's own uses must still get the error
                logger.exception("jax_threadmap: could not release the gates")
        with self._lock:
            self._state = _FINISHED
        with _live_lock:
            _live.discard(self)
        self.future.set_exception(error)

    def abandon(self) -> None:
        """At exit: fails the gates of a call that is still running."""
        with self._lock:
            if self._state in (_FINISHING, _FINISHED):
                return
            self._state = _FINISHING
            gates = dict(self.gates)
        if gates:
            self.error_text = (
                f"{self.name}, which jax_threadmap.{self.api} "
                f"{'ran' if self.runnable else 'waited for'}, had not returned "
                "when the interpreter exited"
            )
            _dispatch.offer(self, gates)

    def wait(self, timeout: float | None, what: str) -> list[jax.Array]:
        """Returns the placed leaves; raises the call's error or TimeoutError."""
        if not self.future.done():
            if timeout is None:
                # Run it here rather than wait on work queued behind busy (or
                # not yet started, or deferred) workers. No-op once started.
                self.run()
            else:
                self.submit()
            if self._state != _PENDING and self._pid != os.getpid():
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


def _leaf_specs(
    result_shape_dtypes: Any, device: Any, api: str
) -> tuple[Any, list[_LeafSpec]]:
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
        specs.append(_LeafSpec(where, shape, dtype, aval, sharding))
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


def _check(task: _Task, out: Any) -> list[Any]:
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


def _place(task: _Task, flat: list[Any]) -> list[jax.Array]:
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


def _make(task: _Task) -> Any:
    arrays = [AsyncArray._new(task, i) for i in range(len(task.specs))]
    return jax.tree_util.tree_unflatten(task.treedef, arrays)


# --- async dispatch --------------------------------------------------------------
# A jitted call whose AsyncArray arguments are still pending returns at once: the
# argument handler hands JAX, for each one, a jax.Array made by a small "gate
# program" that has not run yet. Its input is a gate, a 4-byte array pulled from a
# loopback transfer server (jax.experimental.transfer) that the call offers when it
# ends; the program then runs and its host callback copies the call's result into
# the output buffers (the data never crosses the socket), or raises the call's
# error, which then reaches every dependent. XLA orders executions per dispatching
# thread and caps executions in flight per device (32 on CPU), so one program
# covers all the pending arrays of one call, and at most MAX_WAITING_PROGRAMS wait
# per device; beyond that, and where the mechanism is missing, dispatch waits for
# the data as before ("blocking dispatch").

ENV_ASYNC_DISPATCH = "JAX_THREADMAP_ASYNC_DISPATCH"

#: Gate programs that may wait on one device at once; more dispatches wait for
#: their data. XLA's CPU client runs at most 32 executions per device at a time
#: (waiting ones included); this leaves most of them to the programs that
#: depend on pending data and to the loaders themselves.
MAX_WAITING_PROGRAMS = 8

# Platforms on which the gate mechanism was measured (dispatch latency, values,
# failures, exit): others fall back to blocking dispatch.
_DISPATCH_PLATFORMS = frozenset({"cpu"})


class AsyncCallFailed(RuntimeError):
    """Raised in a gate program for a call that failed or never returned.

    A jitted program dispatched with pending arrays receives this error's text
    (``JaxRuntimeError: ... AsyncCallFailed: <fn> ... failed with <Type>:
    <message>``) when its results are used.
    """


def async_dispatch_enabled() -> bool:
    """Whether ``JAX_THREADMAP_ASYNC_DISPATCH`` allows async dispatch (default on)."""
    value = os.environ.get(ENV_ASYNC_DISPATCH, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{ENV_ASYNC_DISPATCH}={value!r} is not understood. Set it to 1 (jitted "
        "calls with pending AsyncArrays return at once, the default) or 0 (they "
        "wait for the data, as in earlier releases)."
    )


def _index_key(index: tuple) -> tuple:
    # Slices are not hashable before Python 3.12; the program cache needs keys.
    return tuple(
        (i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index
    )


def _index_of(key: tuple) -> tuple:
    return tuple(slice(*k) if isinstance(k, tuple) else k for k in key)


def _keep_gate_errors_out_of_jax_log(record: logging.LogRecord) -> bool:
    # JAX logs each exception of a pure_callback; a failed call is reported once,
    # by _Task._fail, and its text is in every dependent's error.
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, AsyncCallFailed)


logging.getLogger(_compat.CALLBACK_LOGGER_NAME).addFilter(
    _keep_gate_errors_out_of_jax_log
)


class _Dispatch:
    """The gate mechanism: transfer servers, gate programs, their bookkeeping."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._servers: dict[Any, tuple[Any, Any]] = {}
        self._broken: str | None = None
        self._programs: dict[Any, Any] = {}
        self._waiting: dict[Any, int] = {}
        self._slots: dict[int, _Task] = {}
        self._slot_ids = itertools.count(1)
        self._failed_devices: set[Any] = set()

    def after_fork(self) -> None:
        # Servers, gates and programs in flight belong to the parent.
        self._reset()

    def status(self) -> str | None:
        """Why dispatch is blocking in this process, or ``None`` if it is async."""
        if not async_dispatch_enabled():
            return f"disabled by {ENV_ASYNC_DISPATCH}=0"
        reason = _compat.async_dispatch_unavailable() or self._broken
        if reason is not None:
            return f"unavailable in jax {jax.__version__}: {reason}"
        platform = jax.default_backend()
        if platform not in _DISPATCH_PLATFORMS:
            return (
                f"the default backend is {platform}; async dispatch is used on "
                f"{', '.join(sorted(_DISPATCH_PLATFORMS))} devices only"
            )
        return None

    # -- at dispatch, in the thread that calls the jitted function --

    def arrays_for(self, xs: list[AsyncArray], shardings: list[Any]) -> list[Any]:
        """One jax.Array per x: the value if there, else a pending one (or wait)."""
        out: list[Any] = [None] * len(xs)
        todo = []
        for i, x in enumerate(xs):
            if x._task.future.done():
                out[i] = x.result()
            else:
                todo.append(i)
        if todo and self._may_dispatch([shardings[i] for i in todo]):
            try:
                made = self._pending_arrays(
                    [xs[i] for i in todo], [shardings[i] for i in todo]
                )
            except Exception:
                # Whatever went wrong (a sharding we cannot split, a transfer
                # server that did not start) costs the wait, not the call.
                logger.warning(
                    "jax_threadmap: async dispatch failed; this call waits for "
                    "its data.",
                    exc_info=True,
                )
            else:
                for i, array in zip(todo, made, strict=True):
                    out[i] = array
        for i in todo:
            if out[i] is None:  # blocking dispatch, as before
                out[i] = xs[i].result()
        return out

    def _may_dispatch(self, shardings: list[Any]) -> bool:
        if getattr(_worker_state, "in_pool", False):
            # A call run by the pool that needs another call's value runs that
            # call itself (see _Task.wait) rather than queue behind busy workers.
            return False
        if self.status() is not None:
            return False
        devices = set()
        for sharding in shardings:
            devices |= set(sharding.addressable_devices)
        if any(d.platform not in _DISPATCH_PLATFORMS for d in devices):
            return False
        with self._lock:
            return all(self._waiting.get(d, 0) < MAX_WAITING_PROGRAMS for d in devices)

    def _pending_arrays(self, xs: list[AsyncArray], shardings: list[Any]) -> list:
        # plan[device][task] = [(position, leaf index, index key, shard shape,
        # dtype)]: what one gate program per device makes for this call.
        plan: dict[Any, dict[_Task, list[tuple]]] = {}
        layouts = []
        for k, (x, sharding) in enumerate(zip(xs, shardings, strict=True)):
            indices = sharding.addressable_devices_indices_map(x.shape)
            layouts.append(list(indices))
            shard_shape = sharding.shard_shape(x.shape)
            for device, index in indices.items():
                plan.setdefault(device, {}).setdefault(x._task, []).append(
                    (k, x._index, _index_key(index), shard_shape, x.dtype)
                )
        # (task, device) pairs whose program count was raised and whose program
        # is not dispatched yet: undone if anything fails on the way.
        owed: list[tuple[_Task, Any]] = []
        try:
            claimed = self._claim(plan, owed)
            shards: dict[tuple[int, Any], jax.Array] = {}
            for device, by_task in plan.items():
                tasks = [t for t in by_task if t in claimed]
                if tasks:
                    outs = self._run_gate_program(device, tasks, by_task, owed)
                    positions = [k for t in tasks for k, *_ in by_task[t]]
                    for k, array in zip(positions, outs, strict=True):
                        shards[k, device] = array
        except BaseException:
            for task, _ in owed:
                self._program_ran(task)
            raise
        for task in claimed:
            task.submit()  # a deferred call starts now; no-op for the others
        made: list[Any] = []
        for k, (x, sharding) in enumerate(zip(xs, shardings, strict=True)):
            if x._task not in claimed:
                made.append(None)  # finishing: wait for its placed value
                continue
            parts = [shards[k, device] for device in layouts[k]]
            made.append(
                jax.make_array_from_single_device_arrays(x.shape, sharding, parts)
            )
        return made

    def _claim(self, plan: dict, owed: list[tuple[_Task, Any]]) -> set[_Task]:
        """Adds gates and program counts to the tasks still running."""
        claimed: set[_Task] = set()
        refused: set[_Task] = set()
        for device, by_task in plan.items():
            for task in by_task:
                if task in refused:
                    continue
                with task._lock:
                    if task._state not in (_PENDING, _RUNNING):
                        refused.add(task)
                        continue
                    if device not in task.gates:
                        task.gates[device] = self._pull_gate(task, device)
                    task.programs += 1
                owed.append((task, device))
                claimed.add(task)
        # A call that finished between two devices waits for its value instead.
        for task, device in [(t, d) for t, d in owed if t in refused]:
            owed.remove((task, device))
            self._program_ran(task)
        return claimed - refused

    def _run_gate_program(
        self,
        device: Any,
        tasks: list[_Task],
        by_task: dict[_Task, list[tuple]],
        owed: list[tuple[_Task, Any]],
    ) -> list[jax.Array]:
        spec = tuple(
            tuple((leaf, index) for _, leaf, index, _, _ in by_task[t]) for t in tasks
        )
        avals = tuple(
            jax.ShapeDtypeStruct(shape, dtype)
            for t in tasks
            for _, _, _, shape, dtype in by_task[t]
        )
        program = self._program(device, spec, avals)
        gates = [t.gates[device][1] for t in tasks]
        if len(tasks) > 1:
            for t in tasks:
                t.solo = False
        with self._lock:
            self._waiting[device] = self._waiting.get(device, 0) + 1
        try:
            outs = program(*gates)
        except BaseException:
            with self._lock:
                self._waiting[device] -= 1
            raise
        # From here the program's callback settles the counts, whatever happens.
        for t in tasks:
            owed.remove((t, device))
        return outs

    def _pull_gate(self, task: _Task, device: Any) -> tuple[int, jax.Array]:
        _, conn = self._server(device.client)
        if not task.slot:
            with self._lock:
                task.slot = next(self._slot_ids)
                self._slots[task.slot] = task
        pull_id = secrets.randbits(62)
        gate_aval = jax.ShapeDtypeStruct(
            (), np.int32, sharding=jax.sharding.SingleDeviceSharding(device)
        )
        return pull_id, conn.pull(pull_id, [gate_aval])[0]

    def _server(self, client: Any) -> tuple[Any, Any]:
        with self._lock:
            if client not in self._servers:
                try:
                    start = _compat.start_transfer_server
                    if start is None:  # status() reports why; callers checked it
                        raise RuntimeError(_compat.async_dispatch_unavailable())
                    # Loopback only, on a port the OS picks; started on first use.
                    server = start(client, "127.0.0.1:0", ["127.0.0.1:0"])
                    conn = server.connect(server.address())
                except Exception as e:
                    self._broken = (
                        f"the loopback transfer server did not start "
                        f"({type(e).__name__}: {e})"
                    )
                    logger.warning(
                        "jax_threadmap: async dispatch is off: %s. Jitted calls "
                        "with pending AsyncArrays wait for their data.",
                        self._broken,
                    )
                    raise
                self._servers[client] = (server, conn)
            return self._servers[client]

    def _program(self, device: Any, spec: tuple, avals: tuple) -> Any:
        key = (device, spec, avals)
        with self._lock:
            program = self._programs.get(key)
            if program is None:
                if len(self._programs) >= 256:  # an LRU would be nicer; rare
                    self._programs.clear()
                callback = functools.partial(self._gate_callback, device, spec)

                def run(*gates: jax.Array) -> Any:
                    return jax.pure_callback(callback, list(avals), *gates)

                program = jax.jit(
                    run, out_shardings=jax.sharding.SingleDeviceSharding(device)
                )
                self._programs[key] = program
        return program

    # -- when the gates arrive, in an XLA thread --

    def _gate_callback(self, device: Any, spec: tuple, *slots: Any) -> list:
        tasks = [self._slots[int(slot)] for slot in slots]
        try:
            outs = []
            for task, leaves in zip(tasks, spec, strict=True):
                if task.error_text is not None:
                    self._failed_devices.add(device)
                    raise AsyncCallFailed(task.error_text)
                host = task.host
                assert host is not None  # set before the gates were offered
                for leaf, index in leaves:
                    outs.append(host[leaf][_index_of(index)])
            return outs
        finally:
            with self._lock:
                self._waiting[device] -= 1
            for task in tasks:
                self._program_ran(task)

    def _program_ran(self, task: _Task) -> None:
        with task._lock:
            task.programs -= 1
            done = task.programs == 0 and task._state in (_FINISHING, _FINISHED)
        if done:  # no gate program will read this call again
            task.host = None
            with self._lock:
                self._slots.pop(task.slot, None)
            task.gates_ran.set()

    # -- when the call ends --

    def offer(self, task: _Task, gates: dict[Any, tuple[int, jax.Array]]) -> None:
        """Lets the gate programs of ``task`` run (with its host or error_text)."""
        for device, (pull_id, _) in gates.items():
            server, _ = self._server(device.client)
            server.await_pull(pull_id, [jax.device_put(np.int32(task.slot), device)])

    def clean_up_at_exit(self, timeout: float = 3.0) -> None:
        """Lets failed gate programs finish; leaves JAX no failed exit token."""
        # JAX's exit handler (registered before ours, so run after it) waits, in
        # this thread, for this thread's last program with host callbacks on
        # each device, and prints its error if it failed. Let the failed gate
        # programs run (XLA threads, which need the GIL: sleep), then dispatch a
        # good program after them in this thread.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not any(self._waiting.values()):
                    break
            time.sleep(0.01)
        if not self._failed_devices:
            return
        noop = jax.jit(
            lambda g: jax.pure_callback(
                lambda v: v, jax.ShapeDtypeStruct((), np.int32), g
            )
        )
        for device in list(self._failed_devices):
            try:
                noop(jax.device_put(np.int32(0), device))
            except Exception:  # at exit: never let this hide the rest
                logger.debug("jax_threadmap: exit token reset failed", exc_info=True)


_dispatch = _Dispatch()


def async_dispatch_status() -> str:
    """Says whether jitted calls with pending ``AsyncArray`` s return at once.

    Returns:
        ``"async"``, or ``"blocking: <reason>"`` (the reason names the switch or
        the missing JAX feature).

    Example:
        >>> import jax_threadmap as jtm
        >>> jtm.async_dispatch_status()  # on CPU with jax 0.6.2 ... 0.12
        'async'
    """
    reason = _dispatch.status()
    return "async" if reason is None else f"blocking: {reason}"


def _at_exit() -> None:
    with _live_lock:
        unfinished = [t for t in _live if not t.future.done()]
    if unfinished:
        names = ", ".join(f"{t.name} ({t.api})" for t in unfinished[:5])
        if len(unfinished) > 5:
            names += f" and {len(unfinished) - 5} more"
        warnings.warn(
            f"jax_threadmap: the interpreter is exiting while {len(unfinished)} "
            f"background call(s) have not returned: {names}. They are abandoned "
            "(their threads stop with the process) and their arrays never get "
            "values. Wait for them (x.block_until_ready()) before the script ends, "
            "or give the function a timeout.",
            RuntimeWarning,
            stacklevel=1,
        )
        for task in unfinished:
            task.abandon()
    _dispatch.clean_up_at_exit()


# Registered after `import jax`, so it runs before JAX's own exit handlers.
atexit.register(_at_exit)


# --- the array ------------------------------------------------------------------------


def _binary(name: str) -> Callable[[AsyncArray, Any], Any]:
    def method(self: AsyncArray, other: Any) -> Any:
        if isinstance(other, AsyncArray):
            other = other.result()
        return getattr(self.result(), name)(other)

    method.__name__ = name
    method.__doc__ = f"Waits for the value, then applies ``jax.Array.{name}``."
    return method


def _unary(name: str) -> Callable[[AsyncArray], Any]:
    def method(self: AsyncArray) -> Any:
        return getattr(self.result(), name)()

    method.__name__ = name
    method.__doc__ = f"Waits for the value, then applies ``jax.Array.{name}``."
    return method


class AsyncArray:
    """An array whose value a background call is still computing.

    Made by :func:`async_call`, :func:`deferred_call` or :meth:`from_future`,
    never directly. Its shape and dtype are known at once, so it can be passed to
    ``jax.jit`` functions (tracing and compilation proceed while the call runs;
    the program waits for the buffer only when it executes), eager ``jax.numpy``
    functions, ``jax.device_put``, ``np.asarray`` and ``threadmap``. Python
    operators, indexing, ``bool``/``int``/``float`` wait for the value and act
    like those of the ``jax.Array`` that :meth:`result` returns; use
    ``result()`` for any other ``jax.Array`` method.

    If the call raised, every use of the array re-raises that exception (same
    type, message and ``__cause__``, with a note naming the call).

    Attributes:
        shape: The declared shape.
        dtype: The dtype of the value on device (the declared dtype,
            canonicalised as ``jnp.asarray`` does: float64 becomes float32
            unless ``jax_enable_x64`` is on).
        ndim: ``len(shape)``.
        size: The number of elements.
        sharding: Where the value goes: the target ``device`` or sharding, or
            ``None`` for the default device (uncommitted, like ``jnp.asarray``).

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import jax_threadmap as jtm
        >>> x = jtm.async_call(np.ones, jax.ShapeDtypeStruct((2,), jnp.float32),
        ...                    2, dtype=np.float32)
        >>> x.shape, x.dtype
        ((2,), dtype('float32'))
        >>> jax.jit(lambda a: a * 2)(x)
        Array([2., 2.], dtype=float32)
    """

    __slots__ = ("_task", "_index", "__weakref__")
    _task: _Task
    _index: int
    # Makes NumPy defer `ndarray + AsyncArray` to AsyncArray.__radd__.
    __array_priority__ = 100

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        raise TypeError(
            "AsyncArray cannot be constructed directly. Use "
            "jax_threadmap.async_call(fn, result_shape_dtypes, *args), "
            "jax_threadmap.deferred_call(...) or AsyncArray.from_future(...)."
        )

    @classmethod
    def _new(cls, task: _Task, index: int) -> AsyncArray:
        self = object.__new__(cls)
        self._task = task
        self._index = index
        return self

    @overload
    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future[Any],
        result_shape_dtypes: jax.ShapeDtypeStruct,
        *,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> AsyncArray: ...

    @overload
    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future[Any],
        result_shape_dtypes: tuple[jax.ShapeDtypeStruct, ...],
        *,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> tuple[AsyncArray, ...]: ...

    @overload
    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future[Any],
        result_shape_dtypes: Any,
        *,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> Any: ...

    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future[Any],
        result_shape_dtypes: Any,
        *,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> Any:
        """Wraps a ``concurrent.futures.Future`` whose result is a pytree of arrays.

        The value is checked and copied to its device as soon as the future
        completes (in the thread that completes it).

        Args:
            future: A ``concurrent.futures.Future`` (from any executor) whose
                result has the structure of ``result_shape_dtypes``.
            result_shape_dtypes: A pytree whose leaves have ``shape`` and
                ``dtype`` (``jax.ShapeDtypeStruct``, arrays).
            device: Optional target ``jax.Device`` or ``jax.sharding.Sharding``
                for every leaf.

        Returns:
            A pytree of :class:`AsyncArray` with the structure of
            ``result_shape_dtypes``.

        Raises:
            TypeError: If ``future`` is not a ``concurrent.futures.Future``, or
                ``result_shape_dtypes`` or ``device`` is malformed.

        Example:
            >>> from concurrent.futures import ThreadPoolExecutor
            >>> import jax, numpy as np
            >>> from jax_threadmap import AsyncArray
            >>> with ThreadPoolExecutor(1) as ex:
            ...     fut = ex.submit(np.arange, 3.0, dtype=np.float32)
            ...     x = AsyncArray.from_future(
            ...         fut, jax.ShapeDtypeStruct((3,), np.float32))
            ...     print(x + 1)
            [1. 2. 3.]
        """
        if not isinstance(future, concurrent.futures.Future):
            raise TypeError(
                "AsyncArray.from_future: future must be a concurrent.futures.Future. "
                f"Got {future!r} of type {type(future).__name__}. For a plain "
                "function use jax_threadmap.async_call(fn, result_shape_dtypes)."
            )
        treedef, specs = _leaf_specs(
            result_shape_dtypes, device, "AsyncArray.from_future"
        )
        task = _Task(
            None,
            None,
            None,
            name=f"a {type(future).__name__} of the caller",
            api="AsyncArray.from_future",
            treedef=treedef,
            specs=specs,
        )
        out = _make(task)
        with _live_lock:
            _live.add(task)
        future.add_done_callback(task.on_source_done)
        return out

    # -- what jit needs, without waiting --

    @property
    def _spec(self) -> _LeafSpec:
        return self._task.specs[self._index]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype:
        return self._spec.aval.dtype

    @property
    def ndim(self) -> int:
        return len(self._spec.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._spec.shape, dtype=np.int64))

    @property
    def sharding(self) -> jax.sharding.Sharding | None:
        return self._spec.sharding

    def _aval(self) -> Any:
        return self._spec.aval

    # -- the value --

    def done(self) -> bool:
        """Returns whether the value (or the call's error) is available now."""
        return self._task.future.done()

    def result(self, timeout: float | None = None) -> jax.Array:
        """Waits for the value and returns it as a ``jax.Array``.

        Args:
            timeout: Seconds to wait at most; ``None`` waits as long as needed.

        Returns:
            The ``jax.Array``, on its target device.

        Raises:
            TimeoutError: If ``timeout`` expires first. The array stays usable.
            Exception: Whatever the call raised, or a ``ValueError`` if it
                returned values that do not match ``result_shape_dtypes``.

        Example:
            >>> import jax, numpy as np
            >>> import jax_threadmap as jtm
            >>> x = jtm.async_call(np.zeros, jax.ShapeDtypeStruct((2,), np.float32),
            ...                    2, dtype=np.float32)
            >>> x.result(timeout=30)
            Array([0., 0.], dtype=float32)
        """
        return self._task.wait(timeout, self._describe())[self._index]

    def block_until_ready(self) -> AsyncArray:
        """Waits until the value is on its device; returns ``self``."""
        self.result().block_until_ready()
        return self

    def __jax_array__(self) -> jax.Array:
        return self.result()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return self.result().__array__(dtype=dtype, copy=copy)

    # -- never blocks --

    def _status(self) -> str:
        task = self._task
        fut = task.future
        if fut.done():
            error = fut.exception()
            if error is None:
                return "done"
            return f"failed: {type(error).__name__}: {error}"
        if task.state == _PENDING and task.runnable and not task._submitted:
            return "deferred"
        return "pending"

    def _describe(self) -> str:
        return f"AsyncArray(shape={self.shape}, dtype={self.dtype})"

    def __repr__(self) -> str:
        return (
            f"AsyncArray(shape={self.shape}, dtype={self.dtype}, "
            f"{self._status()}, from {self._task.name})"
        )

    __str__ = __repr__

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __copy__(self) -> AsyncArray:
        return self  # immutable, like a tuple

    def __deepcopy__(self, memo: dict) -> AsyncArray:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self._describe()} cannot be pickled: its value may not exist yet. "
            "Pickle x.result() (the jax.Array, which waits for the value) instead."
        )

    # -- the rest waits for the value --

    def __iter__(self) -> Iterator[jax.Array]:
        return iter(self.result())

    def __getitem__(self, index: Any) -> jax.Array:
        return self.result()[index]

    __hash__ = None  # type: ignore[assignment]  # like jax.Array

    __add__ = _binary("__add__")
    __radd__ = _binary("__radd__")
    __sub__ = _binary("__sub__")
    __rsub__ = _binary("__rsub__")
    __mul__ = _binary("__mul__")
    __rmul__ = _binary("__rmul__")
    __truediv__ = _binary("__truediv__")
    __rtruediv__ = _binary("__rtruediv__")
    __floordiv__ = _binary("__floordiv__")
    __rfloordiv__ = _binary("__rfloordiv__")
    __mod__ = _binary("__mod__")
    __rmod__ = _binary("__rmod__")
    __divmod__ = _binary("__divmod__")
    __rdivmod__ = _binary("__rdivmod__")
    __pow__ = _binary("__pow__")
    __rpow__ = _binary("__rpow__")
    __matmul__ = _binary("__matmul__")
    __rmatmul__ = _binary("__rmatmul__")
    __and__ = _binary("__and__")
    __rand__ = _binary("__rand__")
    __or__ = _binary("__or__")
    __ror__ = _binary("__ror__")
    __xor__ = _binary("__xor__")
    __rxor__ = _binary("__rxor__")
    __lshift__ = _binary("__lshift__")
    __rlshift__ = _binary("__rlshift__")
    __rshift__ = _binary("__rshift__")
    __rrshift__ = _binary("__rrshift__")
    __eq__ = _binary("__eq__")
    __ne__ = _binary("__ne__")
    __lt__ = _binary("__lt__")
    __le__ = _binary("__le__")
    __gt__ = _binary("__gt__")
    __ge__ = _binary("__ge__")
    __neg__ = _unary("__neg__")
    __pos__ = _unary("__pos__")
    __abs__ = _unary("__abs__")
    __invert__ = _unary("__invert__")
    __bool__ = _unary("__bool__")
    __int__ = _unary("__int__")
    __float__ = _unary("__float__")
    __complex__ = _unary("__complex__")
    __index__ = _unary("__index__")


def _arrays_of(xs: list[AsyncArray], shardings: list[Any]) -> list[jax.Array]:
    # Called by jit only when a compiled program runs, after compilation.
    return _dispatch.arrays_for(xs, shardings)


_compat.register_array_like(AsyncArray, AsyncArray._aval, _arrays_of)


# --- public constructors --------------------------------------------------------------


def _new_task(
    fn: Any,
    result_shape_dtypes: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: Any,
    api: str,
) -> _Task:
    if not callable(fn):
        raise TypeError(
            f"jax_threadmap.{api}: fn must be callable. Got {fn!r} of type "
            f"{type(fn).__name__}. Pass the function first, then "
            "result_shape_dtypes, then its arguments."
        )
    treedef, specs = _leaf_specs(result_shape_dtypes, device, api)
    return _Task(
        fn,
        args,
        kwargs,
        name=f"`{callable_name(fn)}`",
        api=api,
        treedef=treedef,
        specs=specs,
    )


@overload
def async_call(
    fn: Callable[..., Any],
    result_shape_dtypes: jax.ShapeDtypeStruct,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    **kwargs: Any,
) -> AsyncArray: ...


@overload
def async_call(
    fn: Callable[..., Any],
    result_shape_dtypes: tuple[jax.ShapeDtypeStruct, ...],
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    **kwargs: Any,
) -> tuple[AsyncArray, ...]: ...


@overload
def async_call(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    **kwargs: Any,
) -> Any: ...


def async_call(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    **kwargs: Any,
) -> Any:
    """Starts ``fn(*args, **kwargs)`` in the background; returns its arrays now.

    ``fn`` starts at once on a shared pool of at most
    ``JAX_THREADMAP_ASYNC_THREADS`` threads (default ``min(32, cpus + 4)``) and
    runs exactly once, however many arrays it returns. When it finishes, its
    result is checked against ``result_shape_dtypes`` and copied to its device.
    Meanwhile the returned :class:`AsyncArray` leaves can be passed to
    ``jax.jit`` functions, which trace and compile with their shapes and dtypes
    and wait for the data only when the compiled program runs, so compilation
    hides behind the call.

    A thread that needs a value whose call has not started yet (all workers
    busy) runs the call itself rather than waiting.

    Args:
        fn: The function to call. It returns a pytree of arrays (NumPy arrays,
            ``jax.Array``, anything with ``shape`` and ``dtype`` that
            ``jax.device_put`` accepts) with the structure, shapes and dtypes of
            ``result_shape_dtypes``.
        result_shape_dtypes: A pytree whose leaves have ``shape`` and ``dtype``,
            such as ``jax.ShapeDtypeStruct``. A ``ShapeDtypeStruct`` leaf with a
            ``sharding`` sends that leaf there when ``device`` is not given.
        *args: Positional arguments of ``fn``.
        device: Reserved keyword (not passed to ``fn``). A ``jax.Device`` or
            ``jax.sharding.Sharding`` to put every leaf on as soon as it is
            ready; the arrays are then committed there. ``None`` (default) puts
            them on the default device, uncommitted. To pass a keyword argument
            named ``device`` to ``fn``, bind it with ``functools.partial``.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        A pytree of :class:`AsyncArray` with the structure of
        ``result_shape_dtypes``.

    Raises:
        TypeError: If ``fn`` is not callable, or a leaf of
            ``result_shape_dtypes`` lacks a shape or dtype, or ``device`` is not
            a device or sharding.
        ValueError: If ``result_shape_dtypes`` has no leaves, or ``device``
            cannot hold a declared shape.

    Errors of ``fn`` are not raised here: every use of any of its arrays
    re-raises them. A result of the wrong structure, shape or dtype makes every
    use raise a ``ValueError`` naming the expected and actual values.

    Example:
        >>> import time
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import jax_threadmap as jtm
        >>> def load_weights(n):
        ...     time.sleep(0.1)  # a slow download
        ...     return {"w": np.ones((n, n), np.float32), "b": np.zeros(n, np.float32)}
        >>> shapes = {"w": jax.ShapeDtypeStruct((3, 3), jnp.float32),
        ...           "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
        >>> params = jtm.async_call(load_weights, shapes, 3)
        >>> predict = jax.jit(lambda p, x: p["w"] @ x + p["b"])
        >>> predict(params, jnp.arange(3.0))  # compiles while loading
        Array([3., 3., 3.], dtype=float32)
    """
    task = _new_task(fn, result_shape_dtypes, args, kwargs, device, "async_call")
    out = _make(task)
    task.submit()
    return out


@overload
def deferred_call(
    fn: Callable[..., Any],
    result_shape_dtypes: jax.ShapeDtypeStruct,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    **kwargs: Any,
) -> AsyncArray: ...


@overload
def deferred_call(
    fn: Callable[..., Any],
    result_shape_dtypes: tuple[jax.ShapeDtypeStruct, ...],
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    **kwargs: Any,
) -> tuple[AsyncArray, ...]: ...


@overload
def deferred_call(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    **kwargs: Any,
) -> Any: ...


def deferred_call(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    /,
    *args: Any,
    device: jax.Device | jax.sharding.Sharding | None = None,
    **kwargs: Any,
) -> Any:
    """Like :func:`async_call`, but runs ``fn`` only when a value is first needed.

    A thunk-backed array: nothing runs until the first use of any of the
    returned arrays (``result()``, ``block_until_ready()``, a jitted program
    that executes with it, ``np.asarray``, an operator...). That first use runs
    ``fn`` in its own thread, or on the pool when it is ``result(timeout=...)``,
    so that the timeout holds. ``done()`` and ``repr`` never start it, and
    ``jax.jit`` tracing and compiling with the arrays does not either, so
    a program that is traced but never run never pays for the call.

    Args:
        fn: The function to call, as in :func:`async_call`.
        result_shape_dtypes: A pytree whose leaves have ``shape`` and ``dtype``.
        *args: Positional arguments of ``fn``.
        device: Reserved keyword, as in :func:`async_call`.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        A pytree of :class:`AsyncArray` with the structure of
        ``result_shape_dtypes``.

    Raises:
        TypeError: As :func:`async_call`.
        ValueError: As :func:`async_call`.

    Example:
        >>> import jax, numpy as np
        >>> import jax_threadmap as jtm
        >>> x = jtm.deferred_call(np.full, jax.ShapeDtypeStruct((2,), np.float32),
        ...                       2, 7.0, dtype=np.float32)
        >>> x.done()
        False
        >>> x + 1
        Array([8., 8.], dtype=float32)
    """
    task = _new_task(fn, result_shape_dtypes, args, kwargs, device, "deferred_call")
    return _make(task)
