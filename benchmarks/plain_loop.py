"""Per-element time of a plain (not generated) element loop against the
generated loops of ``jax_threadmap._host.loops``, side by side in one process.

Issue 19 asked to prefer a plain loop if it came within 5% of the generated
loops' time per element. The plain loop here is the best general one we could
write for the commonest signature family (positional operand leaves, one result
leaf): operands read once per chunk when constant (stride 0), the arguments
kept in one list whose batched slots are refilled per element, the kernel
called with ``fn(*args)``, and the same fast store and checks as the generated
loop. Both run the same kernels on the same views on one thread, alternating
rep by rep, best of many reps.

With ``--old MODULE`` (another revision's package copied under another name,
as for ``compare_revisions.py``), it also times that revision's generated loops
on the same views, alternated with this one's: the per-element cost of a change
to the loops (how a failure stops a chunk, for one).

Usage::

    PYTHONPATH=. python benchmarks/plain_loop.py [--reps 15] [--n 20000]
    PYTHONPATH=.:/tmp/oldpkg python benchmarks/plain_loop.py --old jax_threadmap_old

Not collected by pytest (not a ``test_`` file): it is a measurement, and its
numbers are in docs/architecture-design.md.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_threadmap._executors.jobs import Job
from jax_threadmap._host.maps import ElementCaller
from jax_threadmap._support.errors import PASS_THROUGH


def _job(n: int) -> Job:
    """A chunk's job (a real one, for the cost of reading its ``failed``)."""
    return Job(n, lambda *a: None)


class _OldJob:
    """What an older revision's loops read per element (``job.halt``, or a
    cursor's ``halt`` and ``row``)."""

    row: Any = None

    def __init__(self) -> None:
        self.failed = self.halt = False


def plain_loop(caller: ElementCaller, in_v: list[np.ndarray], out: np.ndarray) -> Any:
    """A plain loop over 1-D views for positional leaves and one result leaf."""
    fn, store, raised = caller.fn, caller.store, caller.kernel_raised
    result_leaves = caller.result_leaves
    ((shape, dtype),) = caller.out_core
    exact = dtype.type if shape == () else None
    ndarray = np.ndarray
    batched = [k for k, v in enumerate(in_v) if v.strides[0] != 0]

    def chunk(start: int, stop: int, job: Any) -> None:
        args = [v[0, ...] for v in in_v]
        views = [(k, in_v[k]) for k in batched]
        for i in range(start, stop):
            if job.failed:
                return
            for k, v in views:
                args[k] = v[i, ...]
            try:
                r = fn(*args)
            except PASS_THROUGH:
                raise
            except BaseException as e:
                raise raised(e, i) from e
            if type(r) is exact or (
                type(r) is ndarray and r.dtype is dtype and r.shape == shape
            ):
                out[i] = r
            else:
                store(out, i, result_leaves(r, i)[0], 0, i)

    return chunk


def case(
    kernel: Callable[..., Any],
    operands: list[np.ndarray],
    out_shape: tuple[int, ...],
    caller_type: Any = ElementCaller,
) -> tuple[ElementCaller, list[np.ndarray], np.ndarray]:
    n = max(len(x) for x in operands if x.ndim and x.strides[0])
    args = tuple(0 for _ in operands)
    in_tree = jax.tree_util.tree_structure((args, {}))
    out_tree = jax.tree_util.tree_structure(0)
    dtype = np.dtype(np.float32)
    caller = caller_type(kernel, "k", in_tree, out_tree, [(out_shape, dtype)], (n,))
    out = np.empty((n, *out_shape), dtype)
    return caller, operands, out


def best(run: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--old", default="", help="another revision's package")
    a = p.parse_args()
    n = a.n
    x = np.arange(n, dtype=np.float32)
    v3 = np.arange(3 * n, dtype=np.float32).reshape(n, 3)
    c3 = np.lib.stride_tricks.as_strided(  # one vector read by every element
        np.ones(3, np.float32), (n, 3), (0, 4)
    )
    two = np.float32(2)
    cases = {
        "x * 2 (1 scalar)": (lambda x: x * two, [x], ()),
        "x + y (2 scalars)": (lambda x, y: x + y, [x, x], ()),
        "v * c (vector, 1 unbatched)": (lambda v, c: v * c, [v3, c3], (3,)),
        "a + b + c (3 scalars)": (lambda a, b, c: a + b + c, [x, x, x], ()),
    }
    old = None
    if a.old:
        old = importlib.import_module(f"{a.old}._host").ElementCaller
    head = f"{'kernel':32s} {'generated':>12s} {'plain':>12s}  plain/generated"
    print(head + ("  old generated  generated/old" if old else ""))
    for name, (kernel, ops, shape) in cases.items():
        caller, in_v, out = case(kernel, ops, shape)
        generated = caller.loop(in_v, [out], (n,))
        plain = plain_loop(caller, in_v, out)
        plain(0, n, _job(n))
        expected = out.copy()
        out[...] = 0
        generated(0, n, _job(n))
        np.testing.assert_array_equal(out, expected)  # the same results
        runs = {
            "generated": lambda g=generated: g(0, n, _job(n)),
            "plain": lambda p=plain: p(0, n, _job(n)),
        }
        if old is not None:
            old_loop = case(kernel, ops, shape, old)[0].loop(in_v, [out], (n,))
            if isinstance(old_loop, tuple):  # a revision with the units loop
                old_loop = old_loop[0]
            runs["old"] = lambda o=old_loop: o(0, n, _OldJob())
        t: dict[str, list[float]] = {side: [] for side in runs}
        for r in range(a.rounds):
            for side in list(runs)[:: 1 if r % 2 == 0 else -1]:
                t[side].append(best(runs[side], a.reps) / n)
        g, q = min(t["generated"]), min(t["plain"])
        line = f"{name:32s} {g * 1e9:9.0f} ns {q * 1e9:9.0f} ns  {q / g:6.2f}"
        if old is not None:
            o = min(t["old"])
            line += f"  {o * 1e9:10.0f} ns  {g / o:12.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
