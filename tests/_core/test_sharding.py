"""threadmap and its derivatives in sharded programs, on 8 CPU devices: the
checks of ``sharding_checks.py``, run in a child process (the number of CPU
devices is fixed when JAX starts, and this session keeps one) per part and
partitioner; and the JAX internals that per-shard maps under ``jit`` rely on,
checked here so that a JAX release that moves them fails loudly."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_script

from jax_threadmap._jax import hooks as _hooks

CHECKS = pathlib.Path(__file__).parents[1] / "sharding_checks.py"
#: The lines each part prints (the script stops at the first failure).
CHECK_LINES = {"shard_map": 59, "jit": 62}


# Both partitioners: Shardy is the default from jax 0.7, GSPMD before, and their
# callback shardings differ (one per result for Shardy).
@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
@pytest.mark.parametrize("part", sorted(CHECK_LINES))
@pytest.mark.long
@pytest.mark.timeout(240)
def test_sharded_programs_on_8_devices(part, partitioner):
    # As `python sharding_checks.py PART PARTITIONER`, forked from the process
    # that imported JAX once (tests/fresh_scripts.py; the script sets its 8
    # devices and the partitioner before JAX's backend starts): 2 s of CPU less
    # per run than a fresh interpreter.
    ran = run_script(
        CHECKS.read_text(),
        part,
        partitioner,
        forked=True,
        name=CHECKS.name,
        timeout=220,
    )
    assert ran.returncode == 0, ran.report
    assert f"all sharding checks passed ({part})" in ran.stdout, ran.report
    lines = ran.stdout.splitlines()
    assert sum(line.startswith("ok ") for line in lines) == CHECK_LINES[part], lines


def test_host_callbacks_are_still_ffi_calls_by_index():
    """The per-shard call is JAX's own host-callback FFI call, naming the
    callback by its index in the program (hooks.PYTHON_CALLBACK_TARGETS): what
    jax.pure_callback lowers to on the CPU."""
    f = jax.jit(
        lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct((3,), jnp.float32), x)
    )
    # Lowered for the CPU wherever the tests run (a TPU's host callbacks are
    # send/recv, and the partitioner is not used there).
    x = jax.device_put(np.zeros(3, np.float32), jax.devices("cpu")[0])
    text = f.lower(x).as_text()
    target = _hooks.PYTHON_CALLBACK_TARGETS["cpu"]
    assert f'"{target}"' in text or f"@{target}(" in text, text
    assert "index = 0 : ui64" in text, text


def test_the_hooks_of_per_shard_maps_under_jit_are_found():
    names = {h.name for h in _hooks.HOOKS if _hooks.AUTO_PER_SHARD in h.features}
    assert names == {
        "custom_partitioning",
        "ffi_lowering",
        "ModuleContext",
        "ShardingContext",
        "use_abstract_mesh",
    }
    assert _hooks.missing_for(_hooks.AUTO_PER_SHARD) is None
