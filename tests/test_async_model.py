"""A model of async arrays that checks every edge, after every step.

A hypothesis state machine drives random sequences of background calls (that
return, fail, hang until landed, return 0-size arrays or a pytree; sharded loads;
``async def`` loaders; ``deferred_call`` s), with no, tiny or huge timeouts,
cancels, ``result()``, jitted dispatches on pending arrays, and data landing.
After every step it checks that the pool never runs more calls than its bound
nor abandons more threads than its cap, and that the gate programs waiting per
device are never more than the model's dispatches allow; a dispatch under the
bound on pending data returns before its data (then ``async_dispatch_status()``,
which says ``'async'``, told the truth). When a call is looked at, its value
equals the synchronous one (NumPy), or its error is the one it must be, and
every dependent carries that same value or error. At the end, with every load
landed, every count is back where it started, and a deferred call cancelled
before its first use never started.

Only events order the steps (a loader waits for its ``land`` step); where a
timeout races a landing, either outcome is accepted, but every use must agree
with the first one seen.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from helpers import examples, returns_within
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from jax_threadmap import (
    async_array_from_callback,
    async_call,
    async_pool_status,
    deferred_call,
)
from jax_threadmap._async import dispatch as _dispatch
from jax_threadmap._async import pool as _async_threads

pytestmark = pytest.mark.timeout(600)

SDS = jax.ShapeDtypeStruct
WAIT = 60.0
STATUS = _dispatch.async_dispatch_status()
ASYNC = STATUS == "async"
DEVICE = jax.devices()[0]
KINDS = ("value", "zero", "pytree", "fail", "async", "sharded", "deferred")
TIMEOUTS = {"none": None, "tiny": 1e-3, "huge": 1e10}


def dependent(a: Any) -> Any:
    return a * 2 + 1


_jitted = jax.jit(dependent)


@dataclass
class Call:
    """One call of the model: its arrays, its events, what it must give."""

    kind: str
    timeout: str
    go: threading.Event
    expected: Any  # the synchronous value (NumPy), leaf 0 for a pytree
    x: Any  # the AsyncArray whose value is checked and dispatched on
    started: threading.Event = field(default_factory=threading.Event)
    landed: bool = False
    cancelled: bool = False  # cancel() returned True
    never_starts: bool = False  # cancelled before any use (deferred)
    used: bool = False  # something asked for its value (a deferred call starts)
    outcome: str | None = None  # "value", or the error's type name, once seen
    dependents: list[Any] = field(default_factory=list)  # (y, counted)


def _loader(call_box: dict, go: threading.Event, started: threading.Event, value):
    def load(*index):
        started.set()
        go.wait(WAIT)
        if call_box["kind"] == "fail":
            raise ValueError(f"model failure {call_box['n']}")
        if index:  # a shard
            return value[index[0]]
        if call_box["kind"] == "pytree":
            return value, value[:1]
        return value

    return load


def _async_loader(go: threading.Event, started: threading.Event, value):
    async def load():
        started.set()
        await asyncio.to_thread(go.wait, WAIT)
        return value

    return load


class AsyncArraysModel(RuleBasedStateMachine):
    calls = Bundle("calls")

    def __init__(self) -> None:
        super().__init__()
        self.all: list[Call] = []
        self.waiting, self.slots = _dispatch.mechanism.counts()
        self.abandoned = len(async_pool_status().abandoned)
        self.outstanding = 0  # dispatches on pending data not yet looked at
        self.n = 0

    # -- steps --

    @rule(
        target=calls,
        kind=st.sampled_from(KINDS),
        timeout=st.sampled_from(tuple(TIMEOUTS)),
        size=st.sampled_from([0, 3]),
    )
    def new_call(self, kind: str, timeout: str, size: int) -> Call:
        self.n += 1
        size = 0 if kind == "zero" else max(size, 1) if kind == "pytree" else size
        value = np.arange(size, dtype=np.float32) + self.n
        go = threading.Event()
        started = threading.Event()
        box = {"kind": kind, "n": self.n}
        sds = SDS((size,), np.float32)
        seconds = TIMEOUTS[timeout]
        load = _loader(box, go, started, value)
        if kind == "pytree":
            x = async_call(load, (sds, SDS((1,), np.float32)), timeout=seconds)[0]
        elif kind == "async":
            x = async_call(_async_loader(go, started, value), sds, timeout=seconds)
        elif kind == "sharded":
            sharding = jax.sharding.SingleDeviceSharding(DEVICE)
            x = async_array_from_callback(
                (size,), sharding, load, np.float32, timeout=seconds
            )
        elif kind == "deferred":
            x = deferred_call(load, sds, timeout=seconds)
        else:
            x = async_call(load, sds, timeout=seconds)
        call = Call(kind, timeout, go, value, x, started)
        call.used = kind != "deferred"
        self.all.append(call)
        return call

    @rule(call=calls)
    def land(self, call: Call) -> None:
        call.go.set()
        call.landed = True

    @rule(call=calls)
    def cancel(self, call: Call) -> None:
        unused = not call.used
        if call.x.cancel():
            call.cancelled = True
            call.never_starts = call.never_starts or unused
            self._seen(call, "CancelledError")

    @precondition(lambda self: self.outstanding < _dispatch.MAX_WAITING_PROGRAMS)
    @rule(call=calls)
    def dispatch(self, call: Call) -> None:
        if not ASYNC and not self._ends(call):
            return  # blocking dispatch: it would wait for the landing step
        pending = not call.x.done()
        call.used = True
        try:
            # Under the bound, a dispatch on pending data returns before it.
            y = returns_within(
                _jitted, call.x, limit=WAIT, what="return before its data"
            )
        except AssertionError:
            raise
        except Exception as e:  # the call had ended with an error: raised here
            self._seen(call, _error_kind(e, call))
            return
        # Counted if it may have made a gate program (an over-count is safe).
        counted = pending and ASYNC
        self.outstanding += counted
        call.dependents.append((y, counted))

    @rule(call=calls)
    def look(self, call: Call) -> None:
        if not self._ends(call):
            return  # it would wait for the landing step
        self._check(call)

    # -- checks --

    @invariant()
    def pool_within_bound_and_cap(self) -> None:
        status = async_pool_status()
        assert status.abandoned_cap == _async_threads.ABANDONED_PER_BOUND * status.bound
        assert status.running <= status.bound, status
        assert len(status.abandoned) <= status.abandoned_cap, status

    @invariant()
    def waiting_programs_within_the_model(self) -> None:
        waiting, _ = _dispatch.mechanism.counts()
        for device, n in waiting.items():
            assert n <= self.waiting.get(device, 0) + self.outstanding, (waiting, self)
        assert _dispatch.async_dispatch_status() == STATUS

    def teardown(self) -> None:
        for call in self.all:
            call.go.set()
            call.landed = True
        try:
            for call in self.all:
                self._check(call)
            for call in self.all:
                if call.never_starts:  # cancelled before its first use
                    assert not call.started.is_set(), call
            # Every count back where it started, once the gate programs ran.
            waiting, slots = _dispatch.mechanism.counts()
            for device, n in waiting.items():
                assert n <= self.waiting.get(device, 0), waiting
            assert slots <= self.slots, slots
        finally:
            self.all.clear()

    # -- helpers --

    def _ends(self, call: Call) -> bool:
        """Whether the call ends without a later step (so a wait is bounded)."""
        return (
            call.landed
            or call.cancelled
            or call.outcome is not None
            or (call.timeout == "tiny" and call.kind != "deferred")
            or (call.timeout == "tiny" and call.used)
        )

    def _seen(self, call: Call, outcome: str) -> None:
        if call.outcome is None:
            assert outcome in _allowed(call), (outcome, call)
            call.outcome = outcome
        assert outcome == call.outcome, (outcome, call)

    def _check(self, call: Call) -> None:
        call.used = True
        try:
            value = np.asarray(call.x.result(timeout=WAIT))
        except Exception as e:
            assert not isinstance(e, TimeoutError) or "given up on" in str(e), e
            self._seen(call, _error_kind(e, call))
        else:
            self._seen(call, "value")
            np.testing.assert_array_equal(value, call.expected)
        for y, counted in call.dependents:
            self._check_dependent(call, y)
            self.outstanding -= counted
        call.dependents = []

    def _check_dependent(self, call: Call, y: Any) -> None:
        try:
            got = np.asarray(returns_within(np.asarray, y, limit=WAIT))
        except Exception as e:  # the call's error, as the gate program raised it
            assert call.outcome != "value", (e, call)
            assert call.outcome in str(e) or _text(call) in str(e), (e, call)
        else:
            assert call.outcome == "value", (got, call)
            np.testing.assert_array_equal(got, dependent(call.expected))


def _text(call: Call) -> str:
    """What the gate programs' error says of the call's error."""
    return {
        "ValueError": "model failure",
        "TimeoutError": "timeout=",
        "CancelledError": "cancelled",
    }.get(call.outcome or "", "?")


def _error_kind(error: BaseException, call: Call) -> str:
    if isinstance(error, concurrent.futures.CancelledError):
        return "CancelledError"
    if isinstance(error, TimeoutError):
        return "TimeoutError"
    if isinstance(error, ValueError) and "model failure" in str(error):
        return "ValueError"
    raise AssertionError(f"unexpected error for {call}: {error!r}") from error


def _allowed(call: Call) -> set[str]:
    """The outcomes the call may have (a tiny timeout races its landing)."""
    allowed = {"CancelledError"} if call.cancelled else set()
    if not call.cancelled:
        allowed.add("ValueError" if call.kind == "fail" else "value")
    if call.timeout == "tiny":
        allowed.add("TimeoutError")
    return allowed


AsyncArraysModel.TestCase.settings = settings(
    max_examples=examples(200), stateful_step_count=30, deadline=None
)
test_async_arrays_model = AsyncArraysModel.TestCase
