"""Detects the one deadlock of async dispatch that XLA leaves to us, and ends it.

XLA's CPU client admits at most 32 programs per device at a time, and a program
that waits for pending data holds its slot until the data is there. jax_threadmap
counts the programs it dispatches with ``AsyncArray`` s, but not the plain ones
that use their results (``h(y)`` after ``y = f(x)``). With all slots of a device
held by such programs, a loader that itself runs JAX on that device waits for a
slot that only its own result frees: neither can go on, and the dispatching
thread may wait inside XLA too, where Ctrl-C does not reach it.

A watchdog thread runs while a call whose arrays were dispatched is running.
Every :data:`POLL_S` it dispatches a *probe* (a one-element program) to each
device on which such a call's gate programs wait, from a thread of its own; a
probe that has not got a slot for :data:`STALL_S` means that every slot of the
device is held. If, then, every running call that programs on that device wait
for is stuck in a JAX dispatch (the innermost frame of the thread running it is
a frame of ``jax`` that is not compiling, or a line of its own that calls a
jitted function, and it has not moved for :data:`STALL_S`), nothing can free a
slot: those calls are failed with a ``RuntimeError`` that says so. Failing
them lets their gate programs raise, which frees the slots; the loader's own
JAX call then returns, and what the loader returns is dropped (as after a
``timeout``).

Calls wrapped by ``AsyncArray.from_future`` run where jax_threadmap cannot see
them, so a device whose slots wait for one of them is never judged stuck.
"""

from __future__ import annotations

import dis
import functools
import gc
import inspect
import logging
import sys
import threading
import time
import types
from typing import Any

import jax
import numpy as np

from . import _fork, _task
from ._task import Task

logger = logging.getLogger("jax_threadmap._async")

#: Seconds between two looks at the devices and the calls' threads.
POLL_S = 0.5

#: Seconds a probe must wait for a slot, and a call's thread stay at one place in
#: JAX, before the device counts as deadlocked. Long enough that a loader in a
#: JAX computation of its own, which holds a slot, is seldom taken for stuck.
STALL_S = 10.0

#: Seconds without a running call with dispatched arrays before the watchdog
#: thread exits (the next dispatch on pending data starts it again).
IDLE_EXIT_S = 5.0

#: XLA's CPU client: at most this many programs per device at a time.
CPU_SLOTS = 32

_JAX_MODULES = ("jax.", "jaxlib")

#: How many wrappers (``functools.partial``, ``__wrapped__``) to look through.
MAX_UNWRAP = 8


def _is_jax_module(name: Any) -> bool:
    return isinstance(name, str) and (name == "jax" or name.startswith(_JAX_MODULES))


def _runs_jax_in_cpp(obj: Any) -> bool:
    """Whether calling ``obj`` enters JAX's C++ dispatch without a Python frame.

    That is a jitted function (``jax.jit``'s ``PjitFunction``, which ``jnp.sin``
    and the other ``jax.numpy`` ufuncs are), possibly behind ``functools.partial``
    or a ``functools.wraps`` wrapper. Dtypes, shapes and arrays are not.
    """
    for _ in range(MAX_UNWRAP):
        if isinstance(obj, type) or not callable(obj):
            return False
        if type(obj).__module__.startswith("jaxlib"):
            return True
        if isinstance(obj, functools.partial):
            obj = obj.func
            continue
        try:
            obj = vars(obj)["__wrapped__"]
        except (TypeError, KeyError):
            return False
    return False


def _line_calls_jax(frame: types.FrameType) -> bool:
    """Whether the frame's current line loads a jitted function (see above).

    Follows names, attributes (without running properties) and subscripts of a
    dict, list or tuple by a constant: ``g(a)``, ``jnp.sin(a)``,
    ``self.model(a)``, ``FNS["k"](a)``.
    """
    line = frame.f_lineno
    on = None  # the line of the instructions being read
    scopes = (frame.f_locals, frame.f_globals, frame.f_builtins)
    loaded: list[Any] = []  # what this line's loads produced, most recent last
    for instr in dis.get_instructions(frame.f_code):
        at = _line_of(instr)
        if at is not None:
            on = at
        if on != line:
            loaded.clear()
            continue
        value = _load(instr, loaded, scopes)
        if value is not _NOT_A_LOAD:
            loaded.append(value)
            if _runs_jax_in_cpp(value):
                return True
    return False


_NOT_A_LOAD = object()
_LOADS_NAME = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF")
_LOADS_ATTR = ("LOAD_ATTR", "LOAD_METHOD")


