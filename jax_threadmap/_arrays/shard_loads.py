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
  dropped at once). The array is assembled
  (``jax.make_array_from_single_device_arrays``) when the last part is placed:
  the same array ``make_array_from_callback`` gives.
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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._jax import traces as _traces
from .._support import event_loop as _event_loop
from .._support.validate import callable_name, check_callable, check_timeout
from . import async_pool as _async_pool
from . import outcomes as _outcomes
from .async_array import AsyncArray, make_arrays
from .leaves import LeafSpec, is_extended, leaf_specs, shape_of
from .parts import Part, Parts, PartState
from .shards import (
    auto_layout_name,
    check_shard,
    extended_spec,
    format_layout,
    index_key,
    index_str,
    is_format,
    place_shard,
    slice_shape,
)
from .task import Task

logger = logging.getLogger("jax_threadmap._async")

API = "async_array_from_callback"


class Shard(Part):
    """One distinct index of the array: its fetch and the devices that hold it."""

    __slots__ = ("index", "key")

    def __init__(self, load: ShardedLoad, index: tuple, key: tuple, devices: list):
        super().__init__(load, devices, "")
        self.index = index
        self.key = key
        self.what = f"the shard at {self.where()} of the array of shape {load.shape}"

    def where(self) -> str:
        """``index [0:2, :] (devices 0, 1)``: device ids as JAX numbers them."""
        ids = ", ".join(str(d.id) for d in self.devices)
        plural = "s" if len(self.devices) > 1 else ""
        return f"index {index_str(self.index)} (device{plural} {ids})"


