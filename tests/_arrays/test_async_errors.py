"""Defects of issue 43 (a hostile pass over the async wing), each a test that
failed (or hung, bounded) before its fix, and what that pass did not reach.

1. (``test_shard_loads.py``) A shard that aliased the callback's memory.
2. A shard whose check raised ``TypeError`` (a ``shape`` that is an int, a dtype
   NumPy cannot read with a wrong shape) left its part running for good; the
   same object given to ``async_call`` raised ``TypeError``, not the
   ``ValueError`` naming the leaf.
3. (``test_async_kernels.py``) An ``async def`` kernel element whose result
   raised ``KeyboardInterrupt`` or ``SystemExit`` killed the event loop's thread.
4. A loader's exception whose ``__setattr__`` raises: ``result()`` raised
   ``AttributeError`` instead of it.

6. What the pass did not reach: 1,320 loaders at once that return, raise, time
   out and are cancelled; negative, NaN and infinite timeouts at every API; a
   fork while calls, sharded loads and an ``async def`` map run (a forked child
   used to claim the queued shards of a load running in the parent, then wait
   for good); (in ``test_async_kernels.py``) ``async def`` derivative rules,
   second order and failing, and Ctrl-C inside an ``async def`` map.

Every wait is bounded (``result(timeout=...)``, ``returns_within``, a child's
timeout); no assertion rests on a clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_script

from jax_threadmap import async_array_from_callback, async_call, async_pool_status
from jax_threadmap._arrays import async_pool as _async_pool

pytestmark = pytest.mark.timeout(120)

SDS = jax.ShapeDtypeStruct
F32 = SDS((), jnp.float32)
WAIT = 30.0
DEVICE = jax.devices()[0]
ONE = jax.sharding.SingleDeviceSharding(DEVICE)


# --- 2. a shard (or a leaf) whose check raised TypeError ----------------------------


class IntShape:
    """Another library's array whose ``shape`` is an int."""

    shape = 4
    dtype = np.float32


class UnknownDtype:
    """Another library's array of a dtype NumPy cannot read (torch.float32),
    of the wrong shape."""

    shape = (2, 2)
    dtype = object()


class ShapeRaises:
    """An array whose ``shape`` property raises."""

    dtype = np.float32

    @property
    def shape(self):
        raise TypeError("no shape yet")


class Odd(BaseException):
    """An exception of no usual kind."""


class ArrayRaises:
    """The right shape and dtype, but reading its data raises ``Odd``."""

    shape = (4,)
    dtype = np.float32

    def __array__(self, dtype=None, copy=None):
        raise Odd("the data could not be read")


BAD_LEAVES = {
    "int shape": (IntShape, "whose shape is 4, not a sequence of integers"),
    "unknown dtype": (UnknownDtype, "shape (2, 2) and dtype <object object"),
    "shape raises": (ShapeRaises, "whose shape or dtype could not be read"),
}


@pytest.mark.parametrize("bad", list(BAD_LEAVES))
@pytest.mark.parametrize("kind", ["plain", "async"])
def test_a_shard_whose_check_raised_type_error_fails_naming_the_shard(bad, kind):
    make, words = BAD_LEAVES[bad]

    def fetch(index):
        return make()

    async def fetch_async(index):
        return make()

    x = async_array_from_callback(
        (4,), ONE, fetch if kind == "plain" else fetch_async, np.float32
    )
    with pytest.raises(ValueError) as info:
        x.result(timeout=WAIT)  # was: TimeoutError (the part ran for good)
    text = str(info.value)
    assert words in text, text
    assert "for the shard at index [:] (device 0)" in text, text


@pytest.mark.parametrize("bad", list(BAD_LEAVES))
def test_async_call_names_the_leaf_of_the_same_objects(bad):
    make, words = BAD_LEAVES[bad]
    x = async_call(lambda: {"w": make()}, {"w": SDS((4,), np.float32)})["w"]
    with pytest.raises(ValueError, match="do not match result_shape_dtypes") as info:
        x.result(timeout=WAIT)
    assert "at ['w']: " in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_any_exception_of_a_shard_reaches_the_array_naming_the_shard(kind):
    def fetch(index):
        return ArrayRaises()

    async def fetch_async(index):
        return ArrayRaises()

    x = async_array_from_callback(
        (4,), ONE, fetch if kind == "plain" else fetch_async, np.float32
    )
    with pytest.raises(Odd, match="the data could not be read") as info:
        x.result(timeout=WAIT)
    if sys.version_info >= (3, 11):
        assert any(
            "for the shard at index [:] (device 0)" in n for n in info.value.__notes__
        ), info.value.__notes__
    # The next load works.
    y = async_array_from_callback((4,), ONE, lambda i: np.ones(4)[i], np.float32)
    np.testing.assert_array_equal(y.result(timeout=WAIT), 1.0)


