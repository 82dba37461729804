"""The runners: one class per kind of executor, chosen once per map, and the
private attributes read for an executor's size, each optional."""

import _thread
import atexit
import concurrent.futures
import multiprocessing
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import ExecutorError, threadmap
from jax_threadmap._executors import runners as _maps
from jax_threadmap._executors import thread_pools as _thread_pools

F32 = jax.ShapeDtypeStruct((), jnp.float32)


def test_each_kind_of_executor_gets_its_runner():
    assert isinstance(_maps.runner_for(None), _thread_pools.ThreadPool)
    assert _maps.runner_for(3).workers == 3
    with concurrent.futures.ThreadPoolExecutor(5) as ex:
        runner = _maps.runner_for(ex)
        assert isinstance(runner, _maps.ThreadExecutor)
        assert runner.workers == 5 and runner.on_threads
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn) as ex:
        runner = _maps.runner_for(ex)
        assert isinstance(runner, _maps.PicklingExecutor)
        assert runner.workers == 2 and not runner.on_threads


def test_the_size_hooks_answer_on_the_installed_versions():
    # (Dask's: test_remote_executors.py.)
    with concurrent.futures.ThreadPoolExecutor(7) as ex:
        assert _maps.known_workers(ex) == 7
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(3, mp_context=spawn) as ex:
        assert _maps.known_workers(ex) == 3


class _Odd(concurrent.futures.Executor):
    """An executor whose private attributes are not what the hooks expect."""

    _max_workers = "many"

    @property
    def _client(self):
        raise RuntimeError("no client today")


def test_a_size_hook_that_fails_means_the_executor_does_not_say():
    assert _maps.known_workers(_Odd()) is None
    assert _maps.known_workers(concurrent.futures.Executor()) is None


class InlineExecutor(concurrent.futures.Executor):
    """A kind of executor for this test: its runner runs chunks in the caller."""


def test_a_new_kind_of_executor_is_one_class_and_one_branch(monkeypatch):
    ran = []

    class Inline:
        on_threads = False
        workers = 1

        def __init__(self, executor):
            self.executor = executor

        def run(self, job, work, progress):
            del work, progress
            ran.append(job.n)
            job.drain()

    runner_for = _maps.runner_for

    def with_inline(ex):
        return Inline(ex) if isinstance(ex, InlineExecutor) else runner_for(ex)

    monkeypatch.setattr(_maps, "runner_for", with_inline)
    x = np.arange(6, dtype=np.float32)
    f = jax.vmap(lambda v: threadmap(lambda a: a * 2, F32, v, executor=ex))
    ex = InlineExecutor()
    np.testing.assert_array_equal(f(x), 2 * x)
    assert ran == [6]


def _initializer_fails():
    raise RuntimeError("no thread for you")


def test_a_thread_pool_whose_initializer_fails_names_its_error():
    # The pool breaks (BrokenThreadPool): the map's error says so, and none of a
    # process pool's hints (worker processes, the main script) appear.
    ex = concurrent.futures.ThreadPoolExecutor(2, initializer=_initializer_fails)
    f = jax.vmap(lambda v: threadmap(lambda a: a * 2, F32, v, executor=ex))
    with pytest.raises(ExecutorError) as info:
        f(np.arange(6, dtype=np.float32))
    message = str(info.value)
    assert "the executor failed with BrokenThreadPool" in message, message
    assert "initializer" in message and "worker process" not in message, message
    ex.shutdown()


class _UnhashablePool(concurrent.futures.ThreadPoolExecutor):
    """A user's thread pool whose ``__eq__`` drops ``__hash__`` (as Python does)."""

    def __eq__(self, other: object) -> bool:
        return self is other


def test_an_unhashable_thread_pool_runs_a_map_outside_jit():
    # It takes weak references but is no dict key: the package keys nothing by
    # an executor (JAX refuses it as a jitted param, not under vmap).
    x = np.arange(8, dtype=np.float32)
    with _UnhashablePool(2) as ex:
        out = jax.vmap(lambda v: threadmap(lambda e: e * 2, F32, v, executor=ex))(x)
    np.testing.assert_array_equal(np.asarray(out), x * 2)


@pytest.mark.parametrize("private_name", [True, False])
def test_the_early_exit_hook_has_a_public_fallback(monkeypatch, private_name):
    # CPython's threading._register_atexit runs the hook before Python joins the
    # pools' threads; where that private name is missing, atexit runs it.
    registered = []
    monkeypatch.setattr(_maps, "_early_hook", threading.Lock())  # not yet taken
    if private_name:
        monkeypatch.setattr(threading, "_register_atexit", registered.append)
    else:
        monkeypatch.delattr(threading, "_register_atexit", raising=False)
        monkeypatch.setattr(atexit, "register", registered.append)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        for _ in range(2):  # registered once
            f = jax.vmap(lambda v: threadmap(np.negative, F32, v, executor=ex))
            np.testing.assert_array_equal(f(np.arange(3.0)), -np.arange(3.0))
    assert registered == [_maps._before_executors_exit]


@pytest.mark.parametrize("private_name", [True, False])
def test_a_map_that_xla_waits_for_is_told_apart(monkeypatch, private_name):
    # A thread Python did not start (XLA's) is a dummy thread to it: JAX waits
    # for its program at exit, so its map runs on. CPython's class for it is
    # private; without it, its default name tells.
    seen, done = [], threading.Event()
    _thread.start_new_thread(
        lambda: (seen.append(threading.current_thread()), done.set()), ()
    )
    assert done.wait(30)
    if not private_name:
        monkeypatch.setattr(_maps, "_DUMMY", None)
    xla, ours = object(), object()
    monkeypatch.setitem(_maps._flights, xla, seen[0])
    monkeypatch.setitem(_maps._flights, ours, threading.current_thread())
    assert _maps._run_for_jax(xla) and not _maps._run_for_jax(ours)
    assert not _maps._run_for_jax(object())  # no map
