import concurrent.futures
import contextlib
import multiprocessing
import os
import pathlib
import threading

# Worker processes (spawned pools, Dask workers) import tests/worker_kernels.py.
_here = str(pathlib.Path(__file__).parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_here, os.environ.get("PYTHONPATH")) if p
)

# A fixed pool size so that tests observing threads see the same bound everywhere.
os.environ.setdefault("JAX_THREADMAP_NUM_THREADS", "4")

import jax  # noqa: E402

# Child processes (scripts, spawned pools, Dask workers) run on the CPU: on an
# accelerator this process holds the device, and one process at a time may hold
# a TPU. JAX read JAX_PLATFORMS when it was imported above: this process keeps
# its own platforms (the accelerator, where there is one).
os.environ["JAX_PLATFORMS"] = "cpu"
# A TPU host's JAX warns at every import that transparent hugepages are off
# (jax/_src/cloud_tpu_init.py): a fact of the machine, not of the code under test,
# whose children must otherwise write nothing to stderr.
os.environ["PYTHONWARNINGS"] = ",".join(
    w
    for w in (
        os.environ.get("PYTHONWARNINGS"),
        "ignore:Transparent hugepages are not enabled:UserWarning",
    )
    if w
)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import EXAMPLES, LOOPBACK, NO_LOOPBACK, PATIENCE, cpus_seen  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis runs are reproducible: the seed is fixed (pyproject.toml's addopts pass
# --hypothesis-seed=0; pass another to draw other examples) and no example database
# replays what an earlier run on this machine found.
settings.register_profile("jax_threadmap", database=None, deadline=None)
settings.load_profile("jax_threadmap")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # Printed under -q too (a report header is not), at the end where a failure is.
    del exitstatus
    seed = config.getoption("hypothesis_seed", None)
    terminalreporter.write_line(
        f"hypothesis: seed {seed}, {EXAMPLES} example counts "
        "(JAX_THREADMAP_TEST_EXAMPLES=quick|full; CI's default leg runs full)"
    )


@pytest.fixture
def x64():
    """Enables jax_enable_x64 for one test."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", prev)


@pytest.fixture
def kept_threads(monkeypatch):
    """A set of shared threads of the test's own (``thread_pools._threads``)
    whose idle threads stay (``IDLE_TIMEOUT`` an hour), for a test that counts
    the threads started: a pause longer than the idle timeout (a loaded machine
    makes them) would end idle threads, and the next map start new ones. Its
    threads leave after the test."""
    from jax_threadmap._executors import thread_pools

    threads = thread_pools._Threads()
    monkeypatch.setattr(thread_pools, "_threads", threads)
    monkeypatch.setattr(thread_pools, "IDLE_TIMEOUT", 3600.0)
    yield threads
    threads.exit(lambda job: False)


# Executors that pickle work (each costs seconds to start): a process pool shared
# by the test modules that use it (its workers import JAX once per test process,
# not once per module; every test leaves it usable), a Dask cluster per module.


@pytest.fixture(scope="session")
def spawn_pool():
    with concurrent.futures.ProcessPoolExecutor(
        2, mp_context=multiprocessing.get_context("spawn")
    ) as ex:
        yield ex


@pytest.fixture(scope="module")
def dask_client():
    distributed = pytest.importorskip("distributed")
    if not LOOPBACK:
        pytest.skip(f"a Dask cluster {NO_LOOPBACK}")
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=40,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


# --- the suite in parts (one device run may last 10 minutes: docs/accelerators.md) ---


def pytest_addoption(parser):
    parser.addoption(
        "--part",
        default=None,
        metavar="K/N",
        help="run the K-th of N parts of the selected tests: each file's tests "
        "dealt to the parts in turn, so that a slow file is spread over all of "
        "them (the suite on an accelerator, one device run per part; "
        "tests/tpu_suite.sh)",
    )
    parser.addoption(
        "--cpus",
        type=int,
        default=None,
        metavar="N",
        help="this process reports N CPUs to the package (os.sched_getaffinity "
        "and os.cpu_count; helpers.cpus_seen): the suite as on a machine of N "
        "cores (its child processes see the machine's own)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "long: the test takes tens of seconds (children on 8 devices, a property "
        "test, exit scripts): it starts first, so that a run on several workers "
        "(-n 2) does not end with one worker running it and the other idle",
    )
    cpus = config.getoption("cpus")
    if cpus is not None:  # for the whole session, workers included (-n)
        if cpus < 1:
            raise pytest.UsageError(f"--cpus takes a count of at least 1, got {cpus}")
        stack = contextlib.ExitStack()
        stack.enter_context(cpus_seen(cpus))
        config.add_cleanup(stack.close)
    config.addinivalue_line(
        "markers",
        "children: the test's work runs in child processes on the CPU, or reads "
        "files: nothing of it uses this process's accelerator (on a TPU host it "
        "runs in a CPU process beside the TPU one, tests/tpu_suite.sh)",
    )


def part_of_test(index: int, parts: int) -> int:
    """The part (0-based) of the ``index``-th selected test: the tests are dealt
    to the parts in turn, in collection order, so every part holds its share
    (within one) of each file's tests, slow or quick, and of the whole."""
    return index % parts


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    # The tests marked `long` first, then the rest, each in collection order (a
    # stable sort: every xdist worker collects the same order).
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    spec = config.getoption("part")
    if spec is None or not items:
        return
    try:
        k, n = (int(s) for s in spec.split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(
            f"--part takes K/N with 1 <= K <= N (the K-th of N parts), got {spec!r}"
        ) from None
    keep, drop = [], []
    for index, item in enumerate(items):
        (keep if part_of_test(index, n) == k - 1 else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture
def held():
    """Makes pending arrays (``held(value)``) whose loads end when the test calls
    ``held.release()``, or when it ends."""
    import jax_threadmap

    release = threading.Event()

    def make(value):
        value = np.asarray(value)

        def load():
            assert release.wait(PATIENCE), "never released"
            return value

        return jax_threadmap.async_call(
            load, jax.ShapeDtypeStruct(value.shape, value.dtype)
        )

    make.release = release.set
    yield make
    release.set()