def _load(instr: dis.Instruction, loaded: list[Any], scopes: tuple) -> Any:
    """What a load instruction of the line produces, as far as it can be known."""
    name = instr.argval
    if instr.opname.startswith(_LOADS_NAME) and isinstance(name, str):
        return next((s[name] for s in scopes if name in s), None)
    if instr.opname == "LOAD_CONST":
        return name
    if instr.opname.startswith(_LOADS_ATTR) and isinstance(name, str) and loaded:
        try:
            return inspect.getattr_static(loaded.pop(), name)
        except (AttributeError, TypeError):
            return None
    if instr.opname == "BINARY_SUBSCR" and len(loaded) >= 2:
        key, container = loaded.pop(), loaded.pop()
        if type(container) in (dict, list, tuple):
            try:
                return container[key]
            except (LookupError, TypeError):
                return None
        return None
    return _NOT_A_LOAD


def _line_of(instr: dis.Instruction) -> int | None:
    """The source line of an instruction, where ``dis`` says (3.10 ... 3.13)."""
    positions = getattr(instr, "positions", None)  # 3.11+
    if positions is not None:
        return positions.lineno
    starts = instr.starts_line  # 3.10: the line number where a line starts
    return starts if isinstance(starts, int) and not isinstance(starts, bool) else None


def _in_jax(frame: types.FrameType | None) -> bool:
    """Whether a thread whose innermost frame is ``frame`` waits in a JAX dispatch.

    Its innermost frame decides: a frame of ``jax`` (dispatch, or a wait for an
    array) unless JAX is compiling there (which needs no slot); user code only
    where its current line calls a jitted function. User code that JAX called
    (``jax.tree.map(download, urls)``) is user code.
    """
    if frame is None:
        return False
    if not _is_jax_module(frame.f_globals.get("__name__")):
        try:
            return _line_calls_jax(frame)
        except Exception:  # a frame that cannot be read is no evidence
            logger.debug("jax_threadmap: could not read a frame", exc_info=True)
            return False
    inner: types.FrameType | None = frame
    while inner is not None and _is_jax_module(inner.f_globals.get("__name__")):
        if "compile" in inner.f_code.co_name:
            return False
        inner = inner.f_back
    return True


class _Probe:
    """Dispatches a one-element program to one device, from a thread of its own."""

    def __init__(self, device: Any):
        self.device = device
        self.busy = False  # a probe thread is running
        self.since: float | None = None  # when its dispatch began to wait
        self._compiled: Any = None

    def waited(self, now: float) -> float:
        """Seconds the dispatch in flight has waited for a slot (0 if none)."""
        since = self.since
        return 0.0 if since is None else now - since

    def start(self) -> None:
        if self.busy:
            return  # still waiting for its slot
        self.busy = True
        threading.Thread(
            target=self._dispatch, name="jax_threadmap-slot-probe", daemon=True
        ).start()

    def _dispatch(self) -> None:
        try:
            arg = jax.device_put(np.int8(0), self.device)
            if self._compiled is None:
                # Compiling needs no slot: only the dispatch below is timed.
                self._compiled = jax.jit(lambda v: v + 1).lower(arg).compile()
            self.since = time.monotonic()
            self._compiled(arg)  # returns once XLA admitted it
        except Exception:
            logger.debug("jax_threadmap: slot probe failed", exc_info=True)
        finally:
            self.since = None
            self.busy = False


_frames_lock = threading.Lock()


def current_frames() -> dict[int, types.FrameType]:
    """``sys._current_frames()``, with the cyclic garbage collector paused.

    ``sys._current_frames`` holds the interpreter's lock on its list of threads
    while it makes frame objects. A collection started by one of those
    allocations runs ``gc.callbacks`` (Python code, which may hand the GIL to
    another thread); a thread that then starts or ends a thread waits for the
    list's lock while holding the GIL, and the process hangs for good
    (python/cpython#106883, not fixed in 3.10 and 3.11). With the collector
    paused, no Python code runs inside the call. A collector that was already
    disabled stays so; the lock keeps two of these calls from re-enabling it
    early. (Moved here from ``_compat``, which holds JAX internals only.)
    """
    with _frames_lock:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return sys._current_frames()
        finally:
            if enabled:
                gc.enable()


class _Place:
    """Where a call's thread was (its innermost frame's identity, code and
    instruction), since when, and that frame as read in the latest round.

    Only frames of the latest snapshot are read: on CPython 3.11 a frame object
    of another thread kept from an earlier round may point at a frame that
    thread has popped since (python/cpython#99110, #111363).
    """

    __slots__ = ("key", "since", "frame")

    def __init__(self, key: tuple | None, now: float, frame: types.FrameType | None):
        self.key = key
        self.since = now
        self.frame = frame


