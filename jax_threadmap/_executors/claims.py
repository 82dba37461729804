"""What a thread claims of a map: a chunk of units ``[start, stop)``, the
function that runs one, and what the executor layer needs of a map
(:class:`MapWork`, which ``_host.maps.HostMap`` provides).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Busy(Protocol):
    """A thread's flag: whether it runs a kernel (see ``jobs.Job.run``)."""

    running: bool


#: A claimed chunk: units ``[start, stop)``.
Chunk = tuple[int, int]

#: Runs units ``[start, stop)`` of a job (the third argument), stopping before
#: the next unit once the job's ``failed`` is true.
ChunkFn = Callable[[int, int, Any], None]


class MapWork(Protocol):
    """What the executor layer needs of a map (``_host.maps.HostMap``)."""

    name: str  # for messages and progress bars
    n: int  # elements
    sums: bool  # outputs summed on the host: chunk bounds must not depend on timing
    vectorized: bool  # one kernel call per chunk

    @property
    def element_bytes(self) -> int: ...  # one element's operands and results

    def split(self, max_elements: int) -> int:
        """Cuts a vectorized map into chunks of at most ``max_elements``; returns
        how many (the work units)."""
        ...

    def run_chunk(self, start: int, stop: int, job: Any) -> None: ...

    def shared(self) -> list[Any]:
        """Operands shipped once per map to an executor that pickles work."""
        ...

    def pack(self, start: int, stop: int) -> Callable[..., Any]:
        """A picklable task running ``[start, stop)`` in another process."""
        ...

    def store_packed(self, start: int, stop: int, outs: Any) -> None: ...
