"""jax_threadmap: fast host code inside JAX programs.

One flat, threaded map per host callback, however deeply it is ``vmap``-ed.
"""

import importlib.metadata

from ._api import KernelFunction as KernelFunction
from ._api import kernel as kernel
from ._api import threadmap as threadmap
from ._arrays import AsyncArray as AsyncArray
from ._arrays import async_call as async_call
from ._arrays import deferred_call as deferred_call
from ._async_threads import async_pool_status as async_pool_status
from ._compat import UnsupportedJaxError as UnsupportedJaxError
from ._dispatch import async_dispatch_status as async_dispatch_status
from ._errors import ExecutorError as ExecutorError
from ._errors import KernelError as KernelError
from ._errors import ThreadmapError as ThreadmapError
from ._inner_threads import limit_inner_threads as limit_inner_threads
from ._primitive import threadmap_p as threadmap_p
from ._scheduling import InOrder as InOrder
from ._shard_loads import async_array_from_callback as async_array_from_callback

try:
    __version__ = importlib.metadata.version("jax_threadmap")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    __version__ = "0+unknown"

__all__ = [
    "AsyncArray",
    "ExecutorError",
    "InOrder",
    "KernelError",
    "KernelFunction",
    "ThreadmapError",
    "UnsupportedJaxError",
    "async_array_from_callback",
    "async_call",
    "async_dispatch_status",
    "async_pool_status",
    "deferred_call",
    "kernel",
    "limit_inner_threads",
    "threadmap",
    "threadmap_p",
]
