"""Array-like types that ``jit`` accepts before their data exists (on the hooks
of :mod:`.hooks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .hooks import RESOLVED, Missing


def register_array_like(
    cls: type,
    aval_of: Callable[[Any], Any],
    arrays_of: Callable[[list[Any]], list[Any]],
) -> None:
    """Lets instances of ``cls`` be passed to ``jit`` before their data exists.

    ``aval_of(x)`` returns the abstract value (used to trace and compile);
    ``arrays_of(xs)`` returns one ``jax.Array`` per ``x`` and is called only when
    a compiled program runs with them (JAX's ``shard_args`` then puts each in
    the layout the program expects, as for a ``jax.Array``). A jitted function
    that closes over one embeds its value (``np.asarray(x)``) when lowered.
    Registers nothing where a hook is missing (``require(ASYNC_ARRAYS, ...)`` then
    fails before such an array is made).
    """
    needed = ("pytype_aval_mappings", "canonicalize_value", "shard_arg_handlers")
    constants = "register_constant_handler"
    if any(
        isinstance(RESOLVED[n], Missing) for n in (*needed, "shard_args", constants)
    ):
        return
    RESOLVED["pytype_aval_mappings"][cls] = aval_of
    RESOLVED["canonicalize_value"](cls)
    RESOLVED[constants](cls, np.asarray)  # waits in Python (cls.__array__)

    def handler(xs: Any, shardings: Any, layouts: Any, copy_semantics: Any) -> Any:
        arrays = arrays_of(list(xs))
        return RESOLVED["shard_args"](shardings, layouts, copy_semantics, arrays)

    RESOLVED["shard_arg_handlers"][cls] = handler
