"""The built-in demo: a 3-level nested vmap folded into one threaded map."""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from ._api import threadmap


def sort_kernel(row: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """One element: sorts a row (np.sort releases the GIL) and scales it."""
    return np.sort(row) * scale


def model(row: jax.Array, scale: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(row.shape, row.dtype)
    return threadmap(sort_kernel, out, row, scale)


def nested(fn):
    """sources x frequencies x times; ``scale`` is mapped over frequencies only."""
    fn = jax.vmap(fn, in_axes=(0, None))  # times
    fn = jax.vmap(fn, in_axes=(0, 0))  # frequencies
    return jax.vmap(fn, in_axes=(0, None))  # sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_threadmap",
        description="Shows a 3-level nested vmap of a host kernel folded into one "
        "threadmap equation, and runs it.",
    )
    parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((8, 6, 4, 1000)).astype(np.float32)
    scale = np.linspace(1, 2, 6, dtype=np.float32)
    f = nested(model)
    print("jaxpr of vmap(vmap(vmap(model))):")
    print(jax.make_jaxpr(f)(rows, scale))
    g = jax.jit(f)
    g(rows, scale).block_until_ready()
    t = time.perf_counter()
    out = g(rows, scale).block_until_ready()
    dt = time.perf_counter() - t
    expected = np.sort(rows, axis=-1) * scale[None, :, None, None]
    ok = np.allclose(np.asarray(out), expected)
    print(f"result: shape {out.shape}, dtype {out.dtype}, matches NumPy: {ok}")
    print(f"out[0, 0, 0, :5] = {np.asarray(out[0, 0, 0, :5])}")
    calls = out.shape[0] * out.shape[1] * out.shape[2]
    print(f"{calls} kernel calls in {dt * 1e3:.1f} ms")
    return 0 if ok else 1
