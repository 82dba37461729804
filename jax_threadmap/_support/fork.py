"""The package's one fork hook: what a forked child starts afresh, in one place.

A forked child has only the thread that forked. Every lock that another thread held
at the fork stays held for good there, and every thread, pool, server and call in
flight belongs to the parent. As CPython's ``threading`` reinitialises its locks in
one after-fork function (``_after_fork``, each lock's ``_at_fork_reinit``), this
package registers one ``os.register_at_fork`` hook, here: each module that owns
process-wide state (docs/architecture.md, "Process-wide state") registers its reset
with :func:`in_child`, and the hook calls the resets layer by layer, lowest first
(:data:`LAYERS`), and each layer's in the order they were registered (imported).
"""

from __future__ import annotations

import os
from collections.abc import Callable

#: The subpackages, each after those it imports (tests/project/test_architecture.py): a
#: reset never finds a layer below its own still the parent's.
LAYERS = ("_jax", "_support", "_host", "_executors", "_coroutines", "_core", "_arrays")

#: Every reset, in registration order; written at import only.
resets: list[Callable[[], None]] = []


def in_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Registers ``reset`` to run in a forked child, after the fork; returns it.

    Usable as a decorator. ``reset`` runs in the child's only thread, before the
    child's own code goes on; it replaces locks and forgets threads, servers and
    calls that exist only in the parent.
    """
    resets.append(reset)
    return reset


def _after_fork_in_child() -> None:
    # By the layer of each reset's module; sorted() keeps the order of one layer's.
    for reset in sorted(resets, key=lambda r: LAYERS.index(r.__module__.split(".")[1])):
        reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
