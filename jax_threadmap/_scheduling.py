"""Scheduling policy: what size the next chunk is, when a map gets every thread,
when a chunk counts as stuck.

Pure functions of what a map has measured (:class:`Measure`) and the clocks'
readings, which their callers (:mod:`._jobs`, :mod:`._maps`) pass in, so
that each decision is tested with made-up times rather than sleeps. Every
threshold is a named constant here, with its reason and the test or benchmark
that fails without it; the docs quote them through ``tests/test_scheduling.py``,
which fails when the prose and the numbers part.

The heuristics, each shown necessary by switching it off:

- a large map on an executor with more threads than CPUs starts *limited*, on
  one thread per CPU (:func:`starts_limited`): ``benchmarks/compare_revisions.py``
  "4096 el, executor=32" and "ThreadPoolExecutor(32)" take 1.33-1.42x as long on
  every thread (threads taking turns at the GIL);
- one limited map at a time per executor (``_jobs.LimitedGate``):
  ``test_two_large_maps_whose_elements_wait_for_each_other`` hangs without it;
- *slow-element votes* raise a limited map to every thread
  (:func:`record_chunk`): without them the "sleep 1 ms" case of
  ``compare_revisions.py`` takes 15x as long (one thread per CPU), "sleep 50 us"
  3.5x; with one vote instead of :data:`SLOW_VOTES`, "100k el, the first slow"
  takes 9.3x as long (its first chunk alone raises it);
- the *stuck-chunk watch* (:data:`STUCK_CHUNK`) raises it when a chunk runs too
  long: ``test_pairs_that_wait_for_each_other`` and
  ``test_elements_that_wait_for_each_other_all_start`` hang without it;
- once raised, a map runs one element per claim in index order (:func:`rise`):
  without it every case of ``test_pairs_that_wait_for_each_other`` hung, in 3
  runs of 3 under two busy loops. Its threads draw the elements from one shared
  range iterator, without the job's lock (``_jobs.Job._run_in_order``);
- a large map on no more threads than CPUs, or a nested one, *probes*
  (:func:`starts_probing`, :func:`record_probe`): one element per claim in
  index order, each timed, until :func:`fast_run` fast elements in a row give
  it guided chunks; without it the 8- and 16-CPU cases of
  ``test_pairs_that_wait_for_each_other`` wait until their barriers break.

The watch has no period of its own: the waiting thread wakes when the oldest
running chunk reaches :data:`STUCK_CHUNK` (``_jobs.Job.poll``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TypeVar

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
#: Seconds a chunk of a map on fewer threads may run before the thread that
#: waits for the map gives it every thread, one element per claim from then on
#: (see :func:`rise`): elements that wait for each other (at a barrier, for
#: replies that come once all requests are out) all start, and none waits
#: behind another in its own thread's chunk. The waiting thread wakes when the
#: oldest running chunk reaches this age, not on a period. Without the watch,
#: ``tests/test_scheduling_defects.py::test_pairs_that_wait_for_each_other``
#: waits until its barriers break: a limited map's threads all wait at a pair.
STUCK_CHUNK = 0.05
#: Elements per executor thread from which a map starts on fewer threads (or,
#: on an executor with no more threads than CPUs, probing: see
#: :func:`starts_probing`). A smaller map runs as it did before maps were
#: limited: on every thread at once, mostly one element per chunk, so that
#: elements which wait for each other all start whatever else runs on the
#: executor; its few elements cost little on many threads.
LIMITED_FROM = 4
#: Seconds under which an element of a probing map counts as fast (if its
#: thread was also on a CPU for at least ``WAIT_SHARE`` of them): chunks of
#: several elements then save a claim per element, about a tenth of a trivial
#: kernel's time in index order (``benchmarks/compare_revisions.py``
#: signatures). Longer elements run in index order, where the claim costs them
#: under 1% and no element waits behind another in a chunk.
FAST_ELEMENT = 20e-6
#: Elements in a row, per executor thread, that must be fast before a probing
#: map takes chunks of several elements. Elements that wait for each other in
#: groups cannot do it: each group's last element returns at once, the others
#: wait, and fewer groups than threads run at a time, so at most about one
#: fast element per thread comes between two that waited. With 0 (8 in a
#: row whatever the threads), 256 elements in pairs on ``executor=32`` with 32
#: CPUs waited until their barriers broke in 1 run of 12
#: (``test_pairs_that_wait_for_each_other``, 32 CPUs).
FAST_RUN_PER_WORKER = 2
#: The least of those elements in a row, for executors of one or two threads.
#: With 0 as well (the probe ends at its first element), every 8- and 16-CPU
#: case of ``test_pairs_that_wait_for_each_other`` waits until its barriers
#: break.
FAST_RUN_MIN = 8
#: A probing map that has run this many runs' worth of elements
#: (``PROBE_RUNS * fast_run(workers)``) without a fast run stops timing them
#: and runs in index order to the end, claiming without the job's lock.
PROBE_RUNS = 4
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


def available_cpus() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


@dataclasses.dataclass
class Measure:
    """What a map on threads has learned of its elements from its chunks."""

    #: Seconds per element, from the last chunk measured (0: none yet).
    per_element: float = 0.0
    #: Chunks in a row that found the elements slow or waiting.
    votes: int = 0
    #: One element per claim in index order, to the end: the map rose to every
    #: thread (:func:`rise`) or a probe found its elements slow or waiting
    #: (:func:`record_probe`).
    one_each: bool = False
    #: One element per claim in index order, each timed, until a run of fast
    #: ones (:func:`record_probe`).
    probing: bool = False
    #: Elements of a probing map in a row that were fast.
    fast: int = 0
    #: Elements of a probing map timed so far.
    probed: int = 0


def guided_divisor(workers: int) -> int:
    """Guided chunks take ``1 / guided_divisor(workers)`` of what is left."""
    return GUIDED_SHARE * workers


def fixed_chunk(units: int, workers: int) -> int | None:
    """Elements per chunk of a map summed on the host (fixed bounds)."""
    return -(-units // (FIXED_CHUNKS_PER_WORKER * workers)) if units else None


def starts_limited(
    units: int, workers: int, cpus: int, nested: bool, on_threads: bool
) -> bool:
    """Whether a map starts on one thread per CPU: a large map (see
    :data:`LIMITED_FROM`) on an executor with more threads than CPUs.

    A small map and a nested one take every thread at once, since their
    elements may wait on each other (and the thread that waits for a nested
    map runs a kernel and watches nothing)."""
    large = units > LIMITED_FROM * workers
    return on_threads and not nested and large and cpus < workers


def starts_probing(
    units: int, workers: int, cpus: int, nested: bool, on_threads: bool
) -> bool:
    """Whether a map starts *probing*: every thread of its executor at once, one
    element per claim in index order, each timed (:func:`record_probe`).

    A large map on threads that does not start limited: on an executor with no
    more threads than CPUs (``executor=None``, ``executor=8`` on 8 CPUs), or a
    nested one. No thread is spare there to take the rest of a chunk whose
    thread waits at one element for the next, queued behind it: 64 elements
    where ``2k`` and ``2k + 1`` wait for each other, on ``executor=8`` with 8
    CPUs, waited for good with guided chunks from the start
    (``test_pairs_that_wait_for_each_other``), and finish in index order, as
    with ``ThreadPoolExecutor(8).map``."""
    large = units > LIMITED_FROM * workers
    limited = starts_limited(units, workers, cpus, nested, on_threads)
    return on_threads and large and not limited


def fast_run(workers: int) -> int:
    """Fast elements in a row after which a probing map takes chunks of several
    (:data:`FAST_RUN_PER_WORKER`, :data:`FAST_RUN_MIN`)."""
    return max(FAST_RUN_MIN, FAST_RUN_PER_WORKER * workers)


def chunk_size(remaining: int, divisor: int, measure: Measure, limited: bool) -> int:
    """Elements in the next guided chunk of a map with ``remaining`` left.

    A limited map takes one element until an element has been timed, then the
    share of what is left that it would take on every thread, between
    :data:`MIN_CHUNK_SECONDS` and :data:`MAX_CHUNK_SECONDS` of work: the first
    elements' time says little of the later ones'. Any other guided map takes
    the share of what is left, at most :data:`MAX_CHUNK_SECONDS` of work once an
    element has been timed; a map that had a stuck chunk, one element."""
    per = measure.per_element
    if measure.one_each or measure.probing or (limited and per <= 0.0):
        return 1
    size = remaining // divisor
    if limited:
        size = max(size, int(MIN_CHUNK_SECONDS / per))
    if per > 0.0:
        size = min(size, int(MAX_CHUNK_SECONDS / per))
    return max(1, size)


def record_chunk(
    measure: Measure, elements: int, wall: float, cpu: float, threads: int
) -> bool:
    """Records a chunk of a limited map that took ``wall`` seconds (``cpu`` on a
    CPU) on one of ``threads``; returns whether the map now gets every thread:
    :data:`SLOW_VOTES` chunks in a row found its elements slow
    (:data:`SLOW_ELEMENT`) or waiting (:data:`WAIT_SHARE`)."""
    measure.per_element = per = max(wall / elements, 1e-9)
    waits = cpu * threads < WAIT_SHARE * wall
    measure.votes = measure.votes + 1 if per >= SLOW_ELEMENT or waits else 0
    return measure.votes >= SLOW_VOTES


def rise(measure: Measure) -> None:
    """A limited map gets every thread (its elements proved slow or waiting, or
    a chunk was stuck): from now on every chunk is one element, claimed in index
    order, and the running chunks give back the elements they have not started
    (``_jobs.Job``). The map then runs as ``ThreadPoolExecutor.map`` does, so
    that elements that wait for each other meet. With chunks of several
    elements on every thread, each thread could wait at the first element of a
    pair for the second, queued behind it in its own chunk, with no thread left
    to take it (2-3 runs in 10 of 64 pairs on ``executor=8``, under load;
    ``test_pairs_that_wait_for_each_other`` fails so without this)."""
    measure.one_each = True


def record_probe(measure: Measure, wall: float, cpu: float, workers: int) -> bool:
    """Records one element of a probing map, which took ``wall`` seconds (``cpu``
    of them on a CPU) on an executor of ``workers`` threads; returns whether the
    map now runs in index order to the end.

    An element is fast when it took less than :data:`FAST_ELEMENT` and its
    thread was on a CPU for at least :data:`WAIT_SHARE` of it (it did not wait:
    for another element, a lock, a sleep). After :func:`fast_run` fast elements
    in a row the map stops probing and takes guided chunks (a slow first
    element, a thread that lost its CPU for a moment, only restart the run).
    After :data:`PROBE_RUNS` runs' worth of elements without one, its elements
    wait or take long, and it runs in index order to the end, untimed."""
    measure.per_element = max(wall, 1e-9)
    measure.probed += 1
    fast = wall < FAST_ELEMENT and cpu >= WAIT_SHARE * wall
    measure.fast = measure.fast + 1 if fast else 0
    run = fast_run(workers)
    if measure.fast >= run:
        measure.probing = False
    elif measure.probed >= PROBE_RUNS * run:
        measure.probing = False
        measure.one_each = True
        return True
    return False


def record_time(measure: Measure, elements: int, wall: float) -> None:
    """Records a chunk of a map on every thread that took ``wall`` seconds."""
    measure.per_element = max(wall / elements, 1e-9)


def is_stuck(started: float, now: float) -> bool:
    """Whether a chunk of a limited map started at ``started`` (wall clock) has
    run long enough that the map gets every thread (:data:`STUCK_CHUNK`)."""
    return now - started >= STUCK_CHUNK


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
