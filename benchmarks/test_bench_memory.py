"""Peak memory of one batch with large results, each method in its own process.

4096 elements (16 x 16 x 16) of 64 KB results: 256 MB of outputs. The budget is
inputs + outputs + one copy of the outputs (the result handed to JAX); threads
may add O(threads x element) and nothing else may grow with the batch. The
timing pytest-benchmark records here is that of the whole subprocess and means
little; the memory is in ``extra_info``.
"""

from __future__ import annotations

import harness as B
import pytest


@pytest.mark.parametrize("method", ["threadmap", "bare_loop", "recipe", "sequential"])
def test_peak_memory(measure, benchmark, method):
    result = {}
    measure(
        lambda: result.update(B.peak_memory(method)),
        group="memory",
        rounds=1,
        warmup=0,
        case="fill",
        method=method,
        batch_shape=list(B.MEMORY_SHAPE),
    )
    # The report reads the memory from extra_info (the same dict the JSON gets).
    benchmark.extra_info.update(result)
    assert result["added_bytes"] > 0
