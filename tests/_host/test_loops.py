"""Generated element loops: every signature calls the kernel as written, checked.

Each case runs ``threadmap`` under a 2-level vmap against the same kernel in a
per-element Python loop, for the signatures that get literal calls and unpacking
(positional, keyword, tuple/list/dict arguments and results) and those that take
the general path (a namedtuple argument, nested results).
"""

import collections
import linecache
import os
import pathlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_threadmap import KernelError, threadmap
from jax_threadmap._host import loops as _loops
from jax_threadmap._host.loops import call_source, unpack_source

F32 = jax.ShapeDtypeStruct((), jnp.float32)
V3 = jax.ShapeDtypeStruct((3,), jnp.float32)
Pair = collections.namedtuple("Pair", "a b")

X = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
Y = np.linspace(-1, 1, 5, dtype=np.float32)


CASES = {
    # name: (kernel, result_shape_dtypes, how the element's arguments are passed)
    "positional": (lambda x, y: x * y, V3, lambda x, y: ((x, y), {})),
    "keyword": (lambda x, *, y: x - y, V3, lambda x, y: ((x,), {"y": y})),
    "tuple arg": (lambda p: p[0] + p[1], V3, lambda x, y: (((x, y),), {})),
    "list arg": (lambda p: p[0] * 2 + p[1], V3, lambda x, y: (([x, y],), {})),
    "dict arg": (
        lambda d: d["x"] / 2 + d["y"],
        V3,
        lambda x, y: (({"x": x, "y": y},), {}),
    ),
    "namedtuple arg": (
        lambda p: p.a + p.b,
        V3,
        lambda x, y: ((Pair(x, y),), {}),
    ),
    "None in args": (lambda x, n, y: x + y, V3, lambda x, y: ((x, None, y), {})),
    "tuple result": (
        lambda x, y: (x.sum(), x * y),
        (F32, V3),
        lambda x, y: ((x, y), {}),
    ),
    "list result": (lambda x, y: [x * y, y], [V3, F32], lambda x, y: ((x, y), {})),
    "dict result": (
        lambda x, y: {"s": x.sum() * y, "v": x},
        {"s": F32, "v": V3},
        lambda x, y: ((x, y), {}),
    ),
    "nested result": (
        lambda x, y: (x, {"t": (y, x.max())}),
        (V3, {"t": (F32, F32)}),
        lambda x, y: ((x, y), {}),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("jit", [False, True])
def test_signature_matches_a_python_loop(name, jit):
    kernel, out, build = CASES[name]

    def f(x, y):
        args, kwargs = build(x, y)
        return threadmap(kernel, out, *args, **kwargs)

    g = jax.vmap(jax.vmap(f, (0, 0)), (0, None))
    if jit:
        g = jax.jit(g)
    got = g(X, Y)

    def run(x, y):
        args, kwargs = build(x, y)
        return kernel(*args, **kwargs)

    want = [[run(X[i, j], Y[j]) for j in range(5)] for i in range(2)]
    got_leaves, got_tree = jax.tree.flatten(got)
    flat_want = [jax.tree.leaves(w) for row in want for w in row]
    assert got_tree == jax.tree.structure(out)
    for k, leaf in enumerate(got_leaves):
        expected = np.stack([w[k] for w in flat_want]).reshape(leaf.shape)
        np.testing.assert_allclose(leaf, expected, rtol=1e-6)


def test_literal_calls_and_unpacking_are_generated_where_they_can_be():
    tree = jax.tree.structure
    assert call_source(tree(((0, 0), {"s": 0})), ["a", "b", "c"]) == "fn(a, b, s=c)"
    assert call_source(tree((({"x": 0, "y": [0]},), {})), ["a", "b"]) == (
        "fn({'x': a, 'y': [b]})"
    )
    assert call_source(tree(((Pair(0, 0),), {})), ["a", "b"]) is None
    assert unpack_source(tree((0, 0))) == (
        "type(r) is tuple and len(r) == 2",
        "q0, q1, = r",
    )
    assert unpack_source(tree({"a": 0})) == (
        "type(r) is dict and r.keys() == {'a'}",
        "q0 = r['a']",
    )
    assert unpack_source(tree(0)) is None  # one leaf: the checked path
    assert unpack_source(tree((0, (0,)))) is None  # nested: the general path


I32 = jax.ShapeDtypeStruct((), jnp.int32)


@pytest.mark.parametrize(
    "result, fragment",
    [
        (lambda x: (x, (x, x)), "structure"),  # a container where a leaf is
        (lambda x: (x,), "structure"),  # too short
        (lambda x: {"a": x, "b": x}, "structure"),  # a dict for a tuple
        (lambda x: (x, np.zeros(2, np.int32)), "returned shape (2,) for output 1"),
        (lambda x: (x, np.int64(2**40)), "for output 1, expected int32"),
    ],
)
def test_wrong_results_of_several_leaves_name_what_is_wrong(result, fragment):
    f = jax.vmap(lambda v: threadmap(result, (F32, I32), v))
    with pytest.raises(KernelError, match=r"batch index \(\d,\)") as info:
        f(jnp.arange(3.0))
    assert fragment in str(info.value)


def test_a_kernel_sees_an_unbatched_operand_as_the_same_view_each_element():
    seen = []

    def k(x, table):
        seen.append(table)  # kept alive, so that identity is meaningful
        assert table.shape == (4,) and not table.flags.writeable
        return x + table[0]

    table = np.arange(4, dtype=np.float32)
    f = jax.vmap(lambda v: threadmap(k, F32, v, table, executor=1))
    np.testing.assert_array_equal(f(jnp.arange(1000.0)), np.arange(1000.0))
    # Read once per chunk, not indexed per element: a handful of distinct views.
    assert len(seen) == 1000 and len({id(t) for t in seen}) <= 50


# --- the whole generated source, per signature family ---------------------------

GOLDEN = pathlib.Path(__file__).parents[1] / "loop_sources"
#: Set to rewrite the checked-in sources after a deliberate change of the loops.
REGENERATE = os.environ.get("JAX_THREADMAP_TEST_REGENERATE_LOOPS") == "1"


def _loops_built_by(name, monkeypatch):
    """(label, source) of each loop built while CASES[name] runs eagerly under
    a 2-level vmap (one operand batched at both levels, one at the inner one)."""
    kernel, out, build = CASES[name]
    built = collections.OrderedDict()
    compile_loop = _loops._compile

    def recording(source, label):
        built[label] = source
        built.move_to_end(label)
        return compile_loop(source, label)

    def f(x, y):
        args, kwargs = build(x, y)
        return threadmap(kernel, out, *args, **kwargs)

    monkeypatch.setattr(_loops, "_compile", recording)
    jax.vmap(jax.vmap(f, (0, 0)), (0, None))(X, Y)
    return list(built.items())


@pytest.mark.parametrize("name", list(CASES))
def test_the_whole_generated_loop_is_the_checked_in_one(name, monkeypatch):
    built = _loops_built_by(name, monkeypatch)
    text = "".join(f"# {label}\n{source}" for label, source in built)
    path = GOLDEN / (name.replace(" ", "_") + ".py.txt")
    if REGENERATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no checked-in source {path}: run with REGENERATE"
    assert text == path.read_text(), (
        f"the generated loop of the {name!r} family changed; if on purpose, rerun "
        "with JAX_THREADMAP_TEST_REGENERATE_LOOPS=1 and review the diff of "
        f"{path.relative_to(GOLDEN.parent.parent)}"
    )


def test_tracebacks_name_the_kernel_and_signature_and_show_the_loop():
    def my_kernel(x, y):
        if x > 3:
            raise ValueError("boom")
        return x + y

    f = jax.vmap(lambda a: threadmap(my_kernel, F32, a, np.float32(1)))
    with pytest.raises(KernelError) as info:
        f(np.arange(5, dtype=np.float32))
    name = my_kernel.__qualname__  # the name in threadmap's messages
    label = _loops.loop_label(name, 2, 1, 0)
    assert label == (
        f"<threadmap loop for kernel {name!r} (2 operand leaves, 1 result leaves)>"
    )
    frames = traceback.extract_tb(info.value.__traceback__)
    loop = [fr for fr in frames if fr.filename.endswith(label)]
    assert loop, [fr.filename for fr in frames]
    # linecache has the source: the frame shows its line.
    assert loop[0].line == "raise kernel_raised(e, base + j) from e"
    shown = "".join(linecache.getlines(loop[0].filename))
    assert shown.startswith("def build(")
    assert "r = fn(w0[j, ...], e1)" in shown
