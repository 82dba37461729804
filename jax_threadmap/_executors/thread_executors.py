"""A user's ``ThreadPoolExecutor`` passed as ``executor=``: one puller task per
thread it may use, each draining the map's job (:func:`run_on_executor`); a
nested map's waiting thread drains it too.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # now, not lazily at exit (it then fails)
import threading
import weakref
from typing import Any

from .._support import fork as _fork
from .._support.errors import ExecutorError
from .jobs import Job, this_thread
from .progress import Progress, wait
from .refusals import refused

#: Per thread executor, the lock held while a map queues its first pullers: two
#: maps started at once would split its workers, and elements that wait for each
#: other could wait for good. Executors without weak references share _fallback.
_states: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()
_fallback = threading.Lock()


def _queueing(executor: concurrent.futures.Executor) -> threading.Lock:
    with _states_lock:
        try:
            return _states.setdefault(executor, threading.Lock())
        except TypeError:  # an executor that takes no weak references
            return _fallback


def run_on_executor(
    executor: concurrent.futures.Executor,
    job: Job,
    progress: Progress | None,
) -> None:
    """Runs ``job`` on a thread executor: one puller task (``job.drain``) per
    thread it may use; a nested map's thread drains it too."""
    lock = threading.Lock()  # guards ``left`` and ``futures``
    left = [0]  # pullers submitted and not yet done
    futures: list[concurrent.futures.Future[None]] = []

    def on_done(f: concurrent.futures.Future[None]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if f.cancelled():
            if last:  # no puller will ever claim the rest
                job.fail(ExecutorError(f"The executor {executor!r} cancelled the map."))
        elif f.exception() is not None:
            job.fail(f.exception())  # type: ignore[arg-type]

    def hand() -> None:
        """Submits pullers up to the job's limit; a refusal fails the map when
        no puller runs it."""
        while job.add_hand():
            with lock:
                left[0] += 1
            try:
                future = executor.submit(job.drain)  # a puller
            except RuntimeError as e:
                job.drop_hand()
                with lock:
                    left[0] -= 1
                    alone = not futures
                if alone:
                    job.fail(refused(executor, e))
                return
            with lock:
                futures.append(future)
            future.add_done_callback(on_done)

    job.grow = hand
    try:
        with _queueing(executor):
            hand()
        if this_thread.job is not None:
            job.drain()
        wait(job, job.done.wait, progress)
    finally:
        with lock:
            started = list(futures)
        for f in started:  # pullers that never started: nothing left to claim
            f.cancel()


@_fork.in_child
def _start_afresh() -> None:
    """Any lock here may have been held at the fork."""
    global _states, _states_lock, _fallback
    _states = weakref.WeakKeyDictionary()
    _states_lock = threading.Lock()
    _fallback = threading.Lock()
