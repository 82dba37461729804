"""Scheduling policy: the size of the next chunk, how many threads a map gets,
and which maps run in index order (docs/executors.md). Pure functions of a
map's size and of what it measured (:class:`Measure`), tested with made-up
times; every threshold is a named constant, which the docs quote (checked by
``tests/_executors/test_scheduling.py``). Timings decide only how fast a map
runs, never which elements run or whether it finishes.
"""

from __future__ import annotations

import dataclasses

#: Seconds of kernel work per task that amortise the cost of a task of an
#: executor that pickles work (about 1 ms for a process pool or Dask).
TASK_SECONDS_REMOTE = 0.05
#: ... and the least, also at the end of a map: a round trip costs more than
#: the balance smaller tasks buy.
MIN_TASK_SECONDS_REMOTE = 0.01
#: Tasks in flight, and workers assumed for chunk sizes, when an executor does
#: not say how many workers it has.
UNKNOWN_WORKERS_IN_FLIGHT = 128
UNKNOWN_WORKERS = 8
#: Seconds a shared thread waits for work before it exits: maps called in a
#: loop keep their threads; a burst of maps on many pool sizes leaves none.
IDLE_TIMEOUT = 2.0
#: Seconds interpreter exit waits, in all, for kernels still running.
EXIT_GRACE = 1.0
#: Seconds per element from which a limited map gets every thread: taking turns
#: costs little beside such elements, and waiting ones gain from every thread.
SLOW_ELEMENT = 200e-6
#: ... or when its threads were on a CPU for less than this share of their
#: time, summed over its threads: its elements wait (sleeps, I/O). Threads
#: taking turns at the GIL add up to about one CPU.
WAIT_SHARE = 0.5
#: Chunks in a row that must find the elements slow or waiting: one may be slow
#: for its own reasons (with 1, "100k el, the first slow" took 9.3x as long).
SLOW_VOTES = 2
#: Seconds of work in a guided chunk: at least (a limited map's chunks, which
#: are timed), and at most, from the last time per element, so that slow
#: elements spread over every thread rather than queue in one chunk.
MIN_CHUNK_SECONDS = 200e-6
MAX_CHUNK_SECONDS = 10e-3
#: Seconds of work (the chunks of the last map of its equation) under which a
#: map of fast elements runs on the thread that started it: handing it to other
#: threads costs more than they save (wake-ups, and the GIL passed between them).
INLINE_SECONDS = 10e-3
#: Elements per thread up to which a map on threads runs in index order; a
#: larger one may start limited. Its guided chunks would be one element anyway.
IN_ORDER_UP_TO = 4
#: Guided chunks take ``1 / (GUIDED_SHARE * workers)`` of the elements left:
#: few claims for fast kernels, and one-element chunks at the end.
GUIDED_SHARE = 2
#: Chunks per worker of a map summed on the host: fixed bounds (sums that do
#: not depend on timing), a few per worker for balance.
FIXED_CHUNKS_PER_WORKER = 2
#: Chunks per worker, and bytes of operands and results per chunk at most, of a
#: vectorized map whose chunk length is automatic.
VECTOR_CHUNKS_PER_WORKER = 4
VECTOR_CHUNK_BYTES = 16 * 2**20
#: Tasks in flight per worker of an executor that pickles work: one running,
#: one queued.
REMOTE_IN_FLIGHT_PER_WORKER = 2


@dataclasses.dataclass
class Measure:
    """What a map on threads has learned of its elements from its chunks."""

    #: Seconds per element, from the last chunk measured (0: none yet).
    per_element: float = 0.0
    #: Chunks in a row of a limited map that found the elements slow or waiting.
    votes: int = 0


def runs_inline(units: int, last: Measure | None, shared: bool) -> bool:
    """Whether a map on the shared threads runs on the thread that started it,
    from the time per element of the last map of its equation (``last``); it
    gets every thread once it has run :data:`INLINE_SECONDS` (:class:`.jobs.Job`)."""
    per = last.per_element if shared and last else 0.0
    return 0.0 < per < SLOW_ELEMENT and per * units < INLINE_SECONDS


