"""threadmap and its derivatives in sharded programs, on 4 CPU devices.

The checks live in ``sharding_checks.py`` and run in one subprocess: the number
of CPU devices is fixed when JAX starts, and this session keeps one device.
"""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


# Both partitioners: Shardy is the default from jax 0.7, GSPMD before, and their
# callback shardings differ (one per result for Shardy).
@pytest.mark.parametrize("shardy", ["1", "0"], ids=["shardy", "gspmd"])
@pytest.mark.timeout(240)
def test_shard_map_named_sharding_and_pmap_on_4_devices(shardy):
    env = dict(os.environ, JAX_USE_SHARDY_PARTITIONER=shardy)
    root = str(HERE.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "sharding_checks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    report = proc.stdout + proc.stderr[-5000:]
    assert proc.returncode == 0, report
    assert "all sharding checks passed" in proc.stdout, report
    # Every check printed its line (the script stops at the first failure).
    assert proc.stdout.count("\nok ") + proc.stdout.startswith("ok ") >= 28, report
