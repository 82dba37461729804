"""limit_inner_threads: kernels on the pool see the limit inside the block only."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

import jax_threadmap as jtm

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads() -> list[int]:
    return [
        int(p["num_threads"])
        for p in threadpoolctl.threadpool_info()
        if p["user_api"] == "blas"
    ]


def _seen_on_the_pool() -> set[tuple[int, ...]]:
    """The BLAS thread counts that each kernel of a map sees, on the pool."""
    seen = set()

    def kernel(a):
        seen.add(tuple(_blas_threads()))
        return a @ a

    one = jax.ShapeDtypeStruct((16, 16), np.float32)
    f = jax.vmap(lambda a: jtm.threadmap(kernel, one, a, executor=2))
    a = np.broadcast_to(np.eye(16, dtype=np.float32), (8, 16, 16))
    np.testing.assert_array_equal(f(a), a)
    return seen


def test_kernels_see_the_limit_in_the_block_and_the_default_outside():
    default = tuple(_blas_threads())
    if not default:
        pytest.skip("threadpoolctl finds no BLAS library here")
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        assert _seen_on_the_pool() == {(2,) * len(default)}  # off by default
        with jtm.limit_inner_threads(1):
            assert _seen_on_the_pool() == {(1,) * len(default)}
        assert _seen_on_the_pool() == {(2,) * len(default)}
    assert tuple(_blas_threads()) == default


def test_a_jitted_map_waited_for_in_the_block_runs_under_the_limit():
    if not _blas_threads():
        pytest.skip("threadpoolctl finds no BLAS library here")
    seen = set()

    def kernel(a):
        seen.add(tuple(_blas_threads()))
        return a + 1

    one = jax.ShapeDtypeStruct((), np.float32)
    f = jax.jit(jax.vmap(lambda a: jtm.threadmap(kernel, one, a)))
    with jtm.limit_inner_threads(1, user_api="blas"):
        out = f(np.arange(6, dtype=np.float32)).block_until_ready()
    np.testing.assert_array_equal(out, np.arange(6) + 1)
    assert seen == {(1,) * len(_blas_threads())}


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"limit": 0}, ValueError, "at least 1 (1 runs each"),
        ({"limit": 1.5}, TypeError, "must be an int"),
        ({"limit": True}, TypeError, "of type bool"),
        ({"user_api": "mkl"}, ValueError, "Got 'mkl'"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, words):
    with pytest.raises(error, match="limit_inner_threads") as info:
        with jtm.limit_inner_threads(**kwargs):
            pass
    assert words in str(info.value)


def test_without_threadpoolctl_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    with pytest.raises(ModuleNotFoundError, match="pip install threadpoolctl"):
        with jtm.limit_inner_threads(1):
            pass
