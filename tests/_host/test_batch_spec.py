"""BatchSpec: growth under vmap, summed levels, and its jaxpr form."""

import pytest

from jax_threadmap._host.batch_spec import BatchSpec


def test_unbatched_has_no_levels():
    spec = BatchSpec.unbatched(3)
    assert spec.shape == () and spec.in_axes == ((), (), ()) and spec.size == 1


def test_grow_puts_the_new_level_outermost():
    spec = BatchSpec.unbatched(2).grow(5, [0, None])
    assert spec.shape == (5,) and spec.in_axes == ((0,), (None,))
    # A second (outer) level: operand 0 gets its new axis at 1, in front of
    # which the inner level's axis 0 stays; operand 1 is batched at axis 0,
    # which pushes nothing (it had no batch axes).
    spec = spec.grow(3, [1, 0])
    assert spec.shape == (3, 5)
    assert spec.in_axes == ((1, 0), (0, None))
    assert spec.size == 15


def test_grow_shifts_axes_at_or_after_the_new_one():
    # The operand's inner-level axis is 0; the new level is inserted at 0, so
    # the old one moves to 1.
    spec = BatchSpec.unbatched(1).grow(4, [0]).grow(2, [0])
    assert spec.in_axes == ((0, 1),)
    # Inserted after it: the old axis stays.
    spec = BatchSpec.unbatched(1).grow(4, [0]).grow(2, [1])
    assert spec.in_axes == ((1, 0),)


def test_summed_levels_shift_as_levels_grow():
    spec = BatchSpec((4, 6), ((0, 1), (None, None)), out_sum=((), (0, 1)))
    assert spec.summed(0) == () and spec.summed(1) == (0, 1)
    assert spec.out_batch_shape(0) == (4, 6) and spec.out_batch_shape(1) == ()
    grown = spec.grow(3, [0, None])
    assert grown.out_sum == ((), (1, 2))  # the new outer level is never summed
    assert grown.out_batch_shape(1) == (3,)
    assert BatchSpec((2,), ((0,),)).summed(0) == ()


def test_specs_are_hashable_and_equal_by_value():
    a = BatchSpec.unbatched(2).grow(3, [0, None])
    b = BatchSpec.unbatched(2).grow(3, [0, None])
    assert a == b and hash(a) == hash(b)
    assert a != BatchSpec.unbatched(2).grow(3, [None, 0])


@pytest.mark.parametrize(
    "spec, text",
    [
        (BatchSpec((), ((),)), "BatchSpec(shape=(), in_axes=[-])"),
        (BatchSpec((4,), ((0,), (None,))), "BatchSpec(shape=(4,), in_axes=[(0,), -])"),
        (
            BatchSpec((4, 3, 5), ((0, None, 1), (None, None, None))),
            "BatchSpec(shape=(4, 3, 5), in_axes=[(0, -, 1), -])",
        ),
        (
            BatchSpec((2, 3), ((0, 1),), out_sum=((1,),)),
            "BatchSpec(shape=(2, 3), in_axes=[(0, 1)], out_sum=((1,),))",
        ),
    ],
)
def test_jaxpr_form(spec, text):
    assert str(spec) == repr(spec) == text
