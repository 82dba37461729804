"""``async def`` kernels: each element a coroutine on the package's event loop;
what an element's result may raise, ``async def`` derivative rules (second order,
failing), and Ctrl-C inside such a map.

No assertion rests on a clock: the tests count elements in flight and the threads
that ran them, and wait on events (with generous bounds, so nothing hangs).
"""

import _thread
import asyncio
import concurrent.futures
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cause_of, returns_within, run_script, sigint_as_usual

import jax_threadmap
from jax_threadmap import ExecutorError, KernelError, async_call, kernel, threadmap
from jax_threadmap._coroutines import event_loop as _event_loop
from jax_threadmap._coroutines.async_kernels import (
    DEFAULT_MAX_IN_FLIGHT,
)

F32 = jax.ShapeDtypeStruct((), jnp.float32)
#: Seconds a test waits for an event before it fails (never reached when it passes).
PATIENCE = 60.0


class InFlight:
    """Counts a kernel's elements in flight (on the loop's one thread: no lock),
    the threads that ran them, and opens a gate once ``until`` are in flight."""

    def __init__(self, until: int):
        self.until = until
        self.now = 0
        self.peak = 0
        self.threads: set[int] = set()
        self.most_threads = 0
        self.cancelled = 0
        self.all_cancelled = threading.Event()
        self.expect_cancelled: int | None = None
        self._gate: asyncio.Event | None = None

    def gate(self) -> asyncio.Event:
        if self._gate is None:  # made on the loop that awaits it
            self._gate = asyncio.Event()
        return self._gate

    async def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.threads.add(threading.get_ident())
        self.most_threads = max(self.most_threads, threading.active_count())
        if self.now >= self.until:
            self.gate().set()
        await asyncio.wait_for(self.gate().wait(), PATIENCE)

    def leave(self) -> None:
        self.now -= 1

    def was_cancelled(self) -> None:
        self.cancelled += 1
        if self.cancelled == self.expect_cancelled:
            self.all_cancelled.set()


def test_nested_vmap_under_jit_runs_every_element_at_once_on_one_thread():
    # The done-when: 2,000 elements of a 0.2 s wait, jit of two vmaps.
    seen = InFlight(until=2000)

    async def fetch(i):
        await seen.enter()
        await asyncio.sleep(0.2)
        seen.leave()
        return i * 2 + 1

    threads_before = threading.active_count()
    f = jax.jit(jax.vmap(jax.vmap(lambda i: threadmap(fetch, F32, i))))
    x = jnp.arange(2000.0).reshape(40, 50)
    y = f(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2 + 1)
    # Every element was in flight at once (the gate opened at 2,000), all on the
    # loop's one thread; the process gained a handful of threads, not 2,000.
    assert seen.peak == 2000
    assert len(seen.threads) == 1
    assert seen.most_threads - threads_before <= 8


def test_results_match_the_plain_kernel_under_nested_vmap_with_unbatched_operands():
    def plain(x, v, *, scale):
        return {"sum": np.sum(x * v) * scale, "row": x[::-1] + v}

    async def coro(x, v, *, scale):
        await asyncio.sleep(0)
        return plain(x, v, scale=scale)

    spec = {"sum": F32, "row": jax.ShapeDtypeStruct((3,), jnp.float32)}

    def f(kernel):
        g = lambda x, v, s: threadmap(kernel, spec, x, v, scale=s)  # noqa: E731
        return jax.jit(jax.vmap(jax.vmap(g, (0, None, None)), (1, 0, None)))

    x = jnp.arange(60.0).reshape(5, 4, 3)
    v = jnp.arange(12.0).reshape(4, 3)
    s = jnp.float32(0.5)
    got, want = f(coro)(x, v, s), f(plain)(x, v, s)
    jax.tree.map(np.testing.assert_allclose, got, want)
    # Eager, unbatched: the same primitive's impl.
    got = threadmap(coro, spec, x[0, 0], v[1], scale=s)
    jax.tree.map(
        np.testing.assert_allclose, got, plain(x[0, 0], v[1], scale=np.float32(0.5))
    )


