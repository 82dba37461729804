"""Helpers shared by the tests (fixtures live in conftest.py)."""

import concurrent.futures
import contextlib
import itertools
import os
import pathlib
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

#: How many examples each hypothesis test draws: "quick" (the default: a quarter of
#: the full count, for a test run in minutes) or "full" (CI's default leg sets it).
EXAMPLES = os.environ.get("JAX_THREADMAP_TEST_EXAMPLES", "quick")
if EXAMPLES not in ("quick", "full"):
    raise ValueError(
        f"JAX_THREADMAP_TEST_EXAMPLES must be 'quick' or 'full', got {EXAMPLES!r}. "
        "Unset it for quick counts; CI's default leg sets 'full'."
    )


def _loopback_sockets() -> bool:
    """Whether this machine lets a process open a socket on the loopback (a lent
    TPU host refuses even that: Dask and jax.distributed cannot run there)."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError:
        return False
    return True


#: Whether loopback sockets work here; the tests that need them skip otherwise.
LOOPBACK = _loopback_sockets()
NO_LOOPBACK = "needs loopback sockets, which this machine refuses"


#: The relative tolerance of float32 transcendentals (sin, exp, tanh) computed
#: by jax.numpy on the default backend against NumPy on the host: the CPU's
#: agree to the last digits, an accelerator's to about four or five.
F32_RTOL = 1e-6 if jax.default_backend() == "cpu" else 2e-4


def examples(full: int) -> int:
    """A hypothesis test's ``max_examples``: ``full`` in CI's default leg, a
    quarter otherwise."""
    return full if EXAMPLES == "full" else max(3, full // 4)


#: One element's core shapes of x and z in the nested-vmap property tests.
X_CORE, Z_CORE = (2,), (3,)


def count_eqns(jaxpr, name: str) -> int:
    """Counts equations of primitive ``name``, sub-jaxprs included."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            n += 1
        for sub in jaxprs_in_params(eqn.params):
            n += count_eqns(sub, name)
    return n


