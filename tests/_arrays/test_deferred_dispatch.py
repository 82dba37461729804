"""Deferred dispatch: a jitted call on pending data returns at once, its program
runs on the device once the data lands, and nothing else waits for it.

The one mechanism of async dispatch on every platform
(jax_threadmap/_arrays/dispatch.py). Each test holds
the background call on an Event it releases itself, so "returned before the data"
is checked without timing: the dispatch runs in a helper thread, which must finish
while the gate is still closed. Values are compared with NumPy on the host.
"""

from __future__ import annotations

import gc
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import F32_RTOL, examples, returns_within, run_script, wait_until
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from jax.experimental import io_callback
from wait_hooks import calling_on_wait

from jax_threadmap import AsyncArray, async_call, threadmap
from jax_threadmap._arrays import dispatch as _dispatch

SDS = jax.ShapeDtypeStruct
WAIT = 30.0
F32 = SDS((3,), np.float32)


pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        _dispatch.mechanism.status() is not None,
        reason=f"async dispatch is off here: {_dispatch.mechanism.status()}",
    ),
]


class Gate:
    """A background function that returns (or raises) only when released."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error
        self.release = threading.Event()
        self.calls = 0
        self.__name__ = self.__qualname__ = "load"

    def __call__(self):
        self.calls += 1
        if not self.release.wait(WAIT):
            raise RuntimeError("the test never released the gate")
        if self.error is not None:
            raise self.error
        return self.value


def gated(value=None, error=None, shape=F32, **kwargs):
    gate = Gate(value, error)
    return gate, async_call(gate, shape, **kwargs)


def while_gated(fn, *args):
    """``fn(*args)`` in a thread; fails unless it returns while the data is missing."""
    return returns_within(fn, *args, limit=WAIT, what="return while the data missed")


def test_a_call_returns_arrays_at_once_and_their_values_follow():
    value = np.arange(3, dtype=np.float32)
    gate, x = gated(value)
    f = jax.jit(lambda a: {"twice": a * 2, "sum": a.sum()})
    y = while_gated(f, x)
    assert isinstance(y["twice"], AsyncArray) and isinstance(y["sum"], AsyncArray)
    assert y["twice"].shape == (3,) and y["sum"].dtype == np.float32
    assert not y["twice"].done() and "pending, from `jit(<lambda>)`" in repr(y["sum"])
    assert not y["twice"].is_ready()
    gate.release.set()
    # Printed as the jax.Array it stands for: its values, once they are there.
    assert str(y["twice"]) == str(jnp.asarray(value * 2)) == "[0. 2. 4.]"
    np.testing.assert_array_equal(np.asarray(y["twice"]), value * 2)
    np.testing.assert_array_equal(np.asarray(y["sum"]), value.sum())
    assert isinstance(y["twice"].result(), jax.Array) and y["twice"].is_ready()
    assert repr(y["twice"]) == repr(y["twice"].result())  # landed: JAX's repr
    assert gate.calls == 1


def test_a_program_that_does_not_use_the_data_runs_meanwhile():
    gate, x = gated(np.ones(3, np.float32))
    y = while_gated(jax.jit(lambda a: a + 1), x)
    # Dispatched after it, on the same device and thread: done before the load.
    other = while_gated(
        lambda: jax.jit(lambda b: b * 3)(jnp.ones(2)).block_until_ready()
    )
    np.testing.assert_array_equal(other, [3.0, 3.0])
    assert not x.done() and not y.done()
    gate.release.set()
    np.testing.assert_array_equal(np.asarray(y), [2.0, 2.0, 2.0])


def test_chains_eager_ops_and_mixed_arguments():
    value = np.arange(3, dtype=np.float32)
    gate, x = gated(value)
    ready = jnp.full(3, 10.0)
    host = np.full(3, 100.0, np.float32)
    y = while_gated(jax.jit(lambda a, b, c: a + b + c), x, ready, host)
    host[:] = -1.0  # written after the call: the program keeps what it was given
    z = while_gated(jax.jit(lambda a: a * 2), y)  # on a pending result in turn
    s = while_gated(jnp.sin, x)  # eager
    gate.release.set()
    np.testing.assert_array_equal(np.asarray(y), value + 110.0)
    np.testing.assert_array_equal(np.asarray(z), (value + 110.0) * 2)
    np.testing.assert_allclose(np.asarray(s), np.sin(value), rtol=F32_RTOL, atol=1e-6)


def test_finished_programs_keep_neither_what_they_read_nor_what_they_made():
    """An input that lives on (weights) keeps neither the programs run on it
    while pending, nor their outputs and arguments (it kept all of them); the
    end of a chain keeps none of the middle: as many arrays live on after a
    few programs as after many."""
    shape = (7, 13)  # no other test's arrays: counted among the live ones
    add = jax.jit(lambda a, b: a + b)

    def live() -> int:
        gc.collect()
        return sum(a.shape == shape for a in jax.live_arrays())

    def run(n: int) -> AsyncArray:
        gate, x = gated(np.ones(shape, np.float32), shape=SDS(shape, jnp.float32))
        for i in range(n):
            y = while_gated(add, x, jnp.full(shape, float(i)))
            z = while_gated(lambda a, i=i: a * float(i), x)
        chain = x + 1
        for _ in range(2 * n):
            chain = chain * 2
        gate.release.set()
        np.testing.assert_array_equal(np.asarray(y), np.full(shape, n))
        np.testing.assert_array_equal(np.asarray(z), np.full(shape, n - 1.0))
        want = np.full(shape, 2.0 ** (2 * n + 1))
        np.testing.assert_array_equal(np.asarray(chain), want)
        return x

    x = run(2)
    few = live()
    del x
    x = run(6)
    # (a pool thread may hold its last program's outputs a moment longer)
    wait_until(lambda: live() <= few, f"as few live arrays as {few}", timeout=WAIT)
    np.testing.assert_array_equal(np.asarray(x), np.ones(shape))  # it lived on


def test_an_op_whose_landed_argument_is_handed_on_first_still_runs():
    """``x + y`` waits for ``y``; ``x`` landed and is handed to a program first:
    the op reads a copy of ``x`` then, and gives ``x + y`` (it raised
    AttributeError: the copy is a ``jax.Array``, with no ``result``)."""
    gate_x, x = gated(np.full(3, 1.0, np.float32))
    gate_y, y = gated(np.full(3, 10.0, np.float32))
    ops = {
        "x + y": lambda a, b: a + b,
        "x.at[0].set(y[1])": lambda a, b: a.at[0].set(b[1]),
    }
    got = {k: while_gated(f, x, y) for k, f in ops.items()}
    gate_x.release.set()
    twice = jax.jit(lambda a: a * 2)(x)  # hands x's buffer on, y still pending
    gate_y.release.set()
    np.testing.assert_array_equal(np.asarray(twice), np.full(3, 2.0))
    a, b = jnp.full(3, 1.0), jnp.full(3, 10.0)
    for k, f in ops.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(f(a, b)), k)


def test_a_kernel_inside_the_deferred_program():
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    gate, x = gated(value, shape=SDS((2, 3), np.float32))
    f = jax.jit(jax.vmap(lambda r: threadmap(np.sort, SDS((3,), r.dtype), -r)))
    y = while_gated(f, x)
    gate.release.set()
    np.testing.assert_array_equal(np.asarray(y), np.sort(-value, axis=-1))


@pytest.mark.parametrize("how", ["raises", "times out", "cancelled"])
def test_a_failed_load_fails_every_dependent_with_its_error(how, caplog):
    if how == "raises":
        gate, x = gated(error=OSError("no route to the weights"))
        expected = "`load`, which jax_threadmap.async_call ran, failed with OSError"
    elif how == "times out":  # its deadline passes after the dispatch (below)
        gate, x = gated(np.ones(3, np.float32), timeout=3600.0)
        expected = "TimeoutError: `load`, which jax_threadmap.async_call ran"
    else:
        gate, x = gated(np.ones(3, np.float32))
        expected = "CancelledError: `load`, which jax_threadmap.async_call ran"
    runs = []

    def count(v):
        runs.append(1)
        return v

    f = jax.jit(lambda a: threadmap(count, F32, a))  # counts the program's runs
    with caplog.at_level(logging.WARNING, logger="jax_threadmap"):
        y = while_gated(f, x)
        z = while_gated(jax.jit(lambda a: a - 1), y)  # a chain
        if how == "cancelled":
            assert x.cancel()
        elif how == "times out":
            x._task.time_out()  # what the event loop calls at the deadline
        gate.release.set()
        for dependent in (y, z, y):  # every use, every time
            with pytest.raises(jax.errors.JaxRuntimeError) as info:
                np.asarray(dependent)
            text = str(info.value)
            assert f"AsyncCallFailed: {expected}" in text, text
            assert text.count("AsyncCallFailed") == 1, text  # not nested
        with pytest.raises(jax.errors.JaxRuntimeError, match="AsyncCallFailed"):
            z.block_until_ready()
    assert runs == []  # the program never ran
    reports = [r.getMessage() for r in caplog.records if "`load`" in r.getMessage()]
    assert len(reports) == 1, reports  # once per failed call, whatever depends on it
    if how == "raises":
        with pytest.raises(OSError, match="no route"):  # the array's own uses
            x.result()
        assert y.done(), repr(y)
        cause = _cause(y)
        assert isinstance(cause, OSError), repr(cause)


def test_a_failed_load_fails_every_program_of_a_long_chain():
    # Each program of the chain fails from the done-callback of the one before:
    # 600 of them once overflowed the stack there, and the rest never ended.
    gate, x = gated(error=OSError("no route to the weights"))
    f = jax.jit(lambda a: a + 1)
    chain = [x]
    for _ in range(600):
        chain.append(f(chain[-1]))
    gate.release.set()
    for y in (chain[-1], chain[1], chain[300]):
        with pytest.raises(jax.errors.JaxRuntimeError, match="no route") as info:
            y.result(timeout=WAIT)
        assert "AsyncCallFailed" in str(info.value), str(info.value)
    ok = jnp.zeros(3, np.float32)
    for _ in range(600):  # and a chain on ready data computes
        ok = f(ok)
    np.testing.assert_array_equal(np.asarray(ok), np.full(3, 600, np.float32))


def test_a_waiter_never_dispatches_a_program_whose_input_is_failing(monkeypatch):
    # A failure along a chain is queued (not nested): the program on the failed
    # program's results learns of it in two steps, its input counted as ended,
    # then failed. A waiter that looks between the two must see a failed input,
    # not a landed one, and never dispatch the program. The failing thread is
    # held right there, and the waiter's step runs then.
    gate, x = gated(error=OSError("no route to the weights"))
    y = while_gated(jax.jit(lambda a: a + 1), x)
    z = while_gated(jax.jit(lambda a: a * 2), y)  # on y's program: a chain
    second = z._task
    dispatched = []

    def dispatch(args):
        dispatched.append(args)
        raise AssertionError("dispatched a program whose input failed")

    second._dispatch = dispatch
    held, go = threading.Event(), threading.Event()
    fail_for = type(second)._fail_for

    def holding(run, task):
        if run is second:  # between its input's end and its own failure
            held.set()
            assert go.wait(WAIT), "the test never let the failure go on"
        fail_for(run, task)

    monkeypatch.setattr(type(second), "_fail_for", holding)
    gate.release.set()
    wait_until(held, "the failure to reach the second program")
    try:
        second.run()  # what a thread waiting for z does first
    finally:
        go.set()
    assert dispatched == []  # the program never ran
    with pytest.raises(jax.errors.JaxRuntimeError, match="no route") as info:
        z.result(timeout=WAIT)
    assert str(info.value).count("AsyncCallFailed") == 1, str(info.value)


def test_a_program_on_a_failed_and_a_pending_argument_never_runs():
    # The failed argument had ended at the call: it fails the program as one
    # that fails later does, and the program is never dispatched.
    def load():
        raise OSError("no route to the weights")

    failed = async_call(load, F32)
    wait_until(failed.done, "the failing load to end")
    gate, x = gated(np.ones(3, np.float32))
    y = while_gated(jax.jit(lambda a, b: a + b), failed, x)  # deferred: x pends
    dispatched = []

    def dispatch(args):
        dispatched.append(args)
        raise AssertionError("dispatched a program whose input failed")

    y._task._dispatch = dispatch
    gate.release.set()
    with pytest.raises(jax.errors.JaxRuntimeError, match="no route") as info:
        y.result(timeout=WAIT)
    assert "AsyncCallFailed" in str(info.value), str(info.value)
    assert dispatched == []
    np.testing.assert_array_equal(np.asarray(x), np.ones(3))


def test_a_wait_for_the_end_of_a_long_chain_helps_it_without_nesting():
    # np.asarray(y) on the last of 2000 pending programs: the waiter helps the
    # chain from its first program on, not nested (it overflowed the stack).
    gate, x = gated(np.zeros(3, np.float32))
    f = jax.jit(lambda a: a + 1)
    y = x
    for _ in range(2000):
        y = f(y)
    # Released once the main thread is inside its wait (a release before the
    # wait makes the test pass whatever the code): the load runs on the pool,
    # and the main thread's wait for it is the first step of its help.
    wait_until(lambda: gate.calls == 1, "the load to start on the pool")
    with calling_on_wait(gate.release.set):
        np.testing.assert_array_equal(np.asarray(y), np.full(3, 2000, np.float32))


def _cause(array):
    try:
        array.result()
    except jax.errors.JaxRuntimeError as e:
        return e.__cause__
    return None


def test_cancelling_a_deferred_program_means_it_never_runs():
    gate, x = gated(np.ones(3, np.float32))
    runs = []

    def count(v):
        runs.append(1)
        return v

    y = while_gated(jax.jit(lambda a: threadmap(count, F32, a)), x)
    assert y.cancel() and not y.cancel()
    gate.release.set()
    with pytest.raises(Exception, match="`jit\\(<lambda>\\)`, which jax_threadmap's"):
        y.result()
    np.testing.assert_array_equal(np.asarray(x), np.ones(3))  # the load landed
    assert runs == []


def test_a_program_with_ordered_effects_waits_for_its_data_at_dispatch():
    value = np.arange(3, dtype=np.float32)
    gate, x = gated(value)
    seen = []
    effect_ran = threading.Event()

    def effect(v):
        seen.append(np.asarray(v))
        effect_ran.set()

    def f(a):
        io_callback(effect, None, a, ordered=True)
        return a + 1

    box = {}
    t = threading.Thread(target=lambda: box.update(y=jax.jit(f)(x)))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # it waits for the data, in Python
    gate.release.set()
    t.join(WAIT)
    # Run at once on the landed data (not deferred): an AsyncArray that is done.
    assert isinstance(box["y"], AsyncArray) and box["y"].done()
    np.testing.assert_array_equal(np.asarray(box["y"]), value + 1)
    # (Not jax.effects_barrier(): it would also raise the error of an earlier
    # test's failed program with host callbacks on this thread.)
    assert effect_ran.wait(WAIT)
    np.testing.assert_array_equal(seen[0], value)


def test_a_donated_pending_argument_is_deleted_once_its_program_ran():
    gate, x = gated(np.ones(3, np.float32))
    y = while_gated(jax.jit(lambda a: a * 2, donate_argnums=0), x)
    gate.release.set()
    np.testing.assert_array_equal(np.asarray(y), [2.0] * 3)
    if jax.default_backend() != "cpu":  # the CPU does not donate
        assert x.is_deleted()
        with pytest.raises(RuntimeError, match="deleted"):
            np.asarray(x)


# --- the model: random programs on pending, landed, failed and program data ----------

OPS = {
    "add": (lambda a, b: a + b, np.add),
    "mul": (lambda a, b: a * b, np.multiply),
    "sub": (lambda a, b: a - b, np.subtract),
}


class DeferredPrograms(RuleBasedStateMachine):
    """Loads land or fail in any order; programs are dispatched on any mix of
    pending, landed, failed and program arrays. After every step: a program's
    result is pending while one of its inputs is, and once all landed it equals
    NumPy on the host, or raises the error of a failed load it depends on."""

    @initialize()
    def start(self):
        self.loads = []  # (gate, array, value, fails)
        self.arrays = []  # (array, host value or None, failed load names)
        self.deps = []  # of each array: the loads it depends on

    @rule(seed=st.integers(0, 10**6), fails=st.booleans())
    def load(self, seed, fails):
        value = np.random.default_rng(seed).integers(-9, 9, 3).astype(np.float32)
        name = f"load_{len(self.loads)}"
        gate = Gate(value, OSError(f"{name} failed") if fails else None)
        gate.__name__ = gate.__qualname__ = name
        x = async_call(gate, F32)
        self.loads.append((gate, x, value, fails))
        self.arrays.append((x, None if fails else value, {name} if fails else set()))
        self.deps.append({name})

    @precondition(lambda self: self.arrays)
    @rule(data=st.data(), op=st.sampled_from(sorted(OPS)))
    def dispatch(self, data, op):
        i = data.draw(st.integers(0, len(self.arrays) - 1))
        j = data.draw(st.integers(0, len(self.arrays) - 1))
        (a, va, fa), (b, vb, fb) = self.arrays[i], self.arrays[j]
        fn, ref = OPS[op]
        failed = fa | fb
        if a is None or b is None:  # a dispatch that raised: nothing to use
            self.arrays.append((None, None, failed))
            self.deps.append(self.deps[i] | self.deps[j])
            return
        try:
            y = returns_within(jax.jit(fn), a, b, limit=WAIT, what="return")
        except Exception as e:  # a failed load that had ended raises at the call
            assert failed and any(f"{name} failed" in str(e) for name in failed), e
            # Kept in the list (as None) all the same: whether the load had ended
            # is timing, and the next draws' ranges must not depend on it.
            y, va = None, None
        value = None if va is None or vb is None else ref(va, vb)
        self.arrays.append((y, value, failed))
        self.deps.append(self.deps[i] | self.deps[j])

    @precondition(lambda self: any(not g.release.is_set() for g, *_ in self.loads))
    @rule(data=st.data())
    def release(self, data):
        waiting = [g for g, *_ in self.loads if not g.release.is_set()]
        data.draw(st.sampled_from(waiting)).release.set()

    @invariant()
    def pending_while_an_input_is(self):
        # Done only once every load it depends on is released, or a failed one.
        released = {g.__name__ for g, *_ in self.loads if g.release.is_set()}
        failed = {g.__name__ for g, _, _, fails in self.loads if fails}
        for (array, *_), deps in zip(self.arrays, self.deps, strict=True):
            if array is None:  # a dispatch that raised
                continue
            if not isinstance(array, AsyncArray) or array.done():  # (or dispatched)
                assert deps <= released or deps & released & failed, (deps, released)

    def teardown(self):
        for gate, *_ in self.loads:
            gate.release.set()
        for array, value, failed in self.arrays:
            if array is None:  # a dispatch that raised (checked there)
                continue
            if failed:
                with pytest.raises(Exception) as info:  # a load's own, or a program's
                    np.asarray(array)
                text = str(info.value)
                assert any(f"{name} failed" in text for name in failed), text
            else:
                np.testing.assert_array_equal(np.asarray(array), value)


def test_deferred_programs_model():
    run = DeferredPrograms.TestCase
    run.settings = settings(
        max_examples=examples(40),
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    run().runTest()


EXIT_SCRIPT = """
import threading
import numpy as np, jax, jax.numpy as jnp
import jax_threadmap as jtm

go = threading.Event()
def load():
    go.wait(60)
    return np.ones(4, np.float32)

x = jtm.async_call(load, jax.ShapeDtypeStruct((4,), np.float32))
y = jax.jit(lambda v: v * 2)(x)
h = jax.jit(lambda v, i: v + i)
outs = [h(y, i) for i in range(30)]  # deferred behind y
go.set()
print("last", np.asarray(outs[-1]).tolist(), flush=True)
# Exits while the other programs may still be dispatched from the pool.
"""


def test_exit_while_deferred_programs_are_dispatched_is_clean():
    # Was: a pool thread still inside JAX's dispatch while the interpreter
    # finalized ("FATAL: exception not rethrown", SIGABRT). Exit waits for the
    # programs whose data landed, as for a call placing its values.
    for _ in range(2):
        proc = run_script(EXIT_SCRIPT, forked=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == "last [31.0, 31.0, 31.0, 31.0]\n", proc.stdout
        assert "FATAL" not in proc.stderr, proc.stderr
        assert "jax_threadmap" not in proc.stderr, proc.stderr  # nothing to report
