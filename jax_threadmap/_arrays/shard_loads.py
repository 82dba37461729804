"""Sharded loads: ``async_array_from_callback``, every shard fetched at once.

The counterpart of ``jax.make_array_from_callback(shape, sharding,
data_callback)``, returning an ``AsyncArray`` at once:

- **Shards.** ``sharding.addressable_devices_indices_map(shape)`` grouped by
  index: one :class:`Shard` (a ``Task`` of its own) per distinct index, with the
  devices that hold it, so a replicated axis is fetched once per process, and
  each process of a multi-process run fetches only its own devices' shards.
- **All at once.** :class:`ShardedLoad` (a ``Task`` made of its shards) starts
  every shard together: a plain callback as one call per shard on the async
  pool, an ``async def`` one as one coroutine per shard on the package's event
  loop.
- **As each lands**, in the thread that fetched it (a pool thread, or the
  loop's): the shard is checked (the shape of its index's slice, ``threadmap``'s
  dtype rule) and copied to its devices (the one copy; the callback's buffer is
  dropped at once). The array is assembled
  (``jax.make_array_from_single_device_arrays``) when the last shard is placed:
  the same array ``make_array_from_callback`` gives.
- **The first failure**, the timeout or ``cancel()`` ends the load: every use
  raises that error (the callback's own, with a note naming the shard); shards
  not started never run, threads still fetching leave the pool's bound (what
  they return is dropped), coroutines are cancelled.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._coroutines import event_loop as _event_loop
from .._jax import traces as _traces
from .._support.validate import callable_name, check_callable, check_timeout
from . import async_pool as _async_pool
from . import outcomes as _outcomes
from .async_array import AsyncArray, make_arrays
from .leaves import LeafSpec, is_extended, leaf_specs, shape_of
from .shards import (
    check_shard,
    extended_spec,
    index_key,
    index_str,
    place_shard,
    slice_shape,
)
from .task import Task

API = "async_array_from_callback"


class Shard(Task):
    """One distinct index of the array: its fetch, a call of its own, whose
    value is the shard placed on each of the devices that hold it."""

    __slots__ = ("index", "devices", "what", "_load")
    bursts = False  # placed as it arrives: its buffer is dropped at once

    def __init__(
        self, load: ShardedLoad, fn: Any, args: tuple, index: tuple, devices: list
    ):
        super().__init__(
            fn,
            args,
            {},
            name=load.name,
            api=API,
            treedef=load.treedef,
            specs=load.specs,
        )
        self.index = index
        self.devices = devices
        self._load = load
        #: Names the shard in errors: "the shard at index [0:2] (devices 0, 1)
        #: of the array of shape (4,)".
        self.what = f"the shard at {self.where()} of the array of shape {load.shape}"

    def where(self) -> str:
        """``index [0:2, :] (devices 0, 1)``: device ids as JAX numbers them."""
        ids = ", ".join(str(d.id) for d in self.devices)
        plural = "s" if len(self.devices) > 1 else ""
        return f"index {index_str(self.index)} (device{plural} {ids})"

    def _accept(self, out: Any) -> None:
        """Checks the shard and copies it to its devices (there when this
        returns), in the thread that fetched it; then publishes it."""
        try:
            placed, problem = self._load.placed_shard(self, out)
        except BaseException as e:  # raised by what the callback returned
            self._fail(e, raised_by_fn=True)
            return None
        del out  # the callback's buffer is not kept
        if problem is not None:
            self._fail(problem, raised_by_fn=False)
        else:
            self._publish_placed(placed)
        return None

    def landed(self) -> bool:
        """Whether the shard is placed on its devices (done, without an error)."""
        return self.future.done() and self.future.exception() is None

    def take(self) -> dict[Any, jax.Array]:
        """The landed shard, by device, taken: the load's array holds it from
        now on (the list published is emptied, so that nothing else does)."""
        leaves = self.future.result()
        placed = dict(zip(self.devices, leaves, strict=True))
        leaves.clear()
        return placed

    def drop(self) -> None:
        """Lets go of the landed shard's data: its load ended without it (a
        shard failed, the timeout, ``cancel()``)."""
        if self.landed():
            self.future.result().clear()

    def __str__(self) -> str:
        return f"{self.name} ({self.api}, {self.what})"


def _fetched(value: Any) -> Any:
    """What the shard fetched at the call returns (its value)."""
    return value


class ShardedLoad(Task):
    """The fetches of one array's shards, and the array they make.

    A call made of other calls: one :class:`Shard` per distinct index, each
    fetched, checked and placed on its own (the pool's or the event loop's). It
    starts them all at :meth:`submit`, and ends with the first of them that
    fails (with that shard's error), or, once the last has landed, with the
    array assembled from them (:meth:`_shard_done`). When it ends first (the
    timeout, ``cancel()``), the shards not done are given up on
    (:meth:`_stop_parts`).
    """

    __slots__ = tuple("shape sharding shards _order _stopped".split())

    def __init__(
        self,
        shape: tuple[int, ...],
        sharding: jax.sharding.Sharding,
        fetch: Callable[..., Any],
        spec: LeafSpec,
        timeout: float | None,
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
        indices = sharding.addressable_devices_indices_map(shape)
        self._order = list(indices)
        by_key: dict[tuple, tuple[tuple, list[Any]]] = {}
        for device, index in indices.items():
            assert index is not None  # typed Optional; None only off this process
            by_key.setdefault(index_key(index), (index, []))[1].append(device)
        # The shard fetched at the call (dtype=None, or traced) is not fetched again.
        first_key, first_value = first if first is not None else (None, None)
        self.shards = tuple(
            Shard(self, _fetched, (first_value,), index, devices)
            if key == first_key
            else Shard(self, fetch, (index,), index, devices)
            for key, (index, devices) in by_key.items()
        )
        # Whether the load ended before its shards: those landing drop their data.
        self._stopped = False

    def _start(self) -> None:
        """Starts every shard; the load ends with them (:meth:`_shard_done`). A
        load without shards (none on this process) is assembled at once."""
        for shard in self.shards:
            shard.future.add_done_callback(functools.partial(self._shard_done, shard))
        for shard in self.shards:
            shard.submit()
        if not self.shards:
            self._shard_done(None, None)

    def run(self, worker: Any = None) -> None:
        """Runs here the shards not started yet (a waiting thread helps)."""
        del worker
        for shard in self.shards:
            shard.run()  # no-op once started, or async def (on the event loop)

    def _shard_done(self, shard: Shard | None, future: Any) -> None:
        """A shard landed or failed (in the thread or coroutine that ended it):
        the first failure fails the load; the last landing assembles it."""
        error = None if future is None else future.exception()
        if error is not None:
            assert shard is not None
            self.give_up(error, shard.failure_text())
        elif self._stopped:  # landed after the load ended: not kept
            assert shard is not None
            shard.drop()
        # Every shard landed, none failed: a shard failing as the last lands
        # is done before its own callback gives up on the load.
        elif all(s.landed() for s in self.shards):
            if self._claim(None) and self._settle():  # once: the last to land
                self._assemble()

    def ran_elsewhere(self) -> bool:
        """Whether a shard started in the parent of this forked child (then the
        load never ends here)."""
        return any(s.ran_elsewhere() for s in self.shards)

    def _stop_parts(self) -> None:
        """Shards not started never run; those running are given up on (their
        threads leave the pool's bound, their coroutines are cancelled); those
        landed let go of their data (as do those landing from now on:
        :meth:`_shard_done`), which the failed array would otherwise keep."""
        self._stopped = True  # before the loop: a shard landing now drops its own
        for shard in self.shards:
            error = concurrent.futures.CancelledError(f"{shard}: the load ended first")
            if not shard.give_up(error):
                shard.drop()

    @_async_pool.landing
    def _assemble(self) -> None:
        placed: dict[Any, jax.Array] = {}
        for shard in self.shards:
            placed.update(shard.take())
        try:
            out = jax.make_array_from_single_device_arrays(
                self.shape, self.sharding, [placed[d] for d in self._order]
            )
        except BaseException as e:
            placed.clear()  # freed before the error is set
            self._conclude(e, raised_by_fn=False)
            return
        # Arrays are freed before the result is set, never after (a daemon
        # thread still in JAX's C++ when the interpreter exits aborts it).
        placed.clear()
        self._publish([out])

    def placed_shard(
        self, shard: Shard, out: Any
    ) -> tuple[list[jax.Array], BaseException | None]:
        """``out``, what ``shard``'s fetch returned, checked and placed on the
        shard's devices; or what is wrong with it (naming the shard), or the
        error of its placement. Raises what reading ``out`` raises."""
        if isinstance(out, jax.core.Tracer):
            return [], _outcomes.traced_error(self.name)
        expected = slice_shape(shard.index, self.shape)
        try:
            checked = check_shard(out, expected, self.specs[0].aval.dtype)
        except ValueError as e:
            return [], ValueError(self._bad_shard(shard, e, expected, out))
        try:
            return place_shard(checked, out, shard.devices), None
        except BaseException as e:  # noqa: BLE001 - the load fails with it
            return [], e

    def _bad_shard(
        self, shard: Shard, problem: ValueError, expected: tuple, out: Any
    ) -> str:
        got = shape_of(out)
        jax_words = (  # JAX's own words, for code that matches its error
            f"Expected shard shape {expected} doesn't match the single device "
            f"array shape {got}. "
            if got is not None and got != expected
            else ""
        )
        return jax_words + (
            f"The data_callback {self.name}, for the shard at {shard.where()} of the "
            f"array of shape {self.shape}, returned {problem}. Make it return that "
            "shard of the array (e.g. data[index]), or fix shape or dtype."
        )

    def time_out(self) -> None:
        late = [s.where() for s in self.shards if not s.future.done()]
        shown = "; ".join(late[:4]) + (
            f"; and {len(late) - 4} more" if late[4:] else ""
        )
        self.give_up(
            TimeoutError(
                f"The data_callback {self.name}, which jax_threadmap.{API} ran, did "
                f"not return within timeout={self.timeout:g} s for {len(late)} of "
                f"{len(self.shards)} shard(s) ({shown}); the array was given up on ("
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


def _check_sharding(sharding: Any) -> jax.sharding.Sharding:
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    raise TypeError(
        f"jax_threadmap.{API}: sharding must be a jax.sharding.Sharding. Got "
        f"sharding={sharding!r} of type {type(sharding).__name__}. Pass e.g. "
        "jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x')), or "
        "jax.sharding.SingleDeviceSharding(device) for one device (for a Format: "
        "its .sharding, then jax.device_put(x.result(), fmt) for its layout)."
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
    dispatched with the array meanwhile returns at once and is dispatched once
    the last shard has arrived (docs/async-sharded.md, "What waits for what").
    When the last shard has arrived, the value is the array that
    ``jax.make_array_from_callback(shape, sharding, data_callback)`` returns.

    Args:
        shape: The shape of the whole (global) array.
        sharding: A ``jax.sharding.Sharding`` (``NamedSharding``,
            ``SingleDeviceSharding``, ...) that can hold ``shape``.
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
            ``Sharding``, ``dtype`` is not a dtype, ``shape`` is not a sequence
            of integers, or ``timeout`` is not a number.
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
    sharding = _check_sharding(sharding)
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
    load = ShardedLoad(dims, sharding, data_callback, spec, seconds, first)
    array: AsyncArray = make_arrays(load)
    load.submit()
    return array
