"""Per-call time of this checkout's threadmap against another revision's, in one
process, alternating the two rep by rep (best of many reps), as ratios.

Usage: copy the other revision's package under another name, then run this::

    git worktree add /tmp/old <revision>      # or: git archive <revision> ...
    cp -r /tmp/old/jax_threadmap /tmp/oldpkg/jax_threadmap_old
    PYTHONPATH=.:/tmp/oldpkg python benchmarks/compare_revisions.py \\
        [--old jax_threadmap_old] [--groups trivial,signatures,sleep,imbalanced,sort]
        [--rounds 15] [--reps 5] [--only SUBSTRING] [--clock cpu]

Both packages register their own primitive. The groups:

- ``trivial``: trivial kernels (the cost is the library's) on the paths the
  scheduling touches: the default pool, a pool with more threads than CPUs (a
  map that starts limited), a user's ThreadPoolExecutor, nested vmaps, small
  maps called in a loop, a long map, a long map whose first element is slow (a
  first call that fills a cache);
- ``signatures``: the kernel signatures of ``test_bench_signatures.py`` (4096
  elements each: 1 to 4 operands, a keyword, two outputs, a dict operand, a
  ``ThreadPoolExecutor(32)``, a 3-level outer product);
- ``sleep``: the demo's ``sleep`` case (16 x 16 x 16 elements sleeping 1 ms on
  32 threads), the same with 50 us sleeps (elements that wait but are short),
  and front-loaded costs (2,000 elements whose first 200 sleep 5 ms, on 32);
- ``imbalanced``: maps whose elements' costs vary 10-100x, where a thread may
  finish while another still has a long chunk: sleeps of 20 us to 2 ms in a
  random order on 32 threads, a few slow elements near the end of a fast map
  (on 32 threads and on the default pool), fast elements then 20x slower ones
  on 4 threads, and NumPy sorts of 1k to 100k
  floats (GIL released) on every CPU;
- ``sort``: the demo's ``sort`` case (100k floats sorted per element, every
  CPU), on 4 x 8 x 8 elements.

Each line prints the best per-call time of each side and new/old; the machine's
load (``os.getloadavg``) is printed at the start and the end. ``--clock cpu``
times the process's CPU time (every thread) instead of the wall: on a machine
busy with other work, wall times swing by 2x from minute to minute, CPU times
by a few percent (but a kernel's waits do not show).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import os
import time
from collections.abc import Callable
from typing import Any

import harness as B
import jax
import jax.numpy as jnp
import numpy as np

from examples import demo as _demo

F32 = jax.ShapeDtypeStruct((), jnp.float32)
Cases = dict[str, Callable[[], object]]


def _kernel(x):
    return x * np.float32(2)


def _add(x, y):
    return x + y


def _compiled(f: Callable[..., Any], *args: Any) -> Callable[[], object]:
    args = tuple(jax.device_put(a) for a in args)
    compiled = jax.jit(f).lower(*args).compile()
    return lambda: jax.block_until_ready(compiled(*args))


def _warm_up_once(x):
    # A kernel whose first call is slow (it fills a cache): the map's first
    # timed chunk is slow, the others are not.
    if int(x) == 0:
        time.sleep(5e-3)
    return x * np.float32(2)


def trivial(tm: Callable[..., Any], user: object) -> Cases:
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
    warm = jax.jit(jax.vmap(lambda v: tm(_warm_up_once, F32, v, executor=32)))

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
        "100k el, the first slow, executor=32": lambda: warm(big).block_until_ready(),
    }


def signatures(tm: Callable[..., Any], user: object) -> Cases:
    n = B.SIGNATURE_ELEMENTS
    cols = [np.arange(n, dtype=np.float32) * (j + 1) for j in range(4)]

    def positional(kernel: Callable[..., Any], k: int, **kw: Any) -> Any:
        return _compiled(jax.vmap(lambda *a: tm(kernel, F32, *a, **kw)), *cols[:k])

    side = round(n ** (1 / 3))
    x, y, z = (np.arange(side, dtype=np.float32) * j for j in (1, 10, 100))
    outer = jax.vmap(
        jax.vmap(
            jax.vmap(lambda a, b, c: tm(B._add3, F32, a, b, c), (None, None, 0)),
            (None, 0, None),
        ),
        (0, None, None),
    )
    return {
        "signature 1 operand": positional(B._inc, 1),
        "signature 2 operands": positional(B._add2, 2),
        "signature 3 operands": positional(B._add3, 3),
        "signature 4 operands": positional(B._add4, 4),
        "signature keyword": _compiled(
            jax.vmap(lambda a, b, c: tm(B._add2_kw, F32, a, b, s=c)), *cols[:3]
        ),
        "signature 2 outputs": _compiled(
            jax.vmap(lambda a: tm(B._two_outputs, (F32, F32), a)), cols[0]
        ),
        "signature dict operand": _compiled(
            jax.vmap(lambda a, b: tm(B._dict_operand, F32, {"a": a, "b": b})),
            *cols[:2],
        ),
        "signature ThreadPoolExecutor(32)": positional(B._inc, 1, executor=user),
        "signature 3-level outer": _compiled(outer, x, y, z),
    }


def _sleep_50us(x: np.ndarray) -> np.ndarray:
    time.sleep(50e-6)
    return x


def _front_loaded(i: np.ndarray) -> np.ndarray:
    if int(i) < 200:
        time.sleep(5e-3)
    return i


def sleep(tm: Callable[..., Any], user: object) -> Cases:
    del user
    case = _demo.CASES["sleep"]
    inputs = case.inputs(_demo.NESTED_SHAPE)

    def nested(kernel: Callable[..., Any]) -> Callable[[], object]:
        def f(*args: Any) -> Any:
            return tm(kernel, case.out, *args, executor=case.workers)

        return _demo.compiled_thunk(_demo.nest(f, inputs), inputs)

    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    front = jax.vmap(lambda i: tm(_front_loaded, i32, i, executor=32))
    return {
        "sleep 1 ms, 16x16x16, executor=32": nested(case.kernel),
        "sleep 50 us, 16x16x16, executor=32": nested(_sleep_50us),
        "front-loaded 200 of 2000 sleep 5 ms, executor=32": _compiled(
            front, np.arange(2000, dtype=np.int32)
        ),
    }


def _sleep_us(us: np.ndarray) -> np.ndarray:
    time.sleep(float(us) * 1e-6)
    return us


def _sort_first(n: np.ndarray, data: np.ndarray) -> np.ndarray:
    return np.sort(data[: int(n)]).sum(dtype=np.float32)


def imbalanced(tm: Callable[..., Any], user: object) -> Cases:
    del user
    rng = np.random.default_rng(0)
    varied = (20 * 100 ** rng.random(2048)).astype(np.float32)  # 20 us .. 2 ms
    late = np.full(4096, 5, np.float32)
    late[-400::50] = 20_000  # 8 of the last 400 sleep 20 ms
    step = np.repeat(np.float32([100, 2000]), 256)  # 100 us, then 2 ms
    sizes = (1000 * 100 ** rng.random(256)).astype(np.int32)  # 1k .. 100k
    data = rng.random(100_000, dtype=np.float32)

    def sleeps(executor: object) -> Callable[..., Any]:
        return jax.vmap(lambda u: tm(_sleep_us, F32, u, executor=executor))

    sort_map = jax.vmap(lambda n, d: tm(_sort_first, F32, n, d), (0, None))
    return {
        "sleep 20 us-2 ms random, 2048 el, executor=32": _compiled(sleeps(32), varied),
        "8 of the last 400 of 4096 sleep 20 ms, executor=32": _compiled(
            sleeps(32), late
        ),
        "8 of the last 400 of 4096 sleep 20 ms, executor=None": _compiled(
            sleeps(None), late
        ),
        "256 el of 100 us, then 256 of 2 ms, executor=4": _compiled(sleeps(4), step),
        "sort 1k-100k floats, 256 el, every CPU": _compiled(sort_map, sizes, data),
    }


def sort(tm: Callable[..., Any], user: object) -> Cases:
    del user
    case = _demo.CASES["sort"]
    inputs = case.inputs((4, 8, 8))

    def f(*args: Any) -> Any:
        return tm(case.kernel, case.out, *args, executor=case.workers)

    run = _demo.compiled_thunk(_demo.nest(f, inputs), inputs)
    return {"sort 100k floats, 4x8x8, every CPU": run}


GROUPS: dict[str, Callable[[Callable[..., Any], object], Cases]] = {
    "trivial": trivial,
    "signatures": signatures,
    "sleep": sleep,
    "imbalanced": imbalanced,
    "sort": sort,
}


def best(run: Callable[[], object], reps: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(reps):
        t = clock()
        run()
        times.append(clock() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", default="jax_threadmap_old")
    p.add_argument("--groups", default="trivial")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", default="")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = p.parse_args()
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    new = importlib.import_module("jax_threadmap")
    old = importlib.import_module(a.old)
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(32) as user:
        for group in a.groups.split(","):
            sides = {
                "new": GROUPS[group](new.threadmap, user),
                "old": GROUPS[group](old.threadmap, user),
            }
            for name in sides["new"]:
                if a.only not in name:
                    continue
                for side in sides.values():
                    side[name]()  # warm the threads
                t: dict[str, list[float]] = {"new": [], "old": []}
                for r in range(a.rounds):
                    order = ("old", "new") if r % 2 == 0 else ("new", "old")
                    for key in order:
                        t[key].append(best(sides[key][name], a.reps, clock))
                o, n = min(t["old"]), min(t["new"])
                ms = f"old {o * 1e3:9.3f} ms  new {n * 1e3:9.3f} ms"
                print(f"{name:52s} {ms}  new/old {n / o:5.3f}", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