# --- 4. an exception that refuses attributes ----------------------------------------


class Frozen(Exception):
    def __setattr__(self, name, value):
        raise AttributeError("frozen exception")


@pytest.mark.parametrize("kind", ["async_call", "shards"])
def test_a_loaders_frozen_exception_is_what_every_use_raises(kind):
    def load(*index):
        raise Frozen("the loader's own error")

    if kind == "async_call":
        x = async_call(load, SDS((4,), np.float32))
    else:
        x = async_array_from_callback((4,), ONE, load, np.float32)
    for _ in range(2):  # every use: the same exception
        with pytest.raises(Frozen, match="the loader's own error"):
            x.result(timeout=WAIT)


# --- 6. what the hostile pass did not reach -----------------------------------------


class Hangs:
    """Loaders that never return until cancelled: how many started, and how
    many of those were cancelled (a call given up on before its coroutine
    started never starts it)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.started = self.cancelled = 0

    async def __call__(self, *index):
        with self.changed:
            self.started += 1
            self.changed.notify_all()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            with self.changed:
                self.cancelled += 1
                self.changed.notify_all()
            raise
        return None  # never reached

    def wait_for(self, predicate) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout=WAIT)


async def _value(i, *index):
    await asyncio.sleep(0)
    return np.full((2,), i, np.float32)[index[0] if index else ...]


async def _fails(i, *index):
    await asyncio.sleep(0)
    raise LookupError(f"missing {i}")


def _plain_value(i, *index):
    return np.full((2,), i, np.float32)[index[0] if index else ...]


def _plain_fails(i, *index):
    raise LookupError(f"missing {i}")


#: Each kind of load at scale: its loader (``None``: one that hangs), whether it
#: is a sharded load, its ``timeout``, whether it is cancelled, and the outcome.
SCALE_KINDS = {
    "value": (_value, False, None, False, "value"),
    "raises": (_fails, False, None, False, "LookupError"),
    "times out": (None, False, 0.2, False, "TimeoutError"),
    "cancelled": (None, False, None, True, "CancelledError"),
    "shard value": (_value, True, None, False, "value"),
    "shard raises": (_fails, True, None, False, "LookupError"),
    "shard times out": (None, True, 0.2, False, "TimeoutError"),
    "shard cancelled": (None, True, None, True, "CancelledError"),
    "plain value": (_plain_value, False, None, False, "value"),
    "plain raises": (_plain_fails, False, None, False, "LookupError"),
    "plain shard": (_plain_value, True, None, False, "value"),
}


def _outcome(x, i):
    try:
        value = np.asarray(x.result(timeout=WAIT))
    except LookupError as e:
        assert str(e) == f"missing {i}", e
        return "LookupError"
    except TimeoutError as e:
        assert "did not return within timeout=0.2 s" in str(e), e
        return "TimeoutError"
    except concurrent.futures.CancelledError:
        return "CancelledError"
    np.testing.assert_array_equal(value, np.full((2,), i, np.float32))
    return "value"


def test_a_thousand_async_def_loaders_that_raise_time_out_and_are_cancelled():
    n = 1320  # 120 of each kind; 960 async def
    hangs = Hangs()
    kinds = list(SCALE_KINDS)
    with _async_pool.live_lock:
        live_before = len(_async_pool.live)
    made = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        loader, sharded, timeout, _, _ = SCALE_KINDS[kind]
        fn = hangs if loader is None else functools.partial(loader, i)
        if sharded:
            x = async_array_from_callback((2,), ONE, fn, np.float32, timeout=timeout)
        else:
            x = async_call(fn, SDS((2,), np.float32), timeout=timeout)
        made.append((kind, x))
    # A few jitted dispatches while they are pending (under the bound of 8).
    double = jax.jit(lambda a: a * 2)
    dispatched = []
    for i, (_, x) in enumerate(made[:6]):
        try:
            dispatched.append((i, double(x)))
        except Exception as e:  # it had failed already: raised at the dispatch
            assert type(e).__name__ == SCALE_KINDS[made[i][0]][4], e
    # Some coroutine of a loader that hangs runs (else the cancels below would
    # all come before the coroutines start, and cancel nothing that runs).
    assert hangs.wait_for(lambda: hangs.started > 0)
    for kind, x in made:
        if SCALE_KINDS[kind][3]:
            assert x.cancel()
    for i, (kind, x) in enumerate(made):
        assert _outcome(x, i) == SCALE_KINDS[kind][4], (i, kind)
    for i, y in dispatched:
        kind = made[i][0]
        if SCALE_KINDS[kind][4] == "value":
            np.testing.assert_array_equal(np.asarray(y), np.full((2,), 2 * i))
        else:
            with pytest.raises(Exception, match="missing|timeout|cancelled"):
                np.asarray(y)
    # Every coroutine of a loader that hangs and started was cancelled (the
    # calls are all given up on: no more start), and no call stays live.
    hanging = sum(SCALE_KINDS[k][0] is None for k, _ in made)
    assert hangs.wait_for(lambda: hangs.cancelled == hangs.started)
    assert 0 < hangs.started <= hanging
    with _async_pool.live_lock:
        assert len(_async_pool.live) <= live_before
    assert async_pool_status().abandoned == ()
    # The loop still serves loaders.
    np.testing.assert_array_equal(
        async_call(functools.partial(_value, 7), SDS((2,), np.float32)).result(WAIT),
        7.0,
    )


BAD_TIMEOUTS = [-1, -0.0, float("nan"), float("inf"), -float("inf"), np.float32("nan")]


@pytest.mark.parametrize(
    "api, timeout",
    [
        (api, t)
        for api in ("async_call", "shards", "async shards", "result")
        for t in BAD_TIMEOUTS
        if not (api == "result" and t == 0)  # result(timeout=-0.0): look, no wait
    ],
    ids=repr,
)
def test_a_negative_nan_or_infinite_timeout_is_refused_before_any_work(api, timeout):
    started = []

    def load(*index):
        started.append(index)
        return np.zeros(2, np.float32)[index[0] if index else ...]

    async def load_async(index):
        started.append(index)
        return np.zeros(2, np.float32)[index]

    landed = async_call(np.zeros, SDS((2,), np.float32), 2)
    landed.result(timeout=60)
    with pytest.raises(ValueError, match="finite number of seconds. Got timeout="):
        if api == "async_call":
            async_call(load, SDS((2,), np.float32), timeout=timeout)
        elif api == "shards":  # dtype=None: would fetch one shard at the call
            async_array_from_callback((2,), ONE, load, timeout=timeout)
        elif api == "async shards":
            async_array_from_callback((2,), ONE, load_async, timeout=timeout)
        else:
            landed.result(timeout=timeout)
    assert started == []
    with _async_pool.live_lock:  # nothing of it is in flight
        assert not [t for t in _async_pool.live if "before_any_work" in str(t)]


FORK_SCRIPT = """
import asyncio, os, sys, threading, warnings
warnings.simplefilter("ignore")
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap as jtm
from jax.sharding import NamedSharding, PartitionSpec as P

