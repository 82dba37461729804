"""Pools, thread bounds, nesting, concurrency, fork and shutdown."""

import concurrent.futures
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CLOCKS,
    all_idle,
    clocked_executor,
    executor_of,
    run_script,
    start_script,
    wait_until,
)

import jax_threadmap
from jax_threadmap import ExecutorError, InOrder, threadmap
from jax_threadmap._executors import jobs as _jobs
from jax_threadmap._executors import progress as _progress
from jax_threadmap._executors import runners as _maps
from jax_threadmap._executors import scheduling as _scheduling
from jax_threadmap._executors import thread_pools as _thread_pools

F32 = jax.ShapeDtypeStruct((), jnp.float32)
pytestmark = pytest.mark.timeout(120)


#: Seconds a gated kernel waits for the others to start: only a broken pool
#: waits that long (the test then fails on the count, not on a hang).
GATE_TIMEOUT = 30.0


class Recorder:
    """A sleepy kernel that records its threads and how many run at once.

    With ``gate=k``, no call returns before ``k`` calls have run at once (or
    ``GATE_TIMEOUT`` passed, which ``gate_timed_out`` records): a pool that can run
    ``k`` kernels at once reaches ``max_running == k`` whatever the machine's load,
    with no timing. A map whose elements wait for each other like this runs them
    with ``InOrder`` (every thread at once); without it a map on more threads than
    CPUs starts on fewer and would reach ``k`` only after the gate gave up."""

    def __init__(self, sleep=0.01, gate=None):
        self.sleep = sleep
        self.gate = gate
        self.all_in = threading.Event()
        self.lock = threading.Lock()
        self.threads = set()
        self.running = 0
        self.max_running = 0
        self.gate_timed_out = False

    def __call__(self, x):
        with self.lock:
            self.threads.add(threading.current_thread())
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            if self.gate is not None and self.running >= self.gate:
                self.all_in.set()
        if self.gate is None:
            time.sleep(self.sleep)
        elif not self.all_in.wait(GATE_TIMEOUT):
            self.gate_timed_out = True
        with self.lock:
            self.running -= 1
        return x * 2


def run(kernel, x, executor=None, jit=True):
    f = jax.vmap(jax.vmap(lambda v: threadmap(kernel, F32, v, executor=executor)))
    if jit:
        f = jax.jit(f)
    return np.asarray(f(x))


X = np.arange(24, dtype=np.float32).reshape(4, 6)


@pytest.mark.parametrize("n", [1, 3])
def test_env_var_sets_default_pool_size(monkeypatch, n):
    monkeypatch.setenv("JAX_THREADMAP_NUM_THREADS", str(n))
    rec = Recorder(gate=n)
    np.testing.assert_array_equal(run(rec, X, executor=InOrder()), X * 2)
    assert rec.max_running == n  # the pool's n threads run at once, no more
    assert not rec.gate_timed_out
    assert threading.main_thread() not in rec.threads
    assert all(t.name.startswith("jax_threadmap") for t in rec.threads)


def test_env_var_rejects_garbage(monkeypatch):
    monkeypatch.setenv("JAX_THREADMAP_NUM_THREADS", "lots")
    with pytest.raises(Exception, match="JAX_THREADMAP_NUM_THREADS='lots'"):
        run(np.negative, X, jit=False)


@pytest.mark.parametrize("n", [2, 5])
def test_int_executor_is_a_hard_bound_and_threads_are_reused(kept_threads, n):
    # Each map starts once the last one's threads are idle, and none idles out
    # (else a loaded machine's pause, or a thread still on its way back from
    # the last map, may have a map start a thread).
    rec = Recorder(gate=n)
    np.testing.assert_array_equal(run(rec, X, executor=InOrder(n)), X * 2)
    started = kept_threads.started
    for _ in range(2):
        wait_until(lambda: all_idle(kept_threads), "the threads went idle")
        np.testing.assert_array_equal(run(rec, X, executor=InOrder(n)), X * 2)
    assert rec.max_running == n
    assert not rec.gate_timed_out
    sleepy = Recorder(0.002)  # chunks sized from timings: within the bound too
    wait_until(lambda: all_idle(kept_threads), "the threads went idle")
    np.testing.assert_array_equal(run(sleepy, X, executor=n), X * 2)
    assert 1 <= sleepy.max_running <= n
    assert _thread_pools.get_pool(n).peak <= n
    # The next maps of a pool take over its threads: no thread starts.
    assert kept_threads.started == started


def test_bound_is_per_pool_not_per_map():
    rec = Recorder(gate=3)
    callers = [threading.Thread(target=run, args=(rec, X, 3)) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert rec.max_running == 3


def test_pools_of_every_size_share_threads_and_idle_threads_exit(monkeypatch):
    monkeypatch.setattr(_thread_pools, "IDLE_TIMEOUT", 0.2)
    threads = _thread_pools._Threads()  # a set of its own: its peak is this test's
    monkeypatch.setattr(_thread_pools, "_threads", threads)
    x = np.zeros(40, np.float32)
    for n in range(1, 21):
        np.testing.assert_array_equal(
            run(Recorder(0.002), x[None], executor=n), x[None]
        )
        assert _thread_pools.get_pool(n).peak <= n
    # Sequential maps of sizes 1..20 need at most 20 threads at once, and their
    # threads are handed from pool to pool: far fewer than 1 + 2 + ... + 20 = 210
    # threads ever start, and at most a few more than 20 are alive at once (when a
    # map's threads are still finishing as the next map starts). The set records
    # its exact peak: a count sampled between maps would miss an overshoot.
    assert 1 <= threads.peak <= 40, threads.peak
    wait_until(lambda: _thread_pools.num_threads() == 0, "idle threads exited")
    rec = Recorder(gate=4)
    np.testing.assert_array_equal(run(rec, X, executor=InOrder(4)), X * 2)  # restarted
    assert rec.max_running == 4
    assert not rec.gate_timed_out


def test_user_executor_runs_every_kernel():
    rec = Recorder()
    with concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="mine") as ex:
        np.testing.assert_array_equal(run(rec, X, executor=ex), X * 2)
    assert rec.threads and all(t.name.startswith("mine") for t in rec.threads)
    assert rec.max_running <= 3