class ShardedLoad(Task):
    """The fetches of one array's shards, and their shared outcome.

    A ``Task`` of parts (:class:`Shard`), one per distinct index: the task owns
    the load's state, its :class:`.parts.Parts` the parts' states (each move
    asked under the task's lock, through the task's override points); this
    class starts and runs every part, says what a part fetches (:meth:`_work`),
    how its shard is checked and placed (:meth:`_part_returned`), and how the
    array is assembled when the last one lands (:meth:`_all_parts_landed`).
    """

    __slots__ = tuple("shape sharding _fetch _order _layout _first _parts".split())

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
        by_key: dict[tuple, tuple[tuple, list[Any]]] = {}
        for device, index in indices.items():
            assert index is not None  # typed Optional; None only off this process
            by_key.setdefault(index_key(index), (index, []))[1].append(device)
        self._parts = Parts(
            [Shard(self, index, key, devs) for key, (index, devs) in by_key.items()]
        )
        # A Format's layout (its type and layout), for each shard's placement.
        self._layout = layout
        # (key, value) of the shard fetched at the call (dtype=None, or traced).
        self._first = first

    @property
    def parts(self) -> tuple[Part, ...]:  # type: ignore[override]
        """The load's parts, one per distinct index."""
        return self._parts.all

    def parts_not_placed(self) -> list[Part]:
        """The parts whose data has not landed (for a timeout's message)."""
        return self._parts.not_placed()

    # -- start --

    def _start(self) -> None:
        """Starts every part not started yet (the one fetched at the call lands
        first; a load without parts settles at once): a coroutine fetch as a
        coroutine on the event loop, any other on the pool."""
        first, self._first = self._first, None
        if first is not None:
            for part in self.parts:
                if isinstance(part, Shard) and part.key == first[0]:
                    if self._claim(None, None, part):  # fetched at the call
                        self._part_returned(part, first[1])
        if not self.parts and self._claim(None) and self._settle():
            self._all_parts_landed()
        for part in self.parts:
            if part.state != PartState.PENDING:  # a hint: _claim decides
                continue
            if self.coroutine:
                _event_loop.event_loop().submit(self._on_loop(part), self.name)
            else:
                _async_pool.pool().submit(part)

    def run(self, worker: Any = None) -> None:
        """Starts every part, and runs here those not started yet (a waiting
        thread helps)."""
        del worker
        self.submit()
        if not self.coroutine:
            for part in self.parts:
                self.run_part(part, None)

    def _work(self, part: Part | None) -> Any:
        assert isinstance(part, Shard)
        return self._fetch(part.index)

    # -- the parts' moves, asked by the task --

    def _claim_part(
        self, part: Part, worker: Any, source: asyncio.Task | None
    ) -> bool:  # the task's lock held
        return self._parts.claim(part, worker, source)

    def _left_runner(self, part: Part | None) -> None:
        if part is None:
            super()._left_runner(part)
        else:
            self._parts.left_runner(part)

    def _adopt(self, source: asyncio.Task | None, part: Part | None) -> bool:
        if part is None:
            return super()._adopt(source, part)
        return self._parts.adopt(part, source)

    def _raised(self, part: Part | None, error: BaseException) -> None:
        if part is None:
            super()._raised(part, error)
        else:
            self._part_failed(part, error)

    def _returned(self, part: Part | None, out: Any) -> None:
        if part is None:
            super()._returned(part, out)
            return
        try:
            self._part_returned(part, out)
        except BaseException as e:  # whatever a landing raises ends the part
            self._part_failed(part, e)

    def _part_failed(
        self, part: Part, error: BaseException, ours: bool = False
    ) -> None:
        """``part`` failed with ``error``: the load fails, naming the part
        (``ours``: the error is this package's, naming the load)."""
        self._parts.fail(part)  # its own thread or coroutine is not stopped
        if not self._settle():
            logger.debug("%s: %s failed after the call ended", self, part.what)
            return
        self._conclude(error, raised_by_fn=not ours, names_call=ours, part=part.what)

    def _stop_parts(self) -> None:
        """Parts not placed never start, or leave the pool's bound, or are cancelled."""
        for part, worker, source in self._parts.stop():
            if worker is not None:
                _async_pool.pool().abandon(worker, part)
            if source is not None:
                _event_loop.event_loop().cancel(source)

    # -- a shard lands, in the thread that fetched it --

    @_async_pool.landing
    def _part_returned(self, part: Part, out: Any) -> None:
        assert isinstance(part, Shard)
        if part.state != PartState.RUNNING:  # the load ended meanwhile: not even placed
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
        # Arrays are freed before the result is set, never after (a daemon
        # thread still in JAX's C++ when the interpreter exits aborts it): the
        # list is emptied, so that no frame here holds them.
        if self._land(part, functools.partial(self._parts.land, part, placed)):
            self._all_parts_landed()  # the last part: the array is assembled

    def _bad_shard(
        self, part: Shard, problem: ValueError, expected: tuple, out: Any
    ) -> str:
        got = shape_of(out)
        jax_words = (  # JAX's own words, for code that matches its error
            f"Expected shard shape {expected} doesn't match the single device "
            f"array shape {got}. "
            if got is not None and got != expected
            else ""
        )
        return jax_words + (
            f"The data_callback {self.name}, for the shard at {part.where()} of the "
            f"array of shape {self.shape}, returned {problem}. Make it return that "
            "shard of the array (e.g. data[index]), or fix shape or dtype."
        )

    def _all_parts_landed(self) -> None:
        placed = self._parts.take_placed()
        try:
            out = jax.make_array_from_single_device_arrays(
                self.shape, self.sharding, [placed[d] for d in self._order]
            )
        except BaseException as e:
            placed.clear()  # freed before the error is set
            self._conclude(e, raised_by_fn=False)
            return
        placed.clear()
        self._publish([out])

    # -- timeout --

    def time_out(self) -> None:
        late = [p.where() for p in self.parts_not_placed() if isinstance(p, Shard)]
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
    """The sharding, and the ``Format`` whose layout shards take (or ``None``).

    A ``Format`` is refused at the call as ``jax.make_array_from_callback``
    refuses it, in JAX's words: with the AUTO layout (a placed array has a
    concrete one), or without a sharding.
    """
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding, None
    if is_format(sharding):
        layout = format_layout(sharding)
        auto = auto_layout_name(layout)
        if auto is not None:
            raise TypeError(
                f"`{auto}` cannot be used in place of a device-local layout when "
                f"calling `jax.make_array_from_callback`. Got {sharding} "
                f"(jax_threadmap.{API}). Pass a Format with a concrete layout "
                "(e.g. a compiled program's input_formats), or the sharding alone."
            )
        inner = sharding.sharding
        if not isinstance(inner, jax.sharding.Sharding):
            raise TypeError(
                f"sharding should be an instance of `jax.sharding`. Got {inner} of "
                f"type {type(inner)} (jax_threadmap.{API}: the sharding of "
                f"{sharding}). Pass Format(layout, sharding) with a Sharding, e.g. "
                "jax.sharding.SingleDeviceSharding(device)."
            )
        return inner, None if layout is None else sharding
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
            ``Sharding`` or ``Format`` (or is a ``Format`` with the AUTO layout
            or without a sharding, in JAX's words), ``dtype`` is not a dtype,
            ``shape`` is not a sequence of integers, or ``timeout`` is not a
            number.
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
        >>> print(jax.jit(lambda a: a.sum())(x))  # an AsyncArray, as x
        120.0
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
