"""The machine, as both wings size their threads by it."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)
