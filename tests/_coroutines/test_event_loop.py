"""``async def`` loaders: async_call on the package's event loop.

Each test waits on events (asyncio or threading), never on elapsed time; the
bounds only turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import sys
import threading

import jax
import numpy as np
import pytest
from helpers import run_script

import jax_threadmap as jtm
from jax_threadmap._coroutines import event_loop as _event_loop

pytestmark = pytest.mark.timeout(120)

SDS = jax.ShapeDtypeStruct
F32 = SDS((3,), np.float32)
WAIT = 30.0


async def load(value: float) -> np.ndarray:
    await asyncio.sleep(0)
    return np.full(3, value, np.float32)


class Hung:
    """An async def loader that awaits forever; records its start and cancel."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def __call__(self) -> np.ndarray:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()  # its clean-up runs: connections get closed
            raise
        raise AssertionError("never set")


# --- what runs on the loop ---------------------------------------------------------


class AsyncCallable:
    async def __call__(self, value: float) -> np.ndarray:
        return await load(value)


@pytest.mark.parametrize(
    "fn",
    [
        load,
        functools.partial(load),
        AsyncCallable(),
        lambda v: load(v),  # a plain function returning a coroutine: awaited
    ],
    ids=["async def", "partial", "async __call__", "returns a coroutine"],
)
def test_coroutine_loaders_give_their_values(fn):
    x = jtm.async_call(fn, F32, 2.5)
    np.testing.assert_array_equal(x.result(timeout=WAIT), np.full(3, 2.5))
    y = jax.jit(lambda a: a * 2)(jtm.async_call(fn, F32, 1.0))
    np.testing.assert_array_equal(y, 2.0)


def test_coroutines_run_on_one_loop_thread_without_a_thread_each():
    threads = []

    async def where(i):
        threads.append(threading.current_thread().name)
        await asyncio.sleep(0)
        return np.full(3, i, np.float32)

    xs = [jtm.async_call(where, F32, i) for i in range(50)]
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(x.result(timeout=WAIT), i)
    assert set(threads) == {"jax_threadmap-asyncio"}
    assert _event_loop.event_loop().threads_started == 1


def test_loads_returning_in_one_turn_each_get_their_own_outcome():
    # Released by one asyncio.Event, the loaders return in the same turn of
    # the loop and are landed together: each keeps its own value, dtype,
    # device or error.
    release = asyncio.Event()
    device = jax.devices()[-1]

    async def wait_then(kind, i):
        await release.wait()
        if kind == "raise":
            raise KeyError(f"load {i}")
        if kind == "shape":
            return np.zeros(4, np.float32)
        return np.full(3, i, np.int8 if kind == "int8" else np.float32)

    async def opener():
        release.set()
        return np.zeros(3, np.float32)

    kinds = ["ok", "raise", "ok", "shape", "int8", "device"] * 5
    xs = [
        jtm.async_call(
            wait_then,
            SDS((3,), np.int32) if kind == "int8" else F32,
            kind,
            i,
            device=device if kind == "device" else None,
        )
        for i, kind in enumerate(kinds)
    ]
    jtm.async_call(opener, F32).result(timeout=WAIT)
    for i, (kind, x) in enumerate(zip(kinds, xs, strict=True)):
        if kind == "raise":
            with pytest.raises(KeyError, match=f"load {i}"):
                x.result(timeout=WAIT)
            continue
        if kind == "shape":
            with pytest.raises(ValueError, match="shape"):
                x.result(timeout=WAIT)
            continue
        value = x.result(timeout=WAIT)
        expected = np.full(3, i, np.int32 if kind == "int8" else np.float32)
        assert value.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(value), expected)
        if kind == "device":
            assert value.devices() == {device} and value.committed
        else:
            assert value.devices() == {jax.devices()[0]} and not value.committed
        assert x.done()


def test_a_call_whose_end_fails_keeps_neither_itself_nor_its_burst_waiting(
    monkeypatch, caplog
):
    # Landed together (one turn of the loop), one call's end raises (here, the
    # end itself): it still gets its value, and so does the rest.
    from jax_threadmap._arrays import task as _task

    release = asyncio.Event()
    real_end = _task.Task._end
    broken = []

    def end(task):
        if "wait_then" in task.name and not broken:
            broken.append(task)
            raise RuntimeError("slot lost")
        real_end(task)

    async def wait_then(i):
        await release.wait()
        return np.full(3, i, np.float32)

    async def opener():
        release.set()
        return np.zeros(3, np.float32)

    monkeypatch.setattr(_task.Task, "_end", end)
    xs = [jtm.async_call(wait_then, F32, i) for i in range(6)]
    jtm.async_call(opener, F32).result(timeout=WAIT)
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(np.asarray(x.result(timeout=WAIT)), i)
    assert len(broken) == 1
    assert any("slot lost" in r.exc_text for r in caplog.records if r.exc_text)


def test_a_coroutine_error_keeps_its_type_and_names_the_loader():
    async def broken():
        await asyncio.sleep(0)
        raise FileNotFoundError("weights.bin")

    x = jtm.async_call(broken, F32)
    with pytest.raises(FileNotFoundError, match="weights.bin") as info:
        x.result(timeout=WAIT)
    if sys.version_info >= (3, 11):
        note = info.value.__notes__[0]
        assert "broken`, which jax_threadmap.async_call ran" in note
    with pytest.raises(FileNotFoundError):  # every use raises it
        np.asarray(x)


