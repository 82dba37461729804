"""Per-call time of this checkout's threadmap against another revision's, in one
process, alternating the two rep by rep (best of many reps), as ratios.

Usage: copy the other revision's package under another name, then run this::

    git worktree add /tmp/old <revision>
    cp -r /tmp/old/jax_threadmap /tmp/oldpkg/jax_threadmap_old
    PYTHONPATH=.:/tmp/oldpkg python benchmarks/compare_revisions.py

Both packages register their own primitive; the cases are trivial kernels (the
cost is the library's), on the paths the scheduling touches: the default pool,
a pool with more threads than CPUs (a map that starts limited), a user's
ThreadPoolExecutor, nested vmaps, small maps called in a loop, a long map.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

F32 = jax.ShapeDtypeStruct((), jnp.float32)


def _kernel(x):
    return x * np.float32(2)


def _add(x, y):
    return x + y


def cases(tm: Callable[..., object], user: object) -> dict[str, Callable[[], object]]:
    """name -> a function that runs the case once (compiled, blocking)."""
    x = jnp.arange(4096, dtype=jnp.float32)
    xy = jnp.arange(16 * 256, dtype=jnp.float32).reshape(16, 256)
    big = jnp.arange(100_000, dtype=jnp.float32)
    small = jnp.arange(50, dtype=jnp.float32)

    def flat(executor: object) -> Callable[[jax.Array], jax.Array]:
        return jax.jit(jax.vmap(lambda v: tm(_kernel, F32, v, executor=executor)))

    nested = jax.jit(
        jax.vmap(jax.vmap(lambda a, b: tm(_add, F32, a, b), (0, None)), (None, 0))
    )
    f_none, f_32, f_user, f_1000 = flat(None), flat(32), flat(user), flat(1000)

    def loop_small() -> None:
        for _ in range(20):
            f_1000(small).block_until_ready()

    return {
        "4096 el, executor=None": lambda: f_none(x).block_until_ready(),
        "4096 el, executor=32": lambda: f_32(x).block_until_ready(),
        "4096 el, ThreadPoolExecutor(32)": lambda: f_user(x).block_until_ready(),
        "16x256 nested, 2 operands": lambda: nested(
            xy[0], xy[:, 0]
        ).block_until_ready(),
        "100k el, executor=None": lambda: f_none(big).block_until_ready(),
        "20 calls of 50 el, executor=1000": loop_small,
    }


def best(run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return min(times)


def main(rounds: int = 15, reps: int = 5) -> None:
    new = importlib.import_module("jax_threadmap")
    old = importlib.import_module(
        sys.argv[1] if len(sys.argv) > 1 else "jax_threadmap_old"
    )
    with concurrent.futures.ThreadPoolExecutor(32) as user:
        sides = {"new": cases(new.threadmap, user), "old": cases(old.threadmap, user)}
        for name in sides["new"]:
            for side in sides.values():
                side[name]()  # compile, warm the threads
            t = {"new": [], "old": []}
            for _ in range(rounds):
                for key in ("old", "new"):
                    t[key].append(best(sides[key][name], reps))
            o, n = min(t["old"]), min(t["new"])
            ms = f"old {o * 1e3:8.3f} ms  new {n * 1e3:8.3f} ms"
            print(f"{name:36s} {ms}  new/old {n / o:5.2f}")


if __name__ == "__main__":
    main()
