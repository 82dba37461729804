"""Exit with background calls in flight: the process ends with status 0, always.

Before Python 3.14, a daemon thread that wants the GIL back while the
interpreter finalizes is ended with ``pthread_exit``, which unwinds the C++
frames it is in: a loader's thread that was placing its values in XLA then
aborted the process ("terminate called without an active exception", "FATAL:
exception not rethrown"; about 1 run in 30 of a script that made an
``AsyncArray`` and exited at once, under load). Exit now lets no landing start
and waits for those in flight (``_arrays/async_pool.py``, ``_Landings``).

The scripts here make that race likely instead of rare: the loaders return at
the moment exit reports them (``warnings.showwarning`` lets them go, then waits
a little), which aborted every run before the fix.
"""

from __future__ import annotations

import pytest
from helpers import run_script, run_scripts_at_once

#: Loaders that return while exit reports them; with ``JITTED``, a jitted program
#: waits on each (deferred, to be dispatched when it lands).
RACE = """
import threading, time, warnings
import jax, numpy as np
import jax_threadmap as jtm

S = jax.ShapeDtypeStruct((1 << 20,), np.float32)
go = threading.Event()
shown = warnings.showwarning

def showwarning(*args, **kwargs):
    go.set()  # the loaders return now, while exit goes on
    time.sleep(0.05)
    shown(*args, **kwargs)

warnings.showwarning = showwarning

def load():
    go.wait()
    return np.ones(1 << 20, np.float32)

xs = [jtm.async_call(load, S) for _ in range(8)]
ys = [jax.jit(lambda a: a * 2)(x) for x in xs] if JITTED else []
print("exiting", flush=True)
"""

#: The script of the report: an array made, and the process ends at once.
AT_ONCE = """
import jax, numpy as np
import jax_threadmap as jtm
x = jtm.async_call(lambda: np.ones(1000, np.float32),
                   jax.ShapeDtypeStruct((1000,), np.float32))
"""

pytestmark = pytest.mark.long  # (conftest.py: they start first)

RUNS = 2  # each case aborted 3 runs in 3 before the fix (fresh processes)


def assert_clean(proc) -> None:
    err = proc.stderr
    assert proc.returncode == 0, (proc.returncode, err[-3000:])
    assert "terminate called" not in err and "FATAL" not in err, err[-3000:]


@pytest.mark.parametrize("jitted", [False, True], ids=["plain", "deferred"])
def test_loaders_that_return_during_exit_never_abort_it(jitted):
    # Fresh processes: forked from a zygote (tests/fresh_scripts.py), the same
    # script aborted 1 run in 3 before the fix.
    for proc in run_scripts_at_once([f"JITTED = {jitted}\n" + RACE] * RUNS):
        assert_clean(proc)
        assert "exiting" in proc.stdout, proc.stdout
        # Reported and abandoned, not placed: they returned once exit had begun.
        assert "background call(s) have not returned" in proc.stderr, proc.stderr


def test_a_script_that_exits_at_once_ends_cleanly():
    for _ in range(RUNS):
        assert_clean(run_script(AT_ONCE, forked=True))


#: A thread waits for a deferred result whose load hangs; the process exits once
#: that thread is inside its wait (tests/wait_hooks.py says so from inside it).
#: Exit's wait for landings is made an hour long: it waits for placements and
#: dispatches in flight, never for a load.
WAITER = """
import threading
import jax, numpy as np
import jax_threadmap as jtm
from jax_threadmap._arrays import async_pool
from wait_hooks import calling_on_wait

async_pool.EXIT_PLACE_S = 3600.0
started, waiting = threading.Event(), threading.Event()

def hang():
    started.set()
    threading.Event().wait()
    return np.zeros(4, np.float32)

x = jtm.async_call(hang, jax.ShapeDtypeStruct((4,), np.float32))
y = jax.jit(lambda a: a * 2)(x)
assert started.wait(60)  # on a pool thread: the waiter below waits, never runs it

def waiter():
    np.asarray(y)

with calling_on_wait(waiting.set):
    threading.Thread(target=waiter, daemon=True).start()
    assert waiting.wait(60)  # the waiter is inside its wait for the load
print("exiting", flush=True)
"""


def test_a_thread_waiting_for_a_deferred_result_does_not_hold_exit():
    proc = run_script(WAITER, timeout=60, forked=True)
    assert_clean(proc)
    assert "exiting" in proc.stdout, proc.stdout
    assert "background call(s) have not returned" in proc.stderr, proc.stderr
