"""BLAS threads of kernels: the automatic limit of maps on several threads, and
limit_inner_threads, the user's limit for a block."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from helpers import examples, returns_within
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jax_threadmap as jtm
from jax_threadmap._host.inner_threads import BLAS_LIMIT
from jax_threadmap._support.environment import ENV_LIMIT_BLAS

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads() -> list[int]:
    return [
        int(p["num_threads"])
        for p in threadpoolctl.threadpool_info()
        if p["user_api"] == "blas"
    ]


_names = itertools.count()


def _seen_on_the_pool(executor=2, fail_at=None) -> set[tuple[int, ...]]:
    """The BLAS thread counts that each kernel of a map sees, on the pool.

    Each kernel first waits until the automatic limit matches the maps counted
    (it is set without delay then), and each call's kernel has a name of its own
    (the limit skips a kernel whose last map was short, which depends on timing),
    so what it sees does not depend on timing.
    """
    seen = set()

    def kernel(a):
        BLAS_LIMIT.settle()
        seen.add(tuple(_blas_threads()))
        if fail_at is not None and a[0, 0] == fail_at:
            raise ValueError("this element fails")
        return a @ a

    kernel.__qualname__ = kernel.__name__ = f"kernel_{next(_names)}"

    one = jax.ShapeDtypeStruct((16, 16), np.float32)
    f = jax.vmap(lambda a: jtm.threadmap(kernel, one, a, executor=executor))
    eye = np.eye(16, dtype=np.float32)
    a = eye * np.arange(1, 9, dtype=np.float32)[:, None, None]
    np.testing.assert_array_equal(f(a), a @ a)
    return seen


@pytest.fixture
def blas_default():
    """The BLAS thread counts outside maps, each at least 2 (so that a limit
    shows); the limit is released after the test.

    (A ``threadpool_limits`` block of this thread would set them, but with
    threadpoolctl 3.8 the thread in such a block alone sets OpenBLAS's limit,
    and the automatic limit then steps aside as for ``limit_inner_threads``.)
    """
    default = tuple(_blas_threads())
    if not default or min(default) < 2:
        pytest.skip(f"no BLAS library with 2 threads or more here ({default})")
    yield default
    BLAS_LIMIT.settle()
    assert not BLAS_LIMIT.held


def test_kernels_on_several_threads_get_one_blas_thread_by_default(blas_default):
    ones = (1,) * len(blas_default)
    assert _seen_on_the_pool() == {ones}
    BLAS_LIMIT.settle()  # the holder restores it just after the map
    assert not BLAS_LIMIT.held
    assert tuple(_blas_threads()) == blas_default


def test_one_thread_env_off_and_the_users_block_keep_blas_threads(
    blas_default, monkeypatch
):
    ones = (1,) * len(blas_default)
    assert _seen_on_the_pool(executor=1) == {blas_default}  # one kernel at a time
    with jtm.limit_inner_threads(3):
        assert _seen_on_the_pool() == {(3,) * len(blas_default)}  # the user's wins
    with jtm.limit_inner_threads(1):
        assert _seen_on_the_pool() == {ones}
    monkeypatch.setenv(ENV_LIMIT_BLAS, "0")
    assert _seen_on_the_pool() == {blas_default}
    monkeypatch.setenv(ENV_LIMIT_BLAS, "1")
    assert _seen_on_the_pool() == {ones}
    BLAS_LIMIT.settle()
    assert tuple(_blas_threads()) == blas_default


def test_a_failing_map_gives_the_limit_back(blas_default):
    with pytest.raises(jtm.KernelError, match="this element fails"):
        _seen_on_the_pool(fail_at=5.0)
    BLAS_LIMIT.settle()
    assert not BLAS_LIMIT.held
    assert tuple(_blas_threads()) == blas_default
    assert _seen_on_the_pool() == {(1,) * len(blas_default)}  # the next map works


def test_nested_and_concurrent_maps_share_one_limit(blas_default):
    """Maps of four threads at once, each with a map nested in its kernels, one
    of them failing: every kernel sees one BLAS thread, and the default is back
    when the last map has ended."""
    ones = (1,) * len(blas_default)
    seen = set()

    def inner(a):
        BLAS_LIMIT.settle()
        seen.add(tuple(_blas_threads()))
        return a @ a

    def outer(a):
        one = jax.ShapeDtypeStruct((4, 4), np.float32)
        got = jax.vmap(lambda b: jtm.threadmap(inner, one, b, executor=2))(
            np.broadcast_to(a, (3, 4, 4))
        )
        if a[0, 0] == 13:
            raise ValueError("the failing map")
        return np.asarray(got[0])

    def one_map(k):
        one = jax.ShapeDtypeStruct((4, 4), np.float32)
        f = jax.vmap(lambda a: jtm.threadmap(outer, one, a, executor=2))
        a = np.eye(4, dtype=np.float32) * np.arange(k * 4, k * 4 + 4)[:, None, None]
        a = a.astype(np.float32)
        try:
            return np.testing.assert_array_equal(f(a), a @ a)
        except jtm.KernelError as e:
            return str(e)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one_map, range(4)))
    assert [r is None for r in results] == [True, True, True, False]
    assert "the failing map" in results[3]
    assert seen == {ones}
    BLAS_LIMIT.settle()
    assert not BLAS_LIMIT.held
    assert tuple(_blas_threads()) == blas_default


#: A new kernel name for each map of the model: never seen, so always counted.
_NAMES = itertools.count()


class BlasLimitModel(RuleBasedStateMachine):
    """Maps and ``limit_inner_threads`` blocks counted in and out in any order,
    each from a thread of its own: once the limit has settled, BLAS has one
    thread exactly while a map is counted and no block is open, its own count
    otherwise. (Each map is of a kernel not seen before, so it is counted.)"""

    def __init__(self):
        super().__init__()
        self.maps: list[contextlib.ExitStack] = []
        self.blocks = 0
        self.default = tuple(_blas_threads())

    @rule()
    def map_starts(self):
        stack = contextlib.ExitStack()
        limit = BLAS_LIMIT.during_map(2, f"model map {next(_NAMES)}")
        returns_within(stack.enter_context, limit, limit=60, what="count a map in")
        self.maps.append(stack)

    @precondition(lambda self: self.maps)
    @rule(data=st.data())
    def map_ends(self, data):
        stack = self.maps.pop(data.draw(st.integers(0, len(self.maps) - 1)))
        returns_within(stack.close, limit=60, what="count a map out")

    @rule()
    def block_opens(self):
        returns_within(BLAS_LIMIT.block_opened, limit=60, what="open a block")
        self.blocks += 1

    @precondition(lambda self: self.blocks)
    @rule()
    def block_closes(self):
        returns_within(BLAS_LIMIT.block_closed, limit=60, what="close a block")
        self.blocks -= 1

    @invariant()
    def limit_matches_the_counts(self):
        BLAS_LIMIT.settle()
        wanted = bool(self.maps) and not self.blocks
        assert BLAS_LIMIT.held == wanted
        ones = (1,) * len(self.default)
        assert tuple(_blas_threads()) == (ones if wanted else self.default)

    def teardown(self):
        for stack in self.maps:
            stack.close()
        for _ in range(self.blocks):
            BLAS_LIMIT.block_closed()
        BLAS_LIMIT.settle()
        assert not BLAS_LIMIT.held
        assert tuple(_blas_threads()) == self.default


BlasLimitModel.TestCase.settings = settings(
    max_examples=examples(100), stateful_step_count=20, deadline=None
)
test_blas_limit_model = BlasLimitModel.TestCase


def test_a_bad_env_value_is_named(monkeypatch):
    monkeypatch.setenv(ENV_LIMIT_BLAS, "sometimes")
    f = jax.vmap(
        lambda a: jtm.threadmap(np.negative, jax.ShapeDtypeStruct((), a.dtype), a)
    )
    with pytest.raises(ValueError, match="JAX_THREADMAP_LIMIT_BLAS='sometimes'"):
        f(np.arange(4.0, dtype=np.float32))


def test_a_jitted_map_waited_for_in_the_block_runs_under_the_limit():
    if not _blas_threads():
        pytest.skip("threadpoolctl finds no BLAS library here")
    seen = set()

    def kernel(a):
        seen.add(tuple(_blas_threads()))
        return a + 1

    one = jax.ShapeDtypeStruct((), np.float32)
    f = jax.jit(jax.vmap(lambda a: jtm.threadmap(kernel, one, a)))
    with jtm.limit_inner_threads(1):
        out = f(np.arange(6, dtype=np.float32)).block_until_ready()
    np.testing.assert_array_equal(out, np.arange(6) + 1)
    assert seen == {(1,) * len(_blas_threads())}


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"limit": 0}, ValueError, "at least 1 (1 runs each"),
        ({"limit": 1.5}, TypeError, "must be an int"),
        ({"limit": True}, TypeError, "of type bool"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, words):
    with pytest.raises(error, match="limit_inner_threads") as info:
        with jtm.limit_inner_threads(**kwargs):
            pass
    assert words in str(info.value)