def test_partials_and_callables_of_coroutine_functions():
    async def scaled(a, x):
        return x * a

    class Kernel:
        async def __call__(self, x):
            return x - 1

    x = jnp.arange(6.0)
    np.testing.assert_array_equal(
        jax.vmap(lambda x: threadmap(functools.partial(scaled, 3.0), F32, x))(x), x * 3
    )
    np.testing.assert_array_equal(
        jax.vmap(lambda x: threadmap(Kernel(), F32, x))(x), x - 1
    )


def test_the_bound_on_elements_in_flight_holds():
    bound = 7
    seen = InFlight(until=bound)

    async def wait_a_little(x):
        await seen.enter()
        await asyncio.sleep(0)
        seen.leave()
        return x

    f = jax.vmap(lambda x: threadmap(wait_a_little, F32, x, max_in_flight=bound))
    x = jnp.arange(100.0)
    np.testing.assert_array_equal(f(x), x)
    assert seen.peak == bound


def test_kernel_takes_the_bound_and_its_default_is_generous():
    assert DEFAULT_MAX_IN_FLIGHT >= 1000
    seen = InFlight(until=3)

    @jax_threadmap.kernel(F32, max_in_flight=3)
    async def k(x):
        await seen.enter()
        seen.leave()
        return x + 1

    np.testing.assert_array_equal(jax.vmap(k)(jnp.zeros(20)), jnp.ones(20))
    assert seen.peak == 3
    with pytest.raises(TypeError, match="'max_in_flight' is an option of"):
        k(1.0, max_in_flight=2)


async def _identity(x):
    return x


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, r"between 1 and .*Got max_in_flight=0"),
        (-3, ValueError, r"Got max_in_flight=-3"),
        (2.5, TypeError, r"positive int.*Got max_in_flight=2.5 of type float"),
        (True, TypeError, r"Got max_in_flight=True of type bool"),
        ("8", TypeError, r"Got max_in_flight='8' of type str"),
        (10**9, ValueError, r"not the batch size"),
    ],
)
def test_bad_bounds_are_refused_at_the_call(value, error, match):
    with pytest.raises(error, match=match):
        threadmap(_identity, F32, 1.0, max_in_flight=value)
    with pytest.raises(error, match=match):
        jax_threadmap.kernel(F32, max_in_flight=value)


@pytest.mark.parametrize(
    "executor", [4, concurrent.futures.ThreadPoolExecutor(1)], ids=["int", "pool"]
)
def test_an_executor_is_refused_at_the_call(executor):
    with pytest.raises(TypeError, match=r"'_identity' is an async def.*executor="):
        threadmap(_identity, F32, 1.0, executor=executor)
    with pytest.raises(TypeError, match=r"executor= must be None"):
        jax_threadmap.kernel(F32, executor=executor)(_identity)

    k = jax_threadmap.kernel(F32, executor=executor)(np.sin)  # a plain primal
    with pytest.raises(TypeError, match=r"the VJP kernel '_identity' is an async"):
        k.defvjp(_identity)


def test_vectorized_is_refused_at_the_call():
    with pytest.raises(TypeError, match=r"vectorized= must be False"):
        threadmap(_identity, F32, 1.0, vectorized=True)


# --- failures ---------------------------------------------------------------------


def test_a_failing_element_names_its_index_and_line_and_the_rest_are_cancelled():
    bound = 16
    seen = InFlight(until=bound)
    seen.expect_cancelled = bound - 1

    async def flaky(i):
        try:
            await seen.enter()
            if i == 37:
                raise ValueError(f"element {int(i)} is bad")  # the line quoted
            await asyncio.Event().wait()  # forever, unless cancelled
        except asyncio.CancelledError:
            seen.was_cancelled()
            raise
        return i

    # The first 16 elements (22..37) are in flight when 37 fails; the others wait
    # forever, so the map ends only if they are cancelled, not awaited.
    x = jnp.arange(22.0, 122.0).reshape(4, 25)
    with pytest.raises(Exception, match=r"batch index \(0, 15\)") as info:
        _with_bound(flaky, x, bound)
    message = str(info.value)
    assert "element 37 is bad" in message
    assert 'raise ValueError(f"element {int(i)} is bad")' in message
    # The others were cancelled at their await, not awaited (they never end).
    assert seen.all_cancelled.wait(PATIENCE)
    assert seen.cancelled == bound - 1