def threadmap_eqns(jaxpr) -> list:
    """The ``threadmap`` equations of ``jaxpr``, sub-jaxprs included, in order."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "threadmap":
            out.append(eqn)
        for sub in jaxprs_in_params(eqn.params):
            out.extend(threadmap_eqns(sub))
    return out


def kname(eqn) -> str:
    """The name of a ``threadmap`` equation's kernel, without its enclosing
    function."""
    return str(eqn.params["kernel"]).rsplit(".", 1)[-1]


def nest(fn, levels):
    """``fn`` under one ``jax.vmap`` per entry of ``levels`` (its ``in_axes``,
    innermost first)."""
    for axes in levels:
        fn = jax.vmap(fn, in_axes=axes)
    return fn


def jaxprs_in_params(params):
    # What jax.extend.core.jaxprs_in_params (jax >= 0.10) does, for every JAX.
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def cause_of(e: BaseException) -> BaseException | None:
    """``e.__cause__``, as JAX's traceback filter leaves it.

    On Python 3.10 only, an exception that crosses a JAX API gets a
    ``SimplifiedTraceback`` as its ``__cause__``, with the original cause behind
    it (jax/_src/traceback_util.py; Python 3.11 has notes instead).
    """
    cause = e.__cause__
    if sys.version_info < (3, 11) and type(cause).__name__ == "SimplifiedTraceback":
        assert type(cause.__cause__).__name__ != "SimplifiedTraceback"
        return cause.__cause__
    return cause


def random_values(rng, shape, dtype):
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype == "int32":
        return rng.integers(-50, 50, shape).astype(np.int32)
    if dtype == "complex64":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(
            np.complex64
        )
    return rng.standard_normal(shape).astype(dtype)


@st.composite
def nestings(draw, max_depth=4):
    depth = draw(st.integers(1, max_depth))
    sizes = [draw(st.integers(1, 4)) for _ in range(depth)]
    # ndims of x, y["a"], z inside the innermost level; grows outward as axes are added.
    ndims = [len(X_CORE), 0, len(Z_CORE)]
    out_ndims = [len(X_CORE), 0]
    in_axes, out_axes = [], []
    for _level in reversed(range(depth)):
        axes = [draw(st.none() | st.integers(-(n + 1), n)) for n in ndims]
        if all(a is None for a in axes):
            k = draw(st.integers(0, 2))
            axes[k] = draw(st.integers(-(ndims[k] + 1), ndims[k]))
        outs = [draw(st.integers(-(m + 1), m)) for m in out_ndims]
        in_axes.append(axes)
        out_axes.append(outs)
        ndims = [n + (a is not None) for n, a in zip(ndims, axes, strict=True)]
        out_ndims = [m + 1 for m in out_ndims]
    # in_axes/out_axes are listed innermost level first.
    return sizes, in_axes, out_axes


def build(fn, sizes, in_axes, out_axes):
    depth = len(sizes)
    for level in range(depth):  # innermost first
        ax_x, ax_y, ax_z = in_axes[level]
        o1, o2 = out_axes[level]
        fn = jax.vmap(
            fn,
            in_axes=(ax_x, {"a": ax_y}, ax_z),
            out_axes=(o1, {"s": o2}),
            axis_size=sizes[depth - 1 - level],
        )
    return fn


def make_inputs(rng, sizes, in_axes, dtype):
    depth = len(sizes)
    shapes = [list(X_CORE), [], list(Z_CORE)]
    for level in range(depth):  # innermost first: insert its axis
        size = sizes[depth - 1 - level]
        for k, a in enumerate(in_axes[level]):
            if a is not None:
                n = len(shapes[k]) + 1
                shapes[k].insert(a % n, size)
    x, ya, z = (random_values(rng, tuple(s), dtype) for s in shapes)
    return x, {"a": ya}, z


def assert_trees_close(actual, expected, dtype):
    la, ta = jax.tree_util.tree_flatten(actual)
    le, te = jax.tree_util.tree_flatten(expected)
    assert ta == te
    for a, e in zip(la, le, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape)
        if dtype in ("int32", "bool"):
            np.testing.assert_array_equal(a, e)
        else:
            np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)


#: (returned value, declared dtype): casts within the kinds bool -> integer ->
#: floating -> complex, whose values NumPy keeps or loses.
VALUE_CASES = [
    # integers, signed and unsigned alike
    (np.int64(2**31 + 5), np.int32),
    (np.int64(-(2**31) - 1), np.int32),
    (np.int64(5), np.int8),
    (300, np.int8),
    (-128, np.int8),
    (-1, np.uint8),
    (255, np.uint8),
    (np.int64(-1), np.uint32),
    (np.int64(7), np.uint32),
    (np.uint32(4_000_000_000), np.int32),
    (np.uint64(2**63), np.int64),
    (np.arange(4, dtype=np.int64) * 1_000_000_000, np.int32),
    (np.arange(4, dtype=np.int64), np.uint16),
    (2**70, np.int32),
    (2**64 - 1, np.uint64),
    (np.int8(7), jnp.int4),
    (np.int8(8), jnp.int4),
    (np.int8(-1), jnp.uint4),
    (True, np.int8),
    (np.array([True, False]), np.float16),
    # integers to floats
    (np.int32(70000), np.float16),
    (np.int64(2**40), np.float16),
    (np.int64(2**40), np.float32),
    (2**70, np.float32),
    (2**200, np.float32),
    # floats
    (1.5, np.float32),
    (np.float64(0.1), np.float32),
    (np.float64(1e300), np.float32),
    (-1e300, np.float32),
    (np.float64(1e-50), np.float32),
    (float("inf"), np.float32),
    (float("-inf"), np.float16),
    (float("nan"), np.float32),
    (70000.0, np.float16),
    (65519.0, np.float16),  # rounds to the largest float16, 65504
    (65520.0, np.float16),  # rounds to inf
    (np.float32(3.4e38), jnp.bfloat16),
    (3.0e38, jnp.bfloat16),
    (448.0, jnp.float8_e4m3fn),
    (1e10, jnp.float8_e4m3fn),  # no inf in this format: nan
    (np.array([1.0, 2.0, 1e300, np.inf]), np.float32),
    (np.array([[1.0, np.nan], [-1e39, 0.0]]), np.float32),
    # complex: each part
    (np.complex128(1e300 + 1j), np.complex64),
    (np.complex128(1 + 1e300j), np.complex64),
    (np.complex128(complex(np.inf, 1)), np.complex64),
    (complex(1.5, 2), np.complex64),
    (np.float64(1e300), np.complex64),
    (np.float64(1.5), np.complex64),
    (np.zeros((2, 0)), np.float16),
    # larger arrays (scanned with NumPy reductions rather than in Python)
    (np.arange(100.0) * 1e37, np.float32),
    (np.r_[np.full(50, np.nan), np.arange(50.0)], np.float16),
    (np.arange(200, dtype=np.int64) - 100, np.int8),
    (np.arange(200, dtype=np.int64) - 50, np.int8),
    (np.arange(40, dtype=np.uint64) * 2**58, np.int64),
]


def numpy_keeps_value(value, dtype) -> bool:
    """The reference: whether NumPy's own cast keeps every value."""
    v = np.asarray(value)
    try:
        with np.errstate(all="ignore"):
            cast = v.astype(dtype)
    except OverflowError:  # a Python int beyond int64
        return False
    if jnp.issubdtype(dtype, np.integer):
        return np.array_equal(cast.astype(object), v.astype(object))
    src, dst = v.astype(np.complex128), cast.astype(np.complex128)
    lost = (np.isfinite(src.real) & ~np.isfinite(dst.real)) | (
        np.isfinite(src.imag) & ~np.isfinite(dst.imag)
    )
    return not lost.any()


