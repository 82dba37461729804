"""A loader that runs JAX while programs on its results fill the device.

XLA's CPU client admits 32 programs per device at a time, and a program that waits
for pending data holds its slot. jax_threadmap itself holds at most two per gate
program (``MAX_WAITING_PROGRAMS`` per device); plain programs on results of a
pending load (``h(y)`` after ``y = f(x)``) hold the rest. With every slot held,
a loader that itself runs JAX on that device waits for a slot that only its own
result frees: the call's ``timeout`` ends that (docs/async.md, "A loader that runs
JAX"). Each scenario runs in a subprocess, since the failure mode is a hang; the
loader starts its JAX call only once every program is dispatched (an event, no
thresholds), so the slots are full when it does.
"""

from __future__ import annotations

import pytest
from helpers import run_script

from jax_threadmap._arrays import async_dispatch as _async_dispatch

pytestmark = pytest.mark.timeout(240)

ASYNC = _async_dispatch.async_dispatch_status().startswith("async")
#: The slots these scenarios fill are those of the gate programs (the CPU's
#: mechanism); deferred dispatch holds none while data is pending.
GATES = _async_dispatch.async_dispatch_status() == "async"

PRELUDE = """
import sys, threading, time
import numpy as np, jax, jax.numpy as jnp
import jax_threadmap as jtm
SDS = jax.ShapeDtypeStruct
f = jax.jit(lambda v: v * 2)
h = jax.jit(lambda v, i: v + i)
g = jax.jit(lambda a: jnp.sin(a) * 0 + 1)
g(np.ones(4, np.float32)).block_until_ready()  # later calls: C++ only
go, returned = threading.Event(), threading.Event()

def outcome(thunk):
    try:
        return "value " + str(np.asarray(thunk()).tolist())
    except Exception as e:
        # XlaRuntimeError before jax 0.7 is the same class under its old name.
        jax_error = isinstance(e, jax.errors.JaxRuntimeError)
        name = "JaxRuntimeError" if jax_error else type(e).__name__
        timed_out = "`load`, which jax_threadmap.async_call ran, did not" in str(e)
        return f"error {name} timeout={timed_out}"
"""

LOADERS = {
    # jax.numpy functions written in Python: JAX frames on the loader's stack.
    "jnp_in_python": """
def load():
    go.wait(60)
    a = jnp.arange(4.0, dtype=jnp.float32)
    out = np.asarray(jnp.sin(a) * 0 + 1)
    returned.set()
    return out
""",
    # A jitted function called from the loader's own line: C++ from there on.
    "jitted_call": """
def load():
    go.wait(60)
    out = np.asarray(g(np.ones(4, np.float32)))
    returned.set()
    return out
""",
}

SCENARIO = """
x = jtm.async_call(load, SDS((4,), np.float32), timeout=TIMEOUT)
y = f(x)  # a gate program and f: two slots
outs = [h(y, i) for i in range(min(N, 30))]  # each holds a slot until y is there
go.set()  # the loader now runs JAX: with N >= 30, every slot is held
outs += [h(y, i) for i in range(30, N)]  # these wait inside XLA for a slot
print("x", outcome(x.result), flush=True)
print("last", outcome(lambda: outs[-1]), flush=True)
print("first", outcome(lambda: outs[0]), flush=True)
print("returned", returned.wait(60), flush=True)  # the loader's JAX call
# The next call works, on the same device.
x2 = jtm.async_call(lambda: np.full(4, 3, np.float32), SDS((4,), np.float32))
print("next", outcome(lambda: f(x2)), flush=True)
"""


def scenario(body: str) -> dict[str, str]:
    """Runs a scenario in a child; what it printed, by line's first word."""
    ran = run_script(PRELUDE + body, timeout=150)
    assert ran.returncode == 0, ran.report
    lines = dict(line.split(" ", 1) for line in ran.stdout.splitlines() if " " in line)
    lines["stderr"] = ran.stderr
    return lines


@pytest.mark.skipif(not GATES, reason="the gate programs' slots (deferred: none)")
@pytest.mark.parametrize("n", [30, 40])
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_the_timeout_ends_a_loader_that_runs_jax_behind_a_full_device(loader, n):
    # 30: every slot is held when the loader's JAX call starts; 40: then the
    # dispatching thread also waits inside XLA for a slot, until the timeout.
    out = scenario(LOADERS[loader] + f"N = {n}\nTIMEOUT = 3.0\n" + SCENARIO)
    assert out["x"] == "error TimeoutError timeout=True", out
    assert out["last"] == "error JaxRuntimeError timeout=True", out
    assert out["first"] == "error JaxRuntimeError timeout=True", out
    # The slots were freed: the loader's own JAX call went on (what it returned
    # was dropped), and the next call gets its value.
    assert out["returned"] == "True", out
    assert out["next"] == "value [6.0, 6.0, 6.0, 6.0]", out
    assert "FATAL" not in out["stderr"], out["stderr"][-3000:]


NUMPY_LOADER = """
def load():
    go.wait(60)  # a download: no JAX
    returned.set()
    return np.ones(4, np.float32)
"""


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
@pytest.mark.parametrize("n", [30, 40])
def test_a_loader_without_jax_behind_a_full_device_gets_its_values(n):
    # Nothing fails a call that has no timeout, however full the device.
    out = scenario(NUMPY_LOADER + f"N = {n}\nTIMEOUT = None\n" + SCENARIO)
    assert out["x"] == "value [1.0, 1.0, 1.0, 1.0]", out
    assert out["last"] == f"value [{n + 1.0}, {n + 1.0}, {n + 1.0}, {n + 1.0}]", out
    assert out["first"] == "value [2.0, 2.0, 2.0, 2.0]", out


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_fewer_programs_behind_a_loader_that_runs_jax_get_their_values(loader):
    out = scenario(LOADERS[loader] + "N = 20\nTIMEOUT = 60.0\n" + SCENARIO)
    assert out["x"] == "value [1.0, 1.0, 1.0, 1.0]", out
    assert out["last"] == "value [21.0, 21.0, 21.0, 21.0]", out
    assert out["first"] == "value [2.0, 2.0, 2.0, 2.0]", out
    assert out["next"] == "value [6.0, 6.0, 6.0, 6.0]", out
