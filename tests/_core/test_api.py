"""The public API: results, params, and every error a user can meet."""

import concurrent.futures
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import worker_kernels
from helpers import VALUE_CASES, cause_of, numpy_keeps_value

import jax_threadmap
from jax_threadmap import KernelError, threadmap, threadmap_p

F32 = jax.ShapeDtypeStruct((), jnp.float32)


def double(x):
    return x * 2


def vmapped(kernel, out=F32, **kw):
    return jax.vmap(lambda x: threadmap(kernel, out, x, **kw))


def test_unbatched_eager_and_jit_calls():
    x = np.arange(4, dtype=np.float32)
    out = jax.ShapeDtypeStruct((4,), jnp.float32)
    np.testing.assert_array_equal(threadmap(np.cumsum, out, x), np.cumsum(x))
    f = jax.jit(lambda x: threadmap(np.cumsum, out, x))
    np.testing.assert_array_equal(f(x), np.cumsum(x))


def test_kernel_sees_numpy_readonly_views_of_unbatched_shape():
    seen = []

    def k(x, s):
        seen.append((type(x), x.shape, x.flags.writeable, type(s), s.shape))
        return x.sum() + s

    x = np.ones((3, 5, 4), np.float32)
    jax.jit(
        jax.vmap(jax.vmap(lambda x, s: threadmap(k, F32, x, s), (0, None)), (0, None))
    )(x, np.float32(1)).block_until_ready()  # then count
    assert len(seen) == 15
    assert set(seen) == {(np.ndarray, (4,), False, np.ndarray, ())}


def test_pytrees_of_args_kwargs_and_results():
    def k(p, *, q):
        return {"sum": p["a"] + p["b"][0] + q, "pair": (p["a"], q * 2)}

    out = {
        "sum": jax.ShapeDtypeStruct((2,), jnp.float32),
        "pair": (jax.ShapeDtypeStruct((2,), jnp.float32), F32),
    }

    def f(p, q):
        return threadmap(k, out, p, q=q)

    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    b = np.arange(3, dtype=np.float32)
    q = np.float32(5)
    res = jax.jit(jax.vmap(f, in_axes=({"a": 0, "b": [0]}, None)))(
        {"a": a, "b": [b]}, q
    )
    np.testing.assert_allclose(res["sum"], a + b[:, None] + q)
    np.testing.assert_allclose(res["pair"][0], a)
    np.testing.assert_allclose(res["pair"][1], np.full(3, 10.0))


def test_python_scalars_and_casting_within_kind():
    f = vmapped(lambda x: float(x) + 0.5)  # Python float into float32
    np.testing.assert_allclose(f(jnp.arange(3.0)), [0.5, 1.5, 2.5])
    g = vmapped(lambda x: int(x) * 3, out=jax.ShapeDtypeStruct((), jnp.int32))
    np.testing.assert_array_equal(g(jnp.arange(3)), [0, 3, 6])


def test_jaxpr_is_one_readable_equation():
    f = jax.vmap(
        jax.vmap(jax.vmap(lambda x, y: threadmap(double, F32, x + y)), (0, None)),
        (None, 0),
    )
    text = str(jax.make_jaxpr(f)(np.ones((4, 5, 6)), np.ones((7, 5, 6))))
    assert text.count("threadmap[") == 1
    assert "kernel=double" in text
    assert "shape=(7, 4, 5)" in text


def test_params_hashable_and_no_recompilation():
    def k(x):
        return x + 1

    f = jax.jit(jax.vmap(jax.vmap(lambda x: threadmap(k, F32, x))))
    x = np.ones((3, 4), np.float32)
    f(x)
    before = f._cache_size()
    f(x)
    f(x + 1)
    assert f._cache_size() == before == 1
    g = jax.vmap(jax.vmap(lambda x: threadmap(k, F32, x)))
    p1 = jax.make_jaxpr(g)(x).eqns[0].params
    p2 = jax.make_jaxpr(g)(x).eqns[0].params
    assert p1 == p2
    assert hash(tuple(sorted(p1.items()))) == hash(tuple(sorted(p2.items())))


