"""A loader that runs JAX while many programs on its results wait for it.

XLA's CPU client admits 32 programs per device at a time. With gate programs
(before deferred dispatch became the one mechanism), a program that waited for
pending data held its slot, and with 30 programs on a pending load's results
(``h(y)`` after ``y = f(x)``) a loader that itself ran JAX on that device waited
for a slot that only its own result freed: only the call's ``timeout`` ended it.
Deferred programs hold no slot while their data is pending, so the loader's JAX
call runs and every program gets its value. Each scenario runs in a subprocess,
since the failure mode is a hang; the loader starts its JAX call only once every
program is dispatched (an event, no thresholds).
"""

from __future__ import annotations

import pytest
from helpers import run_script

from jax_threadmap._arrays import dispatch as _dispatch

pytestmark = pytest.mark.timeout(240)

ASYNC = _dispatch.mechanism.status() is None  # None: no reason to block

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
    # A download: no JAX.
    "numpy": """
def load():
    go.wait(60)
    returned.set()
    return np.ones(4, np.float32)
""",
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
y = f(x)  # deferred until x lands
outs = [h(y, i) for i in range(min(N, 30))]  # (gate programs: a slot each)
go.set()  # the loader now runs JAX (gate programs: with N >= 30, no slot left)
outs += [h(y, i) for i in range(30, N)]  # (gate programs: waited for a slot)
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
    ran = run_script(PRELUDE + body, timeout=150, forked=True)
    assert ran.returncode == 0, ran.report
    lines = dict(line.split(" ", 1) for line in ran.stdout.splitlines() if " " in line)
    lines["stderr"] = ran.stderr
    return lines


@pytest.mark.skipif(not ASYNC, reason="async dispatch is off here")
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_loader_behind_40_programs_on_its_results_gets_its_values(loader):
    # Was (gate programs): with a loader that ran JAX, every program and the
    # load failed with the call's timeout (the device's slots were all held).
    out = scenario(LOADERS[loader] + "N = 40\nTIMEOUT = 60.0\n" + SCENARIO)
    assert out["x"] == "value [1.0, 1.0, 1.0, 1.0]", out
    assert out["last"] == "value [41.0, 41.0, 41.0, 41.0]", out
    assert out["first"] == "value [2.0, 2.0, 2.0, 2.0]", out
    assert out["returned"] == "True", out
    assert out["next"] == "value [6.0, 6.0, 6.0, 6.0]", out
    assert "FATAL" not in out["stderr"], out["stderr"][-3000:]