def test_results_ordered_whatever_the_thread_count():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 9)).astype(np.float32)

    def jittery(v):
        time.sleep(rng.random() * 1e-3)  # finish out of order
        return v + 1

    expected = x + 1
    for n in (1, 2, 7):
        np.testing.assert_array_equal(run(jittery, x, executor=n), expected)


def test_kernel_calling_jax_completes():
    def k(v):
        return np.asarray(jnp.sin(jnp.asarray(v)) + jnp.float32(1))

    np.testing.assert_allclose(run(k, X, executor=2), np.sin(X) + 1, rtol=1e-6)


@pytest.mark.parametrize("executor", [1, 2, None])
def test_nested_threadmap_with_pool_smaller_than_batch(executor):
    inner = jax.jit(
        jax.vmap(lambda v: threadmap(lambda a: a * 3, F32, v, executor=executor))
    )

    def outer(v):
        return np.asarray(inner(jnp.full(5, v))).sum()

    np.testing.assert_allclose(run(outer, X, executor=executor), X * 15)


def test_nested_threadmap_on_user_executor():
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        inner = jax.jit(
            jax.vmap(lambda v: threadmap(lambda a: a + 1, F32, v, executor=ex))
        )

        def outer(v):
            return np.asarray(inner(jnp.full(3, v))).sum()

        np.testing.assert_allclose(run(outer, X, executor=ex), (X + 1) * 3)


def test_many_python_threads_calling_at_once():
    f = jax.jit(jax.vmap(lambda v: threadmap(lambda a: a * a, F32, v, executor=4)))
    x = np.arange(8, dtype=np.float32)
    f(x)
    errors = []
    pool = _thread_pools.get_pool(4)
    pool.peak = 0  # (no map of this pool runs now)

    def caller(seed):
        try:
            for i in range(100):
                y = x + seed + i
                np.testing.assert_array_equal(np.asarray(f(y)), y * y)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    # The 16 callers' maps shared the pool: at most 4 of its places held at
    # once, exactly (the pool records its peak; sampling the thread count would
    # miss a short overshoot, and count a runtime's callback threads).
    assert 1 <= pool.peak <= 4


def test_failure_cancels_work_not_started():
    # The first element fails once another thread runs an element, and every
    # other element waits until the map has failed (events, not sleeps): the
    # other thread is inside its chunk when the failure comes, and must start
    # no other element of it, whatever the machine's load.
    started = []
    other_started = threading.Event()

    def k(v):
        if int(v) >= 1000:  # the map after: runs as usual
            return v
        started.append(int(v))
        if int(v) == 0:
            other_started.wait(GATE_TIMEOUT)
            raise RuntimeError("first element fails")
        other_started.set()
        job = _jobs.this_thread.job

        def failed() -> bool:
            return job is None or job.failed

        wait_until(failed, "the map failed", timeout=GATE_TIMEOUT, poll=1e-3)
        return v

    x = np.arange(400, dtype=np.float32)
    f = jax.vmap(lambda v: threadmap(k, F32, v, executor=2))
    with pytest.raises(Exception, match="first element fails"):
        f(x)
    assert 0 in started and len(started) <= 2, started
    np.testing.assert_array_equal(f(x + 1000), x + 1000)


def test_shut_down_executor_is_a_clear_error():
    ex = concurrent.futures.ThreadPoolExecutor(2)
    ex.shutdown()
    f = jax.vmap(lambda v: threadmap(np.negative, F32, v, executor=ex))
    with pytest.raises(ExecutorError, match="refused new work"):
        f(np.arange(3, dtype=np.float32))


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_pool_is_fresh_after_fork():
    pool = _thread_pools.get_pool(2)
    out = np.zeros(10)

    def fill(start, stop, job):
        out[start:stop] = 1

    pool.run(_jobs.Job(10, fill))
    pid = os.fork()
    if pid == 0:  # child: the parent's workers do not exist here
        code = 1
        try:
            child_pool = _thread_pools.get_pool(2)
            ok = child_pool is not pool and _thread_pools.num_threads() == 0
            res = np.zeros(10)

            def fill_child(start, stop, job):
                res[start:stop] = 2

            child_pool.run(_jobs.Job(10, fill_child))
            code = 0 if ok and (res == 2).all() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_interpreter_exit_is_clean():
    code = (
        "import jax, numpy as np\n"
        "from jax_threadmap import threadmap\n"
        "f = jax.jit(jax.vmap(lambda v: threadmap(np.sqrt, "
        "jax.ShapeDtypeStruct((), v.dtype), v)))\n"
        "print(float(f(np.arange(16.0, dtype=np.float32)).sum()))\n"
    )
    proc = run_script(code, timeout=60, forked=True)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert abs(float(proc.stdout) - np.sqrt(np.arange(16.0)).sum()) < 1e-3


