"""Executors that pickle work: process pools and a real Dask cluster, and Dask
workers that die in the middle of a map: a map never hangs on a dead worker: it
completes on the workers left (Dask's retry) or fails with an error that names
the chunk, and the next map works."""

import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import pathlib
import pickle
import re
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import worker_kernels
from helpers import (
    LOOPBACK,
    NO_LOOPBACK,
    PATIENCE,
    cause_of,
    nested_pids,
    run_script,
    wait_until,
)

import jax_threadmap
from jax_threadmap import ExecutorError, KernelError, threadmap
from jax_threadmap._executors import runners as _maps
from jax_threadmap._executors import scheduling as policy
from jax_threadmap._executors import shipping

pytestmark = pytest.mark.timeout(180)


def mapped(kernel, executor):
    """``kernel`` mapped over a vector of float32 elements on ``executor``."""
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    return jax.vmap(lambda x: threadmap(kernel, f32, x, executor=executor))


def test_process_pool_runs_elements_in_workers(spawn_pool):
    pids = nested_pids(worker_kernels.scaled_with_pid, spawn_pool)
    assert os.getpid() not in pids
    assert pids  # some worker ran them


# --- what the kernel receives: the shapes and dtypes of one element ----------------

#: One element of each operand: a 0-d float32, a (3,) int32, a (2, 3) uint8.
CORES = [((), np.float32), ((3,), np.int32), ((2, 3), np.uint8)]

#: Per layout, the vmap levels (outermost first, sizes 3 and 4) at which each
#: operand is batched. Levels an operand lacks are read with stride 0; an operand
#: batched at the outer level only is gathered per chunk.
LAYOUTS = {
    "unbatched call": ((), [(), (), ()]),
    "1 level, 0-d unbatched": ((5,), [(), (0,), (0,)]),
    "1 level, all batched": ((5,), [(0,), (0,), (0,)]),
    "1 level, 0-d batched only": ((5,), [(0,), (), ()]),
    "2 levels, 0-d unbatched, outer only": ((3, 4), [(), (0,), (0, 1)]),
    "2 levels, 0-d inner, outer only": ((3, 4), [(1,), (0,), ()]),
    "2 levels, 0-d outer only": ((3, 4), [(0,), (), (1,)]),
}


def layout_call(batch, levels, executor):
    """The operands of a layout, its nested vmap of checked_sum, and the reference."""
    rng = np.random.default_rng(0)
    operands = []
    for (core, dtype), lv in zip(CORES, levels, strict=True):
        shape = tuple(batch[level] for level in lv) + core
        operands.append((rng.random(shape) * 100).astype(dtype))
    kernel = functools.partial(
        worker_kernels.checked_sum,
        expected=tuple((core, np.dtype(dtype).name) for core, dtype in CORES),
    )

    def f(*xs):
        return threadmap(
            kernel, jax.ShapeDtypeStruct((), jnp.float32), *xs, executor=executor
        )

    for level in reversed(range(len(batch))):
        f = jax.vmap(f, in_axes=[0 if level in lv else None for lv in levels])
    expected = np.zeros(batch, np.float32)
    for index in np.ndindex(*batch):
        elems = [
            x[tuple(index[level] for level in lv)]
            for x, lv in zip(operands, levels, strict=True)
        ]
        expected[index] = np.float32(sum(np.sum(e, dtype=np.float64) for e in elems))
    return f, operands, expected


def check_layouts(executor):
    for name, (batch, levels) in LAYOUTS.items():
        f, operands, expected = layout_call(batch, levels, executor)
        for g in (f, jax.jit(f)):
            np.testing.assert_allclose(g(*operands), expected, rtol=1e-6, err_msg=name)


def test_process_workers_receive_the_shapes_and_dtypes_of_one_element(spawn_pool):
    check_layouts(spawn_pool)


def test_threads_receive_the_same_shapes_and_dtypes():
    check_layouts(2)


def test_narrowing_in_a_worker_process_names_the_element(spawn_pool):
    f = jax.vmap(
        lambda x: threadmap(
            worker_kernels.big_count,
            jax.ShapeDtypeStruct((), jnp.int32),
            x,
            executor=spawn_pool,
        )
    )
    with pytest.raises(KernelError) as info:
        f(np.arange(4, dtype=np.int32))
    assert info.value.index == (2,)
    assert "returned 1099511627776 (int64) for output 0, expected int32" in str(
        info.value
    )


