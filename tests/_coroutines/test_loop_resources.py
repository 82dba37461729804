"""``jax_threadmap.shared``: one async resource for the coroutines on the loop.

Opened once on first use and reused across elements and maps, an opening failure
named and retried by the next map, closed on the loop at exit (no "Unclosed
client session"), a forked child opening its own; and a stateful model of a
handle's life. Tests wait on events, never on elapsed time; bounds only turn a
hang into a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LOOPBACK, NO_LOOPBACK, cause_of, package_settings, run_script
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jax_threadmap
from jax_threadmap import KernelError, ThreadmapError
from jax_threadmap._coroutines import event_loop as _event_loop

pytestmark = pytest.mark.timeout(120)

I32 = jax.ShapeDtypeStruct((), jnp.int32)
WAIT = 30.0


class Resource:
    """Async context managers that count their entries and exits (on the loop),
    and can be told to fail or to wait before entering."""

    def __init__(self) -> None:
        self.entered = 0
        self.exited = 0
        self.fail = False
        self.gate: asyncio.Event | None = None  # made on the loop
        self.waiting = threading.Event()  # an opening waits at the gate

    @contextlib.asynccontextmanager
    async def open(self):
        if self.gate is not None:
            self.waiting.set()
            await self.gate.wait()
        if self.fail:
            raise ConnectionRefusedError("the server is down")
        self.entered += 1
        value = {"connection": self.entered}
        try:
            yield value
        finally:
            self.exited += 1


def on_loop(coro):
    """Runs ``coro`` on the package's loop and returns its result."""
    return _event_loop.event_loop().run(coro, "test")


def kernel_of(handle, seen, *, jit=True):
    """A map whose elements use ``handle`` (under jit, or eager: then a
    failure is the ``KernelError`` itself, not JAX's runtime error)."""

    async def use(i):
        value = await handle.value()
        seen.append(value["connection"])
        await asyncio.sleep(0)
        return i

    f = jax.vmap(lambda i: jax_threadmap.threadmap(use, I32, i))
    return jax.jit(f) if jit else f


def test_opened_once_and_reused_across_elements_and_maps():
    res = Resource()
    handle = jax_threadmap.shared(res.open)
    name = "<jax_threadmap.shared Resource.open"  # the factory's name
    assert repr(handle) == f"{name}: closed>" and res.entered == 0
    seen = []
    f = kernel_of(handle, seen)
    np.testing.assert_array_equal(f(jnp.arange(300)), np.arange(300))
    np.testing.assert_array_equal(f(jnp.arange(7)), np.arange(7))
    assert seen == [1] * 307 and res.entered == 1 and res.exited == 0
    assert repr(handle) == f"{name}: open>"
    on_loop(handle._close_at_exit())  # what the loop runs at exit
    assert (res.entered, res.exited) == (1, 1) and repr(handle) == f"{name}: closed>"


def test_elements_waiting_for_the_opening_share_it():
    res = Resource()
    handle = jax_threadmap.shared(res.open)
    on_loop(_make_gate(res))
    seen = []
    f = kernel_of(handle, seen)
    out = {}
    caller = threading.Thread(target=lambda: out.update(y=f(jnp.arange(50))))
    caller.start()
    assert res.waiting.wait(WAIT)  # every element is waiting for one opening
    on_loop(_open_gate(res))
    caller.join(WAIT)
    np.testing.assert_array_equal(out["y"], np.arange(50))
    assert res.entered == 1 and seen == [1] * 50


async def _make_gate(res):
    res.gate = asyncio.Event()


async def _open_gate(res):
    res.gate.set()


def test_an_opening_failure_is_named_and_the_next_map_retries():
    res = Resource()
    res.fail = True
    handle = jax_threadmap.shared(res.open)
    seen = []
    f = kernel_of(handle, seen, jit=False)
    with pytest.raises(KernelError) as info:
        f(jnp.arange(20))
    msg = str(info.value)
    assert "jax_threadmap.shared 'Resource.open' could not be opened" in msg
    assert "ConnectionRefusedError: the server is down" in msg
    assert "the next use opens it again" in msg
    cause = cause_of(info.value)
    assert isinstance(cause, ThreadmapError)
    assert isinstance(cause.__cause__, ConnectionRefusedError)
    assert repr(handle).endswith(": closed>") and res.entered == 0 and seen == []
    res.fail = False
    np.testing.assert_array_equal(f(jnp.arange(20)), np.arange(20))
    assert res.entered == 1 and seen == [1] * 20


