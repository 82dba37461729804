"""jax_threadmap: fast host code inside JAX programs.

One flat, threaded map per host callback, however deeply it is ``vmap``-ed.
"""

import importlib.metadata
import typing as _typing

from ._arrays.async_array import AsyncArray as AsyncArray
from ._arrays.async_array import async_call as async_call
from ._arrays.async_pool import async_pool_status as async_pool_status
from ._arrays.shard_loads import async_array_from_callback as async_array_from_callback
from ._core.api import KernelFunction as KernelFunction
from ._core.api import kernel as kernel
from ._core.binding import threadmap as threadmap
from ._core.params import InOrder as InOrder
from ._core.primitive import threadmap_p as threadmap_p
from ._coroutines.loop_resources import Shared as Shared
from ._coroutines.loop_resources import shared as shared
from ._host.inner_threads import limit_inner_threads as limit_inner_threads
from ._jax.hooks import UnsupportedJaxError as UnsupportedJaxError
from ._support import removed as _removed
from ._support.environment import check_environment as _check_environment
from ._support.errors import ExecutorError as ExecutorError
from ._support.errors import KernelError as KernelError
from ._support.errors import ThreadmapError as ThreadmapError

try:
    __version__ = importlib.metadata.version("jax_threadmap")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    __version__ = "0+unknown"

# Removed names raise an AttributeError naming what replaced them (as long as
# CHANGELOG.md lists them); a bad JAX_THREADMAP_* value fails here, at import.
_removed.install(globals())
_check_environment()
if not _typing.TYPE_CHECKING:  # (type checkers see no removed name)
    __getattr__ = _removed.package_getattr

__all__ = [
    "AsyncArray",
    "ExecutorError",
    "InOrder",
    "KernelError",
    "KernelFunction",
    "Shared",
    "ThreadmapError",
    "UnsupportedJaxError",
    "async_array_from_callback",
    "async_call",
    "async_pool_status",
    "kernel",
    "limit_inner_threads",
    "shared",
    "threadmap",
    "threadmap_p",
]
