"""Equinox, Optax and Flax (nnx and linen) training loops, unchanged, on batches
that are still loading: bit for bit the same parameters and losses as the same
loop on ready batches (tests/library_loops.py holds the loops; each test skips
when its library is absent; ``benchmarks/library_loops.py`` measures the overlap).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from library_loops import LOOPS, NEEDS, loading, ready

import jax_threadmap as jtm

pytestmark = pytest.mark.timeout(120)

STEPS = 6


@pytest.mark.parametrize("library", sorted(LOOPS))
def test_a_loop_on_loading_batches_matches_the_loop_on_ready_batches(library):
    for package in NEEDS[library]:
        pytest.importorskip(package)
    loop = LOOPS[library]
    want_params, want_losses = loop(ready(STEPS))
    batches = loading(STEPS, 0.02)
    assert all(isinstance(x, jtm.AsyncArray) for x, _ in batches)
    got_params, got_losses = loop(batches)
    got, want = jax.tree.leaves(got_params), jax.tree.leaves(want_params)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(got_losses), np.asarray(want_losses))
    assert float(want_losses[-1]) < float(want_losses[0])  # it trains
