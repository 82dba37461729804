"""Shipping a map to an executor that pickles work (process pools, Dask): the
tasks in flight and their results (:class:`Shipper`), and what a broken or
refusing executor means (:func:`broken_hint`, :func:`refused`). What each task
carries and runs in the worker is ``_host/packing.py``; the operands sent once
per map, ``_host/shipped_once.py``.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import sys
from typing import Any

from .._host.maps import HostMap
from .._host.packing import KernelNotLoaded
from .._host.shipped_once import Sharing, share
from .._support.errors import ExecutorError, KernelError, restore_shipped_cause
from . import scheduling as policy
from .jobs import Job, at_shutdown
from .progress import Progress, wait


class Shipper:
    """Ships a map to an executor that pickles work, in chunks of
    :func:`.scheduling.remote_chunk_size` (fixed for a map summed on the host).
    Used by the waiting thread alone: no lock."""

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        work: HostMap,
        job: Job,
        workers: int | None,
    ):
        self.executor = executor
        self.work = work
        self.job = job
        self.cap = policy.remote_in_flight(workers)
        self.first_wave = workers or self.cap  # one task per worker, if known
        self.next = 0
        self.pending: dict[concurrent.futures.Future[Any], tuple[int, int]] = {}
        self.per_element: float | None = None
        self.sharing = Sharing([])

    def top_up(self, most: int) -> None:
        """Ships tasks until ``most`` are in flight or nothing is left."""
        while self.next < self.job.n and len(self.pending) < most:
            self.submit()

    def submit(self) -> None:
        left = self.job.n - self.next
        size = self.job.fixed or policy.remote_chunk_size(
            self.per_element, left, self.cap
        )
        start, stop = self.next, self.next + min(size, left)
        task = self.work.pack(start, stop)
        try:
            fut = self.executor.submit(task, *self.sharing.args)
        except RuntimeError as e:
            if self.pending and isinstance(e, concurrent.futures.BrokenExecutor):
                # It broke while running this map's tasks, before their futures
                # said so: the error they will have, naming one of them.
                lost = next(iter(self.pending.values()))
                raise _chunk_failed(self.executor, self.work, *lost, e) from e
            raise refused(self.executor, e) from e
        except Exception as e:  # e.g. the kernel cannot be pickled
            raise _cannot_ship(self.executor, self.work.name, e) from e
        self.pending[fut] = (start, stop)
        self.next = stop

    def poll(self, timeout: float) -> bool:
        """Stores what has come back, ships more; whether the map is done."""
        if self.job.failed:  # stopped from outside: its parent failed, or exit
            return True
        done, _ = concurrent.futures.wait(
            list(self.pending), timeout, concurrent.futures.FIRST_COMPLETED
        )
        for fut in done:
            start, stop = self.pending.pop(fut)
            try:
                outs, per_element = fut.result()
            except KernelError as e:
                restore_shipped_cause(e)
                raise
            except Exception as e:
                if _unpicklable(e):
                    raise _cannot_ship(self.executor, self.work.name, e) from e
                raise _chunk_failed(self.executor, self.work, start, stop, e) from e
            self.work.store_packed(start, stop, outs)
            self.job.add_completed(stop - start)
            self.per_element = per_element  # the latest: tasks size from it
        # Untimed, a task is one element: no more of them than the first wave,
        # however long a cold pool's workers take to answer.
        timed = self.per_element is not None or self.job.fixed
        self.top_up(self.cap if timed else self.first_wave)
        return not self.pending

    def run(self, progress: Progress | None) -> None:
        try:
            # Large operands read whole by every element: once per map.
            self.sharing = share(self.executor, self.work.shared())
            self.top_up(self.first_wave)
            wait(self.job, self.poll, progress)
        except BaseException as e:
            self.job.fail(e)
        finally:
            if self.job.failed:
                for fut in self.pending:
                    fut.cancel()
            self.sharing.close()


def said(e: BaseException) -> str:
    """``Type: message`` of an exception, without its final period."""
    return f"{type(e).__name__}: {str(e).rstrip().rstrip('.')}"


def refused(executor: Any, e: BaseException) -> ExecutorError:
    """The error of a map whose executor refused its work."""
    if at_shutdown(e):
        return ExecutorError(
            "The interpreter is exiting: this threadmap was stopped before it "
            f"finished, because the executor {executor!r} refuses new work once "
            "the main thread has ended (concurrent.futures stops its executors at "
            "exit). Wait for maps on such executors before the end of the main "
            "thread.",
            cause=e,
        )
    if isinstance(e, concurrent.futures.BrokenExecutor):
        return ExecutorError(
            f"The executor {executor!r} passed as executor= is broken: "
            f"{said(e)}. A worker of it ended "
            "earlier (the error of the map that ran then said how); pass a new "
            "executor.",
            cause=e,
        )
    return ExecutorError(
        f"The executor {executor!r} passed as executor= refused new work: "
        f"{said(e)}. Pass an executor that is "
        "running, or executor=None for the shared pool.",
        cause=e,
    )


def _cannot_ship(executor: Any, name: str, e: BaseException) -> ExecutorError:
    return ExecutorError(
        f"threadmap kernel {name!r} could not be sent to the executor "
        f"{executor!r}, which runs work in other processes and so pickles it: "
        f"{said(e)}. Define the kernel at module level (not a lambda "
        "or closure), or use executor=None / a ThreadPoolExecutor.",
        cause=e,
    )


def _chunk_failed(
    executor: Any, work: HostMap, start: int, stop: int, e: BaseException
) -> ExecutorError:
    """The error of a chunk that the executor could not run."""
    unit = "pieces" if work.vectorized else "elements"
    if isinstance(e, concurrent.futures.BrokenExecutor):
        hint = " " + broken_hint(executor)
    elif isinstance(e, KernelNotLoaded):
        hint = ""  # the worker's own account says what to do
    else:
        hint = " Pass a working executor to the next call."
    return ExecutorError(
        f"The executor {executor!r} failed to run {unit} [{start}, {stop}) (flat "
        f"indices, of {work.n}) of threadmap kernel {work.name!r}: {said(e)}." + hint,
        cause=e,
    )


def _unpicklable(e: BaseException) -> bool:
    # Python 3.13 says "Can't get local object"; the pool's remote traceback
    # (the cause) names the pickler.
    return (
        isinstance(e, (pickle.PicklingError, AttributeError, TypeError))
        and "pickle" in f"{e} {e.__cause__}".lower()
    )


def broken_hint(executor: Any) -> str:
    """What to say when an executor that pickles work broke: a worker process
    ended. Its own traceback, if it wrote one, went to its stderr, which the
    user may not see (a notebook, a captured subprocess); so this names where
    to look and the usual causes, and the one this process can tell: workers
    that import a main script that has no file."""
    hint = (
        "A worker process ended: it crashed (native code, out of memory), or it "
        "could not start, and then its own traceback is on its stderr (the "
        "terminal of this program, or the Jupyter server's log). A worker "
        "started with 'spawn' or 'forkserver' imports the main script again: "
        'its top-level code must be under `if __name__ == "__main__":`, and '
        "every module it imports must import there."
    )
    context = getattr(executor, "_mp_context", None)  # ProcessPoolExecutor's
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    method = context.get_start_method() if context is not None else None
    if method in ("spawn", "forkserver") and main and not os.path.isfile(main):
        hint += (
            f" Here the main script is {main!r}, which is no file (code read from "
            "stdin or passed with -c), so the workers cannot start: put the "
            "program in a script file, or the kernel in a module."
        )
    return (
        hint + " The map was abandoned, and a broken process pool stays broken: "
        "pass a new executor to the next call (a Dask cluster replaces its dead "
        "workers)."
    )
