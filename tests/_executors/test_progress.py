"""Progress bars for long maps: threadmap(progress=True) or JAX_THREADMAP_PROGRESS=1.

A bar appears once a map has run for ``Progress.delay`` seconds; the tests set that
delay rather than wait for the default one, so that what they see does not depend
on how fast the machine is.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import threadmap
from jax_threadmap._executors import progress as _progress

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def delay(monkeypatch):
    """Sets the seconds after which a map shows its bar."""

    def set_delay(seconds):
        monkeypatch.setattr(_progress.Progress, "delay", seconds)

    return set_delay


def slow(x):
    time.sleep(0.01)
    return x


def run(n, **kw):
    f = jax.vmap(
        lambda v: threadmap(
            slow, jax.ShapeDtypeStruct((), jnp.float32), v, executor=1, **kw
        )
    )
    return np.asarray(f(np.arange(n, dtype=np.float32)))


def test_progress_bar_for_long_map(capfd, delay):
    pytest.importorskip("tqdm")
    delay(0.0)
    np.testing.assert_array_equal(run(30, progress=True), np.arange(30))
    err = capfd.readouterr().err
    assert "threadmap slow" in err and "30/30" in err


def test_progress_without_tqdm_warns_that_it_shows_none(monkeypatch, delay):
    delay(0.0)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails
    monkeypatch.setenv("JAX_THREADMAP_PROGRESS", "1")
    with pytest.warns(UserWarning, match="threadmap slow: progress bars need tqdm"):
        np.testing.assert_array_equal(run(30), np.arange(30))


def test_no_bar_before_the_delay_or_when_off(capfd, monkeypatch, delay):
    monkeypatch.delenv("JAX_THREADMAP_PROGRESS", raising=False)
    delay(3600.0)
    run(30, progress=True)  # a map shorter than the delay shows nothing
    delay(0.0)
    run(30)  # long enough, but off
    run(30, progress=False)
    assert "threadmap slow" not in capfd.readouterr().err


def test_default_delay_is_a_second():
    assert _progress.Progress.delay == 1.0


def test_progress_must_be_a_bool():
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        threadmap(slow, jax.ShapeDtypeStruct((), jnp.float32), 1.0, progress="yes")
