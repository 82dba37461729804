"""Scheduling policy: what size the next chunk is, how many threads a map
gets, and which maps run in index order.

Pure functions of what a map has measured (:class:`Measure`) and of its size,
which their callers (:mod:`._jobs`, :mod:`._maps`) pass in, so that each
decision is tested with made-up times rather than sleeps. Every threshold is a
named constant here, with its reason; the docs quote them through
``tests/test_scheduling.py``, which fails when the prose and the numbers part.

Timings decide only *how fast* a map runs (chunk sizes, thread counts), never
*whether* it finishes. Which elements run, and in what order, is decided before
the map starts, from its size and the user's request:

- *in index order* (:func:`runs_in_order`): one element per claim, in index
  order, on every thread of the executor at once, as ``ThreadPoolExecutor.map``
  does, with no clock read. The user asks for it with :class:`InOrder`, and a
  small map (at most :data:`IN_ORDER_UP_TO` elements per thread) runs so
  anyway. Elements that wait for each other in groups of at most as many
  elements as the executor has threads always finish there: the elements
  claimed and not done are a run of consecutive indices, and a group's last
  element is claimed as soon as a thread is free.
- *guided chunks* otherwise: a share of what is left (:func:`chunk_size`), at
  most :data:`MAX_CHUNK_SECONDS` of the work measured so far, one element until
  one has been timed. A large map on an executor with more threads than CPUs
  starts on one thread per CPU (:func:`starts_limited`: threads taking turns
  at the GIL made ``benchmarks/compare_revisions.py`` "4096 el, executor=32"
  1.33-1.42x as long) and gets every thread once :data:`SLOW_VOTES` chunks in
  a row find its elements slow or waiting (:func:`record_chunk`: without it
  the "sleep 1 ms" case took 15x as long). Elements that wait for each other
  may wait for good here: chunk bounds come from timings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from .._support.cpus import available_cpus

K = TypeVar("K")

#: Seconds of kernel work per task that amortise the per-task cost of an executor
#: that pickles work (about 1 ms for a process pool or Dask).
TASK_SECONDS_REMOTE = 0.05
#: Seconds of kernel work that a task of an executor that pickles work holds at
#: least, also at the end of a map: a round trip to a worker costs more than the
#: balance that smaller tasks would buy (about 1 ms, tens of ms on a busy cluster).
MIN_TASK_SECONDS_REMOTE = 0.01
#: Tasks in flight when an executor does not say how many workers it has.
UNKNOWN_WORKERS_IN_FLIGHT = 128
#: Workers assumed, for chunk sizes, of an executor that does not say.
UNKNOWN_WORKERS = 8
#: Seconds a shared thread waits for work before it exits. Long enough that maps
#: called in a loop keep their threads (starting one costs about 50 us), short
#: enough that a burst of maps on many pool sizes leaves no crowd of idle threads.
IDLE_TIMEOUT = 2.0
#: Seconds that interpreter exit waits, in all, for kernels still running. A
#: kernel blocked for good (a read with no timeout) costs the exit this much, not
#: a join per thread.
EXIT_GRACE = 1.0
#: Seconds per element from which a map gets all its executor's threads: the
#: time threads spend taking turns is then small beside each element, and a
#: kernel that waits (a network read) gains from every thread.
SLOW_ELEMENT = 200e-6
#: A map gets all its executor's threads when its threads were on a CPU for
#: less than this share of their time, summed over the threads the map holds:
#: its elements wait rather than compute (sleeps, I/O). Threads that take turns
#: at the GIL add up to about one CPU; a 50 us sleep to about 0.1 per thread.
WAIT_SHARE = 0.5
#: Chunks in a row that must find the elements slow, or waiting, before a map
#: gets all its threads: one chunk may be slow for reasons of its own (a first
#: call that fills a cache, a thread that lost its CPU for a moment). With 1,
#: ``compare_revisions.py`` "100k el, the first slow" takes 9.3x as long.
SLOW_VOTES = 2
#: While a map holds fewer threads than its executor has: seconds of work in a
#: chunk at least (measuring one costs a few us; the same number as
#: ``SLOW_ELEMENT`` by coincidence, not by rule). Any map on threads: seconds of
#: work in a chunk at most, from the last chunk's time per element, so that
#: slow elements spread over every thread rather than queue in one thread's
#: chunk (a map whose first elements are slow: guided chunks of a share of
#: what is left would pack them onto a few threads).
MIN_CHUNK_SECONDS = 200e-6
MAX_CHUNK_SECONDS = 10e-3
#: Elements per executor thread up to which a map on threads runs in index
#: order, on every thread at once (:func:`runs_in_order`); a larger one on an
#: executor with more threads than CPUs starts limited. Guided chunks of so
#: small a map would be one element each anyway (:data:`GUIDED_SHARE`), and
#: its few elements cost little on many threads.
IN_ORDER_UP_TO = 4
#: Guided chunks take ``1 / (GUIDED_SHARE * workers)`` of the elements left:
#: fast kernels run in about ``GUIDED_SHARE`` large chunks per thread (few
#: claims), and the last chunks shrink to one element (no thread idles at the
#: end while another runs a long chunk). With fewer than ``2 * GUIDED_SHARE``
#: elements per thread left, every chunk is one element.
GUIDED_SHARE = 2
#: Chunks per worker of a map whose outputs are summed on the host: fixed bounds
#: (sums that do not depend on timing), a few per worker for balance.
FIXED_CHUNKS_PER_WORKER = 2
#: Chunks per worker of a vectorized map whose chunk length is automatic: enough
#: that every worker stays busy when chunks take unequal time.
VECTOR_CHUNKS_PER_WORKER = 4
#: Bytes of operands and results that one chunk of a vectorized kernel may touch
#: when its length is automatic: big enough that the per-call cost vanishes,
#: small enough that copies of chunks stay far below the batch's size.
VECTOR_CHUNK_BYTES = 16 * 2**20
#: Tasks in flight per worker of an executor that pickles work: one running and
#: one queued, so that no worker waits for a round trip between tasks.
REMOTE_IN_FLIGHT_PER_WORKER = 2
#: Weight of the older estimate in the moving average of an element's seconds
#: (executors that pickle work): each task's measure counts half, so one odd
#: task moves the estimate only halfway.
SMOOTHING = 0.5


def SPARE_THREADS() -> int:  # noqa: N802 - a constant of the machine
    """Shared threads that may be neither idle nor running a kernel before a map
    waits for them rather than start new ones: one per CPU. A thread done with a
    map's chunks takes the next queued map a moment later; starting a thread
    instead, for maps called in a loop, left hundreds of threads for 50 kernels
    at once. So the threads alive stay at most the kernels running plus this."""
    return available_cpus()


@dataclasses.dataclass(frozen=True)
class InOrder:
    """``executor=InOrder(executor)``: the map runs its elements one per claim,
    in index order, on every thread of ``executor`` at once, as
    ``ThreadPoolExecutor.map`` does. No decision reads a clock.

    For maps whose elements wait for each other (at a barrier, for replies that
    come once every request is out): such a map finishes whenever each group of
    elements that wait for each other has no more elements than ``executor``
    has threads. Without it, a large map takes chunks of several elements sized
    from timings, and a thread may wait at one element of a group for another
    queued behind it in its own chunk, for good (docs/executors.md).

    Args:
        executor: Where the elements run, as for [`threadmap`][jax_threadmap.threadmap]:
            ``None`` (the shared pool), an int (a shared pool of that many
            threads) or a ``concurrent.futures.Executor``.

    Examples:
        >>> import threading
        >>> import jax, jax.numpy as jnp
        >>> from jax_threadmap import InOrder, threadmap
        >>> pairs = [threading.Barrier(2, timeout=60) for _ in range(32)]
        >>> def meet(i):  # elements 2k and 2k + 1 wait for each other
        ...     pairs[int(i) // 2].wait()
        ...     return i
        >>> f = jax.vmap(lambda i: threadmap(
        ...     meet, jax.ShapeDtypeStruct((), jnp.int32), i, executor=InOrder(4)))
        >>> int(f(jnp.arange(64, dtype=jnp.int32)).sum())
        2016
    """

    executor: Any = None


@dataclasses.dataclass
class Measure:
    """What a map on threads has learned of its elements from its chunks."""

    #: Seconds per element, from the last chunk measured (0: none yet).
    per_element: float = 0.0
    #: Chunks in a row of a limited map that found the elements slow or waiting.
    votes: int = 0


def guided_divisor(workers: int) -> int:
    """Guided chunks take ``1 / guided_divisor(workers)`` of what is left."""
    return GUIDED_SHARE * workers


def fixed_chunk(units: int, workers: int) -> int | None:
    """Elements per chunk of a map summed on the host (fixed bounds)."""
    return -(-units // (FIXED_CHUNKS_PER_WORKER * workers)) if units else None


def runs_in_order(
    asked: bool, units: int, workers: int, on_threads: bool, sums: bool
) -> bool:
    """Whether a map runs one element per claim in index order on every thread:
    the user asked (:class:`InOrder`), or a small map on threads (at most
    :data:`IN_ORDER_UP_TO` elements per thread) whose outputs are not summed
    on the host (those keep fixed chunk bounds, so that the sums do not change
    with the size of the map)."""
    small = on_threads and not sums and units <= IN_ORDER_UP_TO * workers
    return asked or small


def starts_limited(
    units: int, workers: int, cpus: int, nested: bool, on_threads: bool
) -> bool:
    """Whether a guided map starts on one thread per CPU: a large map (more than
    :data:`IN_ORDER_UP_TO` elements per thread) on an executor with more
    threads than CPUs, not started from a kernel (the thread that waits for a
    nested map works on it, and a limit would leave its executor idle)."""
    large = units > IN_ORDER_UP_TO * workers
    return on_threads and not nested and large and cpus < workers


def chunk_size(remaining: int, divisor: int, measure: Measure, limited: bool) -> int:
    """Elements in the next guided chunk of a map with ``remaining`` left.

    One element until one has been timed (the first elements' time says
    little, and slow first elements must not queue in one chunk); then the
    share of what is left, at most :data:`MAX_CHUNK_SECONDS` of work, so that
    slow elements spread over every thread; on a limited map at least
    :data:`MIN_CHUNK_SECONDS` of work (its chunks are timed)."""
    per = measure.per_element
    if per <= 0.0:
        return 1
    size = remaining // divisor
    if limited:
        size = max(size, int(MIN_CHUNK_SECONDS / per))
    return max(1, min(size, int(MAX_CHUNK_SECONDS / per)))


def record_chunk(
    measure: Measure, elements: int, wall: float, cpu: float, threads: int
) -> bool:
    """Records a chunk of a limited map that took ``wall`` seconds (``cpu`` on a
    CPU) on one of ``threads``; returns whether the map now gets every thread:
    :data:`SLOW_VOTES` chunks in a row found its elements slow
    (:data:`SLOW_ELEMENT`) or waiting (:data:`WAIT_SHARE`). Only speed rests on
    this: a map that never gets every thread finishes on the ones it has."""
    measure.per_element = per = max(wall / elements, 1e-9)
    waits = cpu * threads < WAIT_SHARE * wall
    measure.votes = measure.votes + 1 if per >= SLOW_ELEMENT or waits else 0
    return measure.votes >= SLOW_VOTES


def record_time(measure: Measure, elements: int, wall: float) -> None:
    """Records a chunk of a map on every thread that took ``wall`` seconds."""
    measure.per_element = max(wall / elements, 1e-9)


def steal_split(running: dict[K, tuple[int, int]]) -> tuple[K, int] | None:
    """Which running chunk a thread that found nothing left to claim takes the
    tail of, and where that chunk would then stop: ``(key, split)``.

    ``running`` maps each chunk (any key) to ``(current, stop)``: the element its
    loop last published (``_claims.Cursor``) and where the chunk stops. The chunk
    with the most elements not yet started gives up all of them, from the one
    after ``current``: an element that waits for the next one (a barrier of
    adjacent elements) then finds it run by another thread rather than queued
    behind it in its own chunk, and a chunk slow to finish gives its rest to
    idle threads. ``None`` when no chunk has an element not yet started.
    """
    best: tuple[K, int] | None = None
    left = 0
    for key, (current, stop) in running.items():
        if stop - (current + 1) > left:
            best, left = (key, current + 1), stop - (current + 1)
    return best


def vector_chunk_length(
    n: int, workers: int, element_bytes: int, max_chunk: int | None = None
) -> int:
    """Elements per call of a vectorized kernel.

    :data:`VECTOR_CHUNKS_PER_WORKER` chunks per worker keep every worker busy
    when chunks take unequal time; :data:`VECTOR_CHUNK_BYTES` bounds the memory
    of one chunk; the user's ``max_chunk`` bounds it further (memory-hungry
    kernels).
    """
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
    element has been timed, then about :data:`TASK_SECONDS_REMOTE` of work, and
    no more than an even share of what is left over the tasks in flight, but at
    least :data:`MIN_TASK_SECONDS_REMOTE` of work."""
    if per_element is None:
        return 1
    per_element = max(per_element, 1e-9)
    size = int(TASK_SECONDS_REMOTE / per_element)
    least = int(MIN_TASK_SECONDS_REMOTE / per_element)
    return max(1, min(size, max(least, -(-remaining // in_flight))))


def smoothed(old: float | None, new: float) -> float:
    """The moving average of an element's seconds (:data:`SMOOTHING`)."""
    return new if old is None else SMOOTHING * old + (1 - SMOOTHING) * new
