"""The rule for storing a returned value as its declared dtype (``result_casts``).

Every case is checked against NumPy's own cast: a value is accepted exactly when
NumPy's cast keeps it (integers equal as Python ints, finite floats finite), and
refused otherwise, with a message naming the value and the dtype.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import VALUE_CASES, numpy_keeps_value

from jax_threadmap._support import result_casts as _result_casts
from jax_threadmap._support.result_casts import ResultCastError, check_result_cast


@pytest.mark.parametrize("value, dtype", VALUE_CASES, ids=repr)
def test_a_value_is_accepted_exactly_when_numpy_keeps_it(value, dtype):
    dtype = np.dtype(dtype)
    if numpy_keeps_value(value, dtype):
        check_result_cast(np.asarray(value), dtype)
        return
    with pytest.raises(ResultCastError) as info:
        check_result_cast(np.asarray(value), dtype)
    msg = str(info.value)
    assert f"{dtype} cannot hold it" in msg
    flat = np.asarray(value).reshape(-1)
    shown = [str(x) for x in (flat.tolist() if flat.dtype == object else flat)]
    assert any(s in info.value.got for s in shown), (info.value.got, shown)


def test_the_cases_cover_both_outcomes_for_every_kind():
    # A guard on the table above: each target kind has kept and lost values.
    outcomes = {}
    for value, dtype in VALUE_CASES:
        kind = next(
            k
            for k in (np.integer, np.floating, np.complexfloating)
            if jnp.issubdtype(dtype, k)
        )
        outcomes.setdefault(kind, set()).add(numpy_keeps_value(value, dtype))
    assert outcomes == {k: {True, False} for k in outcomes} and len(outcomes) == 3


def test_arrays_name_the_first_element_that_does_not_fit():
    value = np.array([[1.0, np.nan], [-1e39, 1e39]])
    with pytest.raises(ResultCastError) as info:
        check_result_cast(value, np.dtype(np.float32))
    assert info.value.got == "an array whose element [1, 0] is -1e+39 (float64)"
    assert "the largest finite float32 is 3.40282e+38" in info.value.reason
    with pytest.raises(ResultCastError) as info:
        check_result_cast(np.array([5, 2**31]), np.dtype(np.int32))
    assert info.value.got == "an array whose element [1] is 2147483648 (int64)"
    assert "its range is -2147483648 to 2147483647" in info.value.reason


@pytest.mark.parametrize(
    "value, dtype",
    [
        (1.5, np.int32),
        (np.float64(0.5), np.uint8),
        (np.complex64(1j), np.float32),
        (2, np.bool_),
        # NumPy's can_cast lets anything into the ml_dtypes types; JAX's kinds do not.
        (np.float32(1.0), jnp.int4),
        (np.complex64(1j), jnp.bfloat16),
        ("text", np.float32),
        (2**70, np.bool_),
    ],
    ids=repr,
)
def test_kind_changes_are_refused_whatever_the_value(value, dtype):
    with pytest.raises(ResultCastError, match="without changing kind"):
        check_result_cast(np.asarray(value), np.dtype(dtype))


def test_the_declared_dtype_itself_is_never_checked(monkeypatch):
    # The fast path: nothing is planned or computed for a value of the declared
    # dtype (a plan, or the plan cache, would be consulted without it).
    def no_plan(*args):
        raise AssertionError(f"planned a check of the declared dtype: {args}")

    monkeypatch.setattr(_result_casts, "_plan", no_plan)
    monkeypatch.setattr(_result_casts, "_plans", {})
    check_result_cast(np.array([np.inf, np.nan], np.float32), np.dtype(np.float32))
    check_result_cast(np.int32(-(2**31)) + np.zeros(3, np.int32), np.dtype(np.int32))
    assert _result_casts._plans == {}
    # ... whereas any other dtype is planned.
    with pytest.raises(AssertionError, match="planned a check"):
        check_result_cast(np.zeros(3, np.int16), np.dtype(np.int32))
