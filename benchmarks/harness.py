"""Kernels, baselines and timing of the benchmarks.

Every timed call of ``benchmarks/`` is built here. The ``sleep`` and ``sort``
cases, their inputs, the ``threadmap`` and ``sequential`` runners and the timing
helpers are the demo's (``examples/demo.py``), so that the demo and the
benchmarks report the same numbers. Each runner returns a thunk that runs a whole
batch once and blocks until the result is ready; compilation happens when the
runner is built.

The ways to run a per-element kernel over a nested-vmap batch:

- ``threadmap``: this package.
- ``sequential``: ``jax.pure_callback(vmap_method="sequential")``, which calls the
  host once per element, one after the other.
- ``recipe``: the best user-side recipe without this package: ``pure_callback``
  with ``vmap_method="expand_dims"``, the batch shape recovered by broadcasting
  the leading dims of each argument (size-1 dims indexed at 0, so nothing is
  tiled), a new ``ThreadPoolExecutor`` per call mapping over a flat index, and
  ``np.stack`` of the list of results. It gets NumPy views of its arguments, not
  ``jax.Array`` s, which would cost about 1 ms more per element to index.
- ``bare_loop``: a Python loop calling the kernel on NumPy views, without JAX,
  writing into a preallocated output: the per-element floor of any Python-level
  map. On a subset of the batch it also measures the serial kernel time, from
  which ``ideal = serial time / workers``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_threadmap import threadmap
from jax_threadmap._support.cpus import available_cpus as num_cpus

# examples/ lives beside the package, not in it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from examples.demo import CASES as DEMO_CASES  # noqa: E402
from examples.demo import (  # noqa: E402, F401 - re-exported for the benchmarks
    NESTED_SHAPE,
    Case,
    Inputs,
    OtherLoad,
    compiled_thunk,
    counting_inputs,
    median,
    nest,
    sequential_runner,
    threadmap_runner,
    time_runs,
)

# --- kernels ------------------------------------------------------------------------


def add_one(x: np.ndarray) -> np.ndarray:
    """Trivial kernel: measures the per-element overhead of a map."""
    return x + 1


def fill(x: np.ndarray, *, size: int) -> np.ndarray:
    """Large-output kernel for the memory benchmark: ``size`` float32 per element."""
    return np.full(size, x, np.float32)


# --- cases --------------------------------------------------------------------------


CASES: dict[str, Case] = {
    "trivial": Case(
        "trivial",
        "trivial kernel `x + 1` on a 0-d float32",
        add_one,
        jax.ShapeDtypeStruct((), jnp.float32),
        workers=None,
        sequential_subset=4096,
    ),
    **DEMO_CASES,
}

# --- the ways to run a batch --------------------------------------------------------


def threaded_pure_callback(
    kernel: Callable[..., Any],
    result_shape_dtype: jax.ShapeDtypeStruct,
    core_ranks: Sequence[int],
    num_threads: int,
) -> Callable[..., Any]:
    """The best user-side recipe: ``pure_callback`` + a thread pool per call.

    Args:
        kernel: The per-element kernel.
        result_shape_dtype: One element's result (a single array).
        core_ranks: The number of non-batch (trailing) dims of each argument,
            which the caller must state because ``expand_dims`` does not.
        num_threads: Threads of the pool created on each call.

    Returns:
        A function of the unbatched arguments, to be ``vmap``-ed.
    """
    out_shape = tuple(result_shape_dtype.shape)
    out_dtype = np.dtype(result_shape_dtype.dtype)

    def callback(*args):
        args = [np.asarray(a) for a in args]
        leads = [a.shape[: a.ndim - r] for a, r in zip(args, core_ranks, strict=True)]
        batch_shape = np.broadcast_shapes(*leads)
        # Per argument: its leading dims, right-aligned with the batch shape as
        # in broadcasting, and which of them are real batch dims (size-1 dims
        # stand for levels the argument is not mapped at; they are read at 0).
        plans = []
        for lead in leads:
            pad = len(batch_shape) - len(lead)
            dims = [(d, d + pad) for d, s in enumerate(lead) if s != 1]
            plans.append((len(lead), dims))

        def one(i):
            index = np.unravel_index(i, batch_shape)
            elem = []
            for a, (rank, dims) in zip(args, plans, strict=True):
                ii = [0] * rank
                for own, full in dims:
                    ii[own] = index[full]
                elem.append(a[(*ii, Ellipsis)])
            return kernel(*elem)

        with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
            results = list(pool.map(one, range(math.prod(batch_shape))))
        return np.stack(results).astype(out_dtype).reshape(batch_shape + out_shape)

    def call(*args):
        return jax.pure_callback(
            callback, result_shape_dtype, *args, vmap_method="expand_dims"
        )

    return call


def recipe_runner(case: Case, inputs: Inputs) -> Callable[[], Any]:
    """Runs the batch with :func:`threaded_pure_callback` (``case.num_workers``)."""
    core_ranks = [
        a.ndim - (len(inputs.batch_shape) if b else 0)
        for a, b in zip(inputs.arrays, inputs.batched, strict=True)
    ]
    f = threaded_pure_callback(case.kernel, case.out, core_ranks, case.num_workers)
    return compiled_thunk(nest(f, inputs), inputs)


def bare_loop_runner(case: Case, inputs: Inputs) -> Callable[[], np.ndarray]:
    """Runs the batch as a plain Python loop on NumPy views, without JAX."""
    n = inputs.size
    nb = len(inputs.batch_shape)
    flat = [
        a.reshape((n, *a.shape[nb:])) if b else a
        for a, b in zip(inputs.arrays, inputs.batched, strict=True)
    ]
    out = np.empty((n, *case.out.shape), case.out.dtype)
    kernel = case.kernel
    if inputs.batched == (True,):
        (x,) = flat

        def run():
            for i in range(n):
                out[i] = kernel(x[i, ...])
            return out

    else:
        pairs = list(zip(flat, inputs.batched, strict=True))

        def run():
            for i in range(n):
                out[i] = kernel(*(a[i, ...] if b else a for a, b in pairs))
            return out

    return run


RUNNERS: dict[str, Callable[..., Callable[[], Any]]] = {
    "threadmap": threadmap_runner,
    "sequential": sequential_runner,
    "recipe": recipe_runner,
    "bare_loop": bare_loop_runner,
}


def reference(case: Case, inputs: Inputs) -> np.ndarray:
    """The expected result of a batch, from the bare loop."""
    return bare_loop_runner(case, inputs)().reshape(
        inputs.batch_shape + tuple(case.out.shape)
    )


# --- peak memory --------------------------------------------------------------------

#: The memory benchmark: 4096 elements of 64 KB results (256 MB of outputs).
MEMORY_SHAPE = (16, 16, 16)
MEMORY_ELEMENT_FLOATS = 16384


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """The peak resident memory of this process since it started.

    On Linux, VmHWM of this process's own address space: ``ru_maxrss`` would
    also count the parent's peak, which Linux keeps across fork and exec, so a
    child started by a big benchmark process would report the parent's memory.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    # ru_maxrss is in kilobytes on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _fill_kernel(x):
    return fill(x, size=MEMORY_ELEMENT_FLOATS)


