"""What the current trace says: whether the caller is under one, and the
explicit mesh axes that the vmaps around it map over (on the hooks of :mod:`.hooks`).
"""

from __future__ import annotations

from .hooks import RESOLVED


def vmapped_mesh_axes() -> frozenset[str]:
    """The explicit mesh axes that the vmaps around the current trace map over."""
    return RESOLVED["trace_ctx"]()  # (a Missing raises by name when called)


def trace_state_clean() -> bool:
    """Whether the caller is outside every trace (``jit``, ``vmap``...)."""
    return bool(RESOLVED["trace_state_clean"]())