def _with_bound(kernel, x, bound):
    g = lambda i: threadmap(kernel, F32, i, max_in_flight=bound)  # noqa: E731
    # Awaited: on an accelerator a failure surfaces when the result is used.
    return jax.block_until_ready(jax.jit(jax.vmap(jax.vmap(g)))(x))


def test_a_failing_element_under_jit_names_its_index():
    async def flaky(i):
        if i == 5:
            raise OSError("no route")
        return i

    f = jax.jit(jax.vmap(lambda i: threadmap(flaky, F32, i)))
    with pytest.raises(Exception, match=r"flaky' at batch index \(5,\)(.|\n)*no route"):
        f(jnp.arange(8.0)).block_until_ready()  # where an accelerator reports it
    np.testing.assert_array_equal(f(jnp.arange(5.0)), jnp.arange(5.0))  # next works


@pytest.mark.parametrize(
    "result, match",
    [
        (np.zeros(2), r"at batch index \(3,\).*returned shape \(2,\)"),
        ("text", r"at batch index \(3,\).*not convertible|at batch index \(3,\)"),
        ((1.0, 2.0), r"at batch index \(3,\).*structure"),
    ],
)
def test_results_are_checked_as_for_plain_kernels(result, match):
    async def wrong(i):
        return result if i == 3 else i

    with pytest.raises(KernelError, match=match) as info:
        jax.vmap(lambda i: threadmap(wrong, F32, i))(jnp.arange(6.0))
    assert info.value.index == (3,)


def test_keyboard_interrupt_in_a_kernel_reaches_the_caller_and_the_loop_lives_on():
    async def interrupted(i):
        if i == 2:
            raise KeyboardInterrupt
        return i

    f = jax.vmap(lambda i: threadmap(interrupted, F32, i))
    with pytest.raises(KeyboardInterrupt):
        f(jnp.arange(4.0))
    np.testing.assert_array_equal(f(jnp.arange(2.0)), jnp.arange(2.0))


def test_ctrl_c_cancels_the_map():
    bound = 10
    seen = InFlight(until=bound)
    seen.expect_cancelled = bound
    interrupted = []

    async def forever(i):
        try:
            await seen.enter()
            if seen.now == bound and not interrupted:  # all in flight: Ctrl-C
                interrupted.append(i)  # once: in the waiting thread
                _thread.interrupt_main()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.was_cancelled()
            raise
        return i

    assert threading.current_thread() is threading.main_thread()
    with sigint_as_usual(), pytest.raises(KeyboardInterrupt):
        threadmap_all(forever, 50, bound)
    assert seen.all_cancelled.wait(PATIENCE), (seen.cancelled, seen.now, interrupted)
    assert seen.cancelled == bound


def threadmap_all(kernel, n, bound):
    g = lambda i: threadmap(kernel, F32, i, max_in_flight=bound)  # noqa: E731
    return jax.vmap(g)(jnp.arange(float(n)))


def test_elements_run_in_tasks_named_after_the_kernel():
    # What asyncio's debug mode (PYTHONASYNCIODEBUG=1) names when a step of an
    # element blocks the loop (docs/async-kernels.md).
    names = set()

    async def named(i):
        names.add(asyncio.current_task().get_name())
        await asyncio.sleep(0)
        return i

    out = jax.vmap(lambda i: threadmap(named, F32, i))(jnp.arange(4.0))
    np.testing.assert_array_equal(out, jnp.arange(4.0))
    assert names == {f"threadmap {named.__qualname__}"}


def test_a_map_called_on_the_event_loop_is_refused():
    async def inner(x):
        return x

    async def outer(x):
        return threadmap(inner, F32, x)  # blocks the loop it needs: refused

    with pytest.raises(KernelError, match="outer' raised ExecutorError") as info:
        threadmap(outer, F32, 1.0)
    assert isinstance(cause_of(info.value), ExecutorError)
    assert "event loop" in str(cause_of(info.value))