class Watchdog:
    """One daemon thread; see the module's docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._probes: dict[Any, _Probe] = {}
        self._places: dict[Task, _Place] = {}
        self._failed: list[Task] = []  # calls failed here, their threads running
        self._stopped = False
        self._wake = threading.Event()  # set by stop(): the thread ends now

    def stop(self) -> None:
        """At exit: no more probes (JAX is being torn down); the thread ends."""
        self._stopped = True
        self._wake.set()

    def wait_stopped(self, timeout: float) -> None:
        """At exit, after :meth:`stop`: waits for the thread and the probes.

        A daemon thread still inside XLA when the interpreter finalizes is
        ended there, and XLA's C++ aborts the process ("FATAL: exception not
        rethrown"); a probe returns at once unless the device is full, which
        the abandoned calls have just ended.
        """
        deadline = time.monotonic() + timeout
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        for probe in list(self._probes.values()):
            while probe.busy and time.monotonic() < deadline:
                time.sleep(0.01)
        # A failed call's thread is in JAX, and goes on once the slots are free.
        for task in list(self._failed):
            while task.thread is not None and time.monotonic() < deadline:
                time.sleep(0.01)

    def ensure_running(self) -> None:
        """Starts the thread if it is not running (called at each gate pull)."""
        with self._lock:
            if self._thread is not None or self._stopped:
                return
            self._thread = threading.Thread(
                target=self._run, name="jax_threadmap-deadlock-watch", daemon=True
            )
            self._thread.start()

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._thread = None
        self._probes = {}
        self._places = {}
        self._failed = []
        self._wake = threading.Event()

    def _run(self) -> None:
        idle_since = time.monotonic()
        while not self._stopped:
            self._wake.wait(POLL_S)
            if self._stopped:
                return
            now = time.monotonic()
            watched = _watched_tasks()
            if watched:
                idle_since = now
            elif now - idle_since > IDLE_EXIT_S:
                with self._lock:
                    if not _watched_tasks():
                        self._thread = None
                        self._places.clear()
                        return
            try:
                self.look(watched, now)
            except Exception:  # never let the watchdog die of a bug
                logger.exception("jax_threadmap: the deadlock watchdog failed")

    def look(self, watched: dict[Task, list[Any]], now: float) -> list[Task]:
        """One round: probes, places, and the calls failed to end a deadlock."""
        self._track_places(watched, now)
        failed: list[Task] = []
        for device in {d for devices in watched.values() for d in devices}:
            probe = self._probes.setdefault(device, _Probe(device))
            if probe.waited(now) < STALL_S:
                if not self._stopped:
                    probe.start()
                continue
            waited_for = [t for t, devices in watched.items() if device in devices]
            if waited_for and all(self._stuck_in_jax(t, now) for t in waited_for):
                for task in waited_for:
                    if task.give_up(RuntimeError(_message(task, device, waited_for))):
                        failed.append(task)
        self._failed = [t for t in self._failed if t.thread is not None] + failed
        return failed

    def _track_places(self, watched: dict[Task, list[Any]], now: float) -> None:
        frames = current_frames()
        for task in list(self._places):
            if task not in watched:
                del self._places[task]
        for task in watched:
            ident = task.thread
            frame = frames.get(ident) if ident is not None else None
            key = (
                (id(frame), frame.f_code, frame.f_lasti) if frame is not None else None
            )
            place = self._places.get(task)
            if place is None or key is None or key != place.key:
                self._places[task] = _Place(key, now, frame)
            else:
                place.frame = frame
        del frames

    def _stuck_in_jax(self, task: Task, now: float) -> bool:
        place = self._places.get(task)
        if place is None or place.frame is None or now - place.since < STALL_S:
            return False
        # The thread has not moved for STALL_S: it is blocked, its frames stay.
        return _in_jax(place.frame)


def _watched_tasks() -> dict[Task, list[Any]]:
    """The running calls that dispatched programs wait for, with their devices."""
    with _task.live_lock:
        tasks = list(_task.live)
    out = {}
    for task in tasks:
        devices = task.waiting_devices()
        if devices:
            out[task] = devices
    return out


def _message(task: Task, device: Any, waited_for: list[Task]) -> str:
    names = ", ".join(t.name for t in waited_for)
    return (
        f"jax_threadmap ended a deadlock: {task.name} ({task.api}) was stuck in a "
        f"JAX call on {device} for {STALL_S:g} s while every program slot of that "
        f"device (XLA's CPU client admits {CPU_SLOTS} programs at a time) was held "
        f"by programs waiting for the result of {names}, so neither could ever go "
        "on. Keep JAX computations out of the function (return NumPy arrays), or "
        "wait for its arrays (jax.block_until_ready) before dispatching more than "
        "about 20 programs that use results computed from them. What the function "
        "returns now is dropped."
    )


watchdog = Watchdog()

_fork.in_child(watchdog.after_fork)
