"""Maps on real threads, every wait bounded (a regression fails here rather than
hangs): elements that wait for each other, in the explicit in-order mode
(``executor=InOrder(...)``) and in the small maps that run in index order
anyway, each with the clock faked very slow and very fast, since no decision
of that mode reads one; and the guided chunks' sizes. The policy's
decisions are tested as pure functions in test_scheduling.py."""

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLOCKS, clocked_executor, fake_clocks

from jax_threadmap import InOrder, threadmap
from jax_threadmap._executors import jobs as _jobs
from jax_threadmap._executors import runners as _maps
from jax_threadmap._executors import scheduling as policy

I32 = jax.ShapeDtypeStruct((), jnp.int32)
#: Seconds a barrier waits before it breaks: far above a working map's time.
BARRIER_TIMEOUT = 20.0


def flat_map(kernel, n, executor):
    f = jax.vmap(lambda i: threadmap(kernel, I32, i, executor=executor))
    return np.asarray(f(jnp.arange(n, dtype=jnp.int32)))


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


def groups_map(n, size, ex):
    """Elements ``size * k`` to ``size * k + size - 1`` wait for each other at a
    barrier."""
    barriers = [
        threading.Barrier(size, timeout=BARRIER_TIMEOUT) for _ in range(n // size)
    ]

    def meet(i):
        barriers[int(i) // size].wait()
        return i

    np.testing.assert_array_equal(flat_map(meet, n, ex), np.arange(n))


@CLOCKS
@pytest.mark.parametrize("kind", ["shared", "user"])
@pytest.mark.parametrize("workers, n", [(4, 32), (8, 64)])
def test_two_large_maps_whose_elements_wait_for_each_other(
    monkeypatch, clock, kind, workers, n
):
    # Each map's elements meet four at a time at a barrier; two such maps at
    # once on one executor. In index order each map takes every thread at
    # once, and the second queues behind the first.
    with clocked_executor(monkeypatch, kind, workers, clock, 2) as ex:
        one = lambda: groups_map(n, 4, InOrder(ex))  # noqa: E731
        errors = in_threads([one, one])
    assert errors == [None, None]


@CLOCKS
@pytest.mark.parametrize("kind", ["shared", "user"])
@pytest.mark.parametrize("workers, n, cpus", [(32, 64, 2), (16, 32, 2), (4, 8, 2)])
def test_a_small_map_runs_in_index_order_without_being_asked(
    monkeypatch, clock, kind, workers, n, cpus
):
    # At most IN_ORDER_UP_TO elements per thread: in index order on every
    # thread, with or without InOrder (docs/executors.md).
    with clocked_executor(monkeypatch, kind, workers, clock, cpus) as ex:
        errors = in_threads([lambda: groups_map(n, 2, ex)])
    assert errors == [None]


@CLOCKS
@pytest.mark.parametrize("kind", ["shared", "user"])
@pytest.mark.parametrize(
    "n, cpus, workers",
    [(64, 2, 8), (64, 6, 8), (256, 2, 8), (64, 8, 8), (64, 16, 8), (256, 8, 8)]
    + [(256, 32, 32), (64, 1, 2)],
)
def test_pairs_that_wait_for_each_other(monkeypatch, clock, kind, n, cpus, workers):
    # Elements 2k and 2k + 1 meet at a barrier, as a user would with
    # ThreadPoolExecutor(8).map: large maps, on executors with fewer, as many
    # and more threads than CPUs, with the clock faked so that every element
    # looks slow (an hour) or free. Before the explicit mode these relied on
    # probing, slow-element votes and a stuck-chunk watch, all read from the
    # clock, and 2-3 runs in 10 waited until the barriers broke under load.
    with clocked_executor(monkeypatch, kind, workers, clock, cpus) as ex:
        errors = in_threads([lambda: groups_map(n, 2, InOrder(ex))])
    assert errors == [None]


@CLOCKS
@pytest.mark.parametrize("kind", ["shared", "user"])
def test_groups_as_large_as_the_executor_in_order(monkeypatch, clock, kind):
    # The bound of the mode: groups of as many elements as the executor has
    # threads all meet.
    with clocked_executor(monkeypatch, kind, 4, clock) as ex:
        errors = in_threads([lambda: groups_map(64, 4, InOrder(ex))])
    assert errors == [None]


@CLOCKS
def test_a_nested_map_in_order(monkeypatch, clock):
    # A kernel that waits for an in-order map whose elements meet in pairs: the
    # waiting thread works on the nested map too.
    fake_clocks(monkeypatch, clock)

    def outer(i):
        groups_map(16, 2, InOrder(4))  # (on the full outer pool, one thread)
        return i

    errors = in_threads(
        [
            lambda: np.testing.assert_array_equal(
                flat_map(outer, 4, InOrder(2)), np.arange(4)
            )
        ]
    )
    assert errors == [None]


def test_in_order_claims_one_element_at_a_time_in_index_order(monkeypatch):
    # The mode's contract, seen from the kernel: on one thread the elements run
    # in index order, one at a time, and every one exactly once.
    seen = []

    def record(i):
        seen.append(int(i))
        return i

    np.testing.assert_array_equal(flat_map(record, 100, InOrder(1)), np.arange(100))
    assert seen == list(range(100))


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

    def run(job, start, stop, *args, **kwargs):
        out = real(job, start, stop, *args, **kwargs)
        with lock:
            chunks.append((start, stop))
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


def test_threads_follow_the_kernels_running_at_once(kept_threads):
    # 300 calls of a 50-element map on a pool of 1000: at most 50 kernels run at
    # once. A thread done with a map's chunks takes the next map a moment later;
    # before the fix each call started threads rather than wait for them. (No
    # thread idles out: a loaded machine's pause ended idle threads, and the
    # next call started new ones.)
    f = jax.jit(jax.vmap(lambda i: threadmap(lambda v: v, I32, i, executor=1000)))
    x = jnp.arange(50, dtype=jnp.int32)
    for _ in range(300):
        np.testing.assert_array_equal(f(x), np.arange(50))
    started = kept_threads.started
    assert started <= 50 + _maps.available_cpus(), started


def test_threads_told_to_leave_at_exit_are_not_counted_to_take_a_queued_map(
    monkeypatch,
):
    # At exit, _Threads.exit wakes the idle threads and empties the idle list;
    # until each takes the lock again it is still in `workers`, with no job and
    # not running. A map that JAX waits for, started then (a host callback of a
    # program dispatched before exit), was handed no thread because those
    # leaving threads were counted as returning ones that would take it from
    # the queue: it waited forever (CI's 3.10 leg hung at exit in a docs block).
    from jax_threadmap._executors import thread_pools

    monkeypatch.setattr(thread_pools, "available_cpus", lambda: 2)
    threads = thread_pools._Threads()
    pool = thread_pools.ThreadPool(2)
    for i in range(2):
        worker = thread_pools._Worker(pool, None, lambda w: None, f"leaving {i}")
        threads.workers.add(worker)  # woken by exit(), not yet gone
    with threads.lock:
        assert not threads._returning_take()