def test_job_of_pool_directly_reports_first_error():
    pool = _thread_pools.ThreadPool(3)

    def fn(start, stop, job):
        for i in range(start, stop):
            if i == 5:
                raise KeyError(i)

    job = _jobs.Job(50, fn)
    pool.run(job)
    assert isinstance(job.error, KeyError)


def test_concurrent_failing_maps_never_hang():
    def k(v):
        if int(v) % 7 == 3:
            raise ValueError("bad")
        return v

    f = jax.jit(jax.vmap(lambda v: threadmap(k, F32, v, executor=3)))
    f(np.zeros(4, np.float32))
    outcomes = []

    def caller(seed):
        rng = np.random.default_rng(seed)
        for _ in range(40):
            x = rng.integers(0, 50, 64).astype(np.float32)
            try:
                out = np.asarray(f(x))
                outcomes.append(np.array_equal(out, x) and not (x % 7 == 3).any())
            except Exception as e:  # noqa: BLE001
                outcomes.append("ValueError: bad" in str(e) and (x % 7 == 3).any())

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not any(t.is_alive() for t in threads), "a map hung"
    assert len(outcomes) == 320 and all(outcomes)


def test_interrupt_while_waiting_stops_work_not_started():
    class Interrupting(_progress.Progress):
        interval = 0.01

        def update(self, completed):
            raise KeyboardInterrupt

    ran = []  # the chunks begun

    def fn(start, stop, job):
        ran.append(start)
        for _ in range(start, stop):
            if job.failed:
                return
            # Each element waits for the interrupt (it once slept 10 ms, and a
            # waiting thread late to its first update let 50 start).
            wait_until(lambda: job.failed, "the interrupt", poll=1e-3)

    pool = _thread_pools.ThreadPool(2)
    job = _jobs.Job(1000, fn)
    with pytest.raises(KeyboardInterrupt):
        pool.run(job, progress=Interrupting(1000, "k"))
    wait_until(job.done, "the running chunks ended")
    assert isinstance(job.error, KeyboardInterrupt)
    # One chunk of one element per thread, begun before the interrupt; none after.
    assert len(ran) <= 2, ran


def _inline_job(n, fn, per_element):
    last = _scheduling.Measure(per_element=per_element)
    return _jobs.Job(n, fn, workers=2, inline=last)


def test_a_map_expected_short_runs_on_the_thread_that_started_it():
    ran = []  # (element, thread); list.append is thread-safe

    def fn(start, stop, job):
        ran.extend((i, threading.current_thread()) for i in range(start, stop))

    pool = _thread_pools.ThreadPool(2)
    job = _inline_job(16, fn, 1e-6)  # one chunk: 16 elements of 1 us
    pool.run(job)
    assert job.error is None and sorted(i for i, _ in ran) == list(range(16))
    assert {t for _, t in ran} == {threading.current_thread()}
    assert pool.active == 0


def test_an_inline_map_runs_what_fits_in_the_rest_of_its_time_in_one_chunk(
    monkeypatch,
):
    chunks = []  # (start, stop, thread)
    clock = iter(range(10**6))  # a chunk takes 1 ms: 10 us an element, at first
    monkeypatch.setattr(_jobs.time, "perf_counter", lambda: next(clock) * 1e-3)
    pool = _thread_pools.ThreadPool(2)
    job = _inline_job(
        400, lambda a, b, j: chunks.append((a, b, threading.current_thread())), 1e-5
    )
    pool.run(job)
    # A first chunk sized from the last map's time, then the rest at once (what
    # fits in 9 ms), where guided chunks would take a quarter of what is left.
    assert [c[:2] for c in chunks] == [(0, 100), (100, 400)]
    assert {c[2] for c in chunks} == {threading.current_thread()}


def test_a_summed_map_expected_short_runs_here_in_its_fixed_chunks():
    chunks = []
    pool = _thread_pools.ThreadPool(2)
    last = _scheduling.Measure(per_element=1e-6)
    job = _jobs.Job(
        16,
        lambda a, b, j: chunks.append((a, b, threading.current_thread())),
        fixed=4,
        workers=2,
        inline=last,
    )
    assert job.inline
    pool.run(job)
    assert sorted(c[:2] for c in chunks) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert {c[2] for c in chunks} == {threading.current_thread()}
    assert job.per_unit > 0  # its chunks were timed: the next map's estimate


def test_a_map_run_inline_that_turns_out_slow_gets_the_pools_threads():
    ran = []

    def fn(start, stop, job):
        for i in range(start, stop):
            if i == 0:  # longer than the map was expected to take in all
                time.sleep(2 * _scheduling.INLINE_SECONDS)
            ran.append(i)

    pool = _thread_pools.ThreadPool(2)
    n = 40
    job = _inline_job(n, fn, _scheduling.INLINE_SECONDS / n / 2)
    assert job.inline
    pool.run(job)
    assert job.error is None and sorted(ran) == list(range(n))
    assert job.limit == 2  # it rose
    wait_until(lambda: pool.active == 0, "the threads it got gave their places back")