#: How long a test waits for what must happen before it fails: generous, so that
#: only a hang fails a test, never a slow or loaded machine.
PATIENCE = 60.0


def wait_until(condition, what: str, *, timeout: float = PATIENCE, poll=0.01):
    """Waits until ``condition`` holds; fails, saying that ``what`` never
    happened, once ``timeout`` seconds have passed without it.

    ``condition`` is a ``threading.Event`` (waited on) or a function of no
    arguments (called every ``poll`` seconds until it returns true). The bound
    turns a hang into a failure; it is never a measure of speed, so it is
    generous (:data:`PATIENCE`): a wait that may be long (a thread pool
    emptying, a child process ending) waits on what it waits for.
    """
    if isinstance(condition, threading.Event):
        assert condition.wait(timeout), f"{what}: not within {timeout} s"
        return
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(poll)


def returns_within(fn, *args, limit: float, what: str = "return"):
    """Runs ``fn(*args)`` in a daemon thread and returns its value (or raises its
    error); fails, naming ``fn``, unless it ends within ``limit`` seconds."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # reported to the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"{fn} did not {what}"
    if "error" in box:
        raise box["error"]
    return box["value"]


#: This checkout, first on every child's path.
ROOT = pathlib.Path(__file__).resolve().parent.parent


def child_env(env: dict | None = None, unset: tuple[str, ...] = ()) -> dict:
    """The environment of a child process of the tests: this one's (conftest.py
    adds the tests' folder to ``PYTHONPATH`` and quiets the TPU host's warning),
    on the CPU (``JAX_PLATFORMS=cpu``: on an accelerator this process holds the
    device, and one process at a time may hold a TPU), with this checkout first
    on the path and the machine's ``PYTHONPATH`` after it; then ``env``, and
    without the variables ``unset``."""
    full = dict(os.environ, JAX_PLATFORMS="cpu")
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), full.get("PYTHONPATH")) if p
    )
    full.update(env or {})
    for name in unset:
        full.pop(name, None)
    return full


def package_settings() -> tuple[str, ...]:
    """The ``JAX_THREADMAP_*`` variables set here (conftest.py's pool size, a
    test run's own choices): for a child that runs as a user's script does,
    without them (``unset=``)."""
    return tuple(k for k in os.environ if k.startswith("JAX_THREADMAP_"))


class Ran(subprocess.CompletedProcess):
    """A child's run: its status and output, and a report of them."""

    @property
    def report(self) -> str:
        """Its stdout and the end of its stderr, for assertion messages."""
        return self.stdout + self.stderr[-5000:]


def _argv(script: str | pathlib.Path, args: tuple, flags: tuple) -> list[str]:
    if isinstance(script, pathlib.Path):  # a file, run as a user runs it
        return [sys.executable, *flags, str(script), *map(str, args)]
    source = textwrap.dedent(SIGINT_AS_USUAL) + textwrap.dedent(script)
    return [sys.executable, *flags, "-c", source, *map(str, args)]


def run_script(
    script: str | pathlib.Path,
    *args: object,
    env: dict | None = None,
    unset: tuple[str, ...] = (),
    timeout: float = 120,
    flags: tuple[str, ...] = (),
    input: str | None = None,
    forked: bool = False,
    name: str = "script.py",
) -> Ran:
    """Runs a script in a child process and returns its run; a hang fails at
    ``timeout`` (``subprocess.TimeoutExpired``). The one way the tests start
    Python children.

    ``script`` is source (dedented; run as ``python [flags] -c SOURCE ARGS``,
    after :data:`SIGINT_AS_USUAL`) or the path of a file (``python [flags] FILE
    ARGS``). The child's environment is :func:`child_env` (``env``, ``unset``).
    With ``forked``, source runs as ``python FILE ARGS`` would, from a file ``name``
    in a fresh folder, forked from a process that imported JAX once
    (``tests/fresh_scripts.py``, which checks that such a script ends as in a
    fresh interpreter): a fraction of a fresh interpreter's start.
    """
    full = child_env(env, unset)
    if forked:
        assert isinstance(script, str) and not (flags or input), script
        import fresh_scripts

        with tempfile.TemporaryDirectory() as tmp:
            file = pathlib.Path(tmp) / name
            file.write_text(textwrap.dedent(script))
            done = fresh_scripts.run(
                str(file), cwd=tmp, env=full, timeout=timeout, args=args
            )
    else:
        done = subprocess.run(
            _argv(script, args, flags),
            env=full,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return Ran(done.args, done.returncode, done.stdout, done.stderr)


def run_scripts_at_once(scripts: list[str], timeout: float = 120) -> list[Ran]:
    """Runs each of ``scripts`` (source) as :func:`run_script` runs it, in a
    fresh interpreter, all at once: a test that repeats a run to make a race
    likely waits for one run, not for each. A hang fails at ``timeout``
    (``subprocess.TimeoutExpired``), and every child is ended then."""
    procs = [start_script(script) for script in scripts]
    deadline = time.monotonic() + timeout
    ran = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=deadline - time.monotonic())
            ran.append(Ran(p.args, p.returncode, out, err))
        return ran
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def start_script(
    script: str | pathlib.Path,
    *args: object,
    env: dict | None = None,
    unset: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
    stderr: Any = subprocess.PIPE,
) -> subprocess.Popen:
    """Starts a script as :func:`run_script` runs it, for a test that talks to
    it while it runs (reads its output, sends it Ctrl-C): its stdout is a pipe
    of text, and so is its stderr, unless ``stderr`` says where it goes (a file,
    for a test that reads stdout alone). The caller waits for it."""
    return subprocess.Popen(
        _argv(script, args, flags),
        env=child_env(env, unset),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


@contextlib.contextmanager
def executor_of(kind, n):
    """``executor=n`` (a shared pool), or for ``kind == "user"`` a
    ``ThreadPoolExecutor(n)`` that is shut down afterwards."""
    if kind != "user":
        yield n
        return
    ex = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="mine")
    try:
        yield ex
    finally:
        ex.shutdown()


def peak_mb() -> float:
    """This process's peak resident memory, in MB. Test scripts run in a child
    get it with ``inspect.getsource(peak_mb)``."""
    # VmHWM, this address space's own peak: ru_maxrss would start at the peak of
    # the (pytest) parent, which Linux keeps across fork and exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


#: Seconds a faked clock advances per reading: "slow" makes every element
#: look like it took an hour, "fast" like it took no time at all.
CLOCK_STEPS = {"slow": 3600.0, "fast": 0.0}


def fake_clocks(monkeypatch, speed: str) -> None:
    """Replaces the clocks the package may read to time work
    (``time.perf_counter``, ``time.thread_time``, ``time.process_time``,
    ``time.monotonic``) with one that advances ``CLOCK_STEPS[speed]`` seconds per
    reading. Waits with timeouts (``threading``'s) keep the real clock."""
    step = CLOCK_STEPS[speed]
    ticks = itertools.count()
    now = time.monotonic()

    def clock():
        return now + step * next(ticks)

    for name in ("perf_counter", "thread_time", "process_time", "monotonic"):
        monkeypatch.setattr(time, name, clock)


#: Every case with the clock faked very slow and very fast (:func:`fake_clocks`).
CLOCKS = pytest.mark.parametrize("clock", ["slow", "fast"])


@contextlib.contextmanager
def clocked_executor(monkeypatch, kind, n, clock: str, cpus: int | None = None):
    """:func:`executor_of` ``(kind, n)`` with the clocks faked ``clock``
    (:func:`fake_clocks`) and, unless ``None``, ``cpus`` CPUs as the executor
    layer sees them."""
    from jax_threadmap._executors import runners

    if cpus is not None:
        monkeypatch.setattr(runners, "available_cpus", lambda: cpus)
    fake_clocks(monkeypatch, clock)
    with executor_of(kind, n) as ex:
        yield ex


@contextlib.contextmanager
def cpus_seen(n: int):
    """This process (not its children) reports ``n`` CPUs while the context is
    entered: ``os.sched_getaffinity`` (what the package reads,
    ``_support/cpus.py``) and ``os.cpu_count``. For a test of a core count the
    machine lacks; ``pytest --cpus N`` (conftest.py) runs a whole session so."""
    if n < 1:
        raise ValueError(f"cpus_seen takes a CPU count of at least 1, got {n}")
    saved = os.sched_getaffinity, os.cpu_count
    os.sched_getaffinity = lambda pid=0: set(range(n))  # type: ignore[assignment]
    os.cpu_count = lambda: n
    try:
        yield
    finally:
        os.sched_getaffinity, os.cpu_count = saved


def all_idle(threads) -> bool:
    """Whether every thread of a set of shared threads (``kept_threads``) is
    idle: none is still on its way back from a map (a map started then may
    start a thread)."""
    with threads.lock:
        return len(threads.idle) == len(threads.workers)


def nested_pids(kernel, executor, **options) -> set[int]:
    """Runs ``kernel(x, y, scale=s)`` (``worker_kernels.scaled_with_pid`` or its
    vectorized twin; ``options`` go to ``threadmap``) under ``jit`` of two
    ``vmap`` levels on ``executor``: x batched at both levels, y at the inner
    one only, s unbatched. Checks the values against ``(x + y) * s``; returns
    the ids of the processes that ran the elements."""
    from jax_threadmap import threadmap

    out = {
        "value": jax.ShapeDtypeStruct((3,), jnp.float32),
        "pid": jax.ShapeDtypeStruct((), jnp.int32),
    }

    def f(x, y, s):
        return threadmap(kernel, out, x, y, scale=s, executor=executor, **options)

    g = jax.jit(jax.vmap(jax.vmap(f, (0, 0, None)), (0, None, None)))
    x = np.arange(5 * 4 * 3, dtype=np.float32).reshape(5, 4, 3)
    y = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) * 10
    res = g(x, y, np.float32(2))
    np.testing.assert_allclose(res["value"], (x + y[None]) * 2)
    return set(np.asarray(res["pid"]).ravel().tolist())


#: First in a child script that a test sends Ctrl-C: a child started from a process
#: that ignores SIGINT (pytest run as a background job, ``cmd &``) inherits the
#: ignoring, and then neither a signal nor ``_thread.interrupt_main`` reaches it.
SIGINT_AS_USUAL = """
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
"""


@contextlib.contextmanager
def sigint_as_usual():
    """Python's own Ctrl-C handler for the block, in this process (see
    :data:`SIGINT_AS_USUAL`); the handler before it is put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


class Held:
    """A pending array whose load returns ``value`` only when released."""

    def __init__(self, value: np.ndarray):
        import jax_threadmap

        self.release = threading.Event()

        def load():
            assert self.release.wait(PATIENCE), "the test never released the load"
            return value

        self.array = jax_threadmap.async_call(
            load, jax.ShapeDtypeStruct(value.shape, value.dtype)
        )
