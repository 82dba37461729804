"""The package's one fork hook: what a forked child starts afresh, in one place.

A forked child has only the thread that forked. Every lock that another thread held
at the fork stays held for good there, and every thread, pool, server and call in
flight belongs to the parent. As CPython's ``threading`` reinitialises its locks in
one after-fork function (``_after_fork``, each lock's ``_at_fork_reinit``), this
package registers one ``os.register_at_fork`` hook, here: each module that owns
process-wide state (docs/architecture.md, "Process-wide state") registers its reset
with :func:`in_child`, and the hook calls the resets in the order of :data:`OWNERS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

#: The modules whose state a forked child resets, in the order it does: lowest
#: layer first, so a reset never finds a layer below it still the parent's. A
#: module missing here is reset after these (tests/test_architecture.py fails).
OWNERS = (
    "jax_threadmap._host.inner_threads",
    "jax_threadmap._executors.jobs",
    "jax_threadmap._executors.shared_threads",
    "jax_threadmap._executors.runners",
    "jax_threadmap._coroutines.event_loop",
    "jax_threadmap._coroutines.shared_resources",
    "jax_threadmap._arrays.async_pool",
    "jax_threadmap._arrays.task",
)

#: The resets by owning module (``reset.__module__``); written at import only.
resets: dict[str, list[Callable[[], None]]] = {}


def in_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Registers ``reset`` to run in a forked child, after the fork; returns it.

    Usable as a decorator. ``reset`` runs in the child's only thread, before the
    child's own code goes on; it replaces locks and forgets threads, servers and
    calls that exist only in the parent.
    """
    resets.setdefault(reset.__module__, []).append(reset)
    return reset


def _after_fork_in_child() -> None:
    for module in sorted(resets, key=(*OWNERS, *resets).index):
        for reset in resets[module]:
            reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
