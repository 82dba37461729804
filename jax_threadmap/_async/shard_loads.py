"""Sharded loads: ``async_array_from_callback``, every shard fetched at once.

The counterpart of ``jax.make_array_from_callback(shape, sharding,
data_callback)``, returning an ``AsyncArray`` at once:

- **Parts.** ``sharding.addressable_devices_indices_map(shape)`` grouped by index:
  one :class:`Part` per distinct index, with the devices that hold it, so a
  replicated axis is fetched once per process, and each process of a
  multi-process run fetches only its own devices' shards.
- **All at once.** :class:`ShardedLoad` (a ``Task``) starts every part together:
  a plain callback as one call per part on the async pool, an ``async def`` one
  as one coroutine per part on the package's event loop.
- **As each lands**, in the thread that fetched it (a pool thread, or the
  loop's): the shard is checked (the shape of its index's slice, ``threadmap``'s
  dtype rule) and copied to its devices (the one copy; the callback's buffer is
  dropped at once), and the gate programs of those devices are released, so a
  jitted program's part on a device starts once that device's shard is there.
  The array is assembled (``jax.make_array_from_single_device_arrays``) when the
  last part is placed: the same array ``make_array_from_callback`` gives.
- **The first failure**, the timeout or ``cancel()`` ends the load: every use
  raises that error (the callback's own, with a note naming the shard); parts
  not started never run, threads still fetching leave the pool's bound (what
  they return is dropped), coroutines are cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._jax import traces as _traces
from .._support import event_loop as _event_loop
from .._support.validate import callable_name, check_callable, check_timeout
from . import outcomes as _outcomes
from . import pool as _async_threads
from .arrays import AsyncArray, make_arrays
from .background import PENDING, RUNNING, Task
from .leaves import (
    LeafSpec,
    check_shard,
    extended_spec,
    format_layout,
    index_key,
    index_str,
    is_extended,
    leaf_specs,
    place_shard,
    slice_shape,
)

logger = logging.getLogger("jax_threadmap._async")

API = "async_array_from_callback"

# A part's states: its fetch not started, running, its shard placed, or stopped
# (the load ended first).
PLACED, STOPPED = "placed", "stopped"


class Part:
    """One distinct index of the array: its fetch and the devices that hold it.

    A call of the async pool (``name``, :meth:`run`, :meth:`time_out`). Lock
    rule: ``state``, ``worker`` and ``source`` change under the load's lock.
    """

    __slots__ = ("load", "name", "index", "key", "devices", "state", "worker", "source")

    def __init__(self, load: ShardedLoad, index: tuple, key: tuple) -> None:
        self.load = load
        self.name = load.name  # shown in the name of the thread that runs it
        self.index = index
        self.key = key
        self.devices: list[Any] = []
        self.state = PENDING
        self.worker: _async_threads.Worker | None = None
        self.source: asyncio.Task | None = None

    def where(self) -> str:
        """``index [0:2, :] (devices 0, 1)``: device ids as JAX numbers them."""
        ids = ", ".join(str(d.id) for d in self.devices)
        plural = "s" if len(self.devices) > 1 else ""
        return f"index {index_str(self.index)} (device{plural} {ids})"

    def run(self, worker: _async_threads.Worker | None = None) -> None:
        self.load.run_part(self, worker)

    def time_out(self) -> None:  # the load's timeout covers its parts
        pass

    def __str__(self) -> str:
        return f"{self.load.name} ({API}, the shard at {self.where()})"


class ShardedLoad(Task):
    """The fetches of one array's shards, and their shared outcome.

    The state moves as a ``Task``'s: running from the first part's start,
    finishing when the last part is placed (then assembled) or at the first
    failure, timeout or cancel. Lock rule (the task's ``_lock``): the parts'
    states, ``_left``, ``_placed``, and, as for every task, the gates: a part is
    placed and its devices' gates are taken out of ``gates`` and offered under
    one acquisition, so every gate is offered once (by its part, or with the
    error at the end).
    """

    __slots__ = tuple(
        "parts shape sharding _fetch _left _placed _order _layout _first".split()
    )

    def __init__(
        self,
        shape: tuple[int, ...],
        sharding: jax.sharding.Sharding,
        fetch: Callable[..., Any],
        spec: LeafSpec,
        timeout: float | None,
        layout: Any = None,
        first: tuple[tuple, Any] | None = None,
    ) -> None:
        super().__init__(
            fetch,
            None,
            None,
            name=f"`{callable_name(fetch)}`",
            api=API,
            treedef=jax.tree_util.tree_structure(0),
            specs=[spec],
            timeout=timeout,
        )
        self.shape = shape
        self.sharding = sharding
        self._fetch = fetch  # called once per part
        indices = sharding.addressable_devices_indices_map(shape)
        self._order = list(indices)
        parts: dict[tuple, Part] = {}
        for device, index in indices.items():
            assert index is not None  # typed Optional; None only off this process
            key = index_key(index)
            if key not in parts:
                parts[key] = Part(self, index, key)
            parts[key].devices.append(device)
        self.parts = list(parts.values())
        self._left = len(self.parts)
        self._placed: dict[Any, jax.Array] = {}
        # A Format's layout (its type and layout), for each shard's placement.
        self._layout = layout
        # (key, value) of the shard fetched at the call (dtype=None, or traced).
        self._first = first

    # -- start --

    def submit(self) -> None:
        """Starts every part (once); the timeout counts from now."""
        with self._lock:
            if self._submitted or self._state != PENDING:
                return
            self._submitted = True
            if not self.parts:  # no device of this process holds a shard
                self._state = RUNNING
        with _async_threads.live_lock:
            _async_threads.live.add(self)
        self._start_clock()
        if not self.parts:
            self._assemble(self._settle() or {})
        first, self._first = self._first, None
        for part in self.parts:
            if first is not None and part.key == first[0]:
                if self._claim_part(part, None, None):  # fetched at the call
                    self._part_arrived(part, first[1])
                continue
            if self.coroutine:
                coroutine = functools.partial(self._run_part_coroutine, part)
                _event_loop.event_loop().submit(coroutine, self.name)
            else:
                _async_threads.pool().submit(part)

    def run(self, worker: _async_threads.Worker | None = None) -> None:
        """Runs here the parts that have not started (a waiting thread helps)."""
        del worker
        self.submit()
        if not self.coroutine:
            for part in self.parts:
                self.run_part(part, None)

    def _claim_part(
        self,
        part: Part,
        worker: _async_threads.Worker | None,
        source: asyncio.Task | None,
    ) -> bool:
        with self._lock:
            if self._state not in (PENDING, RUNNING) or part.state != PENDING:
                return False
            part.state = RUNNING
            part.worker, part.source = worker, source
            self._state = RUNNING
            self._pid = os.getpid()
        return True

    def run_part(self, part: Part, worker: _async_threads.Worker | None) -> None:
        """Fetches one part here (a pool thread, or a thread that waits)."""
        if not self._claim_part(part, worker, None):
            return
        try:
            out = self._fetch(part.index)
        except BaseException as e:  # routed to every use, like a Future does
            self._part_left_runner(part)
            self._part_failed(part, e)
            return
        self._part_left_runner(part)
        if inspect.isawaitable(out):  # a plain callback returning a coroutine
            coroutine = functools.partial(self._run_part_coroutine, part, out)
            _event_loop.event_loop().submit(coroutine, self.name)
            return
        self._part_arrived(part, out)

    def _part_left_runner(self, part: Part) -> None:
        with self._lock:
            part.worker = part.source = None

    async def _run_part_coroutine(self, part: Part, awaitable: Any = None) -> None:
        """Fetches one part on the event loop (claimed there first)."""
        source = asyncio.current_task()
        if awaitable is None:
            if not self._claim_part(part, None, source):
                return
        else:
            with self._lock:
                part.source = source
                alive = part.state == RUNNING
            if not alive:
                _event_loop.close_awaitable(awaitable)
                return
        try:
            out = self._fetch(part.index) if awaitable is None else awaitable
            while inspect.isawaitable(out):
                out = await out
        except BaseException as e:  # our cancel included: then dropped
            self._part_left_runner(part)
            self._part_failed(part, e)
            return
        self._part_left_runner(part)
        self._part_arrived(part, out)

    # -- a shard lands, in the thread that fetched it --

    def _part_arrived(self, part: Part, out: Any) -> None:
        if part.state != RUNNING:  # the load ended meanwhile: not even placed
            return
        if isinstance(out, jax.core.Tracer):
            self._part_failed(part, _outcomes.traced_error(self.name), ours=True)
            return
        expected = slice_shape(part.index, self.shape)
        try:
            shard = check_shard(out, expected, self.specs[0].aval.dtype)
        except ValueError as e:
            error = ValueError(self._bad_shard(part, e, expected, out))
            self._part_failed(part, error, ours=True)
            return
        try:
            placed = place_shard(shard, out, part.devices, self._layout)
        except BaseException as e:
            self._part_failed(part, e, ours=True)
            return
        del out, shard  # the callback's buffer is not kept
        with self._lock:
            if self._state != RUNNING or part.state != RUNNING:
                return  # the load ended meanwhile: dropped
            part.state = PLACED
            self._placed.update(zip(part.devices, placed, strict=True))
            gates = self._gates
            released = {d: gates.pop(d) for d in part.devices if d in gates}
            if released:  # what the gate programs copy (a view on CPU)
                self._host = self._host or {}
                self._host.update((d, np.asarray(self._placed[d])) for d in released)
            self._left -= 1
            last = self._left == 0
            rest = self._close() if last else {}
        # Arrays are freed before the result is set, never after: a daemon
        # thread still in JAX's C++ when the interpreter exits aborts it.
        del placed
        if released:
            self._open(released)
        del released
        if last:
            self._assemble(rest)

    def _bad_shard(
        self, part: Part, problem: ValueError, expected: tuple, out: Any
    ) -> str:
        got = getattr(out, "shape", None)
        jax_words = (  # JAX's own words, for code that matches its error
            f"Expected shard shape {expected} doesn't match the single device "
            f"array shape {tuple(got)}. "
            if got is not None and tuple(got) != expected
            else ""
        )
        return jax_words + (
            f"The data_callback {self.name}, for the shard at {part.where()} of the "
            f"array of shape {self.shape}, returned {problem}. Make it return that "
            "shard of the array (e.g. data[index]), or fix shape or dtype."
        )

    def _assemble(self, gates: dict) -> None:
        try:
            out = jax.make_array_from_single_device_arrays(
                self.shape, self.sharding, [self._placed[d] for d in self._order]
            )
        except BaseException as e:
            self._conclude(e, gates, raised_by_fn=False)
            return
        self._placed = {}
        self._publish([out])

    # -- failure, timeout, cancel --

    def _part_failed(
        self, part: Part, error: BaseException, ours: bool = False
    ) -> None:
        with self._lock:  # its own thread or coroutine is not stopped
            if part.state == RUNNING:
                part.state = STOPPED
            part.worker = part.source = None
        gates = self._settle()
        if gates is None:
            logger.debug("%s: %s failed after the load ended", self, part.where())
            return
        self._conclude(
            error,
            gates,
            raised_by_fn=not ours,
            names_call=ours,
            part=f"the shard at {part.where()} of the array of shape {self.shape}",
        )

    def _conclude(self, error: BaseException, gates: dict, **how: Any) -> None:
        self._stop_parts()  # first: the placed shards go before uses are told
        super()._conclude(error, gates, **how)

    def _stop_parts(self) -> None:
        """Parts not placed never start, or leave the pool's bound, or are cancelled."""
        with self._lock:
            stopping = [p for p in self.parts if p.state in (PENDING, RUNNING)]
            handles = [(p, p.worker, p.source) for p in stopping]
            for p in stopping:
                p.state = STOPPED
            self._placed = {}
        for part, worker, source in handles:
            if worker is not None:
                _async_threads.pool().abandon(worker, part)
            if source is not None:
                _event_loop.event_loop().cancel(source)

    def time_out(self) -> None:
        with self._lock:
            late = [p.where() for p in self.parts if p.state != PLACED]
        shown = "; ".join(late[:4]) + (
            f"; and {len(late) - 4} more" if late[4:] else ""
        )
        self.give_up(
            TimeoutError(
                f"The data_callback {self.name}, which jax_threadmap.{API} ran, did "
                f"not return within timeout={self.timeout:g} s for {len(late)} of "
                f"{len(self.parts)} shard(s) ({shown}); the array was given up on ("
                + (
                    "the coroutines are cancelled)."
                    if self.coroutine
                    else "threads still fetching run on until they return; what "
                    "they return is dropped)."
                )
            )
        )

    # -- what the dispatch mechanism asks --

    def serves(self, sharding: Any, shape: tuple[int, ...]) -> bool:
        """Whether ``sharding`` puts on each device exactly that device's part
        (and gate programs can copy it: no layout, no PRNG keys)."""
        if self._layout is not None or is_extended(self.specs[0].aval.dtype):
            return False
        try:
            theirs = sharding.addressable_devices_indices_map(shape)
        except Exception:
            return False
        mine = {d: p.key for p in self.parts for d in p.devices}
        return len(theirs) == len(mine) and all(
            mine.get(d) == index_key(index) for d, index in theirs.items()
        )

    def ready_shard(self, device: Any) -> jax.Array | None:
        return self._placed.get(device)

    def gate_data(self, leaf: int, where: tuple, device: Any) -> Any:
        del leaf, where  # one leaf, laid out as its parts (serves)
        host = self._host
        return None if host is None else host.get(device)


def _check_shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(n) for n in shape)
    except TypeError:
        dims = None
    if dims is None or any(n < 0 for n in dims):
        raise (TypeError if dims is None else ValueError)(
            f"jax_threadmap.{API}: shape must be a sequence of non-negative "
            f"integers. Got shape={shape!r}. Pass the shape of the whole array, "
            "e.g. (8, 1024), as for jax.make_array_from_callback."
        )
    return dims