def test_an_async_map_nested_in_a_plain_kernel():
    async def inner(x):
        await asyncio.sleep(0)
        return x * 10

    def outer(row):
        return np.asarray(jax.vmap(lambda x: threadmap(inner, F32, x))(row)).sum()

    x = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    out = returns_within(
        lambda: jax.vmap(lambda r: threadmap(outer, F32, r))(x), limit=PATIENCE
    )
    np.testing.assert_allclose(out, (x * 10).sum(1))


# --- derivatives ------------------------------------------------------------------


def _cube_kernel(primal_async: bool, rule_async: bool):
    @jax_threadmap.kernel(F32)
    async def acube(x, a):
        await asyncio.sleep(0)
        return x**3 * a

    @jax_threadmap.kernel(F32)
    def pcube(x, a):
        return x**3 * a

    k = acube if primal_async else pcube

    if rule_async:

        @k.defvjp
        async def vjp(x, a, ct):
            await asyncio.sleep(0)
            return 3 * x**2 * a * ct, x**3 * ct

        @k.defjvp
        async def jvp(x, a, tx, ta):
            await asyncio.sleep(0)
            return 3 * x**2 * a * tx + x**3 * ta

    else:

        @k.defvjp
        def vjp(x, a, ct):
            return 3 * x**2 * a * ct, x**3 * ct

        @k.defjvp
        def jvp(x, a, tx, ta):
            return 3 * x**2 * a * tx + x**3 * ta

    return k


@pytest.mark.parametrize(
    "primal_async, rule_async", [(True, True), (True, False), (False, True)]
)
def test_grad_and_jvp_of_async_kernels(primal_async, rule_async):
    k = _cube_kernel(primal_async, rule_async)
    x = jnp.linspace(0.5, 2.0, 12).reshape(3, 4)
    a = jnp.float32(1.5)  # unbatched: its cotangent is summed on the host

    def loss(fn, x, a):
        return jax.vmap(jax.vmap(fn, (0, None)), (0, None))(x, a).sum()

    def ref(x, a):
        return x**3 * a

    got = jax.jit(jax.grad(lambda x, a: loss(k, x, a), (0, 1)))(x, a)
    want = jax.grad(lambda x, a: loss(ref, x, a), (0, 1))(x, a)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    t = jnp.ones_like(x)
    _, got_t = jax.jvp(lambda x: loss(k, x, a), (x,), (t,))
    _, want_t = jax.jvp(lambda x: loss(ref, x, a), (x,), (t,))
    np.testing.assert_allclose(got_t, want_t, rtol=1e-5)


def test_summed_cotangents_are_added_in_index_order_within_the_bound():
    # More elements than the bound, the earliest slowest: the sum over an unbatched
    # operand waits for them in index order, and stays exact and bounded.
    seen = InFlight(until=1)

    @jax_threadmap.kernel(F32, max_in_flight=4)
    async def k(x, a):
        return x * a

    @k.defvjp
    async def k_vjp(x, a, ct):
        await seen.enter()
        for _ in range(int(64 - x)):  # earlier elements yield more often
            await asyncio.sleep(0)
        seen.leave()
        return ct * a, ct * x

    x = jnp.arange(64.0)
    g = jax.grad(lambda a: jax.vmap(k, (0, None))(x, a).sum())(jnp.float32(2.0))
    assert float(g) == float(x.sum())
    assert seen.peak <= 4


SDS = jax.ShapeDtypeStruct
#: Seconds a call's result is waited for (never reached when a test passes).
WAIT = 30.0


class Odd(BaseException):
    """An exception no code catches by type."""


# --- an element whose result raised a BaseException (issue 43) ---------------------


def _raising(exc: BaseException):
    class Bad:
        def __array__(self, dtype=None, copy=None):
            raise exc

    return Bad()


