"""The path of one call through the package's modules (docs/architecture.md).

Runs ``jax.jit(jax.vmap(jax.vmap(threadmap(...))))(x)`` once (traced, lowered
and run), then the compiled call alone, then an ``async_call`` and ``jnp.sum`` of
its array (twice: the first compiles), then ``jax.jit(jax.grad(...))`` of a
kernel with ``defvjp(fwd, bwd, residuals=...)`` under ``vmap`` (twice: the first
traces, lowers and runs), under a profiler hook set by this script
(never by the package), on every thread. Per thread, it follows which
package module runs: each time that changes (a call into another module, or a
return to the caller's) is one hop; ``A -> B -> A`` is a hop straight back.
Frames outside the package (JAX, NumPy) are transparent: a callback from JAX
into the package is a hop from the package module that called JAX. The loops
generated per kernel signature count as one module. XLA's callback thread is
not started by Python, so the script sets the hook there as the host function
begins (frames of the package above it on that thread are not seen).

Usage::

    python benchmarks/call_path.py
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_threadmap
from jax_threadmap import threadmap

PACKAGE = os.path.dirname(jax_threadmap.__file__) + os.sep


def _module(frame: Any) -> str | None:
    filename = frame.f_code.co_filename
    if not filename.startswith(PACKAGE):
        return None
    relative = filename[len(PACKAGE) :]
    return relative if relative.endswith(".py") else "generated loop"


class Path:
    """Hops between package modules, per thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sequences: dict[int, list[str]] = {}
        self.stacks: dict[int, list[str | None]] = {}

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        me = threading.get_ident()
        stack = self.stacks.setdefault(me, [])
        sequence = self.sequences.setdefault(me, [])
        if event == "call":
            module = _module(frame)
            stack.append(module)
            if module is not None and (not sequence or sequence[-1] != module):
                sequence.append(module)
        elif stack:
            stack.pop()
            below = next((m for m in reversed(stack) if m is not None), None)
            if below is not None and sequence and sequence[-1] != below:
                sequence.append(below)

    def measure(self, run: Any) -> tuple[int, int, int]:
        self.sequences.clear()
        self.stacks.clear()
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        try:
            run()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        modules: set[str] = set()
        hops = back = 0
        for sequence in self.sequences.values():
            modules.update(sequence)
            hops += max(0, len(sequence) - 1)
            back += sum(
                1 for i in range(2, len(sequence)) if sequence[i] == sequence[i - 2]
            )
        return len(modules), hops, back


def _kernel(x: np.ndarray) -> np.ndarray:
    return x * np.float32(2)


def _hook_callback_threads(path: Path) -> None:
    lowering: Any = sys.modules["jax_threadmap._core.lowering"]
    host_function = lowering.host_function

    def hooked(**params: Any) -> Any:
        run = host_function(**params)

        def hooked_run(*operands: Any) -> Any:
            sys.setprofile(path.hook)
            return run(*operands)

        return hooked_run

    lowering.host_function = hooked


_landing = threading.Event()


def _load() -> np.ndarray:
    _landing.wait(60)
    return np.ones(8, np.float32)


def _async_sum() -> None:
    """An ``async_call``, then ``jnp.sum`` of its array dispatched while the
    call still runs (it returns only then), waited for."""
    _landing.clear()
    x = jax_threadmap.async_call(_load, jax.ShapeDtypeStruct((8,), jnp.float32))
    y = jnp.sum(x)
    _landing.set()
    jax.block_until_ready(y)


S = jax.ShapeDtypeStruct


@jax_threadmap.kernel(S((3,), jnp.float32))
def _solve(m: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.solve(m, b)


def _solve_fwd(m: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, Any]:
    inv = np.linalg.inv(m)
    x = inv @ b
    return x, (inv, x)


def _solve_bwd(res: Any, ct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    inv, x = res
    ct_b = inv.T @ ct
    return -np.outer(ct_b, x), ct_b


_solve.defvjp(
    _solve_fwd, _solve_bwd, residuals=(S((3, 3), jnp.float32), S((3,), jnp.float32))
)


def main() -> None:
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    f = jax.jit(jax.vmap(jax.vmap(lambda v: threadmap(_kernel, f32, v))))
    x = jnp.ones((4, 8), jnp.float32)
    path = Path()
    _hook_callback_threads(path)
    first = path.measure(lambda: jax.block_until_ready(f(x)))
    again = path.measure(lambda: jax.block_until_ready(f(x)))
    async_first = path.measure(_async_sum)
    async_again = path.measure(_async_sum)
    grad = jax.jit(jax.grad(lambda m, b: jnp.sum(jax.vmap(_solve)(m, b)), (0, 1)))
    m = jnp.ones((8, 3, 3), jnp.float32) + 4 * jnp.eye(3, dtype=jnp.float32)
    b = jnp.ones((8, 3), jnp.float32)
    grad_first = path.measure(lambda: jax.block_until_ready(grad(m, b)))
    grad_again = path.measure(lambda: jax.block_until_ready(grad(m, b)))
    for label, (modules, hops, back) in (
        ("traced, lowered and run", first),
        ("the compiled call alone", again),
        ("async_call then jnp.sum, first", async_first),
        ("async_call then jnp.sum, again", async_again),
        ("grad with residuals, traced, lowered and run", grad_first),
        ("grad with residuals, compiled", grad_again),
    ):
        print(f"{label}: {modules} modules, {hops} hops, {back} straight back")


if __name__ == "__main__":
    main()