def _check_sharding(sharding: Any) -> tuple[jax.sharding.Sharding, Any]:
    """The sharding, and the ``Format`` whose layout shards take (or ``None``)."""
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding, None
    inner = getattr(sharding, "sharding", None)
    if isinstance(inner, jax.sharding.Sharding):  # a Format (layout, sharding)
        return inner, None if format_layout(sharding) is None else sharding
    raise TypeError(
        f"jax_threadmap.{API}: sharding must be a jax.sharding.Sharding or a "
        f"Format. Got sharding={sharding!r} of type {type(sharding).__name__}. "
        "Pass e.g. jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("
        "'x')), or jax.sharding.SingleDeviceSharding(device) for one device."
    )


def _fetch_first(fetch: Any, sharding: Any, dims: tuple) -> tuple[tuple, Any] | None:
    """One shard fetched now, in this thread: ``(key, value)``, or ``None``."""
    indices = sharding.addressable_devices_indices_map(dims)
    if not indices:
        return None
    index = next(iter(indices.values()))
    value = fetch(index)
    if inspect.isawaitable(value):  # run to its end on the package's loop
        value = _event_loop.event_loop().run(value, f"`{callable_name(fetch)}`")
    if isinstance(value, jax.core.Tracer):
        raise _outcomes.traced_error(f"`{callable_name(fetch)}`")
    return index_key(index), value


