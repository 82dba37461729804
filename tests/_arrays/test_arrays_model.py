"""A model of async arrays that checks every edge, after every step.

A hypothesis state machine drives random sequences of background calls (that
return, fail, hang until landed, return 0-size arrays or a pytree; sharded loads;
``async def`` loaders), with no, tiny or huge timeouts,
cancels, ``result()``, jitted dispatches on pending arrays, and data landing.
After every step it checks that the pool never runs more calls than its bound
nor abandons more threads than its cap, and that the programs deferred on
pending data are never more than the model's dispatches allow; a dispatch on
pending data returns before its data (then the dispatch mode, which says
async, told the truth). When a call is looked at, its value equals
the synchronous one (NumPy), or its error is the one it must be, and every
dependent carries that same value or error. At the end, with every load landed,
no program of the model is still deferred.

Loads fail in every way the hostile pass of issue 43 found (``FAULTS``): the
loader raises, returns another library's array whose shape is an int or whose
dtype NumPy cannot read, or whose data raises a ``BaseException`` when read,
raises an exception that refuses attributes, or returns a view (an ndarray
subclass) of a buffer it writes again once the array has landed.
Plain and ``async def`` sharded loads take every fault, as do ``async_call`` s.
``async def`` kernel maps (plain, or a grad whose cotangent is summed on the
host) run on the same event loop meanwhile, with an element that fails in
those ways; their values equal NumPy's, or their error names the element. After
every step the event loop's thread is alive, and a finished sharded load has no
part left running.

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
from helpers import examples, returns_within, wait_until
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
)

from jax_threadmap import (
    KernelError,
    async_array_from_callback,
    async_call,
    async_pool_status,
    kernel,
    threadmap,
)
from jax_threadmap._arrays import async_pool as _async_pool
from jax_threadmap._arrays import dispatch as _dispatch
from jax_threadmap._arrays.shard_loads import ShardedLoad
from jax_threadmap._coroutines import event_loop as _event_loop

pytestmark = pytest.mark.timeout(600)

SDS = jax.ShapeDtypeStruct
WAIT = 60.0
STATUS = _dispatch.mechanism.status()  # why dispatch blocks, or None
ASYNC = STATUS is None
DEVICE = jax.devices()[0]
KINDS = (
    "value",
    "zero",
    "pytree",
    "fail",
    "async",
    "sharded",
    "async sharded",
)
TIMEOUTS = {"none": None, "tiny": 1e-3, "huge": 1e10}
#: The kinds of load that take a fault.
FAULTY = ("value", "async", "sharded", "async sharded")


class Odd(BaseException):
    """An exception of no usual kind (a BaseException, not an Exception)."""


class Frozen(Exception):
    """An exception that refuses attributes."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("frozen exception")


class TorchLikeDtype:
    """A dtype NumPy cannot read."""

    def __repr__(self) -> str:
        return "torch.float32"

    __str__ = __repr__


class Foreign:
    """Another library's array: ``shape`` and ``dtype`` as given; reading its
    data raises ``Odd``."""

    def __init__(self, shape: Any, dtype: Any) -> None:
        self.shape, self.dtype = shape, dtype

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise Odd("its data could not be read")


class Sub(np.ndarray):
    """An ndarray subclass (as np.memmap is)."""


def _aligned_view(value: np.ndarray) -> np.ndarray:
    """A 64-byte aligned copy of ``value`` seen as :class:`Sub`: what
    ``jax.device_put`` may keep as its buffer on the CPU."""
    raw = np.empty(value.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start : start + value.nbytes].view(value.dtype).view(Sub)
    out[...] = value
    return out


#: What a faulty loader returns (or raises) instead of its value, and the
#: outcome every use then has.
FAULTS = {
    "none": "value",
    "raises": "ValueError",
    "int shape": "BadValue",
    "unknown dtype": "BadValue",
    "array raises": "Odd",
    "frozen": "Frozen",
    "subclass view": "value",
}


def _faulty(fault: str, value: np.ndarray, n: int, buffer: Any) -> Any:
    """What a loader with ``fault`` returns, or raises."""
    if fault == "raises":
        raise ValueError(f"model failure {n}")
    if fault == "frozen":
        raise Frozen(f"model failure {n}")
    if fault == "int shape":
        return Foreign(len(value), np.float32)
    if fault == "unknown dtype":
        return Foreign((len(value) + 1, 2), TorchLikeDtype())
    if fault == "array raises":
        return Foreign(value.shape, np.float64)
    if fault == "subclass view":
        return buffer
    return value


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
    outcome: str | None = None  # "value", or the error's type name, once seen
    dependents: list[Any] = field(default_factory=list)  # (y, counted)
    fault: str = "none"
    buffer: Any = None  # what a "subclass view" loader returns (then rewrites)


