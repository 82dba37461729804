"""The package's one fork hook: what a forked child starts afresh, in one place.

A forked child has only the thread that forked. Every lock that another thread held
at the fork stays held for good there, and every thread, pool, server and call in
flight belongs to the parent. As CPython's ``threading`` reinitialises its locks in
one after-fork function (``_after_fork``, each lock's ``_at_fork_reinit``), this
package registers one ``os.register_at_fork`` hook, here: each module that holds such
state registers its reset with :func:`in_child`, and the hook calls the resets in
the order they were registered, which is the import order, lowest layer first.
"""

from __future__ import annotations

import os
from collections.abc import Callable

_resets: list[Callable[[], None]] = []


def in_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Registers ``reset`` to run in a forked child, after the fork; returns it.

    Usable as a decorator. ``reset`` runs in the child's only thread, before the
    child's own code goes on; it replaces locks and forgets threads, servers and
    calls that exist only in the parent.
    """
    _resets.append(reset)
    return reset


def _after_fork_in_child() -> None:
    for reset in _resets:
        reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