def test_an_awaitable_inside_the_result_is_named_and_closed(recwarn):
    async def nested():
        return {"a": load(1.0)}  # forgot to await

    x = jtm.async_call(nested, {"a": F32})
    with pytest.raises(ValueError, match="an awaitable, never awaited") as info:
        x["a"].result(timeout=WAIT)
    assert "make the function itself async def" in str(info.value)
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


# --- timeout and cancel cancel the coroutine --------------------------------------


def test_cancel_raises_cancelled_error_inside_the_coroutine():
    hung = Hung()
    x = jtm.async_call(hung, F32)
    assert hung.started.wait(WAIT)
    assert x.cancel() is True
    assert hung.cancelled.wait(WAIT)  # its except CancelledError ran
    with pytest.raises(concurrent.futures.CancelledError, match="`Hung`"):
        x.result()
    assert jtm.async_pool_status().abandoned == ()  # no thread was held


def test_a_timeout_cancels_the_coroutine():
    # The coroutine must start before the timeout (else it never runs, and has
    # nothing to clean up): if the loop's thread came later (a loaded
    # machine), again with a timeout twice as long.
    timeout = 0.2
    while True:
        hung = Hung()
        x = jtm.async_call(hung, F32, timeout=timeout)
        with pytest.raises(TimeoutError, match="its coroutine is cancelled"):
            x.result(timeout=WAIT)
        if hung.started.is_set() or timeout >= 5:
            break
        timeout *= 2
    assert hung.cancelled.wait(WAIT)
    with pytest.raises(TimeoutError, match="its coroutine is cancelled"):
        x.result()


def test_a_call_cancelled_before_the_loop_starts_it_never_runs():
    # asyncio runs a task cancelled before its first step up to its first
    # await; the call is claimed on the loop first, so it never starts here.
    blocker = threading.Event()
    holding = threading.Event()

    async def holds_the_loop():
        holding.set()
        blocker.wait(WAIT)  # blocks the loop on purpose: nothing else runs
        return np.zeros(3, np.float32)

    ran = threading.Event()

    async def never():
        ran.set()  # no await before this line
        return np.zeros(3, np.float32)

    first = jtm.async_call(holds_the_loop, F32)
    assert holding.wait(WAIT)
    second = jtm.async_call(never, F32)
    assert second.cancel() is True
    blocker.set()
    first.result(timeout=WAIT)
    after = jtm.async_call(load, F32, 3.0)  # the loop has run what came before
    after.result(timeout=WAIT)
    assert not ran.is_set()


def test_waiting_on_the_loop_thread_raises_instead_of_blocking_every_loader():
    hung = Hung()
    pending = jtm.async_call(hung, F32)

    async def waits():
        try:
            pending.result()
        except RuntimeError as e:
            return np.full(3, len(str(e)), np.float32), str(e)
        return np.zeros(3, np.float32), ""

    box = {}

    async def outer():
        value, box["message"] = await waits()
        return value

    jtm.async_call(outer, F32).result(timeout=WAIT)
    assert "event loop" in box["message"]
    assert "asyncio.to_thread(x.result)" in box["message"]
    pending.cancel()


# --- fork and exit -----------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_a_fresh_loop():
    script = """
    import asyncio, os, sys, warnings
    warnings.simplefilter("ignore")
    import jax, numpy as np
    import jax_threadmap as jtm
    from jax_threadmap._coroutines import event_loop as _event_loop
    async def load(v):
        await asyncio.sleep(0)
        return np.full(2, v, np.float32)
    S = jax.ShapeDtypeStruct((2,), np.float32)
    assert float(jtm.async_call(load, S, 1.0).result(30)[0]) == 1.0
    parent = _event_loop.event_loop()
    pid = os.fork()
    if pid == 0:
        ok = (_event_loop.event_loop() is not parent
              and float(jtm.async_call(load, S, 2.0).result(30)[0]) == 2.0
              and _event_loop.event_loop()._thread is not parent._thread)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert float(jtm.async_call(load, S, 3.0).result(30)[0]) == 3.0
    print("fork ok")
    """
    proc = run_script(script)
    assert "fork ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


EXIT_SCRIPT = """
import asyncio, threading
import jax, numpy as np
import jax_threadmap as jtm
S = jax.ShapeDtypeStruct((2,), np.float32)
all_started, stubborn_started = threading.Event(), threading.Event()
count = [0]  # on the loop's thread only
async def pending(i):
    count[0] += 1
    if count[0] == 100:
        all_started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        if i == 0:
            print("handler ran", flush=True)
        raise
async def stubborn():
    stubborn_started.set()
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
xs = [jtm.async_call(pending, S, i) for i in range(100)]
if STUBBORN:
    y = jtm.async_call(stubborn, S)
    assert stubborn_started.wait(30)
assert all_started.wait(30)
print("exiting", flush=True)
"""


@pytest.mark.parametrize("stubborn", [False, True], ids=["plain", "stubborn"])
def test_exit_with_pending_coroutines_is_clean(stubborn):
    proc = run_script(f"STUBBORN = {stubborn}\n" + EXIT_SCRIPT, forked=True)
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert "exiting" in proc.stdout and "handler ran" in proc.stdout, proc.stdout
    assert "was destroyed but it is pending" not in err, err[-3000:]
    assert "never awaited" not in err, err[-3000:]
    calls = 101 if stubborn else 100
    assert f"{calls} background call(s) have not returned" in err, err[-3000:]
    assert ("did not end when cancelled at exit: `stubborn`" in err) is stubborn, err
