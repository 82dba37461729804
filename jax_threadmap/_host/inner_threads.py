"""Limits the threads that kernels start themselves (BLAS, OpenMP) during maps.

The default pool runs one kernel per CPU. A kernel that calls a threaded BLAS
(NumPy's ``@``, ``np.linalg``, most of SciPy's linear algebra) or OpenMP code
starts threads of its own on top, one per CPU by default, and N kernels with N
threads each oversubscribe N CPUs. joblib limits its workers' inner threads the
same way (``inner_max_num_threads``), through threadpoolctl.

Two ways to limit them:

- :class:`BlasLimit` (:data:`BLAS_LIMIT`), the default: while a map runs kernels
  on several threads of this process, BLAS libraries use one thread per call
  (``JAX_THREADMAP_LIMIT_BLAS=0`` turns it off);
- :func:`limit_inner_threads`, the user's own limit for a block, which the
  automatic one steps aside for.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from .._support import environment as _environment
from .._support import fork as _fork


@contextlib.contextmanager
def limit_inner_threads(limit: int = 1) -> Iterator[None]:
    """Limits the BLAS and OpenMP threads of the kernels that run in the block.

    Your own limit for a block: while a map runs kernels on several threads,
    BLAS libraries already get one thread per call (the automatic limit, off
    with ``JAX_THREADMAP_LIMIT_BLAS=0``), which steps aside inside the block;
    this sets any count, and OpenMP's too. The limit is process-wide (BLAS and
    OpenMP libraries have one setting per process) and is restored when the
    block ends. A jitted call returns
    before its map has run, so wait for its result inside the block
    (``.block_until_ready()``). Thread counts that a kernel passes explicitly,
    such as ``scipy.fft``'s ``workers=`` or a gridder's ``nthreads=``, are the
    kernel's to choose: see the docs' page on kernels that thread themselves.

    Args:
        limit: The threads each BLAS or OpenMP call may use (at least 1).

    Yields:
        Nothing; the limit holds until the block ends.

    Raises:
        TypeError: ``limit`` is not an ``int``.
        ValueError: ``limit`` is below 1.

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
    import threadpoolctl  # (imported once needed: a dependency)

    BLAS_LIMIT.block_opened()
    try:
        with threadpoolctl.threadpool_limits(limits=limit):
            yield
    finally:
        BLAS_LIMIT.block_closed()


# --- the automatic limit of maps that run kernels on several threads --------------

#: A map that runs this many seconds or more is long: the next map of its kernel
#: is limited from its start. A map of a kernel not seen yet is limited once it
#: has run this long; a map of a kernel whose last map was shorter is not limited,
#: so that short maps never pay for the limit. Only when the limit is set depends
#: on it, never a result.
ENTER_DELAY = 0.005
#: Kernels whose last map's length is remembered (by name), at most.
KNOWN_KERNELS = 1024


