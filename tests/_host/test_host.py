"""The host side alone: views, the element loops, summed outputs, packed chunks.

Each loop is checked against a per-element NumPy reference, without JAX in the
way, for the layouts that take different code paths: one merged batch dim (fast
loops for one and two operands, the general path for more), unmergeable dims with
long rows (row by row) and with short rows (tuple indices).
"""

import itertools

import jax
import numpy as np
import pytest

from jax_threadmap import KernelError
from jax_threadmap._host.batch_spec import BatchSpec
from jax_threadmap._host.maps import (
    ElementCaller,
    HostMap,
    merge_groups,
    merge_view,
    operand_view,
)


class NeverFailed:
    failed = halt = False


def tree(n):
    return jax.tree_util.tree_structure((tuple(range(n)), {}))


LEAF = jax.tree_util.tree_structure(0)


def run_all(host_map, chunks):
    for start, stop in chunks:
        host_map.run_chunk(start, stop, NeverFailed)
    return host_map.finish()


def reference(kernel, spec, operands, out_core):
    """The per-element loop: index each operand as the spec says."""
    out = np.zeros(spec.shape + out_core, np.float32)
    for index in itertools.product(*map(range, spec.shape)):
        elem = []
        for x, axes in zip(operands, spec.in_axes, strict=True):
            ii = [slice(None)] * x.ndim
            for level, a in enumerate(axes):
                if a is not None:
                    ii[a] = index[level]
            elem.append(x[tuple(ii)])
        out[index] = kernel(*elem)
    return out


def test_operand_view_has_zero_strides_where_unbatched_and_is_read_only():
    x = np.arange(12.0).reshape(3, 4)
    v = operand_view(x, (None, 0, None), (2, 3, 5))
    assert v.shape == (2, 3, 5, 4)
    assert v.strides[0] == v.strides[2] == 0 and v.strides[1] == x.strides[0]
    assert not v.flags.writeable
    np.testing.assert_array_equal(v[1, 2, 3], x[2])


def test_merge_groups_merges_only_aligned_dims():
    shape = (2, 3, 4)
    same = np.zeros(shape + (5,))
    inner_only = operand_view(np.zeros((4, 5)), (None, None, 0), shape)
    assert merge_groups(shape, [same]) == [[0, 1, 2]]
    assert merge_groups(shape, [same, inner_only]) == [[0, 1], [2]]
    merged = merge_view(same, [[0, 1], [2]])
    assert merged.shape == (6, 4, 5)


LAYOUTS = {
    # name: (spec, operand shapes)
    "one merged dim, 1 operand": (BatchSpec((6,), ((0,),)), [(6, 3)]),
    "one merged dim, 2 operands": (
        BatchSpec((2, 3), ((0, 1), (None, None))),
        [(2, 3, 3), (3,)],
    ),
    "one merged dim, 3 operands": (
        BatchSpec((4,), ((0,), (None,), (1,))),
        [(4, 3), (3,), (3, 4)],
    ),
    "long rows": (BatchSpec((3, 20), ((0, None), (None, 0))), [(3, 3), (20, 3)]),
    "short rows": (BatchSpec((5, 4), ((1, None), (None, 0))), [(3, 5), (4, 3)]),
    "unbatched": (BatchSpec((), ((), ())), [(3,), (3,)]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("chunks", ["one", "several"])
def test_loops_match_the_per_element_reference(name, chunks):
    spec, shapes = LAYOUTS[name]
    rng = np.random.default_rng(0)
    operands = [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def kernel(*xs):
        return np.float32(sum(float(np.sum(x)) * (k + 1) for k, x in enumerate(xs)))

    caller = ElementCaller(
        kernel, "kernel", tree(len(operands)), LEAF, [((), np.float32)], spec.shape
    )
    host_map = HostMap(caller, spec, operands)
    n = host_map.n
    bounds = (
        [(0, n)] if chunks == "one" else [(i, min(n, i + 7)) for i in range(0, n, 7)]
    )
    (got,) = run_all(host_map, bounds)
    np.testing.assert_allclose(got, reference(kernel, spec, operands, ()), rtol=1e-6)


def test_kernel_error_names_the_unmerged_batch_index():
    spec, shapes = LAYOUTS["short rows"]
    operands = [np.zeros(s, np.float32) for s in shapes]
    calls = []

    def kernel(a, b):
        calls.append(1)
        if len(calls) == 7:
            raise ValueError("seventh")
        return np.float32(0)

    caller = ElementCaller(kernel, "k", tree(2), LEAF, [((), np.float32)], spec.shape)
    with pytest.raises(KernelError, match=r"batch index \(1, 2\).*seventh") as info:
        run_all(HostMap(caller, spec, operands), [(0, spec.size)])
    assert info.value.index == (1, 2)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("chunks", [[(0, 24)], [(0, 5), (5, 11), (11, 24)]])
def test_summed_outputs_add_every_element_in_chunk_order(chunks):
    # Output 0 keeps both levels; output 1 is summed over level 1; output 2 over
    # both. Chunks finishing out of order still fold in order.
    spec = BatchSpec((4, 6), ((0, 1),), out_sum=((), (1,), (0, 1)))
    x = np.random.default_rng(1).standard_normal((4, 6, 2)).astype(np.float32)
    out_core = [((2,), np.float32)] * 3
    caller = ElementCaller(
        lambda v: (v, v * 2, v * 3),
        "k",
        tree(1),
        jax.tree_util.tree_structure((0, 0, 0)),
        out_core,
        spec.shape,
        accumulate=[1, 2],
    )
    host_map = HostMap(caller, spec, [x])
    assert host_map.sums
    run_all(host_map, reversed(chunks))
    a, b, c = host_map.finish()
    np.testing.assert_array_equal(a, x)
    np.testing.assert_allclose(b, (2 * x).sum(1), rtol=1e-6)
    np.testing.assert_allclose(c, (3 * x).sum((0, 1)), rtol=1e-6)


@pytest.mark.parametrize("summed", [(0, 1), (1,), (0,)])
def test_packed_chunks_of_a_summing_map_give_the_local_result_bitwise(summed):
    spec = BatchSpec((8, 9), ((0, 1), (None, None)), out_sum=(summed,))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 9, 3)).astype(np.float32)
    w = rng.standard_normal(3).astype(np.float32)

    def make():
        caller = ElementCaller(
            lambda v, w: v * w,
            "k",
            tree(2),
            LEAF,
            [((3,), np.float32)],
            spec.shape,
            accumulate=[0],
        )
        return HostMap(caller, spec, [x, w])

    bounds = [(0, 20), (20, 50), (50, 72)]
    (local,) = run_all(make(), bounds)
    remote = make()
    for start, stop in bounds:
        outs, _ = remote.pack(start, stop)()
        remote.store_packed(start, stop, outs)
    (shipped,) = remote.finish()
    np.testing.assert_array_equal(shipped, local)
    np.testing.assert_allclose(local, (x * w).sum(summed), rtol=1e-5)
