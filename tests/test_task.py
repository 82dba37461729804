"""``Task``, the one owner of a background call's state (``_arrays/task.py``).

Every move of a call (and of a sharded load's part) goes through one method that
refuses a move not in the table, as ``concurrent.futures.Future`` refuses one;
the tables in the docstring are the moves the code allows; a subclass changes
what a call does through override points (here: the few lines of a call whose
``fn`` returns arrays placed already, published at once); and the host copy that
gate programs read is made only when a gate exists.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import async_array_from_callback, async_call, deferred_call
from jax_threadmap._arrays import async_array as _async_array
from jax_threadmap._arrays import async_dispatch as _async_dispatch
from jax_threadmap._arrays import task as _task
from jax_threadmap._arrays.task import (
    CALL_MOVES,
    FINISHED,
    FINISHING,
    PART_MOVES,
    PENDING,
    PLACED,
    RUNNING,
    STOPPED,
    Task,
)

pytestmark = pytest.mark.timeout(120)

SDS = jax.ShapeDtypeStruct
F32 = SDS((3,), np.float32)
WAIT = 30.0
ASYNC = _async_dispatch.async_dispatch_status() == "async"
CALL_STATES = (PENDING, RUNNING, FINISHING, FINISHED)
PART_STATES = (PENDING, RUNNING, PLACED, STOPPED)


def _tables() -> list[list[tuple[list[str], str]]]:
    """The docstring's tables: each row's states (first column) and next state."""
    doc = Task.__doc__ or ""
    tables, rows, rules = [], [], 0
    for line in doc.splitlines():
        stripped = line.strip()
        if re.fullmatch(r"=+( +=+)+", stripped):
            rules += 1
            starts = [m.start() for m in re.finditer(r"=+", line)]
            if rules % 3 == 0:
                tables.append(rows)
                rows = []
            continue
        if rules % 3 == 2 and stripped and line[starts[0]] != " ":
            state = line[starts[0] : starts[1]].strip()
            nxt = line[starts[2] : starts[3]].strip()
            rows.append(([s.strip() for s in state.split(",")], nxt))
    return tables


def test_the_docstring_tables_are_the_moves_the_code_allows():
    calls, parts = _tables()
    for table, moves, states in (
        (calls, CALL_MOVES, CALL_STATES),
        (parts, PART_MOVES, PART_STATES),
    ):
        shown = set()
        for froms, nxt in table:
            if nxt == "same":
                continue
            for state in froms:
                assert state in states, (state, nxt)
                shown.add((state, nxt))
        assert shown == moves


def _call_in(state: str, monkeypatch) -> tuple[Task, threading.Event]:
    """A real call in ``state`` (finishing: its values being placed)."""
    go, started, placing = threading.Event(), threading.Event(), threading.Event()
    placed = threading.Event()

    def fn():
        started.set()
        go.wait(WAIT)
        return np.zeros(3, np.float32)

    real_place = _task.place

    def slow_place(task, frozen):
        placing.set()
        placed.wait(WAIT)
        return real_place(task, frozen)

    monkeypatch.setattr(_task, "place", slow_place)
    if state == PENDING:
        x = deferred_call(fn, F32)
    else:
        x = async_call(fn, F32)
        assert started.wait(WAIT)
    if state != FINISHING:
        placed.set()
    if state in (FINISHING, FINISHED):
        go.set()
        assert placing.wait(WAIT)
    if state == FINISHED:
        x.result(timeout=WAIT)
    return x._task, (go if state != FINISHING else placed)


@pytest.mark.parametrize("state", CALL_STATES)
def test_an_illegal_move_of_a_call_is_refused_and_changes_nothing(state, monkeypatch):
    task, go = _call_in(state, monkeypatch)
    try:
        assert task._state == state
        for to in CALL_STATES:
            if (state, to) in CALL_MOVES:
                continue
            with (
                task._lock,
                pytest.raises(
                    concurrent.futures.InvalidStateError, match=f"from {state} to {to}"
                ),
            ):
                task._move(to)
            assert task._state == state
    finally:
        go.set()
    if state != PENDING:
        np.testing.assert_array_equal(task.wait(WAIT, "x")[0], 0.0)


def test_a_second_end_of_a_call_is_refused():
    x = async_call(lambda: np.ones(3, np.float32), F32)
    x.result(timeout=WAIT)
    with pytest.raises(concurrent.futures.InvalidStateError, match="finished to"):
        x._task._end()
    np.testing.assert_array_equal(x.result(), 1.0)


def test_an_illegal_move_of_a_part_is_refused():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    x = async_array_from_callback((3,), sharding, lambda i: np.zeros(3)[i], np.float32)
    x.result(timeout=WAIT)
    task = x._task
    (part,) = task.parts
    assert part.state == PLACED
    for to in PART_STATES:
        with task._lock, pytest.raises(concurrent.futures.InvalidStateError):
            task._move(to, part)
        assert part.state == PLACED


class PlacedCall(Task):
    """A call whose fn dispatches a program and returns its output arrays,
    placed already: published at once (no check, no copy, no wait), or failed
    with the error fn hands back for a failed input."""

    __slots__ = ()

    def _accept(self, out):
        if isinstance(out, BaseException):
            self._fail(out, raised_by_fn=False)
        else:
            self._publish_placed(jax.tree_util.tree_leaves(out))
        return None


def _placed_call(fn, shapes):
    task = PlacedCall.for_call(fn, shapes, (), {}, None, "async_call", None)
    out = _async_array.make_arrays(task)
    task.submit()
    return out


@pytest.fixture
def host_copies(monkeypatch):
    """Counts the host copies made for gate programs (``host_view``)."""
    copies = []
    real = _task.host_view

    def counting(leaf):
        copies.append(type(leaf))
        return real(leaf)

    monkeypatch.setattr(_task, "host_view", counting)
    return copies


def test_a_subclass_that_publishes_placed_arrays_at_once(monkeypatch, host_copies):
    def never(*args, **kwargs):
        raise AssertionError("a placed result is neither checked, copied nor waited")

    for name in ("check_result", "place"):
        monkeypatch.setattr(_task, name, never)
    monkeypatch.setattr(Task, "_ready", never)
    made = {}

    def fn():
        made["out"] = (jnp.arange(3.0), jnp.ones((2,), jnp.int32))
        return made["out"]

    x, y = _placed_call(fn, (F32, SDS((2,), np.int32)))
    assert x.result(timeout=WAIT) is made["out"][0]
    assert y.result(timeout=WAIT) is made["out"][1]
    assert host_copies == []  # no gate: never copied back to the host

    failed = ValueError("an input of the program failed")
    z = _placed_call(lambda: failed, F32)
    with pytest.raises(ValueError, match="an input of the program failed") as info:
        z.result(timeout=WAIT)
    assert info.value is failed


@pytest.mark.skipif(not ASYNC, reason="gate programs need async dispatch")
def test_a_placed_subclass_feeds_the_gate_programs_of_a_dispatch(host_copies):
    go = threading.Event()

    def fn():
        go.wait(WAIT)
        return jnp.arange(3.0)

    x = _placed_call(fn, F32)
    y = jax.jit(lambda a: a * 2)(x)  # a gate program waits for x
    go.set()
    np.testing.assert_array_equal(np.asarray(y), np.arange(3.0) * 2)
    assert host_copies  # read by the gate program


def test_no_host_copy_is_made_for_a_call_nothing_was_dispatched_on(host_copies):
    device = jnp.arange(3.0) + 1  # a jax.Array leaf: a host copy is a transfer
    x = async_call(lambda: device, F32)
    np.testing.assert_array_equal(np.asarray(x.result(timeout=WAIT)), [1, 2, 3])
    assert host_copies == []


@pytest.mark.skipif(not ASYNC, reason="gate programs need async dispatch")
def test_a_host_copy_is_made_for_the_gates_of_a_dispatch(host_copies):
    go = threading.Event()

    def fn():
        go.wait(WAIT)
        return jnp.arange(3.0) + 1

    x = async_call(fn, F32)
    y = jax.jit(lambda a: a * 2)(x)
    go.set()
    np.testing.assert_array_equal(np.asarray(y), [2, 4, 6])
    assert host_copies