def _loader(call_box: dict, go: threading.Event, started: threading.Event, value):
    def load(*index):
        started.set()
        go.wait(WAIT)
        if call_box["kind"] == "fail":
            raise ValueError(f"model failure {call_box['n']}")
        out = _faulty(call_box["fault"], value, call_box["n"], call_box["buffer"])
        if index and out is value:  # a shard
            return value[index[0]]
        if call_box["kind"] == "pytree":
            return value, value[:1]
        return out

    return load


def _async_loader(call_box: dict, go: threading.Event, started, value):
    async def load(*index):
        started.set()
        await asyncio.to_thread(go.wait, WAIT)
        await asyncio.sleep(0)
        return _faulty(call_box["fault"], value, call_box["n"], call_box["buffer"])

    return load


# --- async def kernel maps ------------------------------------------------------------

#: How element ``at`` of a map fails, and what the KernelError then says.
MAP_FAULTS = {
    "none": "",
    "raises": "LookupError: model element",
    "kernel raises Odd": "Odd: model element",
    "result raises Odd": "Odd: its data could not be read",
    "wrong shape": "returned shape (2,)",
}


def _element_value(fault: str, value: Any) -> Any:
    if fault == "raises":
        raise LookupError("model element")
    if fault == "kernel raises Odd":
        raise Odd("model element")
    if fault == "result raises Odd":
        return Foreign((), np.float64)
    if fault == "wrong shape":
        return np.zeros(2)
    return value


def _plain_map(x: np.ndarray, fault: str, at: int, bound: int) -> Any:
    async def element(v):
        await asyncio.sleep(0)
        return _element_value(fault, v * 2 + 1) if int(v) == at else v * 2 + 1

    f = lambda v: threadmap(element, SDS((), np.float32), v, max_in_flight=bound)  # noqa: E731
    return jax.vmap(f)(x)


def _summed_grad(x: np.ndarray, fault: str, at: int, bound: int) -> Any:
    @kernel(SDS((), np.float32), max_in_flight=bound)
    async def scaled(v, a):
        return v * a

    @scaled.defvjp
    async def scaled_vjp(v, a, ct):  # the cotangent of `a`: summed on the host
        for _ in range(int(len(x) - v) % 3):  # earlier elements finish later
            await asyncio.sleep(0)
        da = _element_value(fault, ct * v) if int(v) == at else ct * v
        return ct * a, da

    loss = lambda a: jax.vmap(scaled, (0, None))(x, a).sum()  # noqa: E731
    return jax.grad(loss)(np.float32(3.0))