S = jax.ShapeDtypeStruct((2,), np.float32)
F32 = jax.ShapeDtypeStruct((), np.float32)
release, started = threading.Event(), threading.Semaphore(0)
data = np.arange(8.0, dtype=np.float32)
sharding = NamedSharding(jax.make_mesh((4,), ("x",)), P("x"))

def blocked(v):
    started.release()
    release.wait(60)
    return np.full(2, v, np.float32)

def quick(v):
    return np.full(2, v, np.float32)

async def blocked_async(v):
    started.release()
    await asyncio.to_thread(release.wait, 60)
    return np.full(2, v, np.float32)

def fetch(index):  # the first shard blocks; the others wait in the queue
    if index[0].start == 0:
        started.release()
        release.wait(60)
    return data[index]

async def element(i):
    started.release()
    await asyncio.to_thread(release.wait, 60)
    return i * 2

def async_map(n):
    return np.asarray(jax.vmap(lambda i: jtm.threadmap(element, F32, i))(
        jnp.arange(float(n))))

# The pool has 2 threads: one runs `running`, one the sharded load's first
# shard; its 3 other shards and `queued` wait in the queue.
running = jtm.async_call(blocked, S, 1.0)
sharded = jtm.async_array_from_callback((8,), sharding, fetch, np.float32)
queued = jtm.async_call(quick, S, 2.0)
coroutine = jtm.async_call(blocked_async, S, 4.0)
box = {}
mapper = threading.Thread(target=lambda: box.setdefault("map", async_map(4)))
mapper.start()
for _ in range(3 + 4):  # running, the first shard, the coroutine, 4 elements
    assert started.acquire(timeout=60)