def test_remote_chunks_ship_only_their_slices():
    # A map whose operand is batched at the outer level only: each chunk carries
    # the distinct elements it needs, never the whole array.
    big = np.arange(64 * 1000, dtype=np.float32).reshape(64, 1000)
    from jax_threadmap._host.batch_spec import BatchSpec
    from jax_threadmap._host.maps import ElementCaller, HostMap

    tree = jax.tree_util.tree_structure(((0, 0), {}))
    caller = ElementCaller(
        np.add,
        "add",
        tree,
        jax.tree_util.tree_structure(0),
        [((1000,), np.float32)],
        (64, 8),
    )
    spec = BatchSpec((64, 8), ((0, None), (None, 0)))
    host_map = HostMap(caller, spec, [big, np.ones((8, 1000), np.float32)])
    task = host_map.pack(10, 30)  # spans rows 1..3 of the outer level
    assert task.data[0].shape == (3, 1000)  # three distinct rows, not 20
    assert task.data[1].shape == (8, 1000)  # the inner operand's 8 rows
    outs, _ = task()
    host_map.store_packed(10, 30, outs)
    expected = np.broadcast_to(big[:, None] + 1, (64, 8, 1000)).reshape(-1, 1000)
    np.testing.assert_allclose(
        host_map.outs[0].reshape(-1, 1000)[10:30], expected[10:30]
    )