def fixed_chunk(units: int, workers: int) -> int | None:
    """Elements per chunk of a map summed on the host (fixed bounds)."""
    return -(-units // (FIXED_CHUNKS_PER_WORKER * workers)) if units else None


def runs_in_order(
    asked: bool, units: int, workers: int, on_threads: bool, sums: bool
) -> bool:
    """Whether a map runs one element per claim in index order: asked for, or
    small (:data:`IN_ORDER_UP_TO`), on threads and not summed on the host
    (whose chunk bounds must not change with the map's size)."""
    return asked or (on_threads and not sums and units <= IN_ORDER_UP_TO * workers)


def starts_limited(
    units: int, workers: int, cpus: int, nested: bool, on_threads: bool
) -> bool:
    """Whether a guided map starts on one thread per CPU: a large map on threads,
    more of them than CPUs, not started from a kernel (whose waiting thread
    works on it)."""
    large = units > IN_ORDER_UP_TO * workers
    return on_threads and not nested and large and cpus < workers


def chunk_size(remaining: int, workers: int, measure: Measure, limited: bool) -> int:
    """Elements in the next guided chunk of a map on ``workers`` threads: one
    until one has been timed, then ``remaining // (GUIDED_SHARE * workers)``, at
    most :data:`MAX_CHUNK_SECONDS` of work, and on a limited map at least
    :data:`MIN_CHUNK_SECONDS`."""
    per = measure.per_element
    if per <= 0.0:
        return 1
    size = remaining // (GUIDED_SHARE * workers)
    if limited:
        size = max(size, int(MIN_CHUNK_SECONDS / per))
    return max(1, min(size, int(MAX_CHUNK_SECONDS / per)))


def inline_chunk(spent: float, measure: Measure) -> int:
    """Elements in the next chunk of a map run inline, once one is timed: what
    fits in the rest of its :data:`INLINE_SECONDS` (``spent``: seconds so far)."""
    return max(1, int((INLINE_SECONDS - spent) / measure.per_element))


def record_chunk(
    measure: Measure, elements: int, wall: float, cpu: float, threads: int
) -> bool:
    """Records a chunk of a limited map that took ``wall`` seconds (``cpu`` on a
    CPU) on one of ``threads``; whether the map now gets every thread
    (:data:`SLOW_VOTES` chunks in a row slow or waiting)."""
    measure.per_element = per = max(wall / elements, 1e-9)
    waits = cpu * threads < WAIT_SHARE * wall
    measure.votes = measure.votes + 1 if per >= SLOW_ELEMENT or waits else 0
    return measure.votes >= SLOW_VOTES


def record_time(measure: Measure, elements: int, wall: float) -> None:
    """Records a chunk of a map on every thread that took ``wall`` seconds."""
    measure.per_element = max(wall / elements, 1e-9)


def vector_chunk_length(
    n: int, workers: int, element_bytes: int, max_chunk: int | None = None
) -> int:
    """Elements per call of a vectorized kernel: :data:`VECTOR_CHUNKS_PER_WORKER`
    chunks per worker, at most :data:`VECTOR_CHUNK_BYTES` and ``max_chunk``."""
    length = -(-n // (VECTOR_CHUNKS_PER_WORKER * workers))
    length = min(length, max(1, VECTOR_CHUNK_BYTES // max(1, element_bytes)))
    if max_chunk is not None:
        length = min(length, max_chunk)
    return max(1, length)


def remote_in_flight(workers: int | None) -> int:
    """Tasks in flight on an executor that pickles work."""
    return (
        REMOTE_IN_FLIGHT_PER_WORKER * workers if workers else UNKNOWN_WORKERS_IN_FLIGHT
    )


def remote_chunk_size(per_element: float | None, remaining: int, in_flight: int) -> int:
    """Elements per task shipped to an executor that pickles work: one until an
    element has been timed, then :data:`TASK_SECONDS_REMOTE` of work, at most an
    even share of what is left, at least :data:`MIN_TASK_SECONDS_REMOTE`."""
    if per_element is None:
        return 1
    per_element = max(per_element, 1e-9)
    size = int(TASK_SECONDS_REMOTE / per_element)
    least = int(MIN_TASK_SECONDS_REMOTE / per_element)
    return max(1, min(size, max(least, -(-remaining // in_flight))))
