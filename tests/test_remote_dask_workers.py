"""Dask workers that die in the middle of a map (for process pools, see
test_remote_executors.py).

A map never hangs on a dead worker: it completes on the workers left (Dask's
retry) or fails with an error that names the chunk, and the next map works.
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import worker_kernels
from helpers import LOOPBACK, NO_LOOPBACK

from jax_threadmap import ExecutorError, threadmap

pytestmark = pytest.mark.timeout(240)

OUT = jax.ShapeDtypeStruct((), jnp.float32)


def map_of(kernel, executor):
    return jax.vmap(lambda x: threadmap(kernel, OUT, x, executor=executor))


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


def test_dask_map_completes_when_a_worker_dies_once(fragile_client, tmp_path):
    kernel = functools.partial(
        worker_kernels.dies_once_at_three, marker=str(tmp_path / "died")
    )
    f = map_of(kernel, fragile_client.get_executor())
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(f(x), x)
    assert (tmp_path / "died").exists()  # a worker did die, and Dask ran it again


def test_dask_worker_that_always_dies_is_an_error_naming_the_chunk(fragile_client):
    ex = fragile_client.get_executor()
    with pytest.raises(ExecutorError) as info:
        map_of(worker_kernels.dies_at_three, ex)(np.arange(8, dtype=np.float32))
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
    np.testing.assert_array_equal(map_of(worker_kernels.raises_at_five, ex)(x), x)