def test_a_failed_map_leaves_the_opening_for_the_next():
    # Elements waiting for the opening are cancelled when another element fails;
    # the opening goes on, and the next map finds the resource open.
    res = Resource()
    handle = jax_threadmap.shared(res.open)
    on_loop(_make_gate(res))

    async def use(i):
        if i == 0:
            while not res.waiting.is_set():  # until the opening waits at the gate
                await asyncio.sleep(0)
            raise ValueError("element 0 fails")
        return (await handle.value())["connection"]

    f = jax.vmap(lambda i: jax_threadmap.threadmap(use, I32, i))
    with pytest.raises(KernelError, match="element 0 fails"):
        f(jnp.arange(10))
    on_loop(_open_gate(res))
    np.testing.assert_array_equal(f(jnp.arange(1, 4)), [1, 1, 1])
    assert res.entered == 1


def test_closing_at_exit_cancels_an_opening():
    # At exit, an opening under way is cancelled (its waiters with it), and
    # nothing is left entered.
    res = Resource()
    handle = jax_threadmap.shared(res.open)
    on_loop(_make_gate(res))

    async def exit_while_opening():
        waiter = asyncio.ensure_future(handle.value())
        while not res.waiting.is_set():  # the opening waits at the gate
            await asyncio.sleep(0)
        await handle._close_at_exit()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return repr(handle)

    assert on_loop(exit_while_opening()).endswith(": closed>")
    assert (res.entered, res.exited) == (0, 0)


def test_async_loaders_share_it_too():
    res = Resource()
    handle = jax_threadmap.shared(res.open)

    async def load(x):
        return np.float32(x + (await handle.value())["connection"])

    s = jax.ShapeDtypeStruct((), jnp.float32)
    values = [jax_threadmap.async_call(load, s, float(i)) for i in range(5)]
    assert [float(v.result(WAIT)) for v in values] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert res.entered == 1


def test_misuse_is_a_clear_error():
    expected = r"factory must be callable. Got <aiohttp-like .*the class or function"
    with pytest.raises(TypeError, match=expected):
        jax_threadmap.shared(_Instance())
    handle = jax_threadmap.shared(lambda: 42)
    with pytest.raises(KernelError) as info:
        kernel_of(handle, [], jit=False)(jnp.arange(2))
    assert "returned 42 of type int, which is not an async context manager" in str(
        info.value
    )
    assert repr(handle).endswith(": closed>")
    with pytest.raises(RuntimeError, match=r"awaited outside jax_threadmap's event"):
        asyncio.run(jax_threadmap.shared(Resource().open).value())


class _Instance:
    def __repr__(self) -> str:
        return "<aiohttp-like session>"


# --- exit and fork, in processes of their own --------------------------------------


AIOHTTP_SCRIPT = """
import asyncio, gc, sys, threading
import aiohttp
from aiohttp import web
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap

async def square(request):
    i = int(request.match_info["i"])
    return web.Response(text=str(i * i))

server_loop = asyncio.new_event_loop()
runner = web.AppRunner(web.Application())
runner.app.add_routes([web.get("/{i}", square)])
server_loop.run_until_complete(runner.setup())
site = web.TCPSite(runner, "127.0.0.1", 0)
server_loop.run_until_complete(site.start())
port = runner.addresses[0][1]
threading.Thread(target=server_loop.run_forever, daemon=True).start()
sessions = []

async def fetch_one(http, i):
    async with http.get(f"http://127.0.0.1:{port}/{int(i)}") as response:
        return np.int32(await response.text())

if SHARED:
    session = jax_threadmap.shared(aiohttp.ClientSession)
    async def fetch(i):
        http = await session.value()
        sessions.append(http)
        return await fetch_one(http, i)
else:  # the control: a session of its own, never closed
    async def fetch(i):
        http = aiohttp.ClientSession()
        sessions.append(http)
        return await fetch_one(http, i)

S = jax.ShapeDtypeStruct((), jnp.int32)
f = jax.jit(jax.vmap(lambda i: jax_threadmap.threadmap(fetch, S, i)))
assert f(jnp.arange(64)).tolist() == [i * i for i in range(64)]
assert f(jnp.arange(8)).tolist() == [i * i for i in range(8)]
print("sessions", len(set(map(id, sessions))), flush=True)
if not SHARED:
    del sessions[:]
    gc.collect()  # as the end of the program would, sooner or later
print("exiting", flush=True)
"""


@pytest.mark.skipif(not LOOPBACK, reason=f"a local server {NO_LOOPBACK}")
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "control"])
def test_an_aiohttp_session_closes_at_exit_without_a_warning(shared):
    pytest.importorskip("aiohttp")
    proc = run_script(
        f"SHARED = {shared}\n" + AIOHTTP_SCRIPT, forked=True, unset=package_settings()
    )
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "exiting" in proc.stdout, report
    if shared:
        assert "sessions 1" in proc.stdout, report
        assert proc.stderr == "", report
    else:  # the check can fail: a session that nobody closes is reported
        assert "sessions 72" in proc.stdout, report
        assert "Unclosed client session" in proc.stderr, report


