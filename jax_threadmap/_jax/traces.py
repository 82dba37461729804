"""What the current trace says: whether the caller is under one (on the hooks
of :mod:`.hooks`).
"""

from __future__ import annotations

from .hooks import RESOLVED


def trace_state_clean() -> bool:
    """Whether the caller is outside every trace (``jit``, ``vmap``...)."""
    return bool(RESOLVED["trace_state_clean"]())
