"""A background call (``_arrays/task.py``): ``Task``, the one owner of its states.

Every move of a call goes through one method of its owner that refuses a move
not in its table, as ``concurrent.futures.Future`` refuses one; the table in
the owner's docstring is the moves the code allows (tests/_arrays/test_arrays_model.py
drives calls through random events against a model); and a subclass changes
what a call does through override points (here: the few lines of a call whose
``fn`` returns arrays placed already, published at once).
"""

from __future__ import annotations

import concurrent.futures
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import async_call
from jax_threadmap._arrays import async_array as _async_array
from jax_threadmap._arrays import task as _task
from jax_threadmap._arrays.task import (
    CALL_MOVES,
    FINISHED,
    FINISHING,
    PENDING,
    CallState,
    Task,
)

pytestmark = pytest.mark.timeout(120)

SDS = jax.ShapeDtypeStruct
F32 = SDS((3,), np.float32)
WAIT = 30.0
CALL_STATES = tuple(CallState)


def _table(owner: type) -> list[tuple[list[str], str]]:
    """The docstring's table: each row's states (first column) and next state."""
    doc = owner.__doc__ or ""
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
    assert len(tables) == 1, owner
    return tables[0]


def test_the_docstring_table_is_the_moves_the_code_allows():
    shown = set()
    for froms, nxt in _table(Task):
        if nxt == "same":
            continue
        for state in froms:
            shown.add((CallState(state), CallState(nxt)))  # ValueError: not a state
    assert shown == CALL_MOVES


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
    if state == PENDING:  # made, not submitted: nothing runs it
        task = Task.for_call(fn, F32, (), {}, None, "async_call", None)
        x = _async_array.make_arrays(task)
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


def test_a_subclass_that_publishes_placed_arrays_at_once(monkeypatch):
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

    failed = ValueError("an input of the program failed")
    z = _placed_call(lambda: failed, F32)
    with pytest.raises(ValueError, match="an input of the program failed") as info:
        z.result(timeout=WAIT)
    assert info.value is failed


def test_a_placed_subclass_feeds_a_program_deferred_on_it():
    go = threading.Event()

    def fn():
        go.wait(WAIT)
        return jnp.arange(3.0)

    x = _placed_call(fn, F32)
    y = jax.jit(lambda a: a * 2)(x)  # deferred until x lands
    assert not y.done()  # x has not landed
    go.set()
    np.testing.assert_array_equal(np.asarray(y), np.arange(3.0) * 2)
