"""tests/fresh_scripts.py runs a script as ``python FILE`` does: each case runs both
ways (forked from the zygote, and in a fresh interpreter) and must end the same."""

import os
import pathlib
import subprocess
import sys

import fresh_scripts
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Runs in child processes on the CPU (conftest.py, tests/tpu_suite.sh).
pytestmark = pytest.mark.children

SCRIPTS = {
    # Output, a warning, an atexit hook and a non-daemon thread that outlives the
    # script's last line (interpreter shutdown joins it before the hook runs).
    "shutdown": """
import atexit, threading, time, warnings
import numpy as np
atexit.register(lambda: print("atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread"))).start()
warnings.warn("careful")
print(np.arange(3).sum())
""",
    # A name the script never imported (the zygote imported numpy): its globals
    # start empty, and the traceback starts at the script, as python prints it.
    "missing_import": "x = 1\nprint(np.arange(3))\n",
    # The exit status and arguments; XLA_FLAGS set by the script before JAX's
    # backend starts.
    "exit_status": """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
import jax
print(len(jax.devices()), __name__, sys.argv[0] == __file__, sys.argv[1:])
sys.exit(3)
""",
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_forked_script_ends_as_in_a_fresh_interpreter(name, tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_THREADMAP_")}
    # This checkout first, then what the machine's own path holds (JAX, there).
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    file = tmp_path / f"{name}.py"
    file.write_text(SCRIPTS[name])
    fresh = subprocess.run(
        [sys.executable, str(file), "jit", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    monkeypatch.setenv("JAX_THREADMAP_TEST_FRESH_SCRIPTS", "fork")
    forked = fresh_scripts.run(
        str(file), cwd=str(tmp_path), env=env, timeout=300, args=("jit", 2)
    )
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )
    assert fresh.returncode == (
        3 if name == "exit_status" else name == "missing_import"
    )
    if name == "exit_status":
        assert fresh.stdout == "3 __main__ True ['jit', '2']\n"


def test_a_script_past_its_timeout_is_killed(tmp_path, monkeypatch):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    # Zygotes of this test's own that import nothing but the standard library:
    # what ends a stuck script and replaces its zygote does not depend on the
    # imports, and each zygote that imports JAX costs 2 s of CPU to start.
    monkeypatch.setattr(fresh_scripts, "ZYGOTE_IMPORTS", ("json",))
    monkeypatch.setattr(fresh_scripts, "_zygotes", {})
    monkeypatch.setenv("JAX_THREADMAP_TEST_FRESH_SCRIPTS", "fork")
    file = tmp_path / "stuck.py"
    file.write_text("import threading\nthreading.Event().wait()\n")

    def zygote():
        return fresh_scripts._zygotes[fresh_scripts.zygote_key(env)]

    with pytest.raises(subprocess.TimeoutExpired):
        fresh_scripts.run(str(file), cwd=str(tmp_path), env=env, timeout=1)
    killed = zygote()
    assert killed.proc.poll() is not None
    file.write_text("print('next')\n")  # the next script gets a new zygote
    assert fresh_scripts.run(str(file), cwd=str(tmp_path), env=env).stdout == "next\n"
    assert zygote() is not killed and zygote().proc.poll() is None
    zygote().proc.stdin.close()  # (its loop ends at the end of its input)
    zygote().proc.wait(60)


def test_the_scripts_of_every_test_share_a_zygote(tmp_path, monkeypatch):
    # pytest names the running test in PYTEST_CURRENT_TEST: a zygote keyed by it
    # started afresh (a JAX import) for every test's script, 1-2 s each. The
    # child still gets its environment whole. (The key does not depend on the
    # imports: zygotes of the test's own import the standard library alone.)
    monkeypatch.setattr(fresh_scripts, "ZYGOTE_IMPORTS", ("json",))
    monkeypatch.setattr(fresh_scripts, "_zygotes", {})
    monkeypatch.setenv("JAX_THREADMAP_TEST_FRESH_SCRIPTS", "fork")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    file = tmp_path / "parent.py"
    file.write_text(
        "import os\nprint(os.getppid(), os.environ['PYTEST_CURRENT_TEST'])\n"
    )
    seen = []
    for test in ("a", "b"):
        env = dict(os.environ, PYTHONPATH=path, PYTEST_CURRENT_TEST=test)
        ran = fresh_scripts.run(str(file), cwd=str(tmp_path), env=env)
        parent, name = ran.stdout.split()
        assert name == test
        seen.append(int(parent))
    assert seen[0] == seen[1] != os.getpid()  # forked, both from one zygote
    assert len(fresh_scripts._zygotes) == 1
    for zygote in fresh_scripts._zygotes.values():
        zygote.proc.stdin.close()  # (its loop ends at the end of its input)
        zygote.proc.wait(60)