def _dtype_of(dtype: Any, first: tuple[tuple, Any] | None) -> Any:
    if dtype is not None:
        return dtype
    if first is None:
        raise ValueError(
            f"jax_threadmap.{API}: no device of this process holds a shard, so "
            "the dtype cannot be read from one: pass dtype= (as "
            "jax.make_array_from_callback asks then)."
        )
    value = first[1]
    dtype = getattr(value, "dtype", None)
    return np.asarray(value).dtype if dtype is None else dtype


def async_array_from_callback(
    shape: Sequence[int],
    sharding: Any,
    data_callback: Callable[[Any], Any],
    dtype: Any = None,
    *,
    timeout: float | None = None,
) -> AsyncArray:
    """Fetches every shard of an array at once; returns the array now.

    The counterpart of ``jax.make_array_from_callback`` that returns an
    [`AsyncArray`][jax_threadmap.AsyncArray] at once, instead of calling
    ``data_callback`` for one device after another. Every shard of this
    process's devices is fetched together: a plain ``data_callback`` runs once
    per shard on the async pool, an ``async def`` one runs as one coroutine per
    shard on the package's event loop (no thread per fetch). Shards that hold
    the same index (a replicated axis) are fetched once per process, and in a
    multi-process run each process fetches only its own devices' shards.

    Each shard is checked and copied to its devices as soon as it arrives (the
    callback's buffer is not kept, nor aliased), and a jitted program
    dispatched with the array meanwhile starts on each device once that
    device's shard is there (docs/async.md, "Sharded loads"). When the last
    shard has arrived, the value is the array that
    ``jax.make_array_from_callback(shape, sharding, data_callback)`` returns.

    Args:
        shape: The shape of the whole (global) array.
        sharding: A ``jax.sharding.Sharding`` (``NamedSharding``,
            ``SingleDeviceSharding``, ...) that can hold ``shape``, or a
            ``Format`` (``jax.experimental.layout``): each shard is then placed
            with its layout, and jitted programs wait for the whole array.
        data_callback: Called with each distinct index (a tuple of slices, as
            ``jax.make_array_from_callback`` passes) and returns that shard of
            the array, as anything with ``shape`` and ``dtype`` (a NumPy
            array...); or an ``async def`` function (or a function returning an
            awaitable) whose result is that shard.
        dtype: The array's dtype: a NumPy dtype, ``jnp.bfloat16``..., or a PRNG
            key dtype (``jax.random.key`` arrays; jitted programs then wait
            for the whole array). Shards of another dtype are stored as
            ``dtype`` where no value changes, as ``threadmap`` stores its
            results; otherwise the load fails with a ``ValueError`` naming the
            shard. ``None`` (the default, as in JAX): read from one shard,
            which is then fetched *at the call*, in the calling thread (an
            ``async def`` callback on the event loop): the call returns after
            one fetch instead of at once, and that shard's error raises there.
            Pass ``dtype`` to return at once.
        timeout: Seconds from this call after which the load is given up on:
            every use raises a ``TimeoutError`` naming the shards still missing,
            and coroutines still fetching are cancelled. ``None``: no limit.

    Returns:
        The [`AsyncArray`][jax_threadmap.AsyncArray], with ``sharding``.

    Raises:
        TypeError: If ``data_callback`` is not callable, ``sharding`` is not a
            ``Sharding`` or ``Format``, ``dtype`` is not a dtype, ``shape`` is
            not a sequence of integers, or ``timeout`` is not a number.
        ValueError: If ``sharding`` cannot hold ``shape``, ``shape`` has a
            negative size, ``timeout`` is not positive and finite, or ``dtype``
            is ``None`` and no device of this process holds a shard.
        jax.errors.UnexpectedTracerError: Under a trace (``jit``...), one
            shard is fetched at the call; if the callback returns a tracer,
            JAX's error ("cannot be called within a traced context") is raised
            there, as ``jax.make_array_from_callback`` raises it.

    Errors of ``data_callback`` surface where the array is used: every use
    raises the first one (its own type, with a note naming the shard's index and
    devices on Python 3.11+), and the jitted programs dispatched with the array
    fail with a ``JaxRuntimeError`` carrying that text, index and devices
    included. A shard of the wrong shape fails the load with a ``ValueError``
    that starts with JAX's words ("Expected shard shape ...").

    Examples:
        >>> import asyncio, jax, numpy as np
        >>> import jax_threadmap as jtm
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> data = np.arange(16.0, dtype=np.float32).reshape(4, 4)
        >>> async def fetch(index):  # e.g. a range request per shard
        ...     await asyncio.sleep(0.01)
        ...     return data[index]
        >>> mesh = jax.make_mesh((1,), ("x",))
        >>> x = jtm.async_array_from_callback(
        ...     (4, 4), NamedSharding(mesh, P("x")), fetch, np.float32)
        >>> x.shape, x.sharding.spec == P("x")
        ((4, 4), True)
        >>> jax.jit(lambda a: a.sum())(x)
        Array(120., dtype=float32)
    """
    check_callable(
        data_callback,
        f"jax_threadmap.{API}",
        "data_callback",
        "Pass a function of the shard's index, e.g. lambda index: data[index].",
    )
    dims = _check_shape(shape)
    sharding, fmt = _check_sharding(sharding)
    try:
        sharding.shard_shape(dims)
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(
            f"jax_threadmap.{API}: sharding {sharding} cannot hold an array of "
            f"shape {dims} ({e}). Pass a shape whose sharded axes divide evenly "
            "over the mesh axes they are sharded on, or a sharding that fits it."
        ) from None
    seconds = check_timeout(timeout, f"jax_threadmap.{API}", zero=False)
    first = None
    if dtype is None or not _traces.trace_state_clean():
        # The dtype is read from one shard, fetched now; under a trace, a
        # callback that returns a tracer fails here, at the call, as in JAX.
        first = _fetch_first(data_callback, sharding, dims)
    dtype = _dtype_of(dtype, first)
    try:
        declared = jax.ShapeDtypeStruct(
            dims, dtype if is_extended(dtype) else np.dtype(dtype)
        )
    except TypeError as e:
        raise TypeError(
            f"jax_threadmap.{API}: dtype must be a NumPy or JAX dtype. Got "
            f"dtype={dtype!r} ({e}). Pass e.g. np.float32 or jnp.bfloat16."
        ) from None
    if is_extended(dtype):  # PRNG keys: leaf_specs takes NumPy dtypes
        spec = extended_spec(dims, dtype, sharding)
    else:
        _, (spec,) = leaf_specs(declared, sharding, API)
    load = ShardedLoad(dims, sharding, data_callback, spec, seconds, fmt, first)
    array: AsyncArray = make_arrays(load)
    load.submit()
    return array