def _async_map(fn, n):
    return jax.vmap(lambda i: threadmap(fn, F32, i))(jnp.arange(float(n)))


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_from_an_elements_result_reaches_the_caller(exc):
    async def element(i):
        return _raising(exc()) if i == 2 else i

    with pytest.raises(exc):
        returns_within(_async_map, element, 8, limit=WAIT, what="end the map")
    # The loop's thread lives on: the next map and loader run.
    got = returns_within(_async_map, element, 2, limit=WAIT, what="run the next map")
    np.testing.assert_array_equal(got, [0.0, 1.0])

    async def load():
        return np.ones(2, np.float32)

    np.testing.assert_array_equal(
        async_call(load, SDS((2,), np.float32)).result(timeout=WAIT), 1.0
    )


def test_any_other_exception_from_an_elements_result_names_the_element():
    async def element(i):
        await asyncio.sleep(0)
        return _raising(Odd("odd")) if i == 3 else i

    with pytest.raises(KernelError, match=r"batch index \(3,\).*Odd: odd") as info:
        returns_within(_async_map, element, 8, limit=WAIT, what="end the map")
    assert isinstance(cause_of(info.value), Odd)
    assert info.value.index == (3,)


def test_a_summed_output_whose_value_raises_names_its_element():
    # Cotangents of an unbatched operand are added later, in index order: the
    # error is the element's whose value raised, not the one stored then.
    @kernel(F32)
    async def k(x, a):
        return x * a

    @k.defvjp
    async def k_vjp(x, a, ct):
        for _ in range(int(8 - x)):  # earlier elements finish later
            await asyncio.sleep(0)
        return ct * a, (_raising(Odd("odd cotangent")) if x == 5 else ct * x)

    def grad_a():
        x = jnp.arange(8.0)
        return jax.grad(lambda a: jax.vmap(k, (0, None))(x, a).sum())(jnp.float32(2))

    with pytest.raises(KernelError, match=r"batch index \(5,\).*odd cotangent"):
        returns_within(grad_a, limit=WAIT, what="end the map")


def test_the_event_loop_outlives_a_coroutine_that_lets_an_interrupt_out(caplog):
    # asyncio lets KeyboardInterrupt and SystemExit out of run_forever: the
    # package's loop, which every loader and map shares, goes on.
    ran = threading.Event()
    box = {}

    async def escapes():
        box["task"] = asyncio.current_task()
        raise SystemExit("out of the loop")

    _event_loop.event_loop().submit(escapes, "escapes")

    async def load():
        ran.set()
        return np.zeros(2, np.float32)

    x = async_call(load, SDS((2,), np.float32))
    np.testing.assert_array_equal(x.result(timeout=WAIT), 0.0)
    assert ran.is_set()
    assert any("the loop goes on" in r.getMessage() for r in caplog.records)
    # Its task kept the exception (read here: asyncio would log it at exit).
    assert isinstance(box["task"].exception(), SystemExit)


def test_a_map_never_returns_with_an_element_unwritten(monkeypatch):
    # Whatever ends an element without storing it (here: a store that writes
    # nothing for one element), the map fails rather than return that element
    # as whatever its output buffer held.
    from jax_threadmap._coroutines import async_kernels as _async_kernels

    real_store = _async_kernels.AsyncMap._store

    def store(self, i, index, result):
        if i != 3:
            real_store(self, i, index, result)

    monkeypatch.setattr(_async_kernels.AsyncMap, "_store", store)

    async def element(i):
        return i

    with pytest.raises(ExecutorError, match="1 of 8 element"):
        returns_within(_async_map, element, 8, limit=WAIT, what="end the map")


# --- async def derivative rules, second order and failing (issue 43) ---------------

S = jax.ShapeDtypeStruct
F64 = jnp.float64


