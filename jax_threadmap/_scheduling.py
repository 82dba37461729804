"""Scheduling policy: the numbers that decide chunk sizes and threads per map.

Every threshold of the executor layer is a named constant here, with its reason.
"""

from __future__ import annotations

import os

#: Seconds of kernel work per task that amortise the per-task cost of an executor
#: that pickles work (about 1 ms for a process pool or Dask).
TASK_SECONDS_REMOTE = 0.05
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
#: call that fills a cache, a thread that lost its CPU for a moment).
SLOW_VOTES = 2
#: While a map holds fewer threads than its executor has: seconds of work in a
#: chunk at least (measuring one costs a few us) and at most (so that a map
#: whose elements turn slow can still spread what is left over every thread).
MIN_CHUNK_SECONDS = 200e-6
MAX_CHUNK_SECONDS = 10e-3
#: Seconds a chunk of a map on fewer threads may run before the thread that
#: waits for the map gives it every thread: elements that wait for each other
#: (at a barrier, for replies that come once all requests are out) all start.
STUCK_CHUNK = 0.05
#: Elements per executor thread from which a map starts on fewer threads. A
#: smaller map runs as it did before maps were limited: on every thread at once,
#: mostly one element per chunk, so that elements which wait for each other all
#: start whatever else runs on the executor; its few elements cost little on
#: many threads.
LIMITED_FROM = 4


def available_cpus() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)
