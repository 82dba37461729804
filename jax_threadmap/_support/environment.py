"""Environment variables are arguments too: each is parsed here, with one set of
rules, and a value that is not understood is an error naming the variable, the
value and what to set instead.

``import jax_threadmap`` checks every ``JAX_THREADMAP_*`` variable set
(:func:`check_environment`): a bad value fails there, whatever the program then
does, and a name the package does not read warns. A map reads several of them
at every call: each value is parsed once, when it changes (the parsers are
cached on the raw string, so a test or a program that sets a variable sees it
at the next call); a bad value is never cached, so every call fails on it.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

from .validate import MAX_THREADS

#: The environment variable that sizes the shared pool of ``executor=None``.
ENV_NUM_THREADS = "JAX_THREADMAP_NUM_THREADS"
ENV_ASYNC_THREADS = "JAX_THREADMAP_ASYNC_THREADS"
ENV_PROGRESS = "JAX_THREADMAP_PROGRESS"
#: ``0`` turns the automatic BLAS limit of maps off (default on).
ENV_LIMIT_BLAS = "JAX_THREADMAP_LIMIT_BLAS"


def env_positive_int(name: str, what: str, maximum: int | None = None) -> int | None:
    """The positive integer in environment variable ``name``; ``None`` when unset.

    Args:
        name: The variable.
        what: What the number is, for the message when the value is not one.
        maximum: The largest value accepted, if any.
    """
    return _positive_int(name, os.environ.get(name, ""), what, maximum)


@functools.lru_cache(maxsize=64)
def _positive_int(name: str, raw: str, what: str, maximum: int | None) -> int | None:
    value = raw.strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"The environment variable {name} must be a positive integer ({what}). "
            f"Got {name}={raw!r}. Set it to e.g. 8, or unset it to use the default."
        )
    if maximum is not None and n > maximum:
        raise ValueError(
            f"The environment variable {name} must be at most {maximum} ({what}). "
            f"Got {name}={raw!r}. Set it to the number of kernels that should run "
            "at once (e.g. 32 for network reads), or unset it to use the default."
        )
    return n


def env_num_threads() -> int | None:
    """``JAX_THREADMAP_NUM_THREADS``, checked; ``None`` when unset."""
    return env_positive_int(
        ENV_NUM_THREADS, "the number of threads of the shared pool", MAX_THREADS
    )


def env_async_threads() -> int | None:
    """``JAX_THREADMAP_ASYNC_THREADS``, checked; ``None`` when unset."""
    return env_positive_int(
        ENV_ASYNC_THREADS,
        "the number of threads that run jax_threadmap.async_call",
        MAX_THREADS,
    )


def env_progress() -> bool:
    """``JAX_THREADMAP_PROGRESS``: progress bars for every map (default off)."""
    return env_flag(ENV_PROGRESS, "progress bars for long threadmaps")


def env_limit_blas() -> bool:
    """``JAX_THREADMAP_LIMIT_BLAS``: the automatic BLAS limit (default on)."""
    return env_flag(
        ENV_LIMIT_BLAS,
        "one BLAS thread per call while a map runs kernels on several threads (the "
        "default; 0 leaves BLAS its own thread count)",
        default=True,
    )


ENV_ASYNC_DISPATCH = "JAX_THREADMAP_ASYNC_DISPATCH"


def async_dispatch_mode() -> str:
    """``JAX_THREADMAP_ASYNC_DISPATCH``: ``"async"`` (default, or a true value:
    a jitted call on pending data returns at once, its program dispatched when
    the data lands) or ``"off"`` (a false value: the call waits for the data).
    ``deferred``, the name of the one async mode, is a true value too."""
    raw = os.environ.get(ENV_ASYNC_DISPATCH, "")
    on = raw.strip().lower() == "deferred" or _flag(
        ENV_ASYNC_DISPATCH, raw, _ASYNC_DISPATCH_WHAT, True
    )
    return "async" if on else "off"


_ASYNC_DISPATCH_WHAT = (
    "async dispatch (jitted calls with pending AsyncArrays return at once; "
    "0: they wait for the data; deferred means 1)"
)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, what: str, default: bool = False) -> bool:
    """The boolean in environment variable ``name``; ``default`` when unset.

    Args:
        name: The variable.
        what: What the flag turns on, for the message when the value is not one.
        default: The flag when the variable is unset or empty.
    """
    return _flag(name, os.environ.get(name, ""), what, default)


@functools.lru_cache(maxsize=64)
def _flag(name: str, raw: str, what: str, default: bool) -> bool:
    value = raw.strip().lower()
    if not value:
        return default
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise ValueError(
        f"The environment variable {name} turns on {what}; it must be one of "
        f"{', '.join(_TRUE + _FALSE)}. Got {name}={raw!r}."
    )


#: Every variable the package reads, and the function that reads (and checks) it.
READERS: dict[str, Callable[[], object]] = {
    ENV_NUM_THREADS: env_num_threads,
    ENV_ASYNC_THREADS: env_async_threads,
    ENV_ASYNC_DISPATCH: async_dispatch_mode,
    ENV_PROGRESS: env_progress,
    ENV_LIMIT_BLAS: env_limit_blas,
}
#: Variables no longer read, and what replaced each (as long as CHANGELOG.md
#: lists them under "Removed": tests/_support/test_environment.py checks).
REMOVED = {
    "JAX_THREADMAP_MAX_IN_FLIGHT": "pass max_in_flight=N to threadmap or kernel "
    "(the default stays 2048)",
}
#: Variables of the project's own test suite (tests/): neither read nor warned of.
TESTS_PREFIX = "JAX_THREADMAP_TEST_"


def check_environment() -> None:
    """Checks every ``JAX_THREADMAP_*`` variable set (at import): a value that is
    not understood raises ``ValueError``; a name not read here warns."""
    for name in sorted(os.environ):
        if name in READERS:
            READERS[name]()
        elif name.startswith("JAX_THREADMAP_") and not name.startswith(TESTS_PREFIX):
            gone = f", removed ({REMOVED[name]})" if name in REMOVED else ""
            warnings.warn(
                f"jax_threadmap ignores the environment variable {name}{gone}: it "
                f"reads {', '.join(READERS)}. Correct its name, or unset it.",
                stacklevel=3,
            )
