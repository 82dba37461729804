"""Checks of async_array_from_callback on 8 CPU devices.

Run by tests/_arrays/test_shard_loads.py in a subprocess, because the number of CPU
devices is fixed when JAX starts and the main test session keeps one. Prints one
``ok <check>`` line per check and exits non-zero at the first failure. Every wait
is on an event (asyncio or threading); bounds only turn a hang into a failure.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import asyncio  # noqa: E402
import concurrent.futures  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from helpers import wait_until  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_threadmap as jtm  # noqa: E402
from jax_threadmap._arrays import dispatch as _dispatch  # noqa: E402
from jax_threadmap._jax import avals as _avals

assert jax.device_count() == 8, jax.devices()
WAIT = 30.0
SHAPE = (8, 16)
DATA = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
ROW = jax.ShapeDtypeStruct((16,), jnp.float32)
#: Async dispatch: a program on pending data returns AsyncArrays at once, and is
#: dispatched once every shard has landed.
ASYNC = _dispatch.mechanism.status() is None  # None: no reason to block
AXIS_TYPES = {
    "auto": jax.sharding.AxisType.Auto,
    "explicit": jax.sharding.AxisType.Explicit,
}


def check(name, ok, detail=""):
    if not ok:
        print(f"FAILED {name}: {detail}", flush=True)
        sys.exit(3)
    print(f"ok {name}", flush=True)


def raised(error, fn, *args, **kwargs):
    """The ``error`` that ``fn(*args, **kwargs)`` raises, or None if it returns."""
    try:
        fn(*args, **kwargs)
    except error as e:
        return e
    return None


def message(error, fn, *args, **kwargs):
    """The message of the ``error`` that ``fn(*args, **kwargs)`` raises, or None."""
    e = raised(error, fn, *args, **kwargs)
    return None if e is None else str(e)


def key(index):
    return tuple((s.start, s.stop, s.step) for s in index)


def mesh(shape, names, kind):
    return jax.make_mesh(shape, names, axis_types=(AXIS_TYPES[kind],) * len(names))


def shards_of(x):
    return {
        (s.device.id, key(s.index)): np.asarray(s.data) for s in x.addressable_shards
    }


def same_array(a, b):
    sa, sb = shards_of(a), shards_of(b)
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.sharding.is_equivalent_to(b.sharding, a.ndim)
        and _avals.typeof(a) == _avals.typeof(b)
        and sa.keys() == sb.keys()
        and all(np.array_equal(sa[k], sb[k]) for k in sa)
    )


def waited(condition, what):
    """Whether ``condition`` came true (:func:`helpers.wait_until`): a check's
    outcome here, where a failed check is reported, not raised."""
    try:
        wait_until(condition, what, timeout=WAIT)
    except AssertionError:
        return False
    return True


def wait_ready(arrays):
    return waited(lambda: all(a.is_ready() for a in arrays), "arrays ready")


# --- the same array as jax.make_array_from_callback --------------------------------


def same_as_make_array_from_callback():
    cases = [
        ((8,), ("x",), [P("x"), P(), P(None, "x")]),
        ((4, 2), ("x", "y"), [P("x", "y"), P("x"), P(None, "y"), P()]),
        ((2, 4), ("x", "y"), [P("x", "y"), P(None, "y"), P("y", "x"), P()]),
    ]
    for kind in AXIS_TYPES:
        for mesh_shape, names, specs in cases:
            m = mesh(mesh_shape, names, kind)
            for spec in specs:
                sharding = NamedSharding(m, spec)
                jax_calls = []
                ref = jax.make_array_from_callback(
                    SHAPE, sharding, lambda i, c=jax_calls: c.append(i) or DATA[i]
                )
                distinct = {key(i) for i in jax_calls}
                for style in ("thread", "async def"):
                    calls = []
                    lock = threading.Lock()

                    def fetch(index, calls=calls, lock=lock):
                        with lock:
                            calls.append(key(index))
                        return DATA[index]

                    async def afetch(index, fetch=fetch):
                        await asyncio.sleep(0)
                        return fetch(index)

                    fn = fetch if style == "thread" else afetch
                    x = jtm.async_array_from_callback(SHAPE, sharding, fn, np.float32)
                    out = x.result(timeout=WAIT)
                    name = f"{kind} mesh {mesh_shape} {spec} ({style})"
                    check(f"{name}: same array", same_array(out, ref), out.sharding)
                    check(
                        f"{name}: each distinct index fetched once",
                        sorted(calls) == sorted(distinct),
                        f"{len(calls)} fetches, {len(distinct)} distinct, "
                        f"make_array_from_callback called {len(jax_calls)} times",
                    )
                    if spec == P(None, "y") and mesh_shape == (2, 4):
                        check(
                            f"{name}: replicated axis fetched once (4 of 8)",
                            len(calls) == 4 and len(jax_calls) == 8,
                            (len(calls), len(jax_calls)),
                        )
                    if spec == P():
                        check(f"{name}: replicated fetched once", len(calls) == 1)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    out = jtm.async_array_from_callback(SHAPE, one, lambda i: DATA[i], np.float32)
    ref = jax.make_array_from_callback(SHAPE, one, lambda i: DATA[i])
    check("SingleDeviceSharding: same array", same_array(out.result(WAIT), ref))
    zero_d = jtm.async_array_from_callback((), one, lambda i: DATA[0, 1], np.float32)
    check("0-d array", float(zero_d.result(WAIT)) == 1.0)


# --- jit, shard_map, threadmap: dispatched before the data -------------------------


class Shards:
    """A data_callback whose shard k arrives when ``offer(k)`` is called."""

    def __init__(self, rows_per_shard, coroutine=True):
        self.rows = rows_per_shard
        self.events = {}
        self.lock = threading.Lock()
        self.coroutine = coroutine

    def _event(self, k):
        with self.lock:
            return self.events.setdefault(k, threading.Event())

    def offer(self, k=None):
        for j in range(DATA.shape[0] // self.rows) if k is None else [k]:
            self._event(j).set()

    def fetch(self, index):
        k = (index[0].start or 0) // self.rows
        if not self._event(k).wait(WAIT):
            raise RuntimeError("never offered")
        return DATA[index]

    async def afetch(self, index):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.fetch, index)

    def callback(self):
        return self.afetch if self.coroutine else self.fetch


def returns_while_pending(fn, *args):
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=fn(*args)), daemon=True)
    thread.start()
    thread.join(WAIT)
    return not thread.is_alive() and "out" in box, box.get("out")


def dispatch_before_the_data():
    for kind in AXIS_TYPES:
        sharding = NamedSharding(mesh((8,), ("x",), kind), P("x"))
        programs = {
            "jit": jax.jit(lambda a: a * 2 + 1),
            "jit reduction": jax.jit(lambda a: a.sum(axis=1)),
        }
        if kind == "auto":
            programs["shard_map"] = jax.jit(
                jax.shard_map(
                    lambda a: a * 2 + 1,
                    mesh=sharding.mesh,
                    in_specs=P("x"),
                    out_specs=P("x"),
                )
            )
        programs["threadmap"] = jax.jit(
            jax.vmap(lambda r: jtm.threadmap(lambda v: v * 2 + 1, ROW, r))
        )
        for name, f in programs.items():
            shards = Shards(1)
            x = jtm.async_array_from_callback(
                SHAPE, sharding, shards.callback(), np.float32
            )
            label = f"{kind} mesh, {name}"
            if ASYNC:  # (blocking dispatch: f(x) would wait for the data)
                returned, y = returns_while_pending(f, x)
                check(f"{label}: returns before the data", returned)
                check(f"{label}: result pending", not y.done())
            shards.offer()
            if not ASYNC:
                y = f(x)
            expected = f(jax.device_put(DATA, sharding))
            check(
                f"{label}: values",
                np.array_equal(np.asarray(y), np.asarray(expected)),
            )


def a_program_waits_for_every_shard():
    if not ASYNC:
        return
    sharding = NamedSharding(mesh((8,), ("x",), "auto"), P("x"))
    for name, f in (
        ("elementwise", jax.jit(lambda a: a * 2 + 1)),
        ("reduction", jax.jit(lambda a: a.sum() + 0 * a)),
    ):
        shards = Shards(1)
        x = jtm.async_array_from_callback(
            SHAPE, sharding, shards.callback(), np.float32
        )
        y = f(x)
        shards.offer(0)
        shards.offer(3)
        check(f"{name}: waits while a shard is missing", not y.done())
        later = jax.jit(lambda a: a - 1)(x)
        shards.offer()
        check(f"{name}: value", np.array_equal(np.asarray(y), np.asarray(f(DATA))))
        check(f"{name}: later dispatch", np.array_equal(np.asarray(later), DATA - 1))


def shards_landing_while_dispatching():
    # Was (gate programs): a shard that landed between a dispatch's claim of its
    # gate and the gate program's dispatch took the gate away (KeyError).
    sharding = NamedSharding(mesh((8,), ("x",), "auto"), P("x"))
    f = jax.jit(lambda a: a * 2)

    async def fetch(index):
        await asyncio.sleep(0)
        return DATA[index]

    for _ in range(30):
        x = jtm.async_array_from_callback(SHAPE, sharding, fetch, np.float32)
        if not np.array_equal(np.asarray(f(x)), DATA * 2):
            check("shards landing while dispatching: values", False)
    check("shards landing while dispatching: values", True)


def another_layout_waits_for_the_array():
    sharding = NamedSharding(mesh((8,), ("x",), "auto"), P("x"))
    other = NamedSharding(sharding.mesh, P(None, "x"))
    x = jtm.async_array_from_callback(SHAPE, sharding, lambda i: DATA[i], np.float32)
    y = jax.device_put(x, other)
    check(
        "device_put to another layout",
        y.sharding == other and np.array_equal(np.asarray(y), DATA),
    )


# --- errors --------------------------------------------------------------------------


def a_failing_shard():
    sharding = NamedSharding(mesh((4, 2), ("x", "y"), "auto"), P("x"))  # 4 parts
    go = threading.Event()
    started = threading.Semaphore(0)
    cancelled = []

    async def fetch(index):
        k = index[0].start // 2
        if k == 1:
            await asyncio.get_running_loop().run_in_executor(None, go.wait, WAIT)
            raise FileNotFoundError(f"object {k}: no such key")
        started.release()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(k)
            raise
        return DATA[index]

    x = jtm.async_array_from_callback(SHAPE, sharding, fetch, np.float32)
    # (Blocking dispatch: a dispatch now would wait for the data.)
    y = jax.jit(lambda a: a + 1)(x) if ASYNC else None
    check("3 shards fetching", all(started.acquire(timeout=WAIT) for _ in range(3)))
    go.set()
    error = raised(FileNotFoundError, x.result, WAIT)
    check("the callback's own exception", error is not None, repr(error))
    where = "index [2:4, :] (devices 2, 3) of the array of shape (8, 16)"
    if sys.version_info >= (3, 11):
        note = " ".join(error.__notes__)
        check("the note names the shard", where in note, note)
    waited(lambda: len(cancelled) >= 3, "3 coroutines cancelled")
    check("the other coroutines are cancelled", sorted(cancelled) == [0, 2, 3])
    if y is not None:
        text = message(jax.errors.JaxRuntimeError, y.block_until_ready) or ""
        check(
            "dependents raise with the index and devices",
            where in text and "FileNotFoundError: object 1: no such key" in text,
            text[-600:],
        )
    later = raised(FileNotFoundError, jax.jit(lambda a: a * 3), x)
    check("a later dispatch raises the error", later is error)


def a_failing_thread_stops_the_rest():
    # Two threads for four shards (run first: no pool thread exists yet): the
    # two queued never run once one fails.
    sharding = NamedSharding(mesh((4, 2), ("x", "y"), "auto"), P("x"))
    release, second = threading.Event(), threading.Event()
    ran = []

    def fetch(index):
        k = index[0].start // 2
        ran.append(k)
        if k == 0:
            assert second.wait(WAIT)  # both threads are busy
            raise OSError("disk error")
        second.set()
        release.wait(WAIT)
        return DATA[index]

    os.environ["JAX_THREADMAP_ASYNC_THREADS"] = "2"
    try:
        x = jtm.async_array_from_callback(SHAPE, sharding, fetch, np.float32)
        try:
            x.result(WAIT)
        except OSError:
            pass
        abandoned = jtm.async_pool_status().abandoned
        release.set()
    finally:
        del os.environ["JAX_THREADMAP_ASYNC_THREADS"]
    check(
        "thread: the failure ends the load",
        isinstance(x._task.future.exception(), OSError),
    )
    check("thread: queued shards never ran", sorted(ran) == [0, 1], ran)
    check(
        "thread: the running one left the pool's bound",
        len(abandoned) == 1 and "index [2:4, :]" in abandoned[0],
        abandoned,
    )


def bad_shards_are_named():
    sharding = NamedSharding(mesh((4, 2), ("x", "y"), "auto"), P("x"))
    for bad, what in (
        (
            lambda i: DATA[i][:, :3],
            "shape (2, 3) and dtype float32 (expected shape (2, 16)",
        ),
        (lambda i: DATA[i].astype(np.float64) * 1e300, "float64"),
        (lambda i: DATA[i].astype(np.complex64), "complex64"),
        (lambda i: "not an array", "a str without shape and dtype"),
    ):
        x = jtm.async_array_from_callback(
            SHAPE,
            sharding,
            lambda i, bad=bad: bad(i) if i[0].start == 4 else DATA[i],
            np.float32,
        )
        text = message(ValueError, x.result, WAIT)
        check(
            f"bad shard named ({what})",
            text is not None
            and what in text
            and "for the shard at index [4:6, :] (devices 4, 5)" in text,
            text,
        )
    ints = jtm.async_array_from_callback(
        SHAPE, sharding, lambda i: DATA[i].astype(np.int64), np.float32
    )
    check(
        "a dtype that holds every value is cast", ints.result(WAIT).dtype == np.float32
    )


def timeout_and_cancel():
    sharding = NamedSharding(mesh((4, 2), ("x", "y"), "auto"), P("x"))

    def hanging():
        """A loader whose first shard lands and the others hang, with its own
        counts of the shards that started and that were cancelled."""
        cancelled, started = threading.Semaphore(0), threading.Semaphore(0)

        async def hangs(index):
            if index[0].start == 0:
                return DATA[index]
            started.release()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.release()
                raise

        return hangs, cancelled, started

    # The timeout must come once the first shard has landed and the others
    # have started (about 0.1 s on a busy machine, 0.01 s on a quiet one):
    # if it came first, again with a timeout twice as long.
    timeout = 0.5
    while True:
        hangs, cancelled, started = hanging()
        x = jtm.async_array_from_callback(
            SHAPE, sharding, hangs, np.float32, timeout=timeout
        )
        text = message(TimeoutError, x.result, WAIT)
        all_started = all(started.acquire(blocking=False) for _ in range(3))
        early = text is not None and "for 4 of 4 shard(s)" in text
        if (all_started and not early) or timeout >= 8:
            break
        timeout *= 2
    check(
        "timeout names the missing shards",
        text is not None
        and "for 3 of 4 shard(s)" in text
        and "index [2:4, :] (devices 2, 3)" in text,
        text,
    )
    check(
        "timeout cancels them", all(cancelled.acquire(timeout=WAIT) for _ in range(3))
    )
    check("the others started before the timeout", all_started)
    y = jtm.async_array_from_callback(SHAPE, sharding, hangs, np.float32)
    check("started", all(started.acquire(timeout=WAIT) for _ in range(3)))
    check("cancel", y.cancel() is True)
    check("cancel cancels them", all(cancelled.acquire(timeout=WAIT) for _ in range(3)))
    got = raised(concurrent.futures.CancelledError, y.result, WAIT)
    check("cancel: uses raise CancelledError", got is not None)


def the_callbacks_buffer_is_not_kept():
    sharding = NamedSharding(mesh((8,), ("x",), "auto"), P("x"))
    buffers = []

    def fetch(index):
        buffers.append(np.array(DATA[index]))
        return buffers[-1]

    x = jtm.async_array_from_callback(SHAPE, sharding, fetch, np.float32).result(WAIT)
    for b in buffers:
        b[...] = -1  # the loader reuses its buffers
    check("the array does not alias the callback's buffers", np.array_equal(x, DATA))
    # Slices of a memory-mapped file (an ndarray subclass): the device buffers
    # must not be the file's pages, which a later write changes.
    data = np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "data.npy")
        np.save(path, data)
        mapped = np.load(path, mmap_mode="r+")
        y = jtm.async_array_from_callback(
            data.shape, sharding, lambda i: mapped[i], np.float32
        ).result(WAIT)
        mapped[...] = -1
        mapped.flush()
        check(
            "the array does not alias a memory-mapped file's pages",
            np.array_equal(y, data),
            shards_of(y),
        )


def bad_arguments():
    sharding = NamedSharding(mesh((8,), ("x",), "auto"), P("x"))
    for args, kwargs, error, words in (
        (
            (SHAPE, "x", lambda i: DATA[i], np.float32),
            {},
            TypeError,
            "sharding must be a jax.sharding.Sharding",
        ),
        (
            ((7, 16), sharding, lambda i: DATA[i], np.float32),
            {},
            ValueError,
            "cannot hold an array of shape (7, 16)",
        ),
        (
            (SHAPE, sharding, DATA, np.float32),
            {},
            TypeError,
            "data_callback must be callable",
        ),
        (
            ((8, -1), sharding, lambda i: DATA[i], np.float32),
            {},
            ValueError,
            "shape must be a sequence of non-negative",
        ),
        (
            (SHAPE, sharding, lambda i: DATA[i], "floaty"),
            {},
            TypeError,
            "dtype must be a NumPy or JAX dtype",
        ),
        (
            (SHAPE, sharding, lambda i: DATA[i], np.float32),
            {"timeout": -1},
            ValueError,
            "timeout",
        ),
    ):
        text = message(error, jtm.async_array_from_callback, *args, **kwargs)
        check(
            f"bad argument: {words}",
            text is not None
            and text.startswith("jax_threadmap.async_array_from_callback")
            and words in text,
            text,
        )


if __name__ == "__main__":
    print(
        "jax",
        jax.__version__,
        "blocking dispatch:",
        _dispatch.mechanism.status(),
    )
    a_failing_thread_stops_the_rest()
    same_as_make_array_from_callback()
    dispatch_before_the_data()
    a_program_waits_for_every_shard()
    shards_landing_while_dispatching()
    another_layout_waits_for_the_array()
    a_failing_shard()
    bad_shards_are_named()
    timeout_and_cancel()
    the_callbacks_buffer_is_not_kept()
    bad_arguments()
    print("all shard load checks passed", flush=True)
