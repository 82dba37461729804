"""threadmap and its derivatives in sharded programs, on 4 CPU devices.

The checks live in ``sharding_checks.py`` and run in one subprocess: the number
of CPU devices is fixed when JAX starts, and this session keeps one device.
"""

import pathlib

import pytest
from helpers import run_script

CHECKS = pathlib.Path(__file__).parent / "sharding_checks.py"


# Both partitioners: Shardy is the default from jax 0.7, GSPMD before, and their
# callback shardings differ (one per result for Shardy).
@pytest.mark.parametrize("shardy", ["1", "0"], ids=["shardy", "gspmd"])
@pytest.mark.timeout(240)
def test_shard_map_named_sharding_and_pmap_on_4_devices(shardy):
    ran = run_script(CHECKS, env={"JAX_USE_SHARDY_PARTITIONER": shardy}, timeout=220)
    assert ran.returncode == 0, ran.report
    assert "all sharding checks passed" in ran.stdout, ran.report
    # Every check printed its line (the script stops at the first failure).
    assert ran.stdout.count("\nok ") + ran.stdout.startswith("ok ") >= 28, ran.report
