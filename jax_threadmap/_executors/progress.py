"""Progress bars, and the one loop that waits for a map while showing one.

A bar (tqdm's) appears only once a map has run for ``delay`` seconds, so short
maps print nothing; without tqdm, the map warns once that it shows none.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

from .._support import environment as _environment

#: Seconds between two checks of a map that shows no bar: short enough that the
#: waiting thread sees Ctrl-C at once.
POLL_INTERVAL = 0.5


def progress_enabled(progress: bool | None) -> bool:
    """``progress`` if given, else environment variable ``JAX_THREADMAP_PROGRESS``."""
    if progress is not None:
        return bool(progress)
    return _environment.env_progress()


class Progress:
    """A progress bar for ``total`` elements that appears after ``delay`` seconds."""

    #: Seconds between two updates of the bar.
    interval = 0.1
    #: Seconds a map runs before its bar appears (tests set it, rather than wait).
    delay = 1.0

    def __init__(self, total: int, name: str, unit: str = "el"):
        self.total = total
        self.name = name
        self.unit = unit
        self.start = time.perf_counter()
        self.bar: Any = None

    def update(self, completed: int) -> None:
        now = time.perf_counter()
        if now - self.start < self.delay:
            return
        if self.bar is None:
            self.bar = _tqdm(self.total, f"threadmap {self.name}", self.unit) or False
        if self.bar:
            self.bar.update(completed - self.bar.n)

    def close(self, completed: int) -> None:
        if self.bar:
            self.bar.update(completed - self.bar.n)
            self.bar.close()


def _tqdm(total: int, desc: str, unit: str) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        warnings.warn(
            f"{desc}: progress bars need tqdm, which is not installed: pip install "
            "tqdm (or the package's 'progress' extra). This map shows none.",
            stacklevel=2,
        )
        return None
    return tqdm(total=total, desc=desc, unit=unit)


class Waited(Protocol):
    """What :func:`wait` needs of a map: its progress, and a way to stop it."""

    @property
    def completed(self) -> int: ...

    def fail(self, error: BaseException) -> None: ...


def wait(job: Waited, poll: Callable[[float], bool], progress: Progress | None) -> None:
    """Calls ``poll(timeout)`` until it returns ``True``, updating ``progress``.

    ``poll`` waits at most ``timeout`` seconds for the map to finish (or does a
    step of work, such as shipping chunks) and says whether it has. The waits are
    short so that the thread sees Ctrl-C at once; an exception while waiting
    (KeyboardInterrupt) fails ``job``, so that chunks not yet started never run,
    and propagates.
    """
    interval = POLL_INTERVAL if progress is None else progress.interval
    try:
        while not poll(interval):
            if progress is not None:
                progress.update(job.completed)
    except BaseException as e:
        job.fail(e)
        raise
    finally:
        if progress is not None:
            progress.close(job.completed)