class BlasLimit:
    """The process's BLAS limit while maps run kernels on several threads.

    One BLAS thread per call while at least one such map runs (maps are
    counted, so nested and concurrent maps share one limit), BLAS's own thread
    count otherwise. OpenBLAS (pthreads) has one thread count per process, and
    threadpoolctl (3.8) lets only the thread that set a limit restore it, so one
    thread of this object's own, the holder, enters and exits the limit; maps of
    any thread count themselves in and out.

    Maps never wait for the holder (under load, a thread woken may wait
    milliseconds for a CPU): a map counts itself in and out and the holder
    follows, so a map's first kernels may start before the limit and BLAS calls
    just after the last map may still have it; only time depends on it, never a
    result. Short maps never pay for it (:data:`ENTER_DELAY`): the holder sets
    the limit once maps have run that long, at once for a kernel whose last map
    was long, and a kernel whose last map was short is not counted. A
    ``limit_inner_threads`` block (of any thread, a kernel's too) waits until
    the limit is released, and the limit stays off until the last block ends:
    the user's limit wins.

    Lock rule: every field is written under ``_lock`` by this object's own
    methods; ``_held`` and ``_limiter`` only by the holder (:meth:`_hold`).
    """

    def __init__(self) -> None:
        self._blas: Any = None  # threadpoolctl's controller of the BLAS libraries
        self._modules = -1  # len(sys.modules) when _blas was made
        self._start()

    def _start(self) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._maps = 0  # maps counted in and not yet out
        self._blocks = 0  # open limit_inner_threads blocks
        self._held = False  # whether the holder has entered the limit
        self._limiter: Any = None  # threadpoolctl's limiter, while held
        self._holder: threading.Thread | None = None
        self._waiting = 0  # callers waiting for the holder: no delay
        self._since = 0.0  # when the maps counted now started to be counted
        self._long: dict[str, bool] = {}  # kernel name -> its last map was long

    @contextlib.contextmanager
    def during_map(self, threads: int, name: str) -> Iterator[None]:
        """Around a map that runs kernel ``name`` on ``threads`` threads of this
        process: the limit while it runs, when more than one thread and not
        turned off (``JAX_THREADMAP_LIMIT_BLAS=0``)."""
        if threads <= 1 or not _environment.env_limit_blas():
            yield
            return
        long = self._long.get(name)
        if long is not False:
            self._change(1, now=bool(long))
        start = time.monotonic()
        try:
            yield
        finally:
            if long is not False:
                self._change(-1)
            self._learn(name, time.monotonic() - start >= ENTER_DELAY)

    def block_opened(self) -> None:
        """A ``limit_inner_threads`` block starts: the automatic limit steps aside."""
        self._change(blocks=1, wait=True)

    def block_closed(self) -> None:
        """A ``limit_inner_threads`` block has ended."""
        self._change(blocks=-1, wait=True)

    def settle(self) -> None:
        """Waits until the limit matches the maps and blocks counted now."""
        self._change(wait=True)

    @property
    def held(self) -> bool:
        """Whether the automatic limit is in force now."""
        with self._lock:
            return self._held

    def _wanted(self) -> bool:
        return self._maps > 0 and self._blocks == 0

    def _learn(self, name: str, long: bool) -> None:
        with self._lock:
            if len(self._long) >= KNOWN_KERNELS:
                self._long.clear()
            self._long[name] = long

    def _change(
        self, maps: int = 0, blocks: int = 0, wait: bool = False, now: bool = False
    ) -> None:
        """Counts a map or block in or out and wakes the holder if the limit
        must change; ``now``: without the delay of :data:`ENTER_DELAY`; with
        ``wait``, returns once the limit matches the counts (also without it)."""
        with self._lock:
            if maps > 0 and not self._maps:
                self._since = time.monotonic()
            if now:
                self._since = time.monotonic() - ENTER_DELAY
            self._maps += maps
            self._blocks += blocks
            if self._held == self._wanted():
                return
            if self._holder is None:
                holder = threading.Thread(
                    target=self._hold, name="jax_threadmap BLAS limit", daemon=True
                )
                try:
                    holder.start()
                except Exception:  # noqa: BLE001 - no thread: no limit this time
                    return
                self._holder = holder
            self._lock.notify_all()
            self._waiting += wait
            try:
                while wait and self._held != self._wanted():
                    self._lock.wait()
            finally:
                self._waiting -= wait

    def _hold(self) -> None:
        """The holder: enters and exits the limit on this one thread, forever."""
        with self._lock:
            while True:
                wanted = self._wanted()
                if wanted == self._held:
                    self._lock.wait()
                    continue
                left = self._since + ENTER_DELAY - time.monotonic()
                if wanted and not self._waiting and left > 0:
                    self._lock.wait(left)  # maps that end by then never pay
                    continue
                if wanted:
                    self._limiter = self._enter()
                elif self._limiter is not None:
                    limiter, self._limiter = self._limiter, None
                    with contextlib.suppress(Exception):  # restored, or left as is
                        limiter.__exit__(None, None, None)
                self._held = wanted
                self._lock.notify_all()

    def _enter(self) -> Any:
        """The limit, entered on the holder's thread; ``None`` if threadpoolctl
        failed (BLAS then keeps its thread count: the limit only saves time)."""
        try:
            if self._blas is None or self._modules != len(sys.modules):
                import threadpoolctl

                # A module imported since may have loaded a BLAS (SciPy's own).
                self._modules = len(sys.modules)
                controller = threadpoolctl.ThreadpoolController()
                self._blas = controller.select(user_api="blas")
            limiter = self._blas.limit(limits=1)
            limiter.__enter__()
        except Exception:  # noqa: BLE001 - no limit rather than a failed map
            return None
        return limiter

    def in_child(self) -> None:
        """After a fork: the child has no holder; it restores the limit if the
        parent held it, and starts with nothing counted."""
        limiter = self._limiter
        self._start()
        if limiter is not None:
            with contextlib.suppress(Exception):
                limiter.restore_original_limits()


#: The one automatic limit of the process.
BLAS_LIMIT = BlasLimit()
_fork.in_child(BLAS_LIMIT.in_child)