def test_eager_calls_compile_nothing(monkeypatch):
    from jax_threadmap._jax import mlir as _mlir

    lowerings = []

    def counting_emit(*args, **kwargs):
        lowerings.append(1)
        return emit(*args, **kwargs)

    emit = _mlir.emit_python_callback
    monkeypatch.setattr(_mlir, "emit_python_callback", counting_emit)
    calls = []

    def k(x):
        calls.append(1)
        return x

    g = vmapped(k)
    np.testing.assert_array_equal(g(jnp.arange(3.0)), np.arange(3.0))
    np.testing.assert_array_equal(g(jnp.arange(3.0) + 1), np.arange(3.0) + 1)
    assert lowerings == []  # eager calls run the host map directly
    assert len(calls) == 6
    jitted = jax.jit(g)
    # Awaited before counting: on an accelerator the call returns at dispatch.
    jax.block_until_ready([jitted(jnp.arange(3.0)), jitted(jnp.arange(3.0) + 1)])
    assert len(lowerings) == 1 and len(calls) == 12


# --- errors ---------------------------------------------------------------------


def fails_at_7(x):
    if int(x) == 7:
        raise ValueError("element seven is bad")
    return x


@pytest.mark.parametrize("jit", [True, False])
def test_kernel_exception_names_type_message_and_index(jit):
    f = jax.vmap(jax.vmap(lambda x: threadmap(fails_at_7, F32, x)))
    if jit:
        f = jax.jit(f)
    x = jnp.arange(12.0).reshape(3, 4)
    with pytest.raises(Exception) as info:
        f(x).block_until_ready()
    msg = str(info.value)
    assert "ValueError" in msg and "element seven is bad" in msg
    assert "batch index (1, 3)" in msg
    if not jit:  # eager calls re-raise the kernel error itself, cause chained
        assert isinstance(info.value, KernelError)
        assert info.value.index == (1, 3)
        assert isinstance(cause_of(info.value), ValueError)
    # The pool is healthy afterwards.
    np.testing.assert_array_equal(f(x - 20.0), np.asarray(x) - 20.0)


def _check_depth(x):
    if int(x) == 2:
        raise ValueError(f"element {int(x)} is too deep")


def nested_failure(x, depth=0):
    if depth < 30:
        return nested_failure(x, depth + 1)
    _check_depth(x)
    return x


def raised_on_four(kernel, jit, **options):
    """The exception that ``kernel``, mapped over four float32 elements
    (``options`` go to ``threadmap``), raises under ``jit`` or eagerly."""
    f = jax.vmap(lambda x: threadmap(kernel, F32, x, **options))
    f = jax.jit(f) if jit else f
    with pytest.raises(Exception) as info:
        jax.block_until_ready(f(jnp.arange(4.0)))
    return info.value


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_kernel_traceback_is_in_the_message(jit):
    # Under jit, JAX passes only the message through its runtime error: the
    # kernel's own lines must be in it (bounded to the innermost frames).
    msg = str(raised_on_four(nested_failure, jit))
    tail = msg[msg.index("KernelError: ") if jit else 0 :]
    lines = tail.splitlines()
    assert lines[0].endswith("raised ValueError: element 2 is too deep")
    assert lines[1] == "Kernel traceback (most recent call last):"
    assert lines[2] == "  ... 26 earlier frame(s)"  # 1 + 30 frames, 5 + 1 shown
    assert lines[-2] == f'  File "{__file__}", line {_LINE}, in _check_depth'
    assert lines[-1] == '    raise ValueError(f"element {int(x)} is too deep")'
    assert (
        lines[-4].endswith("in nested_failure") and lines[-3] == "    _check_depth(x)"
    )
    assert "_host.py" not in tail  # the package's own frames are left out


_LINE = _check_depth.__code__.co_firstlineno + 2


class Abort(BaseException):
    """A kernel's own BaseException subclass (not an Exception)."""


def aborts_at_2(x):
    if int(x) == 2:
        raise Abort("stop here")
    return x


