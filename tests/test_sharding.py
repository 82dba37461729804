"""threadmap and its derivatives in sharded programs, on 4 CPU devices.

The checks live in ``sharding_checks.py`` and run in one subprocess: the number
of CPU devices is fixed when JAX starts, and this session keeps one device.
"""

import pytest
from helpers import run_checks


# Both partitioners: Shardy is the default from jax 0.7, GSPMD before, and their
# callback shardings differ (one per result for Shardy).
@pytest.mark.parametrize("shardy", ["1", "0"], ids=["shardy", "gspmd"])
@pytest.mark.timeout(240)
def test_shard_map_named_sharding_and_pmap_on_4_devices(shardy):
    proc, report = run_checks("sharding_checks.py", shardy=shardy, timeout=220)
    assert proc.returncode == 0, report
    assert "all sharding checks passed" in proc.stdout, report
    # Every check printed its line (the script stops at the first failure).
    assert proc.stdout.count("\nok ") + proc.stdout.startswith("ok ") >= 28, report
