"""The scheduling defects of issue 19, end to end on real threads, every wait
bounded (a regression fails here rather than hangs). The decisions behind each
fix are tested as pure functions in test_scheduling.py."""

import collections
import concurrent.futures
import contextlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import _jobs, _maps, _threads, threadmap
from jax_threadmap import _scheduling as policy

I32 = jax.ShapeDtypeStruct((), jnp.int32)
#: Seconds a barrier waits before it breaks: far above a working map's time.
BARRIER_TIMEOUT = 20.0


def flat_map(kernel, n, executor):
    f = jax.vmap(lambda i: threadmap(kernel, I32, i, executor=executor))
    return np.asarray(f(jnp.arange(n, dtype=jnp.int32)))


@contextlib.contextmanager
def executor_of(kind, n):
    if kind == "shared":
        yield n
        return
    ex = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="mine")
    try:
        yield ex
    finally:
        ex.shutdown()


def in_threads(fns, timeout=120):
    """Runs each ``fn`` in its own thread at once; their errors, in order."""
    errors = [None] * len(fns)

    def body(k):
        try:
            fns[k]()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors[k] = e

    threads = [threading.Thread(target=body, args=(k,)) for k in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a map hung"
    return errors


@pytest.mark.parametrize("kind", ["shared", "user"])
@pytest.mark.parametrize("workers, n", [(4, 32), (8, 64)])
def test_two_large_maps_whose_elements_wait_for_each_other(
    monkeypatch, kind, workers, n
):
    # Each map's elements meet four at a time at a barrier. Both maps are large
    # (more than LIMITED_FROM elements per thread), so each starts on one thread
    # per CPU: before the fix each held part of the executor and waited for
    # good (here: until the barrier broke) for the part the other held.
    monkeypatch.setattr(_maps, "available_cpus", lambda: 2)

    def one_map(ex):
        barrier = threading.Barrier(4, timeout=BARRIER_TIMEOUT)

        def meet(i):
            barrier.wait()
            return i

        np.testing.assert_array_equal(flat_map(meet, n, ex), np.arange(n))

    with executor_of(kind, workers) as ex:
        errors = in_threads([lambda: one_map(ex), lambda: one_map(ex)])
    assert errors == [None, None]


def pairs_map(n, ex):
    """Elements 2k and 2k + 1 wait for each other at a barrier."""
    barriers = [threading.Barrier(2, timeout=BARRIER_TIMEOUT) for _ in range(n // 2)]

    def pair(i):
        barriers[int(i) // 2].wait()
        return i

    np.testing.assert_array_equal(flat_map(pair, n, ex), np.arange(n))


def test_the_documented_layout_for_pairs_that_wait_for_each_other():
    # docs/executors.md: fewer than 4 elements per thread of the executor.
    errors = in_threads([lambda: pairs_map(64, 32)])
    assert errors == [None]


@pytest.mark.parametrize("kind", ["shared", "user"])
@pytest.mark.parametrize("workers, n, cpus", [(32, 64, 2), (16, 32, 2), (4, 8, 2)])
def test_adjacent_elements_that_wait_for_each_other_in_a_small_map(
    monkeypatch, kind, workers, n, cpus
):
    # docs/executors.md's first layout: fewer than 4 elements per thread, where
    # every chunk is one element from the start.
    monkeypatch.setattr(_maps, "available_cpus", lambda: cpus)
    with executor_of(kind, workers) as ex:
        errors = in_threads([lambda: pairs_map(n, ex)])
    assert errors == [None]


@pytest.mark.parametrize("kind", ["shared", "user"])
@pytest.mark.parametrize(
    "n, cpus, workers",
    [(64, 2, 8), (64, 6, 8), (256, 2, 8), (64, 8, 8), (64, 16, 8), (256, 8, 8)]
    + [(256, 32, 32)],
)
def test_pairs_that_wait_for_each_other(monkeypatch, kind, n, cpus, workers):
    # Issue 27: elements 2k and 2k + 1 meet at a barrier, on executor=8, as a
    # user would with ThreadPoolExecutor(8).map. The map starts on one thread
    # per CPU with chunks of several elements; a thread waiting at the first
    # element of a pair for the second, queued behind it in its own chunk, is
    # rescued by a thread that takes the chunk's tail (its cursor), or by the
    # map rising to every thread, one element per chunk in index order, with
    # the running chunks' tails given back (a chunk stuck for STUCK_CHUNK).
    # Before: 2-3 runs in 10 waited until the barriers broke under load, and
    # every run on CPython 3.11 (no tail stealing there). With 8 or 16 CPUs
    # (no more threads than CPUs, no spare thread to take a tail) the map
    # probes instead: one element per claim in index order, each timed; the
    # pairs never make a run of fast elements, so it stays in index order, as
    # ThreadPoolExecutor(8).map does (before, those waited for good); and on
    # executor=32 with 32 CPUs.
    monkeypatch.setattr(_maps, "available_cpus", lambda: cpus)
    with executor_of(kind, workers) as ex:
        errors = in_threads([lambda: pairs_map(n, ex)])
    assert errors == [None]


def test_a_chunks_tail_taken_by_another_thread_runs_once_and_counts_once():
    # A chunk whose first element waits until every other element has run: the
    # rest of its chunk must be taken by the other thread, each element run
    # exactly once, and the map's count of elements done must be n.
    n = 40
    calls = collections.Counter()
    lock = threading.Lock()
    rest = threading.Event()

    def kernel(i):
        i = int(i)
        with lock:
            calls[i] += 1
            if sum(calls.values()) == n:
                rest.set()
        if i == 0:
            assert rest.wait(BARRIER_TIMEOUT), "element 0's chunk kept its tail"
        return i

    seen = []
    real = _jobs.Job.run

    def run(job, *args, **kwargs):
        seen.append(job)
        return real(job, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(_jobs.Job, "run", run)
        errors = in_threads([lambda: flat_map(kernel, n, 2)])
    assert errors == [None]
    assert calls == collections.Counter(range(n))
    assert {job.completed for job in seen} == {n}


def test_a_limited_map_waits_at_the_gate_only_for_another_limited_map():
    gate = _jobs.LimitedGate()
    first = _jobs.Job(100, lambda *a: None, workers=8, cpus=2)
    second = _jobs.Job(100, lambda *a: None, workers=8, cpus=2)
    small = _jobs.Job(10, lambda *a: None, workers=8)
    assert first.limited and second.limited and not small.limited
    gate.enter(first)
    gate.enter(small)  # not limited: never waits
    entered = threading.Event()
    t = threading.Thread(target=lambda: (gate.enter(second), entered.set()))
    t.start()
    assert not entered.wait(0.2)
    gate.leave(first)
    assert entered.wait(30)
    t.join(30)
    gate.leave(second)


def test_front_loaded_costs_spread_over_every_thread(monkeypatch):
    # The first tenth of the elements sleep: once the map had every thread,
    # guided chunks of a share of what was left packed them onto a few threads
    # (about 150 per chunk here). A chunk now holds at most MAX_CHUNK_SECONDS of
    # the last measured time per element, and one element once the map rose:
    # no chunk ever holds more than 10 of the 1 ms elements, however loaded the
    # machine (its time, against ThreadPoolExecutor.map's, is the benchmark
    # test_bench_scheduling.py's).
    n, slow, workers = 10_000, 1_000, 32
    ran = collections.Counter()
    lock = threading.Lock()
    chunks = []
    real = _jobs.Job.run

    def run(job, start, stop, cursor, *args, **kwargs):
        out = real(job, start, stop, cursor, *args, **kwargs)
        end = stop if cursor is job._single else cursor.stop
        with lock:
            chunks.append((start, end))
        return out

    def kernel(i):
        if int(i) < slow:
            with lock:
                ran[int(i)] += 1
            time.sleep(0.001)
        return i

    monkeypatch.setattr(_jobs.Job, "run", run)
    np.testing.assert_array_equal(flat_map(kernel, n, workers), np.arange(n))
    assert ran == collections.Counter(range(slow))
    most = int(policy.MAX_CHUNK_SECONDS / 0.001)
    slow_per_chunk = [max(0, min(end, slow) - start) for start, end in chunks]
    assert max(slow_per_chunk) <= most, sorted(slow_per_chunk)[-5:]


def test_threads_follow_the_kernels_running_at_once(monkeypatch):
    # 300 calls of a 50-element map on a pool of 1000: at most 50 kernels run at
    # once. A thread done with a map's chunks takes the next map a moment later;
    # before the fix each call started threads rather than wait for them.
    monkeypatch.setattr(_threads, "_threads", _threads._Threads())
    f = jax.jit(jax.vmap(lambda i: threadmap(lambda v: v, I32, i, executor=1000)))
    x = jnp.arange(50, dtype=jnp.int32)
    for _ in range(300):
        np.testing.assert_array_equal(f(x), np.arange(50))
    started = _threads._threads.started
    assert started <= 50 + _maps.available_cpus(), started