async def double(i):
    await asyncio.sleep(0)
    return i * 2

def double_map(x):
    return np.asarray(jax.vmap(lambda i: jtm.threadmap(double, F32, i))(x))

# What the child runs is compiled here: XLA may not compile in a forked child.
assert double_map(np.arange(3.0, dtype=np.float32)).tolist() == [0.0, 2.0, 4.0]

def bounded(fn, limit=30):
    out = {}
    def run():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    return "hung" if t.is_alive() else out

pid = os.fork()
if pid == 0:
    failures = []
    def expect(name, got, ok):
        if not ok:
            failures.append(f"{name}: {got}")
    for name, x in (("running", running), ("coroutine", coroutine),
                    ("sharded", sharded)):
        got = bounded(x.result)  # no timeout: the child may run what is left
        expect(name, got, isinstance(got, dict)
               and "forked" in str(got.get("error", "")))
    got = bounded(queued.result)  # not started at the fork: runs here
    expect("queued", got, isinstance(got, dict) and "value" in got
           and np.asarray(got["value"]).tolist() == [2.0, 2.0])
    async def fresh(v):
        await asyncio.sleep(0)
        return np.full(2, v, np.float32)
    got = bounded(lambda: jtm.async_call(fresh, S, 5.0).result())
    expect("a new loader", got, isinstance(got, dict) and "value" in got)
    def by_shard(x):
        # Shard by shard: JAX 0.12's copy of a whole multi-device array to
        # NumPy hangs in a forked child (XLA's threads are the parent's), ours or not.
        out = np.full(8, np.nan, np.float32)
        for s in x.addressable_shards:
            out[s.index] = np.asarray(s.data)
        return out
    got = bounded(lambda: by_shard(jtm.async_array_from_callback(
        (8,), sharding, lambda i: data[i], np.float32).result()))
    expect("a new sharded load", got, isinstance(got, dict)
           and np.array_equal(got.get("value"), data))
    got = bounded(lambda: double_map(np.arange(3.0, dtype=np.float32)))
    expect("a new async def map", got, isinstance(got, dict)
           and np.array_equal(got.get("value"), [0.0, 2.0, 4.0]))
    print("child:", "; ".join(failures) or "ok", flush=True)
    os._exit(0 if not failures else 1)
_, status = os.waitpid(pid, 0)
release.set()
values = [float(x.result(60)[0]) for x in (running, queued, coroutine)]
mapper.join(60)
ok = (values == [1.0, 2.0, 4.0]
      and np.array_equal(np.asarray(sharded.result(60)), data)
      and np.array_equal(box.get("map"), [0.0, 2.0, 4.0, 6.0]))
print("parent:", "ok" if ok else (values, box), flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_while_calls_loads_and_an_async_def_map_run():
    # In the child: what ran at the fork fails at its first use, naming the
    # fork (a sharded load whose other shards were still queued used to claim
    # them there, and then wait for good for the shard running in the parent);
    # what had not started runs there; new loads and maps work. In the parent
    # everything lands.
    ran = run_script(
        FORK_SCRIPT,
        env={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "JAX_THREADMAP_ASYNC_THREADS": "2",
        },
    )
    assert "child: ok" in ran.stdout, ran.report
    assert "parent: ok" in ran.stdout, ran.report
    assert ran.returncode == 0, ran.report
