"""A slow, broken or stuck load never gives a wrong value or freezes the program.

Each test here failed (or hung, bounded by its timeouts) before the fix it names.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import returns_within

from jax_threadmap import _async, _dispatch, async_call, deferred_call, threadmap

pytestmark = pytest.mark.timeout(120)

SDS = jax.ShapeDtypeStruct
WAIT = 30.0
STATUS = _async.async_dispatch_status()
ASYNC = STATUS.startswith("async")
#: Programs on pending data have a stream of their own (not only thread order).
OWN_STREAM = STATUS == "async"


def in_thread(fn, *args, limit: float = WAIT):
    """Runs ``fn(*args)`` in a daemon thread; fails if it does not end in time."""
    return returns_within(fn, *args, limit=limit, what=f"return within {limit} s")


class Blocker:
    """A pending call with a program dispatched on it by this thread.

    XLA runs the programs that one thread dispatches on pending data in order
    (they share the thread's pending stream), so while it is held, every later
    program of this thread on pending data waits behind it.
    """

    def __enter__(self):
        self.release = threading.Event()
        self.x = async_call(
            lambda: (self.release.wait(WAIT), np.zeros(2, np.float32))[1],
            SDS((2,), np.float32),
        )
        self.y = jax.jit(lambda v: v + 1)(self.x)
        return self

    def __exit__(self, *exc):
        self.release.set()
        in_thread(np.asarray, self.y)


# --- never a wrong value ---------------------------------------------------------


def test_a_buffer_the_loader_refills_later_changes_nothing():
    buf = np.zeros(4, np.int32)
    first = {}
    go = threading.Event()

    def load(v):
        if v == 1:
            go.wait(WAIT)  # until its dependent is dispatched
        else:  # the next load refills the buffer once the first is done
            first["x"].result(timeout=WAIT)
        buf[:] = v
        return buf

    square = jax.jit(lambda v: v * v)
    with Blocker():  # the dependent's copy of the data is queued behind it
        x1 = first["x"] = async_call(load, SDS((4,), np.int32), 1)
        y1 = square(x1)
        go.set()
        x2 = async_call(load, SDS((4,), np.int32), 2)
        x2.result(timeout=WAIT)
    np.testing.assert_array_equal(np.asarray(x1), [1, 1, 1, 1])
    np.testing.assert_array_equal(in_thread(np.asarray, y1), [1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(x2), [2, 2, 2, 2])


def test_a_value_is_there_as_soon_as_the_call_returns():
    # The data used to be held back (2 s) while its copy for a dependent queued.
    go = threading.Event()
    with Blocker():
        x = async_call(
            lambda: (go.wait(WAIT), np.arange(3, dtype=np.int32))[1],
            SDS((3,), np.int32),
        )
        y = jax.jit(lambda v: v + 1)(x)  # its copy of x queues behind the blocker
        go.set()
        start = time.perf_counter()
        got = x.result(timeout=WAIT)
        elapsed = time.perf_counter() - start
    np.testing.assert_array_equal(got, [0, 1, 2])
    np.testing.assert_array_equal(in_thread(np.asarray, y), [1, 2, 3])
    assert elapsed < 1.5, f"result() took {elapsed:.2f} s after the data was there"


# --- unrelated work does not wait behind a load -----------------------------------


class Pending:
    """A load held until the test ends, and a program dispatched on it."""

    def __enter__(self):
        self.release = threading.Event()
        self.x = async_call(
            lambda: (self.release.wait(WAIT), np.full(3, 4, np.float32))[1],
            SDS((3,), np.float32),
        )
        self.y = jax.jit(lambda v: v * 2)(self.x)
        return self

    def __exit__(self, *exc):
        self.release.set()
        np.testing.assert_array_equal(in_thread(np.asarray, self.y), [8, 8, 8])


@pytest.mark.skipif(not OWN_STREAM, reason=f"async dispatch status: {STATUS}")
def test_unrelated_work_of_the_same_thread_does_not_wait_for_a_pending_load():
    # Was: XLA ran the thread's programs in order, so g ran only once x arrived.
    g = jax.jit(lambda v: v + 1)
    with Pending() as p:
        got = in_thread(lambda: np.asarray(g(jnp.ones(3))))
        assert not p.release.is_set()
        np.testing.assert_array_equal(got, [2, 2, 2])
        # The same, dispatched from this thread itself, with a jitted call on a
        # value already loaded, an eager jnp call and an eager threadmap.
        done = async_call(lambda: np.ones(3, np.float32), SDS((3,), np.float32))
        done.result(timeout=WAIT)
        outs = [
            g(jnp.ones(3)),
            jax.jit(lambda v: v * 3)(done),
            jnp.sin(jnp.zeros(3)),
            threadmap(lambda v: v + 5, SDS((3,), np.float32), np.ones(3, np.float32)),
        ]
        for out in outs:
            in_thread(out.block_until_ready, limit=WAIT / 2)
        assert not p.release.is_set()
    np.testing.assert_array_equal(np.asarray(outs[1]), [3, 3, 3])
    np.testing.assert_array_equal(np.asarray(outs[3]), [6, 6, 6])


@pytest.mark.skipif(not OWN_STREAM, reason=f"async dispatch status: {STATUS}")
def test_programs_on_pending_data_keep_their_order_and_the_thread_its_stream():
    from jax_threadmap import _compat

    stream_of_thread = _compat.get("get_execution_stream_id")
    before = stream_of_thread()
    with Pending() as p:
        assert stream_of_thread() == before  # switched back after the dispatch
        # A program that uses the pending result waits for it (data), and a
        # second program on pending data waits behind the first (its stream),
        # even once its own data is there.
        z = jax.jit(lambda v: v - 1)(p.y)
        go = threading.Event()
        later = async_call(
            lambda: (go.wait(WAIT), np.ones(3, np.float32))[1], SDS((3,), np.float32)
        )
        w = jax.jit(lambda v: v + 9)(later)
        assert stream_of_thread() == before
        go.set()
        later.result(timeout=WAIT)
        time.sleep(0.2)
        assert not z.is_ready() and not w.is_ready()
        assert not p.release.is_set()
    np.testing.assert_array_equal(in_thread(np.asarray, z), [7, 7, 7])
    np.testing.assert_array_equal(in_thread(np.asarray, w), [10, 10, 10])


@pytest.mark.skipif(not ASYNC, reason=f"async dispatch status: {STATUS}")
def test_a_profiler_already_set_is_kept_and_dispatch_stays_in_thread_order():
    calls = []

    def profiler(frame, event, arg):
        calls.append(event)

    release = threading.Event()
    x = async_call(
        lambda: (release.wait(WAIT), np.ones(2, np.float32))[1], SDS((2,), np.float32)
    )
    sys.setprofile(profiler)
    try:
        y = jax.jit(lambda v: v + 1)(x)
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
        release.set()
    assert calls
    np.testing.assert_array_equal(in_thread(np.asarray, y), [2, 2])


# --- errors that cannot be printed, errors shared between calls ---------------------


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text for this error")


def test_an_error_whose_text_cannot_be_built_reaches_every_use():
    release = threading.Event()

    def load():
        release.wait(WAIT)
        raise Unprintable()

    x = async_call(load, SDS((3,), np.float32))
    y = jax.jit(lambda v: v * 2)(x)
    release.set()
    with pytest.raises(Unprintable):
        x.result(timeout=WAIT)
    with pytest.raises(Unprintable):
        in_thread(jax.jit(lambda v: v + 1), x)
    assert "failed: Unprintable (its message could not be built" in repr(x)
    if ASYNC:  # the dependent dispatched before the failure
        with pytest.raises(Exception, match="failed with Unprintable") as info:
            in_thread(np.asarray, y)
        assert "load" in str(info.value)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes: 3.11+")
def test_one_exception_raised_by_two_calls_carries_one_note():
    error = KeyError("the same object")

    def load():
        raise error

    a = async_call(load, SDS((2,), np.float32))
    b = async_call(load, SDS((2,), np.float32))
    for x in (a, b, a):
        with pytest.raises(KeyError) as info:
            x.result(timeout=WAIT)
        notes = [n for n in info.value.__notes__ if "raised by" in n]
        assert len(notes) == 1, notes


# --- one dtype rule ---------------------------------------------------------------


def test_the_dtype_rule_is_threadmap_s():
    x = async_call(lambda: np.int64(5), SDS((), np.int8))
    ref = threadmap(lambda v: np.int64(5), SDS((), np.int8), jnp.zeros(()))
    assert x.result(timeout=WAIT).dtype == ref.dtype == np.int8
    assert int(x) == int(ref) == 5
    with pytest.raises(ValueError, match=r"int8.*its range is -128 to 127"):
        async_call(lambda: np.int64(300), SDS((), np.int8)).result(timeout=WAIT)


def test_the_dtype_rule_does_not_depend_on_x64(x64):
    del x64
    x = async_call(lambda: np.float64(1.5), SDS((), np.float32))
    assert x.result(timeout=WAIT).dtype == np.float32
    assert float(x) == 1.5
    y = async_call(lambda: np.arange(3), SDS((3,), np.int16))
    np.testing.assert_array_equal(np.asarray(y), [0, 1, 2])


# --- smaller -----------------------------------------------------------------------


def test_a_shape_dtype_struct_returned_instead_of_data_is_named():
    def load():
        return {"w": SDS((2,), np.float32)}

    out = async_call(load, {"w": SDS((2,), np.float32)})
    with pytest.raises(ValueError, match=r"load.*at \['w'\]: a ShapeDtypeStruct"):
        out["w"].result(timeout=WAIT)


def test_async_threads_are_capped(monkeypatch):
    monkeypatch.setenv(_async.ENV_ASYNC_THREADS, "100000")
    with pytest.raises(ValueError, match=r"JAX_THREADMAP_ASYNC_THREADS.*4096"):
        _async.default_async_threads()
    monkeypatch.setenv(_async.ENV_ASYNC_THREADS, "4096")
    assert _async.default_async_threads() == 4096


# --- giving up on a stuck load -----------------------------------------------------


class Stuck:
    """A load that returns only when the test ends it."""

    def __init__(self):
        self.release = threading.Event()
        self.returned = threading.Event()

    def __call__(self):
        self.release.wait(WAIT)
        self.returned.set()
        return np.full(3, 7.0, np.float32)


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_stuck_load_is_given_up_on(how):
    load = Stuck()
    kwargs = {"timeout": 0.5} if how == "timeout" else {}
    x = async_call(load, SDS((3,), np.float32), **kwargs)
    y = jax.jit(lambda v: v * 2)(x)  # dispatched while it loads
    z = jax.jit(lambda v: v + 3)(jnp.ones(3))  # queued behind y on this thread
    if how == "cancel":
        assert x.cancel() is True
    error = TimeoutError if how == "timeout" else concurrent.futures.CancelledError
    text = "did not return within timeout=0.5 s" if how == "timeout" else "cancelled"
    with pytest.raises(error, match=f"Stuck.*{text}"):
        x.result(timeout=WAIT)
    with pytest.raises(Exception, match=f"{error.__name__}.*Stuck.*{text}"):
        in_thread(np.asarray, y)
    np.testing.assert_array_equal(in_thread(np.asarray, z), [4.0, 4.0, 4.0])
    with pytest.raises(error):  # later uses re-raise
        in_thread(jax.jit(lambda v: v - 1), x)
    assert x.cancel() is False and x.done()
    load.release.set()  # the load returns at last: its value is dropped
    assert load.returned.wait(WAIT)
    with pytest.raises(error):
        np.asarray(x)


def test_cancel_of_a_deferred_call_never_runs_it_and_of_a_done_one_is_false():
    ran = []
    x = deferred_call(lambda: ran.append(1) or np.zeros(2), SDS((2,), np.float32))
    assert x.cancel() is True
    with pytest.raises(concurrent.futures.CancelledError, match="lambda"):
        x.result()
    assert ran == []
    done = async_call(np.zeros, SDS((2,), np.float32), 2)
    done.result(timeout=WAIT)
    assert done.cancel() is False
    np.testing.assert_array_equal(np.asarray(done), [0.0, 0.0])


def test_a_timeout_holds_for_the_thread_that_waits_without_one():
    load = Stuck()
    x = deferred_call(load, SDS((3,), np.float32), timeout=0.5)
    with pytest.raises(TimeoutError, match="timeout=0.5"):
        in_thread(x.result)  # runs on the pool, not in this thread
    load.release.set()


@pytest.mark.parametrize(
    "timeout, exc, pattern",
    [
        ("5", TypeError, r"timeout must be None or a number.*functools.partial"),
        (True, TypeError, r"timeout must be None or a number"),
        (0, ValueError, r"positive, finite number of seconds. Got timeout=0"),
        (float("inf"), ValueError, r"Got timeout=inf"),
    ],
)
def test_a_bad_timeout_fails_at_the_call(timeout, exc, pattern):
    with pytest.raises(exc, match=pattern):
        async_call(np.zeros, SDS((2,), np.float32), 2, timeout=timeout)


# --- dispatch never waits forever -----------------------------------------------------


def _loop(n, stuck, timeout=None):
    """``f(async_call(load, i))`` for i < n, where load(0) returns only when told."""

    def load(i):
        if i == 0:
            stuck.wait(WAIT)
        return np.full(3, i, np.float32)

    f = jax.jit(lambda v: v * 2)
    kwargs = {} if timeout is None else {"timeout": timeout}
    xs, ys = [], []
    for i in range(n):
        xs.append(async_call(load, SDS((3,), np.float32), i, **kwargs))
        ys.append(f(xs[-1]))
    return xs, ys


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
def test_a_loop_behind_a_load_that_times_out_finishes_with_right_values():
    stuck = threading.Event()
    try:
        xs, ys = in_thread(_loop, 50, stuck, 2.0)
        with pytest.raises(Exception, match="TimeoutError.*load.*timeout=2.0"):
            in_thread(np.asarray, ys[0])
        for i in range(1, 50):
            np.testing.assert_array_equal(in_thread(np.asarray, ys[i]), [2 * i] * 3)
    finally:
        stuck.set()


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
def test_a_loop_behind_a_stuck_load_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(_dispatch, "DISPATCH_WAIT_S", 1.0)
    stuck = threading.Event()
    try:
        with pytest.raises(RuntimeError, match=r"queued behind `\S*load`.*timeout="):
            in_thread(_loop, 50, stuck)
    finally:
        stuck.set()


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
def test_ctrl_c_ends_a_loop_behind_a_stuck_load_and_the_process_exits():
    script = textwrap.dedent(
        """
        import threading, jax, numpy as np
        import jax_threadmap as jtm

        def load(i):
            if i == 0:
                threading.Event().wait()  # a download that hangs
            return np.full(3, i, np.float32)

        f = jax.jit(lambda v: v * 2)
        try:
            for i in range(500):
                y = f(jtm.async_call(load, jax.ShapeDtypeStruct((3,), np.float32), i))
                if i == 5:
                    print("queued", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout.readline().strip() == "queued"
        time.sleep(2.0)  # into the wait of dispatch (call 9 or so)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "interrupted" in out, (out, err)
    assert "`load` (async_call)" in err