def test_a_map_queued_behind_an_inline_map_gets_its_place_back():
    pool = _thread_pools.ThreadPool(1)
    second = _jobs.Job(3, lambda start, stop, job: None, workers=1)

    def queued():
        return any(j is second for _, j in _thread_pools._threads.queue)

    def fn(start, stop, job):  # the inline map holds the pool's one place
        wait_until(queued, "the second map queued")

    def start_second():
        wait_until(lambda: pool.active, "the inline map took the pool's place")
        pool.run(second)

    waiter = threading.Thread(target=start_second)
    waiter.start()
    pool.run(_inline_job(4, fn, 1e-6))
    waiter.join(60)
    assert not waiter.is_alive() and second.done.is_set() and second.error is None
    wait_until(lambda: pool.active == 0, "every place given back")


def test_kernel_lends_its_thread_to_the_nested_map_it_waits_for():
    inner_rec = Recorder(0.02)
    inner = jax.jit(jax.vmap(lambda v: threadmap(inner_rec, F32, v, executor=2)))
    outer_threads = set()

    def outer(v):
        outer_threads.add(threading.current_thread())
        return np.asarray(inner(jnp.full(12, v))).sum()

    np.testing.assert_allclose(run(outer, X[:1, :3], executor=1), X[:1, :3] * 24)
    # The waiting outer kernel runs inner elements too: one more than the inner
    # pool's 2 at once, never more.
    assert outer_threads <= inner_rec.threads
    assert inner_rec.max_running <= 3


def test_nested_map_on_the_same_pool_keeps_the_bound_exact():
    inner_rec = Recorder(0.005)
    inner = jax.jit(jax.vmap(lambda v: threadmap(inner_rec, F32, v, executor=2)))

    def outer(v):
        return np.asarray(inner(jnp.full(6, v))).sum()

    np.testing.assert_allclose(run(outer, X[:2, :4], executor=2), X[:2, :4] * 12)
    assert inner_rec.max_running <= 2  # both places are held by waiting kernels


def test_failed_map_stops_the_maps_its_kernels_started():
    ran = []
    nested_running = threading.Event()
    outer = []  # the outer map

    def inner_k(v):
        ran.append(v)
        nested_running.set()
        # Each inner element waits for the outer map's failure (it slept 5 ms:
        # the failure had to come within the nested map's 5 s).
        wait_until(lambda: outer[0].failed, "the outer map failed", poll=1e-3)
        return v

    inner = jax.jit(jax.vmap(lambda v: threadmap(inner_k, F32, v, executor=1)))

    def outer_k(v):
        if int(v) == 0:
            assert nested_running.wait(30)
            raise RuntimeError("outer element fails")
        outer.append(_jobs.this_thread.job)
        return np.asarray(inner(jnp.zeros(2000, jnp.float32))).sum()

    with pytest.raises(Exception, match="outer element fails"):
        run(outer_k, np.arange(2, dtype=np.float32)[None], executor=2)
    # The nested map of element 1 stopped with the outer map: one element ran
    # on each of its threads (its pool's one, and the waiting kernel's).
    assert len(ran) <= 2, len(ran)


@pytest.mark.parametrize(
    "make",
    [
        lambda n: threadmap(np.negative, F32, 1.0, executor=n),
        lambda n: jax_threadmap.kernel(F32, executor=n)(np.negative),
    ],
    ids=["threadmap", "kernel"],
)
def test_absurd_pool_size_is_refused_at_call_time(make):
    for n in (4097, 10**9, np.int64(10**9)):
        with pytest.raises(ValueError, match=f"at most 4096 threads. Got executor={n}"):
            make(n)
    make(4096)  # the ceiling itself is fine (and starts one thread for one element)