def test_a_shared_operand_beside_batch_levels_that_do_not_merge():
    # Was: a large unbatched operand, shipped once per map, was packed a second
    # time into each task when the batch levels could not be merged (x batched
    # as x.T): the task got one operand too many and failed with "multiple
    # indices are not supported for 0d arrays".
    from jax_threadmap._host.batch_spec import BatchSpec
    from jax_threadmap._host.maps import ElementCaller, HostMap
    from jax_threadmap._host.shipped_once import SHARE_BYTES

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    table = np.arange(SHARE_BYTES // 2, dtype=np.float32)  # shared: 2x the bound
    caller = ElementCaller(
        lambda a, t: a + t[-1],
        "add_last",
        jax.tree_util.tree_structure(((0, 0), {})),
        jax.tree_util.tree_structure(0),
        [((), np.float32)],
        (4, 3),
    )
    spec = BatchSpec((4, 3), ((1, 0), (None, None)))
    host_map = HostMap(caller, spec, [x, table])
    assert len(host_map.shape) == 2  # the levels do not merge
    shared = host_map.shared()
    assert len(shared) == 1
    for start, stop in ((0, 5), (5, 12)):
        outs, _ = host_map.pack(start, stop)(*shared)
        host_map.store_packed(start, stop, outs)
    np.testing.assert_array_equal(host_map.outs[0], x.T + table[-1])


def test_grad_in_worker_processes_sums_cotangents_like_the_threads(spawn_pool):
    # w is unbatched under two vmaps: its cotangent is summed on the host, from
    # chunks run in other processes, with the same equation as for threads.
    x = np.random.default_rng(0).standard_normal((6, 5, 4)).astype(np.float32)
    w = np.linspace(-1, 1, 4, dtype=np.float32)

    def loss(executor):
        dot = jax_threadmap.kernel(
            jax.ShapeDtypeStruct((), jnp.float32), executor=executor
        )(worker_kernels.dot)
        dot.defvjp(worker_kernels.dot_vjp)
        return lambda w: jax.vmap(jax.vmap(dot, (0, None)), (0, None))(x, w).sum()

    remote = jax.jit(jax.grad(loss(spawn_pool)))(w)
    local = jax.jit(jax.grad(loss(2)))(w)
    np.testing.assert_allclose(remote, x.sum((0, 1)), rtol=1e-5)
    np.testing.assert_allclose(remote, local, rtol=1e-6)


def test_fwd_and_bwd_with_residuals_in_worker_processes(spawn_pool):
    # fwd's residuals come back from the workers, batched like its output, and
    # go out again to bwd's; w's cotangent is summed on the host as for threads.
    x = np.random.default_rng(1).standard_normal((3, 5, 4)).astype(np.float32)
    w = np.linspace(-1, 1, 4, dtype=np.float32)
    res = (jax.ShapeDtypeStruct((4,), jnp.float32),) * 2

    def loss(executor):
        dot = jax_threadmap.kernel(
            jax.ShapeDtypeStruct((), jnp.float32), executor=executor
        )(worker_kernels.dot)
        dot.defvjp(worker_kernels.dot_fwd, worker_kernels.dot_bwd, residuals=res)
        return lambda x, w: jnp.sum(
            jnp.sin(jax.vmap(jax.vmap(dot, (0, None)), (0, None))(x, w))
        )

    remote = jax.jit(jax.grad(loss(spawn_pool), (0, 1)))(x, w)
    local = jax.jit(jax.grad(loss(2), (0, 1)))(x, w)
    cos = np.cos(x @ w)[..., None]  # the host's reference
    np.testing.assert_allclose(remote[0], cos * w, rtol=1e-5, atol=1e-6)
    # atol: the cos comes from the device program (float32 at the platform's
    # precision: a TPU's is off by 1.4e-7 on a sum near -0.01)
    np.testing.assert_allclose(remote[1], (cos * x).sum((0, 1)), rtol=1e-5, atol=1e-6)
    for there, here in zip(remote, local, strict=True):
        np.testing.assert_allclose(there, here, rtol=1e-6)


def test_kernel_error_from_process_keeps_index_and_message(spawn_pool):
    f = mapped(worker_kernels.raises_at_five, spawn_pool)
    with pytest.raises(KernelError) as info:
        f(np.arange(8, dtype=np.float32))
    assert "batch index (5,)" in str(info.value) and "KeyError" in str(info.value)
    # The worker's frames travel in the message (the cause stays in the worker).
    assert "worker_kernels.py" in str(info.value)
    assert str(info.value).endswith('in raises_at_five\n    raise KeyError("five")')
    assert info.value.index == (5,)
    np.testing.assert_array_equal(f(np.arange(3, dtype=np.float32)), np.arange(3))


def test_kernel_exception_whose_message_fails_keeps_index_and_cause(spawn_pool):
    # Was "ExecutorError: ... the executor failed with RuntimeError: str broke".
    f = mapped(worker_kernels.unprintable_at_two, spawn_pool)
    with pytest.raises(KernelError) as info:
        f(np.arange(4, dtype=np.float32))
    assert "batch index (2,)" in str(info.value)
    assert "raised Unprintable: <exception str() failed>" in str(info.value)
    assert info.value.index == (2,)
    # The kernel's exception comes back as the cause, the worker's traceback
    # behind it.
    cause = cause_of(info.value)
    assert isinstance(cause, worker_kernels.Unprintable)
    assert "unprintable_at_two" in str(cause.__cause__)


def test_base_exception_in_a_worker_is_a_kernel_error(spawn_pool):
    f = mapped(worker_kernels.aborts_at_one, spawn_pool)
    with pytest.raises(KernelError, match="raised Abort: stop") as info:
        f(np.arange(3, dtype=np.float32))
    assert info.value.index == (1,)


def test_unpicklable_kernel_is_a_clear_error(spawn_pool):
    f = mapped(lambda v: v, spawn_pool)
    with pytest.raises(ExecutorError, match="module level"):
        f(np.arange(4, dtype=np.float32))


def test_worker_killed_mid_map_is_an_error_not_a_hang():
    ex = concurrent.futures.ProcessPoolExecutor(
        2, mp_context=multiprocessing.get_context("spawn")
    )
    f = mapped(worker_kernels.dies_at_three, ex)
    with pytest.raises(ExecutorError, match="A worker process ended") as info:
        f(np.arange(8, dtype=np.float32))
    # It names a chunk that was lost (a broken pool fails every chunk in flight),
    # where to find the worker's own error, and reads as sentences ("pending..
    # A worker" before).
    message = str(info.value)
    assert re.search(r"elements \[\d+, \d+\) \(flat indices, of 8\)", message)
    assert "on its stderr" in message and ".." not in message
    # The executor is broken now; a new call says so instead of hanging.
    with pytest.raises(ExecutorError, match="is broken") as info:
        f(np.arange(8, dtype=np.float32))
    assert ".." not in str(info.value)
    ex.shutdown()


def test_a_worker_that_cannot_load_the_kernel_says_why(spawn_pool):
    # Issue 28: a worker that could not import the kernel's module died while
    # unpickling its task, and the map said only that a worker probably died
    # (its ModuleNotFoundError went to the worker's stderr). The kernel travels
    # pickled on its own, so the worker reports it as the task's error, and the
    # pool lives on.
    import parent_only_kernels

    f = mapped(parent_only_kernels.double, spawn_pool)
    with pytest.raises(ExecutorError, match="could not load the kernel") as info:
        f(np.arange(4, dtype=np.float32))
    message = str(info.value)
    assert "ModuleNotFoundError: No module named 'a_module_the_workers_lack'" in message
    assert "parent_only_kernels.py" in message  # the worker's traceback
    good = mapped(worker_kernels.double, spawn_pool)
    np.testing.assert_array_equal(
        good(np.arange(4, dtype=np.float32)), 2 * np.arange(4)
    )


MAIN_FROM_STDIN = """
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
import jax, jax.numpy as jnp, numpy as np
from jax_threadmap import ExecutorError, threadmap

def double(x):
    return x * np.float32(2)

spawn = multiprocessing.get_context("spawn")
with ProcessPoolExecutor(2, mp_context=spawn) as procs:
    f = jax.vmap(lambda v: threadmap(
        double, jax.ShapeDtypeStruct((), jnp.float32), v, executor=procs))
    try:
        f(np.arange(4, dtype=np.float32))
    except ExecutorError as e:
        print(e)
"""


def test_a_pool_whose_workers_cannot_import_the_main_script_says_so():
    # The workers of a spawn pool import the main script again; a program read
    # from stdin has none, so they die at start (FileNotFoundError '<stdin>' on
    # their stderr). The map's error says where to look and this cause.
    proc = run_script(pathlib.Path("-"), input=MAIN_FROM_STDIN)  # python - reads stdin
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "A worker process ended" in proc.stdout, proc.stdout
    assert "the main script is '<stdin>', which is no file" in proc.stdout


def test_dask_local_cluster_runs_elements_in_worker_processes(dask_client):
    ex = dask_client.get_executor()
    assert _maps.known_workers(ex) == 2
    pids = nested_pids(worker_kernels.scaled_with_pid, ex)
    worker_pids = set(dask_client.run(os.getpid).values())
    assert pids and pids <= worker_pids
    assert os.getpid() not in pids


def test_dask_workers_receive_the_shapes_and_dtypes_of_one_element(dask_client):
    check_layouts(dask_client.get_executor())


class OpaqueExecutor(concurrent.futures.Executor):
    """A thread executor that does not say how many workers it has."""

    def __init__(self, n):
        self._inner = concurrent.futures.ThreadPoolExecutor(n)

    def submit(self, fn, /, *args, **kwargs):
        return self._inner.submit(fn, *args, **kwargs)

    def shutdown(self, wait=True, **kw):
        self._inner.shutdown(wait)


def test_unknown_size_executor_runs_slow_elements_at_once():
    import threading

    ex = OpaqueExecutor(64)
    assert _maps.known_workers(ex) is None
    # Each element waits until all 64 run at once: only one element per task in
    # the first wave lets that happen (tasks of two would wait for good). No
    # timing involved, so a busy machine cannot fail it.
    all_running = threading.Barrier(64, timeout=60)

    def slow(v):
        all_running.wait()
        return v

    # Not a module-level kernel: an opaque executor is treated as one that pickles,
    # but threads do not really pickle, so a closure is fine here.
    f = mapped(slow, ex)
    x = np.arange(64, dtype=np.float32)
    np.testing.assert_array_equal(f(x), x)
    ex.shutdown()


# --- large unbatched operands: once per map, never once per task ---------------------


class CountingPool(concurrent.futures.ProcessPoolExecutor):
    """A spawn process pool that counts the bytes its tasks pickle to."""

    def __init__(self, n):
        super().__init__(n, mp_context=multiprocessing.get_context("spawn"))
        self.tasks = 0
        self.bytes = 0

    def submit(self, fn, /, *args, **kwargs):
        self.tasks += 1
        self.bytes += len(pickle.dumps((fn, args, kwargs)))
        return super().submit(fn, *args, **kwargs)


def param_maps(executor):
    """An element kernel and a vectorized one, each reading a parameter whole."""
    out = jax.ShapeDtypeStruct((), jnp.float32)

    def element(x, w):
        return threadmap(worker_kernels.reads_param, out, x, w, executor=executor)

    def chunk(x, w):
        return threadmap(
            worker_kernels.reads_param_chunk, out, x, w, executor=executor, vectorized=8
        )

    return [jax.jit(jax.vmap(g, (0, None))) for g in (element, chunk)]


@pytest.fixture(scope="module")
def counting_pool():
    with CountingPool(2) as ex:
        yield ex


@pytest.mark.parametrize("which", ["element", "vectorized"])
def test_process_pool_gets_a_large_unbatched_operand_once_per_map(
    counting_pool, which, tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where it is shared
    f = param_maps(counting_pool)[which == "vectorized"]
    w = np.random.default_rng(0).random(2**20).astype(np.float32)  # 4 MB
    x = np.arange(256, dtype=np.float32)
    tasks, sent = counting_pool.tasks, counting_pool.bytes
    np.testing.assert_allclose(f(x, w), x + w[0] + w[-1])
    tasks, sent = counting_pool.tasks - tasks, counting_pool.bytes - sent
    assert tasks >= 3  # several tasks: each once carried its own copy of w
    assert sent < w.nbytes / 8, (tasks, sent)  # none does now
    assert not list(tmp_path.iterdir())  # the shared copy is gone after the map
    # A new parameter in the next map is not mistaken for the last one.
    np.testing.assert_allclose(f(x, w[::-1].copy()), x + w[-1] + w[0])
    np.testing.assert_allclose(f(x, w + 1), x + w[0] + w[-1] + 2, rtol=1e-6)


def test_dask_gets_a_large_unbatched_operand_once_per_worker(dask_client):
    ex = dask_client.get_executor()
    shipped = []
    submit = ex.submit

    def counting_submit(fn, /, *args, **kwargs):
        shipped.append(len(pickle.dumps(fn)))
        shipped.extend(a.nbytes for a in args if isinstance(a, np.ndarray))
        return submit(fn, *args, **kwargs)

    ex.submit = counting_submit
    scatter = dask_client.scatter
    scattered = []

    def counting_scatter(data, **kwargs):
        scattered.append((sum(a.nbytes for a in data), kwargs.get("broadcast")))
        return scatter(data, **kwargs)

    dask_client.scatter = counting_scatter
    try:
        w = np.random.default_rng(0).random(2**20).astype(np.float32)  # 4 MB
        x = np.arange(256, dtype=np.float32)
        for f in param_maps(ex):
            np.testing.assert_allclose(f(x, w), x + w[0] + w[-1])
    finally:
        del dask_client.scatter
    # Several tasks (each map's first wave alone is one per worker: 2 here; how
    # many follow depends on the measured cost), none carrying w.
    assert len(shipped) >= 4 and sum(shipped) < w.nbytes / 8, shipped
    assert scattered == [(w.nbytes, True)] * 2  # once per map, to every worker
    # Released after the map: the workers hold nothing of it.
    wait_until(
        lambda: (
            not any(dask_client.run(lambda dask_worker: len(dask_worker.data)).values())
        ),
        "the workers released the scattered parameter",
        poll=0.05,
    )


def test_fast_elements_ship_in_a_few_tasks(counting_pool, monkeypatch):
    # Each task holds at least MIN_TASK_SECONDS_REMOTE of work (by the estimate
    # the workers report), also at the end of a map: 4096 elements of
    # microseconds go out in a few tasks, not in a tail of ever smaller tasks
    # that each cost a round trip (29 tasks before the floor). The estimate is
    # fixed here (the workers' own timings swing with the machine's load, and the
    # policy's arithmetic on them is tests/_executors/test_scheduling.py's): what
    # this checks is that the shipper sizes its tasks from it, with the floor.
    per_element = policy.MIN_TASK_SECONDS_REMOTE / 500
    reported = []
    chunk_size = policy.remote_chunk_size

    def fixed(per, remaining, in_flight):
        if per is not None:  # (None: the first wave, one element per worker)
            reported.append(per)
            per = per_element
        return chunk_size(per, remaining, in_flight)

    monkeypatch.setattr(policy, "remote_chunk_size", fixed)
    f = mapped(worker_kernels.raises_at_five, counting_pool)
    x = (np.arange(4096) % 5).astype(np.float32)
    tasks = counting_pool.tasks
    np.testing.assert_array_equal(f(x), x)
    tasks = counting_pool.tasks - tasks
    assert len(reported) == tasks - 2 and all(t > 0 for t in reported), reported
    # The first wave (one element per worker), then tasks of at least 500
    # elements (or what is left): 2 + ceil(4094 / 500).
    assert tasks <= 2 + -(-4094 // 500), tasks


class SlowToStart(concurrent.futures.Executor):
    """An executor of 2 workers whose workers answer only once ``started`` is
    set, as a cold process pool's do once they have imported JAX. (It runs each
    task on a thread here: what it ships is not pickled.)"""

    _max_workers = 2

    def __init__(self):
        self.started = threading.Event()
        self.tasks = 0

    def submit(self, fn, /, *args, **kwargs):
        self.tasks += 1
        fut = concurrent.futures.Future()

        def run():
            self.started.wait(PATIENCE)
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:
                fut.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        return fut


def test_a_cold_pool_gets_one_untimed_task_per_worker(monkeypatch):
    # Until an element has been timed, a task is one element: while the workers
    # start (many polls without an answer), one such task per worker goes out.
    # Was: each poll that timed out shipped more of them, up to the tasks in
    # flight (4 here), so test_fast_elements_ship_in_a_few_tasks failed whenever
    # its pool was cold (run alone).
    polls = []
    poll = shipping.Shipper.poll

    def quick_poll(self, timeout):
        polls.append(timeout)
        return poll(self, 0.001)

    monkeypatch.setattr(shipping.Shipper, "poll", quick_poll)
    ex = SlowToStart()
    f = mapped(worker_kernels.raises_at_five, ex)
    x = (np.arange(64) % 5).astype(np.float32)
    out = []
    t = threading.Thread(target=lambda: out.append(f(x)))
    t.start()
    try:
        wait_until(lambda: len(polls) >= 20, "polls while the workers start")
        assert ex.tasks == 2
    finally:
        ex.started.set()
        t.join(PATIENCE)
    np.testing.assert_array_equal(out[0], x)


# --- Dask workers that die in the middle of a map ------------------------------


@pytest.fixture(scope="module")
def fragile_client():
    """A Dask cluster of 2 worker processes that retries a task once: a task
    whose worker dies twice fails (``KilledWorker``)."""
    distributed = pytest.importorskip("distributed")
    if not LOOPBACK:
        pytest.skip(f"a Dask cluster {NO_LOOPBACK}")
    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        cluster = distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=50,
        )
    client = distributed.Client(cluster)
    try:
        yield client
    finally:
        client.close()
        # Dask's close can race with the worker restarts of these tests (a
        # KeyError for a worker it is removing): the cluster is closed anyway.
        with contextlib.suppress(KeyError):
            cluster.close()


@pytest.mark.timeout(240)
def test_dask_map_completes_when_a_worker_dies_once(fragile_client, tmp_path):
    kernel = functools.partial(
        worker_kernels.dies_once_at_three, marker=str(tmp_path / "died")
    )
    f = mapped(kernel, fragile_client.get_executor())
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(f(x), x)
    assert (tmp_path / "died").exists()  # a worker did die, and Dask ran it again


@pytest.mark.timeout(240)
def test_dask_worker_that_always_dies_is_an_error_naming_the_chunk(fragile_client):
    ex = fragile_client.get_executor()
    with pytest.raises(ExecutorError) as info:
        mapped(worker_kernels.dies_at_three, ex)(np.arange(8, dtype=np.float32))
    message = str(info.value)
    assert "KilledWorker" in message and "'dies_at_three'" in message
    start, stop = map(int, re.search(r"elements \[(\d+), (\d+)\)", message).groups())
    # A chunk that was on the workers as they died: Dask counts every task
    # running on a dead worker, so it may give up on a neighbour of element 3.
    assert 0 <= start < stop <= 8
    assert "tcp://127.0.0.1:" in message  # the last worker that died running it
    # The cluster replaces its dead workers: the next map runs (on the first
    # worker back; a restart takes seconds on a busy machine).
    fragile_client.wait_for_workers(1, timeout=120)
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(mapped(worker_kernels.raises_at_five, ex)(x), x)
