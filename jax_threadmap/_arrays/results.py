"""The call behind the results of a program run with ``AsyncArray`` arguments
that was not deferred (:class:`Results`: landed when made), and the tree of a
program's outputs (:func:`treedef_of`)."""

from __future__ import annotations

import functools
from typing import Any

import jax

from .leaves import specs_of
from .task import Task


@functools.cache  # per dispatch: a cache hit calls nothing
def treedef_of(n: int) -> Any:
    """The tree of a program's ``n`` outputs (a list), as the calls of its
    results declare it."""
    return jax.tree_util.tree_structure(list(range(n)))


class Results(Task):
    """The call behind the ``AsyncArray`` results of a program run with
    ``AsyncArray`` arguments that was not deferred: it has landed when made,
    with the run's outputs (``jax.Array`` s, still being computed)."""

    __slots__ = ()
    stands_for_an_array = True  # print(y) shows y's values, as for a jax.Array

    def __init__(self, leaves: list[jax.Array]):
        specs = specs_of([a.aval for a in leaves], [a.sharding for a in leaves])
        super().__init__(
            None,  # nothing to run: a wrapped outcome
            (),
            {},
            name="a jitted call on AsyncArrays",
            api="jit",
            treedef=treedef_of(len(leaves)),
            specs=specs,
            coroutine=False,
        )
        self._claim(None)
        self._publish_placed(leaves)
