"""Per-shard maps under ``jit`` on automatic mesh axes (issue 52), on 8 CPU
devices in a child process (``auto_sharding_checks.py``), with each partitioner;
and the JAX internals that path relies on, checked here so that a JAX release
that moves them fails loudly."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_script

from jax_threadmap._jax import hooks as _hooks

CHECKS = pathlib.Path(__file__).parent / "auto_sharding_checks.py"


@pytest.mark.parametrize("shardy", ["1", "0"], ids=["shardy", "gspmd"])
@pytest.mark.timeout(200)
def test_classic_meshes_map_per_shard_on_8_devices(shardy):
    ran = run_script(CHECKS, env={"JAX_USE_SHARDY_PARTITIONER": shardy}, timeout=180)
    assert ran.returncode == 0, ran.report
    assert "all auto sharding checks passed" in ran.stdout, ran.report
    assert ran.stdout.count("ok ") == 29, ran.report


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


def test_the_hooks_of_per_shard_maps_on_automatic_axes_are_found():
    names = {h.name for h in _hooks.HOOKS if _hooks.AUTO_PER_SHARD in h.features}
    assert names == {
        "custom_partitioning",
        "ffi_lowering",
        "ModuleContext",
        "ShardingContext",
    }
    assert _hooks.missing_for(_hooks.AUTO_PER_SHARD) is None