class AsyncArraysModel(RuleBasedStateMachine):
    calls = Bundle("calls")

    def __init__(self) -> None:
        super().__init__()
        self.all: list[Call] = []
        self.deferred_before = _deferred_runs()
        self.abandoned = len(async_pool_status().abandoned)
        self.outstanding = 0  # dispatches on pending data not yet looked at
        self.n = 0

    # -- steps --

    @rule(
        target=calls,
        kind=st.sampled_from(KINDS),
        timeout=st.sampled_from(tuple(TIMEOUTS)),
        size=st.sampled_from([0, 3, 16]),
        fault=st.sampled_from(tuple(FAULTS)),
    )
    def new_call(self, kind: str, timeout: str, size: int, fault: str) -> Call:
        return self._make(kind, timeout, size, fault)

    @rule(
        target=calls,
        kind=st.sampled_from(FAULTY),
        timeout=st.sampled_from(tuple(TIMEOUTS)),
        size=st.sampled_from([3, 16]),
        fault=st.sampled_from(tuple(FAULTS)[1:]),
    )
    def new_faulty_load(self, kind: str, timeout: str, size: int, fault: str) -> Call:
        # A load that fails (or returns a view it writes again): a rule of its
        # own, so that every fault meets sharded loads in a quick run too.
        return self._make(kind, timeout, size, fault)

    def _make(self, kind: str, timeout: str, size: int, fault: str) -> Call:
        self.n += 1
        size = 0 if kind == "zero" else max(size, 1) if kind == "pytree" else size
        fault = fault if kind in FAULTY else "none"
        value = np.arange(size, dtype=np.float32) + self.n
        buffer = _aligned_view(value) if fault == "subclass view" else None
        go = threading.Event()
        started = threading.Event()
        box = {"kind": kind, "n": self.n, "fault": fault, "buffer": buffer}
        sds = SDS((size,), np.float32)
        seconds = TIMEOUTS[timeout]
        load = _loader(box, go, started, value)
        sharding = jax.sharding.SingleDeviceSharding(DEVICE)
        if kind == "pytree":
            x = async_call(load, (sds, SDS((1,), np.float32)), timeout=seconds)[0]
        elif kind == "async":
            load = _async_loader(box, go, started, value)
            x = async_call(load, sds, timeout=seconds)
        elif kind in ("sharded", "async sharded"):
            if kind == "async sharded":
                load = _async_loader(box, go, started, value)
            x = async_array_from_callback(
                (size,), sharding, load, np.float32, timeout=seconds
            )
        else:
            x = async_call(load, sds, timeout=seconds)
        call = Call(kind, timeout, go, value, x, started, fault=fault, buffer=buffer)
        self.all.append(call)
        return call

    @rule(call=calls)
    def land(self, call: Call) -> None:
        call.go.set()
        call.landed = True

    @rule(call=calls)
    def cancel(self, call: Call) -> None:
        if call.x.cancel():
            call.cancelled = True
            self._seen(call, "CancelledError")

    @rule(call=calls)
    def dispatch(self, call: Call) -> None:
        if not ASYNC and not self._ends(call):
            return  # blocking dispatch: it would wait for the landing step
        pending = not call.x.done()
        try:
            # A dispatch on pending data returns before it.
            y = returns_within(
                _jitted, call.x, limit=WAIT, what="return before its data"
            )
        except AssertionError:
            raise
        except (Exception, Odd) as e:  # the call had ended with an error: raised here
            self._seen(call, _error_kind(e, call))
            return
        # Counted if it may have been deferred (an over-count is safe).
        counted = pending and ASYNC
        self.outstanding += counted
        call.dependents.append((y, counted))

    @rule(call=calls)
    def look(self, call: Call) -> None:
        if not self._ends(call):
            return  # it would wait for the landing step
        self._check(call)

    @rule(
        size=st.integers(0, 24),
        fault=st.sampled_from(tuple(MAP_FAULTS)),
        at=st.integers(0, 23),
        bound=st.sampled_from([1, 4, 2048]),
        summed=st.booleans(),
    )
    def async_map(self, size: int, fault: str, at: int, bound: int, summed: bool):
        # An async def kernel map on the loop the loaders share (a grad whose
        # cotangent of an unbatched operand is summed on the host, or a plain
        # map), with element `at` failing in one way: NumPy's values, or the
        # error naming the element.
        x = np.arange(size, dtype=np.float32)
        run = _summed_grad if summed else _plain_map
        failing = fault != "none" and at < size
        try:
            got = returns_within(run, x, fault, at, bound, limit=WAIT, what="end")
        except KernelError as e:
            assert failing, e
            assert e.index == (at,), (e.index, at, fault)
            assert MAP_FAULTS[fault] in str(e), (e, fault)
        else:
            assert not failing, (fault, at, size)
            want = x.sum() if summed else x * 2 + 1
            np.testing.assert_array_equal(np.asarray(got), want)

    # -- checks --

    @invariant()
    def the_event_loop_lives(self) -> None:
        loop = _event_loop.event_loop()
        thread = loop._thread  # read only: the loop publishes it once started
        assert thread is None or thread.is_alive()

    @invariant()
    def a_finished_sharded_load_has_no_shard_running(self) -> None:
        for call in self.all:
            task = call.x._task
            if isinstance(task, ShardedLoad) and task.future.done():
                states = [str(s) + ": " + s.status() for s in task.shards]
                assert all(s.future.done() for s in task.shards), (states, call)

    @invariant()
    def pool_within_bound_and_cap(self) -> None:
        status = async_pool_status()
        cap = _async_pool.ABANDONED_PER_BOUND * status.bound
        assert status.running <= status.bound, status
        assert len(status.abandoned) <= cap, status

    @invariant()
    def deferred_programs_within_the_model(self) -> None:
        deferred = _deferred_runs()
        assert len(deferred - self.deferred_before) <= self.outstanding, deferred
        assert _dispatch.mechanism.status() == STATUS

    def teardown(self) -> None:
        for call in self.all:
            call.go.set()
            call.landed = True
        try:
            for call in self.all:
                self._check(call)
            # No program of the model is still deferred (each leaves the
            # readers in its done-callback, just after its waiters wake).
            wait_until(
                lambda: not (_deferred_runs() - self.deferred_before),
                "the model's deferred programs to leave the readers",
            )
        finally:
            self.all.clear()

    # -- helpers --

    def _ends(self, call: Call) -> bool:
        """Whether the call ends without a later step (so a wait is bounded)."""
        return (
            call.landed
            or call.cancelled
            or call.outcome is not None
            or call.timeout == "tiny"
        )

    def _seen(self, call: Call, outcome: str) -> None:
        if call.outcome is None:
            assert outcome in _allowed(call), (outcome, call)
            call.outcome = outcome
        assert outcome == call.outcome, (outcome, call)

    def _check(self, call: Call) -> None:
        try:
            value = np.asarray(call.x.result(timeout=WAIT))
        except (Exception, Odd) as e:
            assert not isinstance(e, TimeoutError) or "given up on" in str(e), e
            self._seen(call, _error_kind(e, call))
        else:
            self._seen(call, "value")
            np.testing.assert_array_equal(value, call.expected)
            if call.buffer is not None:
                # The loader writes the buffer it returned again, once the
                # array has landed: the array keeps its value (it never is
                # the loader's memory).
                call.buffer[...] = -1
                value = np.asarray(call.x.result(timeout=WAIT))
                np.testing.assert_array_equal(value, call.expected)
        for y, counted in call.dependents:
            self._check_dependent(call, y)
            self.outstanding -= counted
        call.dependents = []

    def _check_dependent(self, call: Call, y: Any) -> None:
        try:
            got = np.asarray(returns_within(np.asarray, y, limit=WAIT))
        except Exception as e:  # the call's error, as the deferred program raised it
            assert call.outcome != "value", (e, call)
            assert call.outcome in str(e) or _text(call) in str(e), (e, call)
        else:
            assert call.outcome == "value", (got, call)
            np.testing.assert_array_equal(got, dependent(call.expected))


