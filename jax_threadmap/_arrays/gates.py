"""The CPU's gate mechanism: a jitted call with pending data returns at once.

How it works (docs/async.md, "How it works", says the same):

- **Gates.** The argument handler hands JAX, for the pending arrays of one
  dispatch, the outputs of a small *gate program* per device, whose input is a
  4-byte gate pulled from a loopback transfer server (``jax.experimental.
  transfer``). The call opens its gates when it ends; the program's host
  callback then copies the call's result (never through the socket) or raises
  its error, which reaches every dependent. A sharded load opens each device's
  gate when that device's shard is placed, and a later dispatch takes the placed
  shard itself (``Task.add_program``); asked for in another layout, it waits.
- **Streams.** XLA runs the programs of one execution stream in dispatch order
  (by default a stream per thread). The gate programs and the program behind
  them go on a new stream per dispatch, so that nothing else waits for this
  data (:mod:`.dispatch_streams`, which wraps every run of a program).
- **The bound.** XLA's CPU client admits 32 programs per device, waiting ones
  included. At most :data:`MAX_WAITING_PROGRAMS` gate programs (and as many
  programs behind them) wait per device; beyond that a dispatch waits, in
  Python, for its own data (blocking dispatch), never for another call.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import secrets
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._jax import program_runs as _program_runs
from . import dispatch_streams as _dispatch_streams
from .shards import index_key
from .task import Task

logger = logging.getLogger("jax_threadmap._async")

#: Gate programs that may wait on one device at once (each with the program
#: dispatched behind it: twice as many of XLA's slots); more dispatches wait, in
#: Python, for their own data. XLA's CPU client runs at most 32 programs per
#: device at a time, waiting ones included: this leaves half of them to plain
#: programs that use pending results, to the loaders' own JAX calls and to
#: other work.
MAX_WAITING_PROGRAMS = 8

#: Gate programs kept compiled, by device and layout (a steady workload needs a
#: handful): a bound against ever new layouts, cleared when full (a miss costs
#: one compile of a tiny program).
MAX_CACHED_PROGRAMS = 256

#: At exit, how long to let the gate programs of failed or abandoned calls run
#: (they raise at once) before JAX's own exit handler waits for them: long
#: enough for XLA's threads to get the GIL on a busy machine.
EXIT_DRAIN_S = 3.0

#: How often the exit drain looks at the count of waiting programs: the programs
#: need the GIL, which a sleep gives them.
EXIT_POLL_S = 0.01

# The gate programs' last output (see Dispatch._program).
_RAN = jax.ShapeDtypeStruct((), np.int32)

#: Platforms on which the gate mechanism was measured (dispatch latency, values,
#: failures, exit): others fall back to blocking dispatch.
GATE_PLATFORMS = frozenset({"cpu"})


class Pending(NamedTuple):
    """An ``AsyncArray`` handed to a dispatch: its call, the leaf of the call's
    result it is, and the array (its shape, dtype, and value once there).

    Made by :mod:`.async_array` (the array's owner), so that dispatch reaches
    the call and leaf by these fields, never by the array's private ones.
    """

    task: Task
    leaf: int
    array: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> Any:
        return self.array.dtype


class Shard(NamedTuple):
    """One shard of one pending array that a gate program makes."""

    #: The array's position among the arguments of the dispatch.
    position: int
    #: The leaf of the call's result (``Pending.leaf``).
    leaf: int
    #: The shard's index into the leaf, hashable (see :func:`.shards.index_key`).
    where: tuple
    shape: tuple[int, ...]
    dtype: Any


class _Gate(NamedTuple):
    """A gate (``background.Gate``): a pending 4-byte pull on one device."""

    array: jax.Array
    pull_id: int
    server: Any
    device: Any

    def open(self, slot: int) -> None:
        """Sends ``slot`` to the pull: the gate programs on it run."""
        value = jax.device_put(np.int32(slot), self.device)
        self.server.await_pull(self.pull_id, [value])


class _Ticket(NamedTuple):
    """What a dispatched gate program owes: a waiting program on ``device``,
    and a program of each of ``tasks`` (the calls whose gates it reads)."""

    device: Any
    tasks: tuple[Task, ...]


class AsyncCallFailed(RuntimeError):
    """Raised in a gate program for a call that failed or never returned.

    A jitted program dispatched with pending arrays receives this error's text
    (``JaxRuntimeError: ... AsyncCallFailed: <fn> ... failed with <Type>:
    <message>``) when its results are used.
    """


def _keep_gate_errors_out_of_jax_log(record: logging.LogRecord) -> bool:
    # JAX logs each exception of a pure_callback; a failed call is reported once,
    # by Task._fail, and its text is in every dependent's error.
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, AsyncCallFailed)


logging.getLogger(_program_runs.CALLBACK_LOGGER_NAME).addFilter(
    _keep_gate_errors_out_of_jax_log
)


#: What the gate programs of one dispatch make: by device, by task, the shards.
Plan = dict[Any, dict[Task, list[Shard]]]
#: The tasks that serve a dispatch, with each device's gate (taken under the task's
#: lock: a sharded load offers and drops it when that device's shard lands) or, for
#: a shard placed already, the shard: ``{task: {device: (gated, array)}}``.
Claimed = dict[Task, dict[Any, tuple[bool, jax.Array]]]


def _plan(xs: list[Any], shardings: list[Any]) -> tuple[Plan, list[list[Any]]]:
    """One gate program per device; returns it and each array's device order."""
    plan: Plan = {}
    layouts = []
    for k, (x, sharding) in enumerate(zip(xs, shardings, strict=True)):
        indices = sharding.addressable_devices_indices_map(x.shape)
        layouts.append(list(indices))
        shard_shape = sharding.shard_shape(x.shape)
        for device, index in indices.items():
            plan.setdefault(device, {}).setdefault(x.task, []).append(
                Shard(k, x.leaf, index_key(index), shard_shape, x.dtype)
            )
    return plan, layouts


class Gates:
    """The gate mechanism (the CPU's): transfer servers, gate programs and their
    bookkeeping; the :class:`.task.Lender` of the calls it serves."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        #: The transfer server and its connection, by client (read without the
        #: lock: whether a client's server started).
        self.servers: dict[Any, tuple[Any, Any]] = {}
        #: Why a transfer server did not start, or ``None``.
        self._broken: str | None = None
        self._programs: dict[Any, Any] = {}
        self._waiting: dict[Any, int] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._ticket_ids = itertools.count(1)
        self._slots: dict[int, Task] = {}
        self._slot_ids = itertools.count(1)
        self._failed_devices: set[Any] = set()

    def counts(self) -> tuple[dict[Any, int], int]:
        """The gate programs waiting per device, and the calls lent a slot."""
        with self._lock:
            return {d: n for d, n in self._waiting.items() if n}, len(self._slots)

    def after_fork(self) -> None:
        # Servers, gates and programs in flight belong to the parent.
        self._reset()

    def start(self, device: Any) -> None:
        """Starts the transfer server of ``device``'s client if it is not (once;
        a refusal is remembered, and the gates' platforms defer from then on)."""
        try:
            self._server(device.client)
        except Exception:  # noqa: BLE001 - remembered in _broken, logged there
            pass

    def unavailable(self) -> str | None:
        """Why gate programs cannot run (a hook missing, a server that did not
        start), or ``None``."""
        return _program_runs.async_dispatch_unavailable() or self._broken

    def _has_room(self, shardings: list[Any]) -> bool:
        """Whether the gate programs' platforms and bound allow a dispatch."""
        devices = set()
        for sharding in shardings:
            devices |= set(sharding.addressable_devices)
        if any(d.platform not in GATE_PLATFORMS for d in devices):
            return False
        with self._lock:
            return all(self._waiting.get(d, 0) < MAX_WAITING_PROGRAMS for d in devices)

    # -- at dispatch, in the thread that calls the jitted function --

    def fill(
        self,
        xs: list[Any],
        shardings: list[Any],
        todo: list[int],
        out: list[Any],
        own_stream: bool,
    ) -> None:
        """Fills ``out[i]`` for the pending ``xs[i]`` with gate programs' outputs
        (left ``None`` where the bound is reached, the call finished meanwhile,
        or on a failure: that dispatch waits for its data)."""
        if not self._has_room([shardings[i] for i in todo]):
            return
        # The gate programs (and the program being dispatched, if any) go on a
        # stream of their own, so that nothing else waits for this data.
        put_back = _dispatch_streams.switch_stream(own_stream)
        try:
            made = self._pending_arrays(
                [xs[i] for i in todo], [shardings[i] for i in todo]
            )
        except Exception:
            # Whatever went wrong (a sharding we cannot split, a transfer
            # server that did not start) costs the wait, not the call.
            logger.warning(
                "jax_threadmap: async dispatch failed; this call waits for its data.",
                exc_info=True,
            )
            return
        finally:
            if put_back:
                _dispatch_streams.put_back()
        for i, array in zip(todo, made, strict=True):
            out[i] = array

    def _pending_arrays(self, xs: list[Any], shardings: list[Any]) -> list:
        plan, layouts = _plan(xs, shardings)
        # (task, device) pairs whose program count was raised and whose program
        # is not dispatched yet: undone if anything fails on the way.
        owed: list[tuple[Task, Any]] = []
        try:
            claimed = self._claim(plan, owed)
            shards = self._run_gate_programs(plan, claimed, owed)
        except BaseException:
            for task, _ in owed:
                task.program_ran()
            raise
        for task in claimed:
            task.submit()  # a deferred call starts now; no-op for the others
        made: list[Any] = []
        for k, (x, sharding) in enumerate(zip(xs, shardings, strict=True)):
            if x.task not in claimed:
                made.append(None)  # finishing: wait for its placed value
                continue
            parts = [shards[k, device] for device in layouts[k]]
            made.append(
                jax.make_array_from_single_device_arrays(x.shape, sharding, parts)
            )
        return made

    def _run_gate_programs(
        self, plan: Plan, claimed: Claimed, owed: list[tuple[Task, Any]]
    ) -> dict[tuple[int, Any], jax.Array]:
        """The array of each (argument position, device): placed, or gated."""
        shards: dict[tuple[int, Any], jax.Array] = {}
        for device, by_task in plan.items():
            tasks = [t for t in by_task if t in claimed and claimed[t][device][0]]
            for t in by_task:
                if t in claimed and not claimed[t][device][0]:
                    for s in by_task[t]:
                        shards[s.position, device] = claimed[t][device][1]
            if tasks:
                gates = [claimed[t][device][1] for t in tasks]
                outs = self._run_gate_program(device, tasks, by_task, owed, gates)
                positions = [s.position for t in tasks for s in by_task[t]]
                for k, array in zip(positions, outs, strict=True):
                    shards[k, device] = array
        return shards

    def _claim(self, plan: Plan, owed: list[tuple[Task, Any]]) -> Claimed:
        """Adds gates and program counts to the tasks still running.

        A sharded load's device whose shard is placed gets no gate: the shard.
        """
        claimed: Claimed = {}
        refused: set[Task] = set()
        for device, by_task in plan.items():
            for task in by_task:
                if task in refused:
                    continue
                got = task.add_program(device, self)
                if got is None:
                    refused.add(task)
                    continue
                if got[0]:
                    owed.append((task, device))
                claimed.setdefault(task, {})[device] = got
        # A call that finished between two devices waits for its value instead.
        for task, device in [(t, d) for t, d in owed if t in refused]:
            owed.remove((task, device))
            task.program_ran()
        for task in refused:
            claimed.pop(task, None)
        return claimed

    def _run_gate_program(
        self,
        device: Any,
        tasks: list[Task],
        by_task: dict[Task, list[Shard]],
        owed: list[tuple[Task, Any]],
        gates: list[jax.Array],
    ) -> list[jax.Array]:
        spec = tuple(tuple((s.leaf, s.where) for s in by_task[t]) for t in tasks)
        avals = tuple(
            jax.ShapeDtypeStruct(s.shape, s.dtype) for t in tasks for s in by_task[t]
        )
        program = self._program(device, spec, avals)
        # The program's counts are the ticket's from here: given back once, by
        # its callback or, if the dispatch raised before the callback took the
        # ticket, here (a program that ran inline may raise its callback's error).
        ticket = self._take_ticket(device, tasks)
        for t in tasks:
            owed.remove((t, device))
        try:
            *outs, _ = program(np.int32(ticket), *gates)
        except BaseException:
            self._give_back(self._pop_ticket(ticket))
            raise
        return outs

    # -- what a call is lent (a background.Lender), under the call's lock --

    def lend_slot(self, task: Task) -> int:
        """The id by which the gate programs find ``task``."""
        with self._lock:
            slot = next(self._slot_ids)
            self._slots[slot] = task
        return slot

    def give_back_slot(self, slot: int) -> None:
        """No gate program reads the call of ``slot`` any more."""
        with self._lock:
            self._slots.pop(slot, None)

    def pull(self, device: Any) -> _Gate:
        """A new gate on ``device``: a pull from the loopback transfer server."""
        server, conn = self._server(device.client)
        pull_id = secrets.randbits(62)
        gate_aval = jax.ShapeDtypeStruct(
            (), np.int32, sharding=jax.sharding.SingleDeviceSharding(device)
        )
        return _Gate(conn.pull(pull_id, [gate_aval])[0], pull_id, server, device)

    # -- the count of waiting gate programs per device, and the programs each
    # one owes its calls: taken when one is dispatched, given back once --

    def _take_ticket(self, device: Any, tasks: list[Task]) -> int:
        with self._lock:
            ticket = next(self._ticket_ids) % 2**31  # an int32 program input
            self._tickets[ticket] = _Ticket(device, tuple(tasks))
            self._waiting[device] = self._waiting.get(device, 0) + 1
        return ticket

    def _pop_ticket(self, ticket: int) -> _Ticket | None:
        """The ticket's counts, for the first to ask (then ``None``)."""
        with self._lock:
            return self._tickets.pop(ticket, None)

    def _give_back(self, ticket: _Ticket | None) -> None:
        """The one place a gate program's counts are given back."""
        if ticket is None:
            return
        with self._lock:
            self._waiting[ticket.device] -= 1
        for task in ticket.tasks:
            task.program_ran()

    def _server(self, client: Any) -> tuple[Any, Any]:
        with self._lock:
            if client not in self.servers:
                try:
                    start = _program_runs.start_transfer_server
                    if start is None:  # status() reports why; callers checked it
                        raise RuntimeError(self.unavailable())
                    # Loopback only, on a port the OS picks; started on first use.
                    server = start(client, "127.0.0.1:0", ["127.0.0.1:0"])
                    conn = server.connect(server.address())
                except Exception as e:
                    self._broken = (
                        f"the loopback transfer server did not start "
                        f"({type(e).__name__}: {e})"
                    )
                    # Not a warning: dispatch on pending data is deferred instead
                    # (async_dispatch_status() says so, or why it blocks).
                    logger.info(
                        "jax_threadmap: no gate programs: %s; jitted calls with "
                        "pending AsyncArrays use deferred dispatch.",
                        self._broken,
                    )
                    raise
                self.servers[client] = (server, conn)
            return self.servers[client]

    def _program(self, device: Any, spec: tuple, avals: tuple) -> Any:
        key = (device, spec, avals)
        with self._lock:
            program = self._programs.get(key)
            if program is None:
                if len(self._programs) >= MAX_CACHED_PROGRAMS:
                    self._programs.clear()
                # The callback returns only the shards that hold data: an
                # accelerator's runtime aborts on a 0-size callback result
                # (see _core/primitive.py); the others are made here.
                data = tuple(k for k, a in enumerate(avals) if math.prod(a.shape))
                callback = functools.partial(
                    self._gate_callback, device, spec, frozenset(data)
                )

                def run(ticket: jax.Array, *gates: jax.Array) -> Any:
                    # The last output, 4 bytes, is never 0-size: XLA runs the
                    # callback even when every other output is (it skips a
                    # computation of 0-size outputs only), so the counts it
                    # gives back and the error it raises never go missing.
                    *filled, ran = jax.pure_callback(
                        callback, [*(avals[k] for k in data), _RAN], ticket, *gates
                    )
                    outs = [jnp.zeros(a.shape, a.dtype) for a in avals]
                    for k, value in zip(data, filled, strict=True):
                        outs[k] = value
                    return [*outs, ran]

                program = jax.jit(
                    run, out_shardings=jax.sharding.SingleDeviceSharding(device)
                )
                self._programs[key] = program
        return program

    # -- when the gates arrive, in an XLA thread --

    def _gate_callback(
        self, device: Any, spec: tuple, data: frozenset[int], ticket: Any, *gates: Any
    ) -> list:
        """Copies the shards (those at ``data`` in the flat order of ``spec``:
        the others hold none) of the calls of ``ticket`` (whose ``gates`` are
        open), and gives back the program's counts."""
        held = self._pop_ticket(int(ticket))
        if held is None:  # its dispatch raised: nothing reads these outputs
            raise AsyncCallFailed("the dispatch of this gate program failed")
        try:
            outs = []
            k = 0
            for task, leaves in zip(held.tasks, spec, strict=True):
                for leaf, index in leaves:
                    value = task.gate_data(leaf, index, device)
                    if value is None:  # opened with the call's error
                        self._failed_devices.add(device)
                        raise AsyncCallFailed(task.failure_text())
                    if k in data:
                        outs.append(value)
                    k += 1
            return [*outs, np.int32(0)]
        finally:
            self._give_back(held)

    def clean_up_at_exit(self, timeout: float = EXIT_DRAIN_S) -> None:
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
            time.sleep(EXIT_POLL_S)
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