def test_the_pool_size_is_read_once_per_map(monkeypatch):
    # Issue 50: once where the map runs (a changed value is followed), and once
    # more where a jitted call's program is built (to refuse a bad value there).
    from jax_threadmap._support import environment as env

    read = []
    real = env.env_positive_int

    def counting(name, *args, **kw):
        read.append(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(env, "env_positive_int", counting)
    reads = env.ENV_NUM_THREADS
    f = jax.vmap(lambda v: threadmap(np.negative, F32, v))
    x = np.arange(3, dtype=np.float32)
    for _ in range(2):
        np.testing.assert_array_equal(f(x), -x)
    assert read.count(reads) == 2, read
    g = jax.jit(f)
    for _ in range(3):
        np.testing.assert_array_equal(g(x), -x)
    assert read.count(reads) == 2 + 1 + 3, read
    monkeypatch.setenv(reads, "lots")
    with pytest.raises(Exception, match="JAX_THREADMAP_NUM_THREADS='lots'"):
        g(x).block_until_ready()  # a compiled program reads it too


def test_absurd_pool_size_in_environment_is_refused_at_call_time(monkeypatch):
    monkeypatch.setenv("JAX_THREADMAP_NUM_THREADS", str(10**9))
    f = jax.jit(jax.vmap(lambda v: threadmap(np.negative, F32, v)))
    with pytest.raises(ValueError, match="JAX_THREADMAP_NUM_THREADS must be at most"):
        f(np.zeros(3, np.float32))


# --- exit, Ctrl-C and deadlocks, in a fresh interpreter ----------------------------


class Child:
    """A Python subprocess running ``code``; it prints "ready" when set up."""

    def __init__(self, code: str, *args: str):
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = start_script(code, *args, stderr=self.stderr)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_ready(self, timeout: float = 60) -> None:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            pytest.fail(f"the child never got ready: {self.err()}")
        assert line == "ready", self.err()

    def exits(self, timeout: float = 60) -> None:
        """Waits for the child's exit; fails if it takes ``timeout`` s (a hang:
        the tests give it work that would hold it far longer)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the child did not exit in {timeout} s: {self.err()}")

    def err(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()


# n kernels that block for good in a socket read with no timeout.
BLOCKED_KERNELS = """
    import socket, sys, threading
    import jax, jax.numpy as jnp, numpy as np
    from jax_threadmap import threadmap

    n, mode = int(sys.argv[1]), sys.argv[2]
    lock, conns, all_blocked = threading.Lock(), [], threading.Event()

    def read_forever(x):
        conn, _peer = socket.socketpair()  # a unix socket: no network needed
        with lock:
            conns.append(conn)
            if len(conns) == n:
                all_blocked.set()
        conn.recv(1)  # the server never sends
        return x

    f = jax.vmap(lambda v: threadmap(
        read_forever, jax.ShapeDtypeStruct((), jnp.float32), v, executor=n))
    f = f if mode == "eager" else jax.jit(f)
    x = np.zeros(2 * n, np.float32)
    if mode == "daemon":  # the map is in flight in another thread at exit
        threading.Thread(target=f, args=(x,), daemon=True).start()
        all_blocked.wait()
        print("ready", flush=True)
    else:  # Ctrl-C while the main thread waits for the map
        threading.Thread(
            target=lambda: all_blocked.wait() and print("ready", flush=True)
        ).start()
        f(x)
"""


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_ctrl_c_with_blocked_kernels_exits_at_once(mode):
    # Was 10 s per blocked thread: 160 s here. The kernels block for good, so the
    # child exits only if Ctrl-C leaves them behind.
    child = Child(BLOCKED_KERNELS, "16", mode)
    child.wait_ready()
    child.proc.send_signal(signal.SIGINT)
    child.exits()
    assert child.proc.returncode != 0
    assert "KeyboardInterrupt" in child.err()


def test_exit_with_a_map_in_flight_in_another_thread_is_prompt_and_clean():
    # Was 10 s per blocked thread (160 s here), then a fatal error in finalization:
    # the daemon thread waited inside the jitted program.
    child = Child(BLOCKED_KERNELS, "16", "daemon")
    child.wait_ready()
    child.exits()  # the kernels block for good
    assert child.proc.returncode == 0, child.err()
    assert "Fatal Python error" not in child.err()
    assert "The interpreter is exiting: this threadmap was stopped" in child.err()


# A program that dispatches maps and ends without waiting for them; JAX waits for
# them at exit. A hook registered before jax is imported runs after JAX's, and
# prints how many kernel calls finished.
DISPATCH_AND_EXIT = """
    import atexit, sys, threading, time
    calls, lock = [0], threading.Lock()
    atexit.register(lambda: print("finished", calls[0], flush=True))

    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_threadmap import threadmap

    def kernel(row, scale):
        time.sleep(0.05)  # still running at exit
        with lock:
            calls[0] += 1
        return np.sort(row) * scale

    def per_row(rows, scale):
        out = jax.ShapeDtypeStruct(rows.shape[1:], rows.dtype)
        return jax.vmap(lambda r: threadmap(kernel, out, r, scale))(rows)

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.device_put(np.ones((8, 1000), np.float32), NamedSharding(mesh, P("d")))
    if sys.argv[1] == "shard_map":  # the example of docs/sharding.md
        f = jax.jit(jax.shard_map(
            per_row, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
    else:  # sharded jit: the partitioner places the host call on one device
        f = jax.jit(per_row)
    out = f(rows, np.float32(2.0))
    print("dispatched", flush=True)
"""


@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("program", ["shard_map", "jit"])
def test_exit_without_waiting_for_dispatched_maps_is_clean(devices, program):
    # Was, with 4 devices: "ExecutorError: The interpreter is exiting" from JAX's
    # own exit handler, and "AssertionError: cannot join a dummy thread".
    flags = f"--xla_force_host_platform_device_count={devices}"
    proc = run_script(DISPATCH_AND_EXIT, program, env={"XLA_FLAGS": flags})
    assert proc.returncode == 0, proc.stderr
    # XLA's own log line about gathering the operands of a host call on one
    # device (under sharded jit, as for jax.pure_callback) is not ours.
    lines = proc.stderr.splitlines()
    assert [x for x in lines if "Involuntary full rematerialization" not in x] == []
    # Every element ran: the maps finished, none was stopped.
    assert proc.stdout.split() == ["dispatched", "finished", "8"]


# Maps on a process pool, in flight in a daemon and a non-daemon thread at exit.
PROCESS_POOL_AT_EXIT = """
    import atexit, concurrent.futures, gc, multiprocessing, os, threading, time
    import jax, jax.numpy as jnp, numpy as np
    from jax_threadmap import threadmap
    from jax_threadmap._executors import runners as _maps
    import worker_kernels
    from helpers import wait_until

    if __name__ == "__main__":
        ex = concurrent.futures.ProcessPoolExecutor(
            2, mp_context=multiprocessing.get_context("spawn"))

        def on_pool(kernel):
            return jax.vmap(lambda v: threadmap(
                kernel, jax.ShapeDtypeStruct((), jnp.float32), v, executor=ex))

        on_pool(worker_kernels.raises_at_five)(np.zeros(4, np.float32))  # warm
        f = on_pool(worker_kernels.slow_identity)  # 64 elements: 64 s a map

        def run(name):
            try:
                f(np.zeros(64, np.float32))  # 64 s of kernels on 2 workers
            except Exception as e:
                # One write per line: the two threads end at the same moment,
                # and print() writes its parts one by one.
                os.write(1, f"{name} {type(e).__name__} {e}\\n".encode())

        threads = [
            threading.Thread(target=run, args=(daemon,), daemon=daemon)
            for daemon in (True, False)
        ]
        for t in threads:
            t.start()
        # A daemon thread may be cut short by the interpreter's end: a non-daemon
        # thread keeps the interpreter until it has ended (its map is stopped
        # before Python joins non-daemon threads), having written its line and
        # let go of the pool.
        threading.Thread(target=threads[0].join, args=(50,)).start()

        def let_go_of_the_pool():
            # After the pool's own exit (atexit runs after concurrent.futures'
            # threading hook has joined its manager): the last references to it
            # (this module's, JAX's caches of the maps' parameters) go while every
            # module is whole. Else the interpreter's teardown drops them, and the
            # pool's weakref callback may meet concurrent.futures.process torn
            # down (CPython's own "Exception ignored in ... weakref_cb",
            # "'NoneType' object has no attribute 'util'": seen under load).
            globals().pop("ex", None)
            jax.clear_caches()
            gc.collect()

        atexit.register(let_go_of_the_pool)
        wait_until(lambda: len(_maps._flights) == 2, "both maps in flight")
        print("ready", flush=True)
"""


@pytest.mark.long
def test_exit_with_process_pool_maps_in_flight_says_the_interpreter_exits():
    # Was "The executor ... refused new work ... cannot schedule new futures after
    # shutdown. Pass an executor that is running", for both maps.
    stderr = tempfile.TemporaryFile("w+")
    proc = start_script(PROCESS_POOL_AT_EXIT, stderr=stderr)
    try:
        assert proc.stdout.readline().strip() == "ready"
        # Exit waits for the tasks that the pool has queued already (a few
        # seconds) and for the pool's own shutdown (seconds: its workers import
        # JAX), not for the maps (64 s each), or this times out.
        proc.wait(timeout=60)
    finally:
        proc.kill()
    # The rest of stdout through the same reader as "ready": the lines may have
    # come in one read with it, and sit in that reader's buffer.
    out = proc.stdout.read()
    stderr.seek(0)
    err = stderr.read()
    assert proc.returncode == 0, err
    lines = sorted(out.splitlines())
    assert len(lines) == 2, (out, err)
    # The daemon thread's map is stopped; the non-daemon thread's map is refused
    # by the pool, which takes no new work once the main thread has ended.
    assert lines[0].startswith("False ExecutorError The interpreter is exiting")
    assert "refuses new work once the main thread has ended" in lines[0]
    assert lines[1].startswith("True ExecutorError The interpreter is exiting")
    assert "refused new work" not in out + err
    assert "Traceback" not in err, err


def test_threads_of_many_pool_sizes_do_not_pile_up():
    # Was 1,276 threads: one pool of N threads for every N, forever. Now the
    # threads alive stay within the most kernels at once (50) plus one spare per
    # CPU, and every one exits once idle (waited for, not slept on).
    code = """
        import time
        import jax, jax.numpy as jnp, numpy as np
        from helpers import wait_until
        from jax_threadmap import threadmap
        from jax_threadmap._executors import thread_pools as _thread_pools
        from jax_threadmap._support.cpus import available_cpus

        _thread_pools.IDLE_TIMEOUT = 0.2

        def k(v):
            time.sleep(0.001)
            return v

        for n in range(1, 51):
            f = jax.jit(jax.vmap(lambda v: threadmap(
                k, jax.ShapeDtypeStruct((), jnp.float32), v, executor=n)))
            f(np.zeros(64, np.float32))
        wait_until(lambda: _thread_pools.num_threads() == 0, "idle threads exited")
        # The most threads alive at once, exactly (recorded as each starts).
        print(_thread_pools._threads.peak, available_cpus())
    """
    proc = run_script(code, timeout=300, forked=True)
    assert proc.returncode == 0, proc.stderr
    peak, cpus = map(int, proc.stdout.split())
    assert 1 <= peak <= 50 + cpus, (peak, cpus)


# Shared pool -> a user ThreadPoolExecutor(1) -> shared pool: the pool's workers
# wait on maps on T, whose one thread waits on a map queued behind them.
NESTED_ACROSS_POOLS = """
    import sys, time
    from concurrent.futures import ThreadPoolExecutor
    import jax, jax.numpy as jnp, numpy as np
    from jax_threadmap import threadmap

    F32 = jax.ShapeDtypeStruct((), jnp.float32)
    inner_n, inner_sleep, jit_outer = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    T = ThreadPoolExecutor(1)

    def inner_k(v):
        if inner_sleep:
            print("ready", flush=True)
            time.sleep(inner_sleep)
        return v + 1

    inner = jax.jit(jax.vmap(lambda x: threadmap(inner_k, F32, x, executor=2)))
    mid = jax.jit(jax.vmap(lambda r: threadmap(
        lambda row: np.float32(np.asarray(inner(row)).sum()), F32, r, executor=T)))

    def outer_k(m):
        time.sleep(0.05)
        return np.float32(np.asarray(mid(m)).sum())

    outer = jax.vmap(lambda m: threadmap(outer_k, F32, m, executor=2))
    outer = jax.jit(outer) if jit_outer == "jit" else outer
    print(np.asarray(outer(np.ones((4, 2, inner_n), np.float32))).tolist(), flush=True)
"""


def test_nested_maps_across_pools_complete():
    # Was a deadlock.
    proc = run_script(NESTED_ACROSS_POOLS, "3", "0", "jit", forked=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[12.0, 12.0, 12.0, 12.0]"


def test_ctrl_c_stops_nested_maps_across_pools():
    # Long inner maps (8 of 4,000 elements of 50 ms on 2 threads: 800 s): one
    # Ctrl-C stops the outer map and the maps its kernels started, including
    # those on the user's (non-daemon) thread executor, or the child never exits.
    # The outer map is not jitted: a jitted program of this size runs on an XLA
    # thread while the main thread waits inside XLA, where Ctrl-C reaches Python
    # only once the program ends (JAX issue #18246; docs/executors.md).
    child = Child(NESTED_ACROSS_POOLS, "4000", "0.05", "eager")
    child.wait_ready()
    child.proc.send_signal(signal.SIGINT)
    child.exits()
    assert "KeyboardInterrupt" in child.err()


@pytest.mark.parametrize(
    ("error", "after_start"),
    [
        (RuntimeError("can't start new thread"), False),
        (RuntimeError("can't create new thread at interpreter shutdown"), False),
        (KeyboardInterrupt(), False),
        (KeyboardInterrupt(), True),  # a start cut short: the thread runs
    ],
)
def test_thread_that_fails_to_start_gives_its_place_back(
    monkeypatch, error, after_start
):
    monkeypatch.setattr(
        _thread_pools, "_threads", _thread_pools._Threads()
    )  # none idle
    real_start = threading.Thread.start
    cut_short = []

    def failing_start(self):
        if self.name.startswith("jax_threadmap"):
            if after_start:
                real_start(self)
                cut_short.append(self)
            raise error
        real_start(self)

    rec = Recorder()
    ran = []

    def fn(start, stop, job):
        for i in range(start, stop):
            ran.append(rec(i) // 2)

    pool = _thread_pools.ThreadPool(3)
    monkeypatch.setattr(threading.Thread, "start", failing_start)
    job = _jobs.Job(12, fn)
    if isinstance(error, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            pool.run(job)
    elif "interpreter shutdown" in str(error):  # CPython 3.12.0/1 in atexit hooks
        pool.run(job)  # then the calling thread runs the map
        assert job.error is None
        assert sorted(ran) == list(range(12))
        assert rec.threads == {threading.current_thread()}
    else:
        pool.run(job)
        assert isinstance(job.error, ExecutorError)
        assert "Could not start a thread" in str(job.error)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    for thread in cut_short:  # it found no job, and left
        thread.join(60)
        assert not thread.is_alive()
    assert pool.active == 0 and _thread_pools.num_threads() == 0
    rec = Recorder(gate=3)
    job = _jobs.Job(12, fn)
    pool.run(job)
    assert job.error is None and rec.max_running == 3


# --- threads per map: fast maps on one thread per CPU ---------------------------------


class Counter:
    """A fast kernel that counts its calls, its threads and how many ran at once."""

    def __init__(self):
        self.rec = Recorder(sleep=0)
        self.calls = 0

    def __call__(self, x):
        with self.rec.lock:
            self.calls += 1
        return self.rec(x)


def _no_votes(monkeypatch):
    """Maps on more threads than CPUs never gain threads: no chunk finds its
    elements slow or waiting, however busy the machine."""
    monkeypatch.setattr(_scheduling, "SLOW_ELEMENT", float("inf"))
    monkeypatch.setattr(_scheduling, "WAIT_SHARE", 0.0)


def user_pool(n):
    return concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="mine")


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("executor", [32, "user"])
def test_fast_map_runs_on_one_thread_per_cpu(monkeypatch, cpus, executor):
    _no_votes(monkeypatch)
    monkeypatch.setattr(_maps, "available_cpus", lambda: cpus)
    with executor_of(executor, 32) as ex:
        x = np.arange(4096, dtype=np.float32).reshape(64, 64)
        k = Counter()
        np.testing.assert_array_equal(run(k, x, executor=ex), x * 2)
        assert k.calls == x.size  # each element once
        assert k.rec.max_running <= cpus
        assert len(k.rec.threads) <= cpus


@pytest.mark.parametrize("n", [1, 2, 3, 31, 100, 4097])
@pytest.mark.parametrize("executor", [32, "user"])
def test_limited_maps_run_every_element_once(monkeypatch, n, executor):
    monkeypatch.setattr(_maps, "available_cpus", lambda: 2)
    with executor_of(executor, 32) as ex:
        x = np.arange(n, dtype=np.float32)[None]
        k = Counter()
        np.testing.assert_array_equal(run(k, x, executor=ex), x * 2)
        assert k.calls == n


class RisenRecorder(Recorder):
    """Sleeps ``sleep`` seconds per call while its map is limited (so that its
    chunks vote); once the map has every thread, no call returns before
    ``gate`` calls run at once: a map that really got its executor's threads
    reaches ``max_running == gate`` however loaded the machine."""

    def __call__(self, x):
        job = _jobs.this_thread.job
        if job is not None and job.limited:
            with self.lock:
                self.threads.add(threading.current_thread())
            time.sleep(self.sleep)
            return x * 2
        return super().__call__(x)


@pytest.mark.parametrize("executor", [8, "user"])
def test_slow_elements_get_every_thread(monkeypatch, executor):
    monkeypatch.setattr(_maps, "available_cpus", lambda: 1)
    with executor_of(executor, 8) as ex:
        rec = RisenRecorder(sleep=0.01, gate=8)  # 10 ms: far above SLOW_ELEMENT
        x = np.zeros((4, 16), np.float32)  # 64 elements: more than 4 per thread
        np.testing.assert_array_equal(run(rec, x, executor=ex), x)
        assert rec.max_running == 8


@pytest.mark.parametrize("executor", [8, "user"])
def test_waiting_elements_get_every_thread(monkeypatch, executor):
    monkeypatch.setattr(_maps, "available_cpus", lambda: 1)
    monkeypatch.setattr(_scheduling, "SLOW_ELEMENT", float("inf"))  # from CPU time
    with executor_of(executor, 8) as ex:
        # Sleeps: its thread is on a CPU a few % of the time.
        rec = RisenRecorder(sleep=0.002, gate=8)
        x = np.zeros((8, 64), np.float32)
        np.testing.assert_array_equal(run(rec, x, executor=ex), x)
        assert rec.max_running == 8


@CLOCKS
@pytest.mark.parametrize("executor", [8, "user"])
def test_elements_that_wait_for_each_other_all_start(monkeypatch, clock, executor):
    # A large map on an executor with more threads than CPUs, in index order:
    # its first element waits for its second, which another thread claims
    # (without the mode, the map would start on one thread and both elements
    # could sit in its first chunk).
    with clocked_executor(monkeypatch, executor, 8, clock, 1) as ex:
        pair = threading.Barrier(2, timeout=60)

        def meet(v):
            if v < 2:
                pair.wait()
            return v + 1

        x = np.arange(64, dtype=np.float32)[None]
        np.testing.assert_array_equal(run(meet, x, executor=InOrder(ex)), x + 1)


@CLOCKS
@pytest.mark.parametrize("executor", [32, "user"])
def test_maps_at_once_with_elements_that_wait_for_each_other(
    monkeypatch, clock, executor
):
    # Two maps at once on one executor, the elements of each waiting for all 32
    # of its elements to run. Maps in index order take every thread at once,
    # and a map's tasks are queued together, so the second map queues behind
    # the first. Starting them on one thread per CPU split the places between
    # the maps, and both waited for good.
    with clocked_executor(monkeypatch, executor, 32, clock, 2) as ex:
        start = threading.Barrier(2, timeout=60)
        errors = []

        def one(m):
            everyone = threading.Barrier(32, timeout=60)

            def meet(v):
                everyone.wait()
                return v + m

            mine = InOrder(ex)
            f = jax.jit(jax.vmap(lambda v: threadmap(meet, F32, v, executor=mine)))
            x = np.arange(32, dtype=np.float32)
            f = f.lower(x).compile()  # both maps start together, after compiling
            try:
                start.wait()
                np.testing.assert_array_equal(np.asarray(f(x)), x + m)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        for _ in range(3):
            callers = [threading.Thread(target=one, args=(m,)) for m in range(2)]
            for t in callers:
                t.start()
            for t in callers:
                t.join()
            assert not errors, errors[0]


def test_executor_shut_down_while_the_map_grows(monkeypatch):
    # The threads added when the limit rises are refused: the ones already
    # running finish the map.
    monkeypatch.setattr(_maps, "available_cpus", lambda: 1)
    ex = user_pool(8)
    rec = Recorder(sleep=0.002)

    def k(v):
        ex.shutdown(wait=False)
        return rec(v)

    x = np.zeros((4, 16), np.float32)  # 64 elements: a large map
    np.testing.assert_array_equal(run(k, x, executor=ex), x)
    assert len(rec.threads) == 1


def test_maps_summed_on_the_host_and_nested_maps_take_every_thread(monkeypatch):
    monkeypatch.setattr(_maps, "available_cpus", lambda: 1)
    work = type("W", (), {"sums": True, "vectorized": False, "n": 64, "scope": None})()
    work.run_chunk = lambda start, stop, job: None
    eight, one = _maps.runner_for(8), _maps.runner_for(1)
    assert not _maps.new_job(work, eight).limited  # fixed bounds: not measured
    work.sums = False
    assert _maps.new_job(work, eight).limited
    parent = _jobs.Job(1, lambda *a: None)
    assert not _maps.new_job(work, eight, parent=parent).limited
    assert not _maps.new_job(work, one).limited  # no more threads than CPUs
    work.n = 32
    small = _maps.new_job(work, eight)  # 4 elements per thread: in index order
    assert small.fixed == 1 and not small.limited
    work.n = 64
    asked = _maps.new_job(work, eight, in_order=True)
    assert asked.fixed == 1 and not asked.limited


@CLOCKS
@pytest.mark.parametrize("executor", [16, "user"])
def test_small_map_does_not_group_elements_it_would_run_alone(
    monkeypatch, clock, executor
):
    # Fast first elements, then elements that meet at a barrier: a small map
    # runs in index order on every thread, each of the 16 elements its own
    # claim, whatever the clock says (chunks of several fast elements measured
    # on fewer threads held barrier elements back).
    with clocked_executor(monkeypatch, executor, 16, clock, 2) as ex:
        all_running = threading.Barrier(8, timeout=60)

        def k(v):
            if v >= 8:
                all_running.wait()
            return v + 1

        x = np.arange(16, dtype=np.float32)[None]
        np.testing.assert_array_equal(run(k, x, executor=ex), x + 1)
