"""A loader that runs JAX while plain programs on its results fill the device.

XLA's CPU client admits 32 programs per device; programs that wait for pending
data hold theirs. With 40 plain programs ``h(y)`` dispatched on ``y = f(x)`` and
``x``'s loader calling JAX, the loader waits for a slot that only its own result
frees: before ``_deadlock`` this hung for good (the scripts here never printed
their results). Each scenario runs in a subprocess, bounded in time, since the
failure mode is a hang; the watchdog's thresholds are lowered there so the tests
take seconds, not the default ``STALL_S`` (10 s).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import _async, _deadlock

pytestmark = pytest.mark.timeout(240)

ASYNC = _async.async_dispatch_status().startswith("async")

PRELUDE = """
import sys, threading, time
import numpy as np, jax, jax.numpy as jnp
import jax_threadmap as jtm
from jax_threadmap import _deadlock
_deadlock.STALL_S = 2.0
_deadlock.POLL_S = 0.1
SDS = jax.ShapeDtypeStruct
f = jax.jit(lambda v: v * 2)
h = jax.jit(lambda v, i: v + i)
g = jax.jit(lambda a: jnp.sin(a) * 0 + 1)
g(np.ones(4, np.float32)).block_until_ready()  # later calls: C++ only
go = threading.Event()

def release(after):
    threading.Timer(after, go.set).start()

def dispatch_behind(x, n):
    y = f(x)
    return [h(y, i) for i in range(n)]

def outcome(thunk):
    try:
        return "value " + str(np.asarray(thunk()).tolist())
    except Exception as e:
        ended = "ended a deadlock" in str(e)
        # XlaRuntimeError before jax 0.7 is the same class under its old name.
        jax_error = isinstance(e, jax.errors.JaxRuntimeError)
        name = "JaxRuntimeError" if jax_error else type(e).__name__
        return f"error {name} deadlock={ended}"
"""

LOADERS = {
    # jax.numpy functions written in Python: JAX frames on the loader's stack.
    "jnp_in_python": """
def load():
    go.wait(60)
    a = jnp.arange(4.0, dtype=jnp.float32)
    return np.asarray(jnp.sin(a) * 0 + 1)
""",
    # A jitted function called from the loader's own line: C++ from there on.
    "jitted_call": """
def load():
    go.wait(60)
    return np.asarray(g(np.ones(4, np.float32)))
""",
}

SCENARIO = """
x = jtm.async_call(load, SDS((4,), np.float32))
release(1.0)
t0 = time.monotonic()
outs = dispatch_behind(x, N)
print("x", outcome(x.result), flush=True)
print("last", outcome(lambda: outs[-1]), flush=True)
print("first", outcome(lambda: outs[0]), flush=True)
# The next call works, on the same device.
x2 = jtm.async_call(lambda: np.full(4, 3, np.float32), SDS((4,), np.float32))
print("next", outcome(lambda: f(x2)), flush=True)
print("seconds", round(time.monotonic() - t0, 1), flush=True)
"""


def run_script(body: str, timeout: float = 150) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + body],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    lines["stderr"] = proc.stderr
    return lines


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_loader_that_runs_jax_behind_a_full_device_fails_with_a_clear_error(loader):
    out = run_script(LOADERS[loader] + "N = 40\n" + SCENARIO)
    assert out["x"] == "error RuntimeError deadlock=True", out
    assert out["last"] == "error JaxRuntimeError deadlock=True", out
    assert out["first"] == "error JaxRuntimeError deadlock=True", out
    assert out["next"] == "value [6.0, 6.0, 6.0, 6.0]", out
    assert "ended a deadlock: `load` (async_call)" in out["stderr"]


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
def test_fewer_programs_behind_a_loader_that_runs_jax_get_their_values():
    out = run_script(LOADERS["jnp_in_python"] + "N = 20\n" + SCENARIO)
    assert out["x"] == "value [1.0, 1.0, 1.0, 1.0]", out
    assert out["last"] == "value [21.0, 21.0, 21.0, 21.0]", out
    assert out["first"] == "value [2.0, 2.0, 2.0, 2.0]", out
    assert out["next"] == "value [6.0, 6.0, 6.0, 6.0]", out


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
def test_a_slow_loader_without_jax_behind_a_full_device_is_not_failed():
    # The device stays full for about twice STALL_S, but the loader is not in
    # JAX: it will free the slots, so it must not be taken for a deadlock.
    body = """
def load():
    go.wait(60)
    return np.ones(4, np.float32)

x = jtm.async_call(load, SDS((4,), np.float32))
release(5.0)
outs = dispatch_behind(x, 40)
print("x", outcome(x.result), flush=True)
print("last", outcome(lambda: outs[-1]), flush=True)
"""
    out = run_script(body)
    assert out["x"] == "value [1.0, 1.0, 1.0, 1.0]", out
    assert out["last"] == "value [41.0, 41.0, 41.0, 41.0]", out


def _calls_jnp_on_this_line():
    return _deadlock._line_calls_jax(sys._getframe()) and jnp.sin is not None


def _calls_numpy_on_this_line():
    return _deadlock._line_calls_jax(sys._getframe()) or np.sin is None


def _with_a_local(fn):
    return _deadlock._line_calls_jax(sys._getframe()) and fn is not None


FNS = {"jitted": jax.jit(lambda a: a), "plain": np.sin}


def _from_a_dict(key):
    return _deadlock._line_calls_jax(sys._getframe()) and FNS["jitted"] is not None


def _from_a_dict_plain(key):
    return _deadlock._line_calls_jax(sys._getframe()) or FNS["plain"] is None


def _reads_a_dtype_and_a_shape(spec):
    return _deadlock._line_calls_jax(sys._getframe()) or (jnp.float32, spec.shape)


def test_the_current_line_is_read_for_jitted_functions():
    assert _calls_jnp_on_this_line()
    assert not _calls_numpy_on_this_line()
    assert _with_a_local(jnp.cos)
    assert _with_a_local(functools.partial(jax.jit(lambda a, b: a + b), 1))
    assert not _with_a_local(np.cos)
    assert not _with_a_local(functools.partial(np.add, 1))
    assert _from_a_dict("jitted")
    assert not _from_a_dict_plain("plain")
    # A dtype and a ShapeDtypeStruct on the line are not a call into JAX.
    assert _reads_a_dtype_and_a_shape(jax.ShapeDtypeStruct((2,), jnp.float32))


def _frame_of(module: str, name: str):
    """A frame of a function named ``name`` whose module is ``module``."""
    scope = {"__name__": module, "sys": sys}
    exec(f"def {name}():\n    return sys._getframe()\n", scope)
    return scope[name]()


def test_the_innermost_frame_decides_whether_a_thread_is_in_jax():
    assert _deadlock._in_jax(_frame_of("jax._src.interpreters.pxla", "__call__"))
    # Compiling needs no slot.
    assert not _deadlock._in_jax(_frame_of("jax._src.compiler", "backend_compile"))
    # User code that JAX called (jax.tree.map(download, urls)) is user code.
    frames = []

    def download(url):
        frames.append(sys._getframe())
        return url

    jax.tree.map(download, ["a"])
    assert _deadlock._in_jax(frames[0].f_back)  # tree.map itself
    assert not _deadlock._in_jax(frames[0])
