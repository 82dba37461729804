"""jax_threadmap: fast host code inside JAX programs.

One flat, threaded map per host callback, however deeply it is ``vmap``-ed.
"""

from ._api import threadmap as threadmap
from ._primitive import threadmap_p as threadmap_p

__version__ = "0.1.0.dev0"

__all__ = [
    "threadmap",
    "threadmap_p",
]
