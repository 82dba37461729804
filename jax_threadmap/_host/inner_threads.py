"""Limits the threads that kernels start themselves (BLAS, OpenMP) during maps.

The default pool runs one kernel per CPU. A kernel that calls a threaded BLAS
(NumPy's ``@``, ``np.linalg``, most of SciPy's linear algebra) or OpenMP code
starts threads of its own on top, one per CPU by default, and N kernels with N
threads each oversubscribe N CPUs. joblib limits its workers' inner threads the
same way (``inner_max_num_threads``), through threadpoolctl.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_USER_APIS = (None, "blas", "openmp")


@contextlib.contextmanager
def limit_inner_threads(
    limit: int = 1, *, user_api: str | None = None
) -> Iterator[None]:
    """Limits the BLAS and OpenMP threads of the kernels that run in the block.

    Opt-in and off by default: outside the block, libraries keep their own thread
    counts. The limit is process-wide (BLAS and OpenMP libraries have one setting
    per process) and is restored when the block ends. A jitted call returns
    before its map has run, so wait for its result inside the block
    (``.block_until_ready()``). Thread counts that a kernel passes explicitly,
    such as ``scipy.fft``'s ``workers=`` or a gridder's ``nthreads=``, are the
    kernel's to choose: see the docs' page on kernels that thread themselves.

    Args:
        limit: The threads each BLAS or OpenMP call may use (at least 1).
        user_api: ``"blas"`` or ``"openmp"`` to limit only those libraries;
            ``None`` (default) limits both.

    Yields:
        Nothing; the limit holds until the block ends.

    Raises:
        TypeError: ``limit`` is not an ``int``.
        ValueError: ``limit`` is below 1, or ``user_api`` is not one of the above.
        ModuleNotFoundError: threadpoolctl is not installed.

    Examples:
        >>> import jax, numpy as np
        >>> import jax_threadmap as jtm
        >>> def kernel(a, b):  # NumPy's BLAS: threads of its own
        ...     return a @ b
        >>> def one(a, b):
        ...     out = jax.ShapeDtypeStruct(a.shape, a.dtype)
        ...     return jtm.threadmap(kernel, out, a, b)
        >>> f = jax.jit(jax.vmap(one, in_axes=(0, None)))
        >>> a, b = np.ones((8, 64, 64), np.float32), np.eye(64, dtype=np.float32)
        >>> with jtm.limit_inner_threads(1):
        ...     out = f(a, b).block_until_ready()  # the map runs in the block
        >>> bool((out == a).all())
        True
    """
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(
            "jax_threadmap.limit_inner_threads: limit must be an int, the threads "
            f"each BLAS or OpenMP call may use. Got {limit!r} of type "
            f"{type(limit).__name__}."
        )
    if limit < 1:
        raise ValueError(
            "jax_threadmap.limit_inner_threads: limit must be at least 1 (1 runs "
            f"each BLAS or OpenMP call on its kernel's own thread). Got {limit}."
        )
    if user_api not in _USER_APIS:
        raise ValueError(
            "jax_threadmap.limit_inner_threads: user_api must be 'blas', 'openmp' "
            f"or None (both). Got {user_api!r}."
        )
    try:
        import threadpoolctl
    except ImportError as e:
        raise ModuleNotFoundError(
            "jax_threadmap.limit_inner_threads needs threadpoolctl to set the "
            "threads of BLAS and OpenMP libraries: pip install threadpoolctl "
            "(or the package's 'inner' extra)."
        ) from e
    with threadpoolctl.threadpool_limits(limits=limit, user_api=user_api):
        yield
