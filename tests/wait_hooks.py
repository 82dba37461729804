"""A test seam: a callback run by each thread that enters a wait of the async
layer for a call's value, inside that wait, before it blocks.

Every such wait is ``jax_threadmap._arrays.outcomes.wait_polling`` (module
docstring there), called through that module by ``Task.wait`` and by
``dispatch`` (a thread that helps a chain of deferred programs). A test that
must act once a thread is inside its wait (release a load then, exit then)
sets an event here instead of sleeping and hoping: it
cannot pass on code that never waits. No frames are read. Should that module
rename the function, ``calling_on_wait`` fails at once (AttributeError).

Imported by tests and by their child scripts (it imports no test tooling).
"""

import contextlib
from collections.abc import Callable, Iterator

from jax_threadmap._arrays import outcomes


@contextlib.contextmanager
def calling_on_wait(callback: Callable[[], object]) -> Iterator[None]:
    """Within the block, ``callback()`` runs in each thread entering such a wait."""
    original = outcomes.wait_polling

    def waiting(future, timeout):
        callback()
        return original(future, timeout)

    outcomes.wait_polling = waiting
    try:
        yield
    finally:
        outcomes.wait_polling = original
