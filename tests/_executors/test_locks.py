"""The lock rules of the executor layer, hammered: many maps on every kind of
runner at once with the interpreter switching threads every microsecond, the
claims (chunks claimed while others run, a failure stopping them) under
the same switching, and a fork while threads hold the layer's locks."""

import concurrent.futures
import functools
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_script, wait_until

from jax_threadmap import threadmap
from jax_threadmap._executors import jobs as _jobs
from jax_threadmap._executors import runners as _maps
from jax_threadmap._executors import runners as _runners
from jax_threadmap._executors import thread_pools as _thread_pools

F32 = jax.ShapeDtypeStruct((), jnp.float32)


class InThreads(concurrent.futures.Executor):
    """Runs tasks on threads of this process, but is no ThreadPoolExecutor: the
    map ships packed chunks to it as to a process pool (the shipper's path)."""

    def __init__(self, n):
        self._pool = concurrent.futures.ThreadPoolExecutor(n)
        self._max_workers = n

    def submit(self, fn, /, *args, **kwargs):
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait=True, **kwargs):
        self._pool.shutdown(wait=wait)


def _double(x):
    return x * np.float32(2)


@pytest.fixture
def switch_often():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def test_many_maps_on_every_runner_at_once(monkeypatch, switch_often):
    jobs = []
    new_job = _maps.new_job

    def recording(*args, **kwargs):
        job = new_job(*args, **kwargs)
        jobs.append(job)
        return job

    monkeypatch.setattr(_maps, "new_job", recording)
    user = concurrent.futures.ThreadPoolExecutor(4)
    shipped = InThreads(3)
    assert isinstance(_maps.runner_for(shipped), _maps.PicklingExecutor)
    executors = [None, 3, 16, user, shipped]
    errors = []
    x = np.arange(200, dtype=np.float32)
    fns = [
        jax.jit(jax.vmap(lambda v, ex=ex: threadmap(_double, F32, v, executor=ex)))
        for ex in executors
    ]

    def client(k):
        try:
            for r in range(6):
                f = fns[(k + r) % len(fns)]
                np.testing.assert_array_equal(f(x), 2 * x)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(10)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads), "a map hung"
    finally:
        user.shutdown()
        shipped.shutdown()
    assert errors == []
    assert len(jobs) == 60
    for job in jobs:  # every count kept under its lock adds up
        assert job.error is None
        assert job.completed == job.n
        assert job.hands <= min(job.n, job.workers)  # Job.add_hand's bound

    def all_given_back() -> bool:  # places come back as threads finish
        with _thread_pools._threads.lock:
            active = [p.active for p in _thread_pools._pools.values()]
            return not any(active) and not _thread_pools._threads.queue

    wait_until(all_given_back, "every pool's places given back, no map queued")


FORK_TIMEOUT = 60


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="a forked child cannot use the parent's accelerator (JAX's runtime is "
    "the parent's), and the child's maps put their results there",
)
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_fork_while_the_layer_is_busy():
    # At the fork: kernels block on the shared threads, and another thread holds
    # the runners' queueing lock. The child must find none of it.
    release = threading.Event()
    started = threading.Barrier(3, timeout=60)

    def blocked(v):
        started.wait()
        release.wait(60)
        return v

    def busy_map():
        f = jax.vmap(lambda v: threadmap(blocked, F32, v, executor=2))
        f(np.zeros(2, np.float32))

    held = threading.Event()

    def hold_locks():
        with _runners._queueing:
            held.set()
            release.wait(60)

    threads = [threading.Thread(target=busy_map), threading.Thread(target=hold_locks)]
    for t in threads:
        t.start()
    try:
        started.wait()
        assert held.wait(60)
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                x = np.arange(40, dtype=np.float32)
                ok = _thread_pools.num_threads() == 0
                with concurrent.futures.ThreadPoolExecutor(3) as ex:
                    for executor in (2, ex):
                        f = jax.vmap(
                            lambda v, e=executor: threadmap(_double, F32, v, executor=e)
                        )
                        ok = ok and bool((np.asarray(f(x)) == 2 * x).all())
                code = 0 if ok else 1
            finally:
                os._exit(code)
        ended: list[int] = []  # its exit status

        def child_ended() -> bool:
            done, status = os.waitpid(pid, os.WNOHANG)
            ended.extend([status] if done else [])
            return bool(done)

        try:
            wait_until(child_ended, "the forked child's end", timeout=FORK_TIMEOUT)
        except AssertionError:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on a lock held at the fork")
        assert os.waitstatus_to_exitcode(ended[0]) == 0
    finally:
        release.set()
        for t in threads:
            t.join(60)


