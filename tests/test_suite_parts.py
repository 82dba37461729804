"""The suite in parts (``--part K/N``, tests/conftest.py; tests/tpu_suite.sh): every
test file falls in exactly one part, the parts follow the collection order, and
each holds about as many tests as the others."""

from __future__ import annotations

import itertools

from conftest import _part_of_file
from hypothesis import given
from hypothesis import strategies as st


def cut(sizes: list[int], parts: int) -> list[int]:
    """The part of each file, for files of ``sizes`` tests in collection order."""
    total, first, out = sum(sizes), 0, []
    for size in sizes:
        out.append(_part_of_file(first, size, total, parts))
        first += size
    return out


@given(
    st.lists(st.integers(1, 200), min_size=1, max_size=60),
    st.integers(1, 8),
)
def test_each_file_is_in_one_part_in_order_and_parts_are_balanced(sizes, parts):
    where = cut(sizes, parts)
    assert all(0 <= p < parts for p in where)
    assert where == sorted(where)  # contiguous runs of files, in order
    total = sum(sizes)
    for p in range(parts):
        held = sum(s for s, q in zip(sizes, where, strict=True) if q == p)
        # A part overshoots its share by at most half a file on each side.
        assert held <= total / parts + max(sizes), (sizes, parts, where)


def test_one_part_is_the_whole_suite_and_equal_files_split_evenly():
    assert cut([5, 7, 1], 1) == [0, 0, 0]
    counts = [len(list(g)) for _, g in itertools.groupby(cut([10] * 12, 4))]
    assert counts == [3, 3, 3, 3]