@pytest.mark.parametrize(
    "executor", [None, 1, "thread_executor"], ids=["shared", "one", "user"]
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_base_exception_of_a_kernel_is_a_kernel_error(executor, jit):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ex = pool if executor == "thread_executor" else executor
        error = raised_on_four(aborts_at_2, jit, executor=ex)
    msg = str(error)
    assert "threadmap kernel 'aborts_at_2' at batch index (2,)" in msg
    assert "raised Abort: stop here" in msg and "ExecutorError" not in msg
    if not jit:
        assert isinstance(error, KernelError) and error.index == (2,)
        assert isinstance(cause_of(error), Abort)


@pytest.mark.parametrize("vectorized", [False, True], ids=["element", "vectorized"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_kernel_exception_whose_message_fails_is_a_kernel_error(jit, vectorized):
    # Was "ExecutorError: ... the executor failed with RuntimeError: str broke",
    # with no batch index and the kernel's exception lost.
    def kernel(x):
        if vectorized:
            return np.array([worker_kernels.unprintable_at_two(v) for v in x])
        return worker_kernels.unprintable_at_two(x)

    error = raised_on_four(kernel, jit, vectorized=vectorized)
    msg = str(error)
    assert "raised Unprintable: <exception str() failed>" in msg
    assert ("batch indices (" if vectorized else "batch index (2,)") in msg
    assert "str broke" not in msg
    if not jit:
        assert isinstance(error, KernelError)
        assert isinstance(cause_of(error), worker_kernels.Unprintable)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_keyboard_interrupt_and_system_exit_of_a_kernel_pass_through(exc):
    # As from a plain loop: `except KeyboardInterrupt` and sys.exit() keep working.
    def k(x):
        if int(x) == 1:
            raise exc(3)
        return x

    with pytest.raises(exc) as info:
        vmapped(k)(jnp.arange(3.0))
    assert info.value.args == (3,)


@pytest.mark.parametrize(
    "result, expected_fragment",
    [
        (np.zeros(3, np.float32), "returned shape (3,) for output 0, expected ()"),
        (np.complex64(1j), "returned dtype complex64 for output 0, expected float32"),
        ((1.0, 2.0), "structure"),
        ("text", "dtype <U4"),
    ],
)
def test_wrong_result_names_expected_and_actual(result, expected_fragment):
    f = vmapped(lambda x: result)
    with pytest.raises(KernelError) as info:
        f(jnp.arange(2.0))
    assert expected_fragment in str(info.value)
    assert "batch index (0,)" in str(info.value) or "batch index (1,)" in str(
        info.value
    )


def test_wrong_result_under_jit_mentions_index():
    f = jax.jit(
        vmapped(lambda x: np.zeros(2), out=jax.ShapeDtypeStruct((3,), jnp.float32))
    )
    with pytest.raises(
        Exception, match=r"returned shape \(2,\) for output 0, expected \(3,\)"
    ):
        f(jnp.arange(2.0)).block_until_ready()


def test_float_result_for_int_output_is_rejected():
    f = vmapped(lambda x: 1.5, out=jax.ShapeDtypeStruct((), jnp.int32))
    with pytest.raises(KernelError, match="float64 for output 0, expected int32"):
        f(jnp.arange(2))


# --- narrowing: a value its declared dtype cannot hold is an error -----------------

#: The cases of test_validate.py whose dtype a threadmap can declare with x64 off.
NARROWING = [
    (value, dtype)
    for value, dtype in VALUE_CASES
    if np.dtype(dtype) == jax.dtypes.canonicalize_dtype(dtype)
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("value, dtype", NARROWING, ids=repr)
def test_results_keep_their_value_or_fail_naming_it(value, dtype, jit):
    dtype = np.dtype(dtype)
    out = jax.ShapeDtypeStruct(np.shape(value), dtype)
    zeros = np.zeros(np.shape(value), dtype)

    def k(i):
        return value if int(i) == 2 else zeros

    f = jax.vmap(lambda i: threadmap(k, out, i))
    f = jax.jit(f) if jit else f
    if numpy_keeps_value(value, dtype):
        got = np.asarray(f(jnp.arange(4))[2])
        np.testing.assert_array_equal(got, np.asarray(value).astype(dtype))
        return
    with pytest.raises(KernelError if not jit else Exception) as info:
        jax.block_until_ready(f(jnp.arange(4)))
    msg = str(info.value)
    assert "at batch index (2,) (batch shape (4,))" in msg
    assert f"for output 0, expected {dtype}" in msg
    assert f"{dtype} cannot hold it" in msg
    assert first_lost_value(value, dtype) in msg


def first_lost_value(value, dtype) -> str:
    """How the message shows the first element that NumPy's cast loses."""
    v = np.asarray(value)
    if v.ndim == 0:
        return f"returned {v[()]!s} ("
    lost = next(i for i in np.ndindex(v.shape) if not numpy_keeps_value(v[i], dtype))
    return f"returned an array whose element {list(lost)} is {v[lost]!s} ({v.dtype})"


def test_narrowing_names_the_output_and_the_value_of_a_pytree_result():
    out = {"n": jax.ShapeDtypeStruct((), jnp.int32), "x": F32}

    def k(i):
        return {"n": np.int64(i) * 2**30, "x": np.float64(i)}

    f = jax.vmap(jax.vmap(lambda i: threadmap(k, out, i)))
    res = f(jnp.arange(2).reshape(1, 2))  # 0 and 2**30 fit int32
    np.testing.assert_array_equal(res["n"], [[0, 2**30]])
    with pytest.raises(KernelError) as info:
        f(jnp.array([[0, 1], [2, 1]]))  # only (1, 0) overflows
    assert info.value.index == (1, 0)
    assert "returned 2147483648 (int64) for output 0, expected int32" in str(info.value)


def test_python_int_fits_unsigned_and_float64_fits_float32():
    # Signed and unsigned integers are one kind: the value decides.
    g = vmapped(lambda x: int(x) * 100, out=jax.ShapeDtypeStruct((), jnp.uint8))
    np.testing.assert_array_equal(g(jnp.arange(3)), np.array([0, 100, 200], np.uint8))
    with pytest.raises(KernelError, match=r"batch index \(3,\).*300 \(int64\)"):
        g(jnp.arange(4))
    h = vmapped(lambda x: np.float64(x) / 3)
    np.testing.assert_array_equal(
        h(jnp.arange(3.0)), (np.arange(3.0) / 3).astype(np.float32)
    )


@pytest.mark.parametrize(
    "call, exc, fragment",
    [
        (lambda: threadmap(3, F32, 1.0), TypeError, "kernel must be callable"),
        (lambda: threadmap(double, (3,), 1.0), TypeError, "result_shape_dtypes[0]"),
        (
            lambda: threadmap(double, {"a": "f"}, 1.0),
            TypeError,
            "result_shape_dtypes['a']",
        ),
        (
            lambda: threadmap(double, F32, "text"),
            TypeError,
            "positional argument 0 is a str",
        ),
        (
            lambda: threadmap(double, F32, 1.0, opt={"k": object()}),
            TypeError,
            "keyword argument 'opt' (at ['k']) is a object",
        ),
        (lambda: threadmap(double, F32, 1.0, executor="many"), TypeError, "executor="),
        (lambda: threadmap(double, F32, 1.0, executor=0), ValueError, "executor=0"),
        (
            lambda: threadmap(double, jax.ShapeDtypeStruct((), jnp.float64), 1.0),
            ValueError,
            "jax_enable_x64",
        ),
    ],
)
def test_bad_input_raises_before_anything_runs(call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value)


def refused_before_running(result_shape_dtypes, jit, error):
    """The message of the ``error`` that a kernel mapped over three elements
    with ``result_shape_dtypes`` (under ``jit`` or not) raises at the call,
    checked to have run no element."""
    ran = []

    def kernel(x):
        ran.append(x)
        return x

    f = jax.vmap(lambda x: threadmap(kernel, result_shape_dtypes, x))
    f = jax.jit(f) if jit else f
    with pytest.raises(error) as info:
        f(jnp.arange(3.0))
    assert ran == []
    return str(info.value)


@pytest.mark.parametrize("empty", [None, (), {}, [], {"a": ()}], ids=repr)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_result_shape_dtypes_without_leaves_fails_at_the_call(empty, jit):
    # Never a kernel that runs eagerly but silently not under jit (dead code).
    msg = refused_before_running(empty, jit, ValueError)
    assert msg.startswith("threadmap: result_shape_dtypes has no array leaves")
    assert "dead code" in msg and "jax.ShapeDtypeStruct((), jnp.bool_)" in msg


@pytest.mark.parametrize("empty", [None, ()], ids=repr)
def test_kernel_decorator_without_results_fails_when_decorating(empty):
    with pytest.raises(ValueError, match="jax_threadmap.kernel: result_shape_dtypes"):
        jax_threadmap.kernel(empty)


def test_negative_dimension_in_result_shape():
    class Bad:
        shape = (-1,)
        dtype = np.float32

    with pytest.raises(ValueError, match="negative dimension"):
        threadmap(double, Bad(), 1.0)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.grad(lambda x: f(x).sum()),
        lambda f: lambda x: jax.jvp(f, (x,), (x,)),
        lambda f: jax.jacrev(f),
    ],
)
def test_derivatives_of_bare_threadmap_say_how_to_get_them(transform):
    f = vmapped(np.sin)
    with pytest.raises(TypeError) as info:
        transform(f)(jnp.arange(3.0))
    msg = str(info.value)
    assert "no derivative rule" in msg
    assert "defjvp" in msg and "defvjp" in msg and "custom_jvp" in msg
    assert "Wrap the kernel with jax_threadmap.kernel(" in msg


def test_public_names():
    assert threadmap_p.name == "threadmap"
    assert isinstance(threadmap_p, jax.extend.core.Primitive)
    # __all__ is exactly the public namespace (no module, no stray import), and
    # each name is the function or class of that name, not a stand-in.
    public = {
        name
        for name, value in vars(jax_threadmap).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert sorted(jax_threadmap.__all__) == sorted(public)
    for name in jax_threadmap.__all__:
        value = getattr(jax_threadmap, name)
        if name != "threadmap_p":
            assert value.__name__ == name, (name, value)
            assert value.__module__.startswith("jax_threadmap."), (name, value)


def test_kernel_keywords_named_like_threadmaps_own_arguments_reach_the_kernel():
    # threadmap(kernel, result_shape_dtypes, /, *args, **kwargs), as
    # jax.pure_callback: those two names are free for the kernel's keywords.
    def k(x, *, kernel, result_shape_dtypes):
        return x * kernel + result_shape_dtypes

    f = jax.vmap(
        lambda x: threadmap(k, F32, x, kernel=2.0, result_shape_dtypes=np.float32(1))
    )
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(f(x), np.arange(4.0) * 2 + 1)

    @jax_threadmap.kernel(F32)
    def g(x, *, result_shape_dtypes):
        return x + result_shape_dtypes

    np.testing.assert_array_equal(
        jax.vmap(lambda v: g(v, result_shape_dtypes=np.float32(3)))(x), x + 3
    )
    with pytest.raises(TypeError, match="positional"):
        threadmap(kernel=k, result_shape_dtypes=F32)


def test_executor_keyword_is_reserved_for_threadmap():
    # `executor` never reaches the kernel: it configures threadmap.
    seen = []

    def k(x, **kw):
        seen.append(sorted(kw))
        return x

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        vmapped(k, executor=ex)(jnp.arange(3.0))
    assert seen == [[], [], []]


@pytest.mark.parametrize("name", ["sharding", "vmap_method"])
@pytest.mark.parametrize("via", ["threadmap", "kernel"])
def test_pure_callback_keywords_are_refused_at_the_call(name, via):
    # Were passed to the kernel, failing at run time ("unexpected keyword argument
    # 'sharding'", or "is a str, not an array" for vmap_method="sequential").
    value = {"sharding": jax.sharding.SingleDeviceSharding(jax.devices()[0])}.get(
        name, "sequential"
    )
    if via == "threadmap":
        call = lambda: threadmap(double, F32, 1.0, **{name: value})  # noqa: E731
    else:
        k = jax_threadmap.kernel(F32)(double)
        call = lambda: k(1.0, **{name: value})  # noqa: E731
    with pytest.raises(TypeError, match=rf"{name}= is a keyword of jax.pure_callback"):
        call()
    with pytest.raises(TypeError) as info:
        jax.jit(jax.vmap(lambda x: call()))(jnp.ones(2))
    assert "threadmap" in str(info.value) and "Drop the keyword" in str(info.value)
    assert ("shard_map" if name == "sharding" else "one flat map") in str(info.value)


class Declared:
    """A duck-typed declaration: ``.shape`` and ``.dtype``, taken as given."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


@pytest.mark.parametrize("dtype", [object, str, "S3", "datetime64[s]"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_result_dtype_that_jax_cannot_hold_is_refused_at_the_call(dtype, jit):
    # Was, eagerly: the kernel ran, then was blamed ("float32 does not convert to
    # object"); under jit: "No dtype_to_ir_type handler for dtype: object".
    out = jax.ShapeDtypeStruct((), dtype)
    msg = refused_before_running({"r": out}, jit, TypeError)
    assert "threadmap: result_shape_dtypes['r'] has dtype" in msg
    assert str(np.dtype(dtype)) in msg and "cannot hold" in msg
    with pytest.raises(TypeError, match="cannot hold"):
        jax_threadmap.async_call(lambda: np.zeros(()), out)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int4, jnp.bool_, jnp.complex64])
def test_result_dtypes_that_jax_holds_are_accepted(dtype):
    out = jax.ShapeDtypeStruct((2,), dtype)
    x = jnp.ones((3, 2), dtype)
    f = jax.vmap(lambda x: threadmap(lambda v: v, out, x))
    np.testing.assert_array_equal(f(x), x)


@pytest.mark.parametrize("shape", [(2.5,), (2.0,), ("2",)])
def test_result_shape_that_is_not_integers_is_refused_not_truncated(shape):
    # Was: (2.5,) silently became (2,).
    with pytest.raises(TypeError, match=r"has shape .*concrete shape of integers"):
        threadmap(lambda x: x, Declared(shape, np.float32), jnp.ones(2))
    np.testing.assert_array_equal(
        threadmap(lambda x: x, Declared((np.int64(2),), np.float32), jnp.ones(2)),
        np.ones(2),
    )


OPERANDS = {
    "python float": 1.5,
    "python int": 3,
    "python bool": True,
    "python complex": 1 + 2j,
    "numpy float64": np.arange(2, dtype=np.float64),
    "numpy int64": np.arange(2, dtype=np.int64),
    "numpy uint64": np.arange(2, dtype=np.uint64),
    "numpy float16": np.arange(2, dtype=np.float16),
}


@pytest.mark.parametrize("wide", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("name", OPERANDS)
def test_kernel_sees_the_dtypes_that_jit_gives_eagerly_too(name, wide, request):
    # Was, with x64 off: a Python float reached the kernel as float64 eagerly and
    # float32 under jit (Python int: int64 and int32), with and without vmap.
    if wide:
        request.getfixturevalue("x64")
    operand = OPERANDS[name]
    seen = []

    def kernel(x, s):
        seen.append((s.dtype, s.shape))
        return x

    def call(x, s):
        return threadmap(kernel, F32, x, s)

    xs = jnp.arange(3.0, dtype=jnp.float32)
    runs = {
        "eager": lambda: call(xs[0], operand),
        "jit": lambda: jax.jit(call)(xs[0], operand),
        "eager vmap": lambda: jax.vmap(call, (0, None))(xs, operand),
        "jit vmap": lambda: jax.jit(jax.vmap(call, (0, None)))(xs, operand),
    }
    got = {}
    for how, run in runs.items():
        seen.clear()
        jax.block_until_ready(run())
        got[how] = set(seen)
    assert len(set(map(frozenset, got.values()))) == 1, got
    (dtype, _), *_ = got["jit"]
    expected = jax.dtypes.canonicalize_dtype(np.asarray(operand).dtype)
    assert dtype == expected, (dtype, expected)


def test_a_kernels_rules_are_built_once_per_change(monkeypatch, x64):
    # Issue 50: the residuals are checked when a rule changes (or x64 does),
    # not at every call; a change of a derivative kernel's own rules, made
    # after the first call, is seen at the next.
    from jax_threadmap._core import api

    checked = []
    real = api._validate.result_avals

    def counting(decl, *args, **kw):
        checked.append(kw.get("name", "result_shape_dtypes"))
        return real(decl, *args, **kw)

    monkeypatch.setattr(api._validate, "result_avals", counting)
    S = jax.ShapeDtypeStruct
    f = jax_threadmap.kernel(S((), jnp.float64))(np.sin)
    f.defvjp(
        lambda x: (np.sin(x), np.cos(x)),
        lambda c, ct: (c * ct,),
        residuals=S((), jnp.float64),
    )
    grad = jax.grad(lambda x: jax.vmap(f)(x).sum())
    x = np.linspace(0.0, 1.0, 4)
    for _ in range(3):
        np.testing.assert_allclose(grad(x), np.cos(x))
        np.testing.assert_allclose(jax.vmap(f)(x), np.sin(x))
    assert checked.count("residuals") == 1, checked
    jax.config.update("jax_enable_x64", False)  # the x64 fixture restores it
    with pytest.raises(ValueError, match=r"residuals asks for dtype float64"):
        f(np.float32(1.0))
    with pytest.raises(ValueError, match=r"residuals asks for dtype float64"):
        f(np.float32(1.0))  # a refused rule is never kept
    jax.config.update("jax_enable_x64", True)
    # A derivative kernel whose own rule is attached after the first call.
    g = jax_threadmap.kernel(S((), jnp.float64))(np.sin)
    cos = jax_threadmap.kernel((S((), jnp.float64),))(lambda x, ct: (np.cos(x) * ct,))
    g.defvjp(cos)
    first = jax.grad(lambda x: jax.vmap(g)(x).sum())
    np.testing.assert_allclose(first(x), np.cos(x))
    with pytest.raises(Exception, match="no VJP|no derivative|defvjp|defjvp"):
        jax.grad(lambda x: first(x).sum())(x)
    cos.defvjp(lambda x, ct, c: (-np.sin(x) * ct * c[0], np.cos(x) * c[0]))
    second = jax.grad(lambda x: first(x).sum())
    np.testing.assert_allclose(second(x), -np.sin(x))