# Every resource that a forked child resets busy at the fork; the child checks
# each is its own, in use, and that the resets ran layer by layer, lowest first.
FORK_EVERY_RESOURCE = """
import asyncio, concurrent.futures, contextlib, functools, os, threading, traceback
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap as jtm
from jax_threadmap._coroutines import event_loop
from jax_threadmap._executors import jobs, runners, thread_pools
from jax_threadmap._host.inner_threads import BLAS_LIMIT
from jax_threadmap._support import fork

F32, S = jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2,), np.float32)
opened_in = []  # the process that opened the shared resource, each time

@jtm.shared
@contextlib.asynccontextmanager
async def resource():
    opened_in.append(os.getpid())
    yield 1.0

@jtm.kernel(F32)
async def plus_one(x):
    return x + await resource.value()

def use_everything():
    x = np.arange(8, dtype=np.float32)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        for e in (2, ex):
            f = jax.vmap(lambda v, e=e: jtm.threadmap(np.negative, F32, v, executor=e))
            assert (np.asarray(f(x)) == -x).all(), e
    assert (np.asarray(jax.vmap(plus_one)(x)) == x + 1).all()
    assert opened_in[-1] == os.getpid(), opened_in
    async def load(v):
        return np.full(2, v, np.float32)
    assert float(jtm.async_call(load, S, 1.0).result(30)[0]) == 1.0
    plain = functools.partial(np.full, 2, dtype=np.float32)
    assert float(jtm.async_call(plain, S, 2.0, timeout=30).result(30)[0]) == 2.0

use_everything()
ran = []  # the layers of the resets run in the child, in order
def recorded(reset):
    return functools.wraps(reset)(lambda: (ran.append(layer(reset)), reset()))
def layer(reset):
    return fork.LAYERS.index(reset.__module__.split(".")[1])
fork.resets[:] = [recorded(r) for r in fork.resets]
release, started = threading.Event(), threading.Event()
def blocked():
    started.set()
    release.wait(60)
    return np.zeros(2, np.float32)
async def pending():
    await asyncio.to_thread(release.wait, 60)
    return np.zeros(2, np.float32)
calls = [jtm.async_call(blocked, S), jtm.async_call(pending, S)]
assert started.wait(30)
parent = (thread_pools._threads, runners._queueing, event_loop.event_loop())
jobs.this_thread.job = object()  # as in a kernel that forks
counted = BLAS_LIMIT.during_map(2, "k")  # a map of two threads runs
counted.__enter__()
runners._queueing.acquire()  # held at the fork: entered in the parent only
pid = os.fork()
if pid == 0:
    try:
        assert len(ran) == len(fork.resets) and ran == sorted(ran), ran
        assert jobs.this_thread.job is None, jobs.this_thread.job
        assert (BLAS_LIMIT._maps, BLAS_LIMIT.held) == (0, False), BLAS_LIMIT._maps
        assert thread_pools._threads is not parent[0], "threads"
        assert thread_pools.num_threads() == 0, thread_pools.num_threads()
        assert runners._queueing is not parent[1] and not runners._queueing.locked()
        assert event_loop.event_loop() is not parent[2], "loop"
        assert repr(resource).endswith("closed>"), resource
        status = jtm.async_pool_status()
        assert (status.running, status.queued, status.abandoned) == (0, 0, ()), status
        use_everything()
        os._exit(0)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
runners._queueing.release()
counted.__exit__(None, None, None)
jobs.this_thread.job = None
release.set()
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
jax.block_until_ready(calls)
use_everything()
print("fork ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_every_resource_afresh():
    proc = run_script(FORK_EVERY_RESOURCE)
    assert "fork ok" in proc.stdout, proc.report


def _protocol_chunk(calls, lock, slow, pause=0.002):
    """A chunk function that follows the loops' protocol, as the generated
    loops do: the job's ``failed`` read before each unit; the ``slow`` units
    pause, so that other threads claim and finish chunks meanwhile."""

    def chunk(start, stop, job):
        for i in range(start, stop):
            if job.failed:
                return
            with lock:
                calls[i] += 1
            if i in slow:
                time.sleep(pause)  # other threads claim while this unit runs

    return chunk


@pytest.mark.parametrize("in_order", [False, True], ids=["guided", "in-order"])
def test_chunks_claimed_while_others_run_leave_every_unit_run_once(
    switch_often, in_order
):
    # The claims hammered: six threads drain maps whose slow units keep chunks
    # running while the others claim and count theirs, with the interpreter
    # switching threads every microsecond; a map in index order claims one unit
    # at a time. Every unit runs once, the counts add up, and no chunk is left
    # counted as running.
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = 600
        calls = [0] * n
        lock = threading.Lock()
        slow = set(rng.choice(n, 40, replace=False).tolist())
        chunk = _protocol_chunk(calls, lock, slow)
        job = _jobs.Job(n, chunk, workers=6, in_order=in_order)
        threads = [threading.Thread(target=job.drain) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a drain hung"
        assert job.done.is_set() and job.error is None
        assert calls == [1] * n, [i for i, c in enumerate(calls) if c != 1]
        assert job.completed == n
        assert job._outstanding == 0 and job.exhausted()
        assert (job.fixed == 1) == in_order


def _failing_chunk(calls, late, job_of):
    """A protocol chunk that fails at unit 150 and notes, per thread, the units
    it began after the failure was recorded (read under the job's lock)."""

    def chunk(start, stop, job):
        assert job is job_of()
        for i in range(start, stop):
            if job.failed:
                return
            with job._lock:  # the order of this unit and the failure
                calls[i] += 1
                if job.failed:
                    me = threading.get_ident()
                    late[me] = late.get(me, 0) + 1
            if i == 150:
                raise ValueError(i)
            time.sleep(0)

    return chunk


def test_a_failure_stops_every_running_chunk_at_its_next_unit(switch_often):
    # fail() sets the job's failed under its lock, read by each loop: a thread
    # may finish the unit it had passed its check for, but starts no other one
    # once the failure is recorded; no unit runs twice.
    for _ in range(20):
        n = 400
        calls = [0] * n
        late: dict[int, int] = {}  # per thread: units begun with the map failed
        jobs: list[_jobs.Job] = []
        chunk = _failing_chunk(calls, late, functools.partial(jobs.__getitem__, 0))
        job = _jobs.Job(n, chunk, workers=6)
        jobs.append(job)
        threads = [threading.Thread(target=job.drain) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a drain hung"
        assert isinstance(job.error, ValueError)
        assert max(calls) == 1
        assert all(k <= 1 for k in late.values()), late