def _memory_child(method: str, batch_shape: Sequence[int]) -> dict[str, Any]:
    """Runs in a fresh process: the peak memory one batch adds, in bytes."""
    case = Case(
        "fill",
        "64 KB result per element",
        _fill_kernel,
        jax.ShapeDtypeStruct((MEMORY_ELEMENT_FLOATS,), jnp.float32),
        workers=num_cpus(),
        sequential_subset=0,
    )
    inputs = case.inputs(batch_shape)
    # Warm up JAX, the pools and the allocator on a small batch of another
    # shape: a warm-up of the measured shape would already reach its peak.
    small = inputs.subset(max(1, inputs.size // 64))
    RUNNERS[method](case, small)()
    run = RUNNERS[method](case, inputs)
    before = _rss_bytes()
    result = run()
    peak = _peak_rss_bytes()
    expected = np.arange(inputs.size, dtype=np.float32)
    assert np.array_equal(np.asarray(result).reshape(inputs.size, -1)[:, 0], expected)
    out_bytes = inputs.size * MEMORY_ELEMENT_FLOATS * 4
    in_bytes = sum(a.nbytes for a in inputs.arrays)
    return {
        "method": method,
        "elements": inputs.size,
        "input_bytes": in_bytes,
        "output_bytes": out_bytes,
        "added_bytes": peak - before,
        "budget_bytes": in_bytes + 2 * out_bytes,
    }


def alternate(
    runs: dict[Any, Callable[[], object]], reps: int
) -> dict[Any, tuple[float, float]]:
    """Each run's best wall time and best CPU time (the process's, every
    thread) over ``reps`` reps, after one call each to compile and warm up;
    runs alternated rep by rep, each rep starting one run later (s)."""
    for run in runs.values():
        run()
    wall = dict.fromkeys(runs, float("inf"))
    cpu = dict.fromkeys(runs, float("inf"))
    keys = list(runs)
    for r in range(reps):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[key]()
            wall[key] = min(wall[key], time.perf_counter() - start)
            cpu[key] = min(cpu[key], time.process_time() - start_cpu)
    return {key: (wall[key], cpu[key]) for key in keys}


def in_subprocess(call: str, timeout: float = 300) -> dict[str, Any]:
    """Runs ``harness.<call>`` in a fresh process; returns the dict it returns."""
    code = f"import json\nimport harness\nprint(json.dumps(harness.{call}))\n"
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return _json_from([sys.executable, "-c", code], env, timeout, call)


def script_in_child(
    script: str, *args: str, devices: int, timeout: float = 600
) -> dict[str, Any]:
    """Runs ``python script *args`` in a fresh process with ``devices`` CPU
    devices (``--xla_force_host_platform_device_count``, which must be set before
    JAX starts) and this checkout first on its path; returns the dict that its
    last line of output holds as JSON."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    env.pop("JAX_PLATFORMS", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    what = " ".join([os.path.basename(script), *args])
    return _json_from([sys.executable, script, *args], env, timeout, what)


def _json_from(
    cmd: list[str], env: dict[str, str], timeout: float, what: str
) -> dict[str, Any]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed in its subprocess:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_memory(
    method: str, batch_shape: Sequence[int] = MEMORY_SHAPE, timeout: float = 300
) -> dict[str, Any]:
    """Measures the peak memory of one batch of :func:`fill` in a subprocess.

    The budget is inputs + outputs + one copy of the outputs (the result moved
    into JAX); threads add O(threads x element), nothing else may grow with the
    batch. ``ratio`` is the memory added by the call over that budget.

    Args:
        method: One of :data:`RUNNERS`.
        batch_shape: The nested batch.
        timeout: Seconds before the subprocess is abandoned.

    Returns:
        A dict with ``elements``, ``input_bytes``, ``output_bytes``,
        ``added_bytes``, ``budget_bytes`` and ``ratio``.
    """
    result = in_subprocess(
        f"_memory_child({method!r}, {tuple(batch_shape)!r})", timeout
    )
    result["ratio"] = result["added_bytes"] / result["budget_bytes"]
    return result


# --- vectorized kernels -------------------------------------------------------------

#: The outer-product case: ``x + y + z`` with each operand batched at its own
#: level of a 3-level nested vmap, so no two levels merge and every chunk
#: gathers its slices.
VECTOR_SHAPE = (128, 128, 128)
#: The CPU-bound case: rows sorted by a GIL-releasing NumPy routine.
SORT_ROWS_SHAPE = (2048, 8192)


def add3(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a + b + c``: one element, or one chunk of elements (vectorized)."""
    return a + b + c


def sort_rows(rows: np.ndarray) -> np.ndarray:
    """Sorts each row of a chunk (NumPy releases the GIL)."""
    return np.sort(rows, axis=-1)


def outer_inputs(shape: Sequence[int] = VECTOR_SHAPE) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(n).astype(np.float32) for n in shape)


def outer_runner(
    arrays: Sequence[np.ndarray], vectorized: bool | int
) -> Callable[[], Any]:
    """``threadmap(add3)`` under three vmaps, each operand mapped at one level."""
    out = jax.ShapeDtypeStruct((), jnp.float32)

    def f(a, b, c):
        return threadmap(add3, out, a, b, c, vectorized=vectorized)

    g = jax.vmap(
        jax.vmap(jax.vmap(f, (None, None, 0)), (None, 0, None)), (0, None, None)
    )
    args = [jax.device_put(a) for a in arrays]
    compiled = jax.jit(g).lower(*args).compile()
    return lambda: jax.block_until_ready(compiled(*args))


def outer_numpy_runner(arrays: Sequence[np.ndarray]) -> Callable[[], Any]:
    """The same sum in NumPy on broadcast arrays: the floor."""
    x, y, z = arrays
    return lambda: x[:, None, None] + y[None, :, None] + z[None, None, :]


def sort_rows_inputs(shape: Sequence[int] = SORT_ROWS_SHAPE) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def sort_rows_runner(rows: np.ndarray) -> Callable[[], Any]:
    """``threadmap(sort_rows, vectorized=True)`` under one vmap over the rows."""
    out = jax.ShapeDtypeStruct(rows.shape[1:], rows.dtype)
    f = jax.vmap(lambda r: threadmap(sort_rows, out, r, vectorized=True))
    arg = jax.device_put(rows)
    compiled = jax.jit(f).lower(arg).compile()
    return lambda: jax.block_until_ready(compiled(arg))


def hand_threads_runner(rows: np.ndarray, threads: int) -> Callable[[], Any]:
    """The best by hand: one thread per core, each sorting a block of rows."""
    out = np.empty_like(rows)
    blocks = np.array_split(np.arange(len(rows)), threads)
    pool = concurrent.futures.ThreadPoolExecutor(threads)

    def one(block: np.ndarray) -> None:
        out[block[0] : block[-1] + 1] = np.sort(rows[block[0] : block[-1] + 1], -1)

    def run() -> np.ndarray:
        list(pool.map(one, blocks))
        return out

    return run


def callback_only_runner(rows: np.ndarray) -> Callable[[], Any]:
    """A ``pure_callback`` that returns a preallocated array of the result's
    shape: what handing the result back to XLA costs, with no work at all."""
    result = np.sort(rows, axis=-1)
    out = jax.ShapeDtypeStruct(rows.shape, rows.dtype)
    f = jax.jit(lambda r: jax.pure_callback(lambda _: result, out, r))
    arg = jax.device_put(rows)
    compiled = f.lower(arg).compile()
    return lambda: jax.block_until_ready(compiled(arg))


def _vector_memory_child(shape: Sequence[int]) -> dict[str, Any]:
    """Runs in a fresh process: the peak memory of the vectorized outer sum."""
    arrays = outer_inputs(shape)
    outer_runner(outer_inputs((4, 4, 4)), True)()  # warm up JAX and the pools
    run = outer_runner(arrays, True)
    before = _rss_bytes()
    result = np.asarray(run())
    peak = _peak_rss_bytes()
    x, y, z = arrays
    assert np.allclose(result, x[:, None, None] + y[None, :, None] + z[None, None, :])
    out_bytes = result.nbytes
    from jax_threadmap._executors import scheduling as _scheduling
    from jax_threadmap._executors import thread_pools as _thread_pools

    # One chunk per worker in flight: three gathered operands and the result.
    workers = _thread_pools.default_num_threads()
    chunk = _scheduling.VECTOR_CHUNK_BYTES
    return {
        "elements": int(result.size),
        "input_bytes": sum(a.nbytes for a in arrays),
        "output_bytes": out_bytes,
        "chunk_bytes": workers * chunk,
        "added_bytes": peak - before,
        "budget_bytes": sum(a.nbytes for a in arrays) + 2 * out_bytes + workers * chunk,
    }


def vector_peak_memory(shape: Sequence[int] = (256, 256, 256)) -> dict[str, Any]:
    """Peak memory of the vectorized outer sum against inputs + 2 x outputs +
    a chunk per worker; ``ratio`` is added / budget."""
    result = in_subprocess(f"_vector_memory_child({tuple(shape)!r})")
    result["ratio"] = result["added_bytes"] / result["budget_bytes"]
    return result


# --- kernel signatures --------------------------------------------------------------

#: Elements of each signature case (a 1-level vmap, or 16 x 16 x 16 for the outer
#: product).
SIGNATURE_ELEMENTS = 4096


def _inc(x: Any) -> Any:
    return x + 1


def _add2(x: Any, y: Any) -> Any:
    return x + y


def _add3(x: Any, y: Any, z: Any) -> Any:
    return x + y + z


def _add4(x: Any, y: Any, z: Any, w: Any) -> Any:
    return x + y + z + w


def _add2_kw(x: Any, y: Any, *, s: Any) -> Any:
    return (x + y) * s


def _two_outputs(x: Any) -> tuple[Any, Any]:
    return x + 1, x * 2


def _dict_operand(d: dict[str, Any]) -> Any:
    return d["a"] + d["b"]


@dataclasses.dataclass(frozen=True)
class Signature:
    """A kernel signature: the kernel, how threadmap is called, and its floor.

    ``floor`` is a bare Python loop that indexes each operand as threadmap does
    (``a[i, ...]``, a 0-d view) and calls the same kernel, writing into
    preallocated outputs.
    """

    name: str
    title: str
    threadmap_run: Callable[[], Any]
    floor_run: Callable[[], Any]
    expected: Any


def _vmapped(
    fn: Callable[..., Any], out: Any, args: Sequence[np.ndarray], **kw: Any
) -> Callable[[], Any]:
    compiled_args = [jax.device_put(a) for a in args]
    f = jax.vmap(lambda *a: threadmap(fn, out, *a, **kw))
    compiled = jax.jit(f).lower(*compiled_args).compile()
    return lambda: jax.block_until_ready(compiled(*compiled_args))


def _positional(name: str, kernel: Callable[..., Any], k: int, **kw: Any) -> Signature:
    n = SIGNATURE_ELEMENTS
    args = [np.arange(n, dtype=np.float32) * (j + 1) for j in range(k)]
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    out = np.empty(n, np.float32)
    # One loop per arity, as threadmap's loops: no list built per element.
    if k == 1:
        (a,) = args

        def floor() -> np.ndarray:
            for i in range(n):
                out[i] = kernel(a[i, ...])
            return out

    elif k == 2:
        a, b = args

        def floor() -> np.ndarray:
            for i in range(n):
                out[i] = kernel(a[i, ...], b[i, ...])
            return out

    elif k == 3:
        a, b, c = args

        def floor() -> np.ndarray:
            for i in range(n):
                out[i] = kernel(a[i, ...], b[i, ...], c[i, ...])
            return out

    elif k == 4:
        a, b, c, d = args

        def floor() -> np.ndarray:
            for i in range(n):
                out[i] = kernel(a[i, ...], b[i, ...], c[i, ...], d[i, ...])
            return out

    else:
        raise ValueError(f"no floor loop for {k} operands")

    title = f"{k} operand{'s' * (k > 1)}"
    if kw.get("executor") is not None:
        title += f", `{type(kw['executor']).__name__}(32)`"
    return Signature(
        name, title, _vmapped(kernel, f32, args, **kw), floor, kernel(*args)
    )


def _keyword_case() -> Signature:
    n = SIGNATURE_ELEMENTS
    x, y, s = (np.arange(n, dtype=np.float32) * j for j in (1, 2, 3))
    out = np.empty(n, np.float32)
    f32 = jax.ShapeDtypeStruct((), jnp.float32)

    def floor() -> np.ndarray:
        for i in range(n):
            out[i] = _add2_kw(x[i, ...], y[i, ...], s=s[i, ...])
        return out

    args = [jax.device_put(a) for a in (x, y, s)]
    f = jax.vmap(lambda a, b, c: threadmap(_add2_kw, f32, a, b, s=c))
    compiled = jax.jit(f).lower(*args).compile()
    return Signature(
        "keyword",
        "2 operands + a keyword argument",
        lambda: jax.block_until_ready(compiled(*args)),
        floor,
        _add2_kw(x, y, s=s),
    )


def _two_outputs_case() -> Signature:
    n = SIGNATURE_ELEMENTS
    x = np.arange(n, dtype=np.float32)
    o1, o2 = np.empty(n, np.float32), np.empty(n, np.float32)
    f32 = jax.ShapeDtypeStruct((), jnp.float32)

    def floor() -> tuple[np.ndarray, np.ndarray]:
        for i in range(n):
            o1[i], o2[i] = _two_outputs(x[i, ...])
        return o1, o2

    run = _vmapped(_two_outputs, (f32, f32), [x])
    return Signature("outputs", "2 outputs (a tuple)", run, floor, _two_outputs(x))


def _dict_case() -> Signature:
    n = SIGNATURE_ELEMENTS
    a, b = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
    out = np.empty(n, np.float32)
    f32 = jax.ShapeDtypeStruct((), jnp.float32)

    def floor() -> np.ndarray:
        for i in range(n):
            out[i] = _dict_operand({"a": a[i, ...], "b": b[i, ...]})
        return out

    args = [jax.device_put(v) for v in (a, b)]
    f = jax.vmap(lambda u, v: threadmap(_dict_operand, f32, {"a": u, "b": v}))
    compiled = jax.jit(f).lower(*args).compile()
    return Signature(
        "dict",
        "a dict operand",
        lambda: jax.block_until_ready(compiled(*args)),
        floor,
        a + b,
    )


def _outer_case() -> Signature:
    side = round(SIGNATURE_ELEMENTS ** (1 / 3))
    x, y, z = (np.arange(side, dtype=np.float32) * j for j in (1, 10, 100))
    out = np.empty((side,) * 3, np.float32)

    def floor() -> np.ndarray:
        for i in range(side):
            xi = x[i, ...]
            for j in range(side):
                yj = y[j, ...]
                for k in range(side):
                    out[i, j, k] = _add3(xi, yj, z[k, ...])
        return out

    return Signature(
        "outer",
        "3-level outer product, 3 operands",
        outer_runner((x, y, z), False),
        floor,
        x[:, None, None] + y[None, :, None] + z[None, None, :],
    )


def signature_cases() -> dict[str, Callable[[], Signature]]:
    """Builders of the signature cases, by name (each compiles when built)."""
    return {
        "1": lambda: _positional("1", _inc, 1),
        "2": lambda: _positional("2", _add2, 2),
        "3": lambda: _positional("3", _add3, 3),
        "4": lambda: _positional("4", _add4, 4),
        "keyword": _keyword_case,
        "outputs": _two_outputs_case,
        "dict": _dict_case,
        "executor32": lambda: _positional(
            "executor32",
            _inc,
            1,
            executor=concurrent.futures.ThreadPoolExecutor(32),
        ),
        "outer": _outer_case,
    }