def _deferred_runs() -> set[Any]:
    """The deferred programs that are still pending (they read their sources)."""
    runs = list(_dispatch.mechanism.readers.by_source.values())
    return {id(run) for group in runs for run in list(group)}


def _text(call: Call) -> str:
    """What the deferred programs' error says of the call's error."""
    return {
        "ValueError": "model failure",
        "TimeoutError": "timeout=",
        "CancelledError": "cancelled",
        "BadValue": "ValueError",
        "Odd": "its data could not be read",
        "Frozen": "model failure",
    }.get(call.outcome or "", "?")


#: What a bad value's ValueError says (another library's array), by fault.
BAD_VALUE_WORDS = ("not a sequence of integers", "dtype torch.float32")


def _error_kind(error: BaseException, call: Call) -> str:
    if isinstance(error, concurrent.futures.CancelledError):
        return "CancelledError"
    if isinstance(error, TimeoutError):
        return "TimeoutError"
    if isinstance(error, ValueError) and "model failure" in str(error):
        return "ValueError"
    if isinstance(error, ValueError) and any(w in str(error) for w in BAD_VALUE_WORDS):
        return "BadValue"
    if isinstance(error, Odd) and "its data could not be read" in str(error):
        return "Odd"
    if isinstance(error, Frozen) and "model failure" in str(error):
        return "Frozen"
    if isinstance(error, AttributeError) and isinstance(error.__context__, Frozen):
        # Raised at a jitted dispatch: JAX's traceback filter adds a note to
        # what crosses jit (Python 3.11+), which this exception refuses.
        return "Frozen"
    raise AssertionError(f"unexpected error for {call}: {error!r}") from error


def _allowed(call: Call) -> set[str]:
    """The outcomes the call may have (a tiny timeout races its landing)."""
    allowed = {"CancelledError"} if call.cancelled else set()
    if not call.cancelled:
        allowed.add("ValueError" if call.kind == "fail" else FAULTS[call.fault])
    if call.timeout == "tiny":
        allowed.add("TimeoutError")
    return allowed


AsyncArraysModel.TestCase.settings = settings(
    max_examples=examples(200), stateful_step_count=30, deadline=None
)
test_async_arrays_model = AsyncArraysModel.TestCase
