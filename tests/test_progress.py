"""Progress bars for long maps: threadmap(progress=True) or JAX_THREADMAP_PROGRESS=1."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import threadmap

pytestmark = pytest.mark.timeout(60)


def slow(x):
    time.sleep(0.05)
    return x


def run(n, **kw):
    f = jax.vmap(
        lambda v: threadmap(
            slow, jax.ShapeDtypeStruct((), jnp.float32), v, executor=1, **kw
        )
    )
    return np.asarray(f(np.arange(n, dtype=np.float32)))


def test_progress_bar_for_long_map(capfd):
    pytest.importorskip("tqdm")
    np.testing.assert_array_equal(run(30, progress=True), np.arange(30))
    err = capfd.readouterr().err
    assert "threadmap slow" in err and "30/30" in err


def test_progress_without_tqdm_prints_lines(capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails
    monkeypatch.setenv("JAX_THREADMAP_PROGRESS", "1")
    run(30)
    err = capfd.readouterr().err
    assert "threadmap slow:" in err and "elements" in err


def test_no_bar_for_short_maps_or_when_off(capfd, monkeypatch):
    monkeypatch.delenv("JAX_THREADMAP_PROGRESS", raising=False)
    run(4, progress=True)  # 0.2 s: under the one-second threshold
    run(30)  # long, but off
    run(30, progress=False)
    assert "threadmap slow" not in capfd.readouterr().err


def test_progress_must_be_a_bool():
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        threadmap(slow, jax.ShapeDtypeStruct((), jnp.float32), 1.0, progress="yes")