EXIT_SCRIPT = """
import asyncio, contextlib, threading
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap

events = []
started = threading.Event()

@jax_threadmap.shared
@contextlib.asynccontextmanager
async def first():
    events.append("open first")
    yield "first"
    events.append("close first")
    print(" ".join(events), flush=True)

@jax_threadmap.shared
@contextlib.asynccontextmanager
async def second():
    events.append("open second")
    yield "second"
    events.append("close second")

async def hang():
    await first.value()
    await second.value()
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        events.append("cancelled")
        raise

pending = jax_threadmap.async_call(hang, jax.ShapeDtypeStruct((), jnp.float32))
assert started.wait(30)
print("exiting", flush=True)
"""


def test_exit_cancels_what_is_pending_then_closes_the_last_opened_first():
    proc = run_script(EXIT_SCRIPT, forked=True, unset=package_settings())
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "exiting" in proc.stdout, report
    order = "open first open second cancelled close second close first"
    assert order in proc.stdout, report
    for bad in ("Traceback", "destroyed but it is pending", "never awaited"):
        assert bad not in proc.stderr, report


FORK_SCRIPT = """
import asyncio, contextlib, os
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap

opened = []

@jax_threadmap.shared
@contextlib.asynccontextmanager
async def conn():
    opened.append(os.getpid())
    yield os.getpid()

async def owner(i):
    return np.int32(await conn.value())

S = jax.ShapeDtypeStruct((), jnp.int32)
f = jax.vmap(lambda i: jax_threadmap.threadmap(owner, S, i))
parent = os.getpid()
assert f(jnp.arange(4)).tolist() == [parent] * 4
pid = os.fork()
if pid == 0:  # JAX's runtime is the parent's: an async def loader, no program
    ok = repr(conn).endswith(": closed>")
    child = int(jax_threadmap.async_call(owner, S, 0).result(30))
    os._exit(0 if ok and child == os.getpid() == opened[-1] else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert repr(conn).endswith(": open>") and f(jnp.arange(2)).tolist() == [parent] * 2
assert opened == [parent]  # the child's opening was the child's
print("fork ok", flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_opens_its_own():
    proc = run_script(FORK_SCRIPT, forked=True, unset=package_settings())
    assert "fork ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# --- a stateful model of one handle's life -----------------------------------------


class SharedModel(RuleBasedStateMachine):
    """Uses, failed openings, closings at exit, and uses cancelled while
    waiting, in any order: every context manager entered is exited once, the
    handle is open exactly when one is entered and not exited, and a use
    returns the value of the opening it waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.res = Resource()
        self.handle = jax_threadmap.shared(self.res.open)
        self.opened = False  # the model: is a connection open?

    @rule(uses=st.integers(1, 4), fail=st.booleans())
    def use(self, uses, fail):
        self.res.fail = fail and not self.opened
        got = on_loop(_gather(self.handle, uses))
        if fail and not self.opened:
            assert all(isinstance(g, ThreadmapError) for g in got), got
        else:
            self.opened = True
            assert got == [{"connection": self.res.entered}] * uses

    @rule()
    def close_at_exit(self):
        on_loop(self.handle._close_at_exit())  # what the loop runs at exit
        self.opened = False

    @precondition(lambda self: not self.opened)
    @rule(fail=st.booleans())
    def cancel_a_waiting_use(self, fail):
        # A use cancelled while the opening waits at its gate: the opening goes
        # on, and ends as it would have.
        self.res.fail = fail
        on_loop(_cancelled_use(self.handle, self.res))
        self.opened = not fail

    @invariant()
    def entered_once_exited_once(self):
        open_now = self.res.entered - self.res.exited
        is_open = repr(self.handle).endswith(": open>")
        assert open_now == int(self.opened) == int(is_open)

    def teardown(self):
        on_loop(self.handle._close_at_exit())
        assert self.res.entered == self.res.exited


async def _gather(handle, n):
    return await asyncio.gather(
        *(handle.value() for _ in range(n)), return_exceptions=True
    )


async def _cancelled_use(handle, res):
    res.gate = asyncio.Event()
    res.waiting.clear()
    waiter = asyncio.ensure_future(handle.value())
    while not res.waiting.is_set():
        await asyncio.sleep(0)
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    res.gate.set()
    res.gate = None
    with contextlib.suppress(ThreadmapError):  # the opening's own end
        await handle.value()


SharedModel.TestCase.settings = settings(max_examples=30, stateful_step_count=12)
test_shared_model = SharedModel.TestCase