def _async_sin_kernel(max_in_flight=None):
    """``f(x, a) = sin(x) * a`` (x (3,), a ()) whose rules, and their rules, are
    all ``async def``: each awaits before it returns."""
    g, g1, g2 = np.sin, np.cos, lambda x: -np.sin(x)
    opts = {} if max_in_flight is None else {"max_in_flight": max_in_flight}

    @kernel(S((3,), F64), **opts)
    async def f(x, a):
        await asyncio.sleep(0)
        return g(x) * a

    @kernel(S((3,), F64), **opts)
    async def f_jvp(x, a, tx, ta):
        await asyncio.sleep(0)
        return g1(x) * a * tx + g(x) * ta

    @kernel((S((3,), F64), S((), F64)), **opts)
    async def f_vjp(x, a, ct):
        await asyncio.sleep(0)
        return ct * g1(x) * a, np.sum(ct * g(x))

    @f_jvp.defjvp
    async def f_jvp_jvp(x, a, tx, ta, dx, da, dtx, dta):
        await asyncio.sleep(0)
        return g2(x) * dx * a * tx + g1(x) * (da * tx + a * dtx + dx * ta) + g(x) * dta

    @f_vjp.defjvp
    async def f_vjp_jvp(x, a, ct, dx, da, dct):
        await asyncio.sleep(0)
        return (
            dct * g1(x) * a + ct * g2(x) * dx * a + ct * g1(x) * da,
            np.sum(dct * g(x) + ct * g1(x) * dx),
        )

    @f_jvp.defvjp
    async def f_jvp_vjp(x, a, tx, ta, ct):
        await asyncio.sleep(0)
        return (
            ct * (g2(x) * a * tx + g1(x) * ta),
            np.sum(ct * g1(x) * tx),
            ct * g1(x) * a,
            np.sum(ct * g(x)),
        )

    @f_vjp.defvjp
    async def f_vjp_vjp(x, a, ct, c):
        await asyncio.sleep(0)
        cx, ca = c
        return (
            cx * ct * g2(x) * a + ca * ct * g1(x),
            np.sum(cx * ct * g1(x)),
            cx * g1(x) * a + ca * g(x),
        )

    f.defjvp(f_jvp)
    f.defvjp(f_vjp)
    return f


def _loss(f):
    def loss(x, a):
        y = jax.vmap(jax.vmap(f, (0, None)), (0, None))(x, a)
        return jnp.sum(y * jnp.cos(y)) + a * jnp.sum(y)

    return loss


SECOND_ORDER = {
    "hessian": lambda loss: jax.hessian(loss, (0, 1)),
    "jvp(grad)": lambda loss: (
        lambda x, a: jax.jvp(
            jax.grad(loss, (0, 1)), (x, a), (jnp.cos(x), 0.7 * jnp.cos(a))
        )[1]
    ),
    "grad(grad)": lambda loss: jax.grad(
        lambda x, a: jnp.sum(jnp.sin(jax.grad(loss)(x, a))), (0, 1)
    ),
}


@functools.cache
def _second_order_reference(transform):
    """The transform of the loss in jax.numpy at the operands below, eager and
    under jit alike: one compile per transform, not one per eager operation."""
    x = jnp.asarray(np.random.default_rng(0).uniform(-1.5, 1.5, (2, 3, 3)))
    a = jnp.float64(0.8)
    loss = _loss(lambda x, a: jnp.sin(x) * a)
    return jax.block_until_ready(jax.jit(SECOND_ORDER[transform](loss))(x, a))


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("transform", list(SECOND_ORDER))
def test_async_def_rules_of_async_def_rules_match_jax_numpy(transform, jit):
    x = jnp.asarray(np.random.default_rng(0).uniform(-1.5, 1.5, (2, 3, 3)))
    a = jnp.float64(0.8)
    make = SECOND_ORDER[transform]
    got = make(_loss(_async_sin_kernel(max_in_flight=2)))
    if jit:
        got = jax.jit(got)
    want = _second_order_reference(transform)
    got = returns_within(got, x, a, limit=WAIT, what="differentiate")
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.dtype == w.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("rule", ["jvp", "vjp"])
@pytest.mark.parametrize("how", ["raises", "wrong shape"])
def test_a_failing_async_def_rule_names_itself_and_its_element(rule, how):
    entered, cancelled = [], threading.Semaphore(0)

    @kernel(F32)
    async def k(x):
        return x * 2

    async def body(x, out, wrong):
        if int(x) == 5:
            if how == "raises":
                raise ArithmeticError(f"rule failed at {int(x)}")
            return wrong
        entered.append(int(x))
        try:  # the other elements wait until the failure cancels them
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.release()
            raise
        return out

    if rule == "jvp":

        @k.defjvp
        async def k_jvp(x, tx):
            return await body(x, 2 * tx, np.zeros(2))

        run = lambda x: jax.jvp(jax.vmap(k), (x,), (jnp.ones_like(x),))  # noqa: E731
    else:

        @k.defvjp
        async def k_vjp(x, ct):
            return await body(x, (2 * ct,), (np.zeros(2),))

        run = jax.grad(lambda x: jax.vmap(k)(x).sum())  # noqa: E731
    x = jnp.arange(8.0)
    words = "rule failed at 5" if how == "raises" else r"shape \(2,\)"
    with pytest.raises(KernelError, match=rf"k_{rule}.*batch index \(5,\).*{words}"):
        returns_within(run, x, limit=WAIT, what="fail")
    # Every element that had started was cancelled (those after the failure
    # never start).
    assert entered
    assert all(cancelled.acquire(timeout=WAIT) for _ in entered), entered
    # The next derivative through async def rules works.

    @kernel(F32)
    async def square(v):
        return v * v

    @square.defvjp
    async def square_vjp(v, ct):
        await asyncio.sleep(0)
        return (2 * v * ct,)

    grad = jax.grad(lambda x: jax.vmap(square)(x).sum())
    got = returns_within(grad, x, limit=WAIT, what="differentiate")
    np.testing.assert_array_equal(got, 2 * np.arange(8.0))


# --- Ctrl-C inside an async def kernel map (issue 43) ---------------------------------

CTRL_C_SCRIPT = """
import asyncio, os, signal, threading, time
import jax, jax.numpy as jnp, numpy as np
import jax_threadmap as jtm

F32 = jax.ShapeDtypeStruct((), np.float32)
BOUND = 8
seen = {"in": 0, "cancelled": 0}
all_cancelled = threading.Event()

async def wait_for_ctrl_c(i):
    seen["in"] += 1
    try:
        if seen["in"] == BOUND:  # all in flight: Ctrl-C from the keyboard
            os.kill(os.getpid(), signal.SIGINT)
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        seen["cancelled"] += 1
        if seen["cancelled"] == BOUND:
            all_cancelled.set()
        raise
    return i

@jtm.kernel(F32, max_in_flight=BOUND)
async def scaled(x, a):
    return x * a

@scaled.defvjp
async def scaled_vjp(x, a, ct):  # its cotangent of `a` is summed on the host
    return await wait_for_ctrl_c(ct * a), ct * x

def plain_map(n):
    f = lambda i: jtm.threadmap(wait_for_ctrl_c, F32, i, max_in_flight=BOUND)
    return jax.vmap(f)(np.arange(float(n), dtype=np.float32))

def summed_grad(n):
    x = np.arange(float(n), dtype=np.float32)
    return jax.grad(lambda a: jax.vmap(scaled, (0, None))(x, a).sum())(
        np.float32(2.0))

for name, run in (("map", plain_map), ("summed grad", summed_grad)):
    seen.update({"in": 0, "cancelled": 0})
    all_cancelled.clear()
    try:
        run(100)
        print(name, "not interrupted", flush=True)
    except KeyboardInterrupt:
        ok = all_cancelled.wait(60)
        print(name, "interrupted; in flight cancelled:", ok, seen, flush=True)

async def double(i):
    await asyncio.sleep(0)
    return i * 2

x = np.arange(4.0, dtype=np.float32)
got = jax.vmap(lambda i: jtm.threadmap(double, F32, i))(x)
print("next map:", np.asarray(got).tolist(), flush=True)
"""


def test_ctrl_c_inside_an_async_def_map_and_a_summed_grad():
    # A real SIGINT while every element in flight waits: the map (and a grad
    # whose cotangent is summed on the host, added in index order) stops with
    # KeyboardInterrupt in the caller, every element in flight is cancelled,
    # and the next map runs.
    ran = run_script(CTRL_C_SCRIPT)
    for name in ("map", "summed grad"):
        said = f"{name} interrupted; in flight cancelled: True"
        assert said in ran.stdout, ran.report
    assert "next map: [0.0, 2.0, 4.0, 6.0]" in ran.stdout, ran.report
    assert ran.returncode == 0, ran.report
