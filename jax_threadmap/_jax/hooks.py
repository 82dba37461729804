"""Every use of JAX internals goes through one table of hooks: this module.

JAX gives no compatibility promise for the hooks a new primitive needs (batching
rules, lowering through a host callback, the eager impl) nor for the hooks an
array-like type needs to be passed to ``jit`` without its data. This module is the
only one in the package that finds them.

:data:`HOOKS` is the table: for each hook, why the package needs it, which
feature fails without it, which public API was tried in its place and why it
does not serve (:attr:`Hook.public`), and where it lives in each range of JAX
versions (a :class:`Form`, gated on ``jax.__version_info__``, with a note beside
each fallback; both described in :mod:`.hook_forms`, with the adapters that
need no hook of their own). The imports are driven by the table and guarded: a
hook that this JAX does not have never fails ``import jax_threadmap``; the first
use of a feature that needs it raises :class:`UnsupportedJaxError`, naming the
hook, the JAX version and what to do (:func:`require`). ``tests/_jax/test_compat.py``
reads the same table.

The feature code built on the table lives beside it, one module per concern
(docs/architecture.md lists them: the primitive class and its rule tables,
what the lowering emits, abstract values, ...). They reach JAX's internals only
through :func:`get`, :func:`or_missing` and :data:`RESOLVED`.

Rules for this module: every internal is an entry of :data:`HOOKS`, at one
location per range of JAX versions (public where JAX has one); the entry says
why; and nothing else (no feature code); no package module but
:mod:`.hook_forms`.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
from collections.abc import Callable
from typing import Any

from .hook_forms import (
    ARRAY_SURFACE,
    ASYNC_ARRAYS,
    ASYNC_DISPATCH,
    AUTO_PER_SHARD,
    DERIVATIVES,
    FAST_PLACEMENT,
    OLDEST_JAX,
    SHARD_MAP,
    THREADMAP,
    Form,
    Hook,
    Missing,
    UnsupportedJaxError,
    _adapted_before,
    _automatic_mesh_of,
    _eager_device_put,
    _emit_python_callback_without_returns_token,
    _everywhere,
    _host_callback_registrar,
    _key_impl_reader,
    _public,
    _register_identity_in,
    _register_lowering_without_cacheable,
    _register_with_none,
    _typeof_checking_sharding_rank,
    _waiting_constant_registrar,
    resolve,
)

# Re-exported for the package's other _jax modules and the tests (mypy, ruff).
from .hook_forms import JAX_VERSION as JAX_VERSION
from .hook_forms import NEWEST_TESTED_JAX as NEWEST_TESTED_JAX
from .hook_forms import PYTHON_CALLBACK_TARGETS as PYTHON_CALLBACK_TARGETS
from .hook_forms import form_for as form_for

# --- adapters that need the table (a hook of their own, or a private module) ----


def _one_sharding_per_result(op_sharding_of: Callable[..., Any]) -> Any:
    sdy_dim = importlib.import_module("jax._src.sharding_impls").SdyDim

    def callback_op_sharding(axis_context: Any, sharding: Any, avals_out: Any) -> Any:
        op_sharding = op_sharding_of(axis_context, sharding, avals_out)
        # Inside shard_map under Shardy (the default from jax 0.7.0) these
        # releases give one replicated annotation whatever the number of
        # results, which XLA's verifier rejects; 0.7.1 gives one per result.
        arrays = getattr(op_sharding, "shardings", None)
        if arrays is not None and len(arrays) != max(1, len(avals_out)):
            op_sharding = type(op_sharding)(
                [
                    dataclasses.replace(
                        arrays[0],
                        dim_shardings=[sdy_dim(axes=[], is_open=False)] * aval.ndim,
                    )
                    for aval in avals_out
                ]
            )
        return op_sharding

    return callback_op_sharding


@dataclasses.dataclass(frozen=True)
class _VaryingAxes:
    """Reads and makes avals that vary over manual mesh axes (inside shard_map).

    ``of`` is an ``operator.attrgetter``: a read of an aval's field, with no call
    into the package (it runs for every abstract value of an equation).
    """

    of: Callable[[Any], frozenset[Any]]
    make: Callable[[tuple[int, ...], Any, frozenset[Any], Any], Any]


def _varying_by_manual_axis_type(manual_axis_type: Any) -> _VaryingAxes:
    def make(
        shape: tuple[int, ...], dtype: Any, varying: frozenset[Any], sharding: Any
    ) -> Any:
        return get("ShapedArray")(
            shape,
            dtype,
            sharding=sharding,
            manual_axis_type=manual_axis_type(varying=varying),
        )

    return _VaryingAxes(operator.attrgetter("manual_axis_type.varying"), make)


def _varying_by_vma(shaped_array: Any) -> _VaryingAxes:
    if "vma" not in shaped_array.__slots__:
        raise AttributeError(f"{shaped_array.__qualname__} has no 'vma' field")

    def make(
        shape: tuple[int, ...], dtype: Any, varying: frozenset[Any], sharding: Any
    ) -> Any:
        return shaped_array(shape, dtype, sharding=sharding, vma=varying)

    return _VaryingAxes(operator.attrgetter("vma"), make)


# --- the table -----------------------------------------------------------------------

HOOKS: tuple[Hook, ...] = (
    # The primitive and its rules.
    Hook(
        "Primitive",
        "the class of threadmap_p",
        (THREADMAP,),
        _everywhere("jax.extend.core:Primitive"),
        _public("jax.extend.core:Primitive"),
    ),
    Hook(
        "ShapedArray",
        "the abstract values of results and cotangents",
        (THREADMAP, DERIVATIVES),
        _everywhere("jax.core:ShapedArray"),
        _public("jax.core:ShapedArray")
        + " (jax.core still exports it without a deprecation warning)",
    ),
    Hook(
        "typeof",
        "the abstract value of an argument, a cotangent or a declared result",
        (THREADMAP, DERIVATIVES, ASYNC_ARRAYS),
        _adapted_before(
            (0, 8, 2),
            "jax:typeof",
            "a ShapeDtypeStruct's sharding of the wrong rank is not rejected; "
            "NamedSharding.check_compatible_aval(shape) is called first",
            _typeof_checking_sharding_rank,
        ),
        "jax.typeof itself, public; in the table for its shim on JAX < 0.8.2",
    ),
    # The table BatchTrace reads first, with the signature (axis_data, vals,
    # dims, **params), in every supported JAX. `primitive_batchers` (vals, dims,
    # **params) is a separate table read after it before 0.8.2, and since then a
    # shim over it that JAX main marks "TODO: delete".
    Hook(
        "fancy_primitive_batchers",
        "the batching rule that folds each vmap level into the batch spec",
        (THREADMAP,),
        _everywhere(
            "jax.interpreters.batching:fancy_primitive_batchers",
            note="rules get (axis_data, vals, dims, **params), unbatched too",
        ),
        _public("jax.interpreters.batching:fancy_primitive_batchers")
        + ". jax.custom_batching.custom_vmap was not tried: it batches a function, "
        "and the rule must be the primitive's, which its JVP and transpose "
        "rules rebind",
    ),
    Hook(
        "register_lowering",
        "lowers each threadmap equation to one host callback",
        (THREADMAP,),
        _adapted_before(
            (0, 7, 0),
            "jax.interpreters.mlir:register_lowering",
            "no cacheable= (0.6 lowers every equation inline)",
            _register_lowering_without_cacheable,
        ),
        _public("jax.interpreters.mlir:register_lowering"),
    ),
    Hook(
        "emit_python_callback",
        "emits the host callback that runs the flat map",
        (THREADMAP,),
        # `jax.interpreters.mlir` re-exports it "temporarily" (JAX main says
        # so); when that goes, the canary test says so and a Form is added.
        _adapted_before(
            (0, 8, 2),
            "jax.interpreters.mlir:emit_python_callback",
            "no returns_token=",
            _emit_python_callback_without_returns_token,
        ),
        _public("jax.interpreters.mlir:emit_python_callback")
        + " (a re-export JAX calls temporary). Tried instead: lowering through "
        "jax.pure_callback's own rule (mlir.lower_fun over jax.pure_callback of "
        "the host function). tests/_core/test_sharding.py, test_compat.py and "
        "test_autodiff.py pass with it (jax 0.10.2), but pure_callback's "
        "callback puts every operand on the CPU as a jax.Array "
        "(jax.device_put) and converts each result back: a jitted threadmap "
        "call took 254 us against 138 us on a scalar and 302 us against 176 us "
        "on 8 elements (jax 0.10.2, best of 9x30 calls, 3 alternated runs, "
        "loaded machine), so it is not used",
    ),
    # An accelerator's runtime aborts the process on a host callback with a
    # 0-size operand or result (libtpu: "HostCommand byte_offset -1 ... not
    # aligned"), so the lowering never hands one to XLA: the results that hold
    # no data (an empty batch, a 0-size result) are lowered as zeros instead.
    Hook(
        "lower_fun",
        "lowers the results that hold no data (an empty batch, 0-size results) "
        "as zeros, in place of a host callback",
        (THREADMAP,),
        _everywhere("jax.interpreters.mlir:lower_fun"),
        _public("jax.interpreters.mlir:lower_fun")
        + ". A lowering rule must return IR values; no public function turns a "
        "jax.numpy function into them inside another rule",
    ),
    Hook(
        "mlir_ir",
        "the block a lowering rule emits into (ir.InsertionPoint.current), and "
        "the operations that computed its operands: an equation equal to one "
        "lowered before it in that block reuses its results (XLA never merges "
        "two host callbacks)",
        (THREADMAP,),
        _everywhere("jax.interpreters.mlir:ir"),
        _public("jax.interpreters.mlir:ir")
        + ". The lowering context has no field for its block",
    ),
    Hook(
        "callback_op_sharding",
        "the op sharding pure_callback uses: MAXIMAL on one device under automatic "
        "sharding, MANUAL inside shard_map, none otherwise",
        (THREADMAP,),
        _adapted_before(
            (0, 7, 1),
            "jax._src.callback:_callback_op_sharding",
            "inside shard_map under Shardy, one annotation for all results; "
            "one per result is made here, as 0.7.1 does (with "
            "jax._src.sharding_impls.SdyDim)",
            _one_sharding_per_result,
        ),
        "tried: lowering through jax.pure_callback's rule, which computes this "
        "sharding itself; it serves but costs about 120 us a call (see "
        "emit_python_callback). jax.pure_callback's sharding= argument is not "
        "reachable from a lowering rule, and no public function computes it",
    ),
    Hook(
        "prim_requires_devices_during_lowering",
        "like pure_callback_p, the lowering needs the devices to place the "
        "callback in sharded (shard_map, pmap, NamedSharding) programs",
        (THREADMAP,),
        _everywhere("jax._src.dispatch:prim_requires_devices_during_lowering"),
        "none: JAX reads this set from the jaxpr before lowering "
        "(dispatch.jaxpr_has_prim_requiring_devices, the same on every supported "
        "JAX), where threadmap_p stands whatever its lowering emits, so lowering "
        "through jax.pure_callback does not remove the need",
    ),
    # Inside shard_map an aval records the manual mesh axes its value varies
    # over. A host call on varying operands gives varying results, and
    # cotangents must have the type of their primal, so the abstract eval and
    # the transpose rule propagate them. There is no public constructor.
    Hook(
        "varying_axes",
        "the manual mesh axes an aval varies over inside shard_map",
        (SHARD_MAP,),
        (
            Form(
                (0, 10, 0),
                None,
                "jax._src.core:ManualAxisType",
                "aval.manual_axis_type.varying; "
                "ShapedArray(..., manual_axis_type=ManualAxisType(varying=...))",
                _varying_by_manual_axis_type,
            ),
            Form(
                OLDEST_JAX,
                (0, 10, 0),
                "jax.core:ShapedArray",
                "aval.vma; the public ShapedArray(..., vma=...)",
                _varying_by_vma,
            ),
        ),
        "public before jax 0.10 (jax.core.ShapedArray(vma=...), aval.vma). From "
        "0.10 on, tried: jax.ShapeDtypeStruct(manual_axis_type=...), which takes "
        "the same private ManualAxisType; jax.lax.pvary/pcast make values vary, "
        "not avals, and an abstract eval has no values",
    ),
    # --- per-shard maps under jit (issue 52, h5-sharding) --------------------------
    # XLA's partitioner decides the sharding after the equation is lowered, so
    # the lowering emits a custom_partitioning call whose partition function
    # (run by XLA during compilation) lowers one host callback per device. Its
    # module is built apart from the program's, and the host callbacks a
    # program may call are fixed when compilation starts (jax-ml/jax#23620), so
    # the callback is registered in the program's module while it is lowered,
    # and the partition function emits JAX's own FFI host-callback call with
    # that callback's index (PYTHON_CALLBACK_TARGETS below).
    Hook(
        "custom_partitioning",
        "lowers a batched equation under jit on a mesh to a call that "
        "XLA's partitioner (GSPMD or Shardy) splits along its batch axes",
        (AUTO_PER_SHARD,),
        _everywhere("jax.experimental.custom_partitioning:custom_partitioning"),
        _public("jax.experimental.custom_partitioning:custom_partitioning")
        + ". Tried instead: jax.pure_callback (its sharding= is fixed when "
        "traced, and under automatic axes the sharding is only known to the "
        "partitioner), a shard_map chosen at lowering (it would impose a "
        "sharding, not take the one XLA chose), and a shard_map bound by the "
        "batching rule (explicit axes only; refused by jax 0.8.1 to 0.9.0.1)",
    ),
    Hook(
        "ffi_lowering",
        "emits the per-shard host-callback call (JAX's own FFI target, by index)",
        (AUTO_PER_SHARD,),
        _everywhere("jax.ffi:ffi_lowering"),
        _public("jax.ffi:ffi_lowering")
        + ". emit_python_callback cannot serve: it registers the callback in "
        "the partition function's own module, which the program never sees",
    ),
    Hook(
        "ModuleContext",
        "registers the per-shard host callback in the program's module while it "
        "is lowered (add_host_callback; its index in host_callbacks)",
        (AUTO_PER_SHARD,),
        _everywhere(
            "jax.interpreters.mlir:ModuleContext", adapt=_host_callback_registrar
        ),
        "none: no public API adds a host callback to a program being lowered; "
        "the class is exported by jax.interpreters.mlir on every supported JAX, "
        "its add_host_callback method and host_callbacks list are not documented",
    ),
    Hook(
        "ShardingContext",
        "tells a lowering under jit on a mesh of several devices "
        "(the axis context custom_partitioning partitions) and its mesh",
        (AUTO_PER_SHARD,),
        _everywhere("jax.interpreters.mlir:ShardingContext", adapt=_automatic_mesh_of),
        _public("jax.interpreters.mlir:ShardingContext")
        + ". jax.sharding.get_abstract_mesh() is empty under jit with "
        "NamedSharding arguments and no mesh context, and a lowering rule has "
        "no other view of its program's devices and mesh",
    ),
    Hook(
        "use_abstract_mesh",
        "traces each device's call in the partition function on the partitioner's "
        "mesh, not on the explicit one of a jax.set_mesh (jax.sharding.use_mesh) "
        "context, whose typed values XLA cannot lower there",
        (AUTO_PER_SHARD,),
        (
            Form((0, 7, 2), None, "jax.sharding:use_abstract_mesh"),
            Form(
                OLDEST_JAX,
                (0, 7, 2),
                "jax._src.mesh:use_abstract_mesh",
                "not exported by jax.sharding before 0.7.2",
            ),
        ),
        "jax.sharding.use_abstract_mesh, public from jax 0.7.2; tried on 0.6.2: "
        "jax.sharding.use_mesh, which raises 'use_mesh can only be used outside "
        "of jax.jit' in the partition function",
    ),
    # Derivative rules on the primitive.
    *(
        Hook(
            name,
            why,
            (DERIVATIVES,),
            _everywhere(f"jax.interpreters.ad:{name}"),
            _public(f"jax.interpreters.ad:{name}"),
        )
        for name, why in (
            ("primitive_jvps", "the JVP rule that binds the JVP kernel's equation"),
            ("primitive_transposes", "the transpose rule that runs the VJP kernel"),
            ("Zero", "symbolic zero tangents and cotangents"),
            ("is_undefined_primal", "tells linear inputs in a transpose rule"),
        )
    ),
    # Async arrays. An `AsyncArray` (jax_threadmap/_arrays/async_array.py) is passed
    # to `jit` without its data: tracing and compilation need only its abstract
    # value, and the wait for the data belongs at execution. JAX has no public hook for
    # such a type, and since jax 0.8 `__jax_array__` is no longer honoured during
    # abstractification (it raises), so three private tables are needed.
    Hook(
        "pytype_aval_mappings",
        "type -> abstract value, read when jit traces, so that tracing and "
        "compiling never touch the data",
        (ASYNC_ARRAYS,),
        _everywhere("jax._src.core:pytype_aval_mappings"),
        "tried: jax.core.pytype_aval_mappings, public on 0.6.2 but deprecated "
        "(a DeprecationWarning at each access) on 0.10.2 and 0.12.0.1. "
        "__jax_array__ would hand jit the data at trace time, which is what an "
        "AsyncArray must not need (and since jax 0.8 it raises there)",
    ),
    Hook(
        "canonicalize_value",
        "argument canonicalisation runs before sharding at execution; an unknown "
        'type is rejected there as "not a valid JAX type"',
        (ASYNC_ARRAYS,),
        (
            Form(
                (0, 10, 2),
                None,
                "jax._src.dtypes:register_canonicalize_value_handler",
                "register(cls, None)",
                _register_with_none,
            ),
            Form(
                (0, 7, 1),
                (0, 10, 2),
                "jax._src.dtypes:canonicalize_value_handlers",
                "a table; the handler must be the identity (None is skipped)",
                _register_identity_in,
            ),
            Form(
                OLDEST_JAX,
                (0, 7, 1),
                "jax._src.interpreters.xla:canonicalize_dtype_handlers",
                "a table under its old name; the handler must be the identity",
                _register_identity_in,
            ),
        ),
        "none: jax.dtypes, jax.core and jax.interpreters.xla export no such "
        "table or register function on 0.6.2, 0.10.2 or 0.12.0.1",
    ),
    Hook(
        "shard_arg_handlers",
        "type -> function that turns arguments into device buffers, called only "
        "when a compiled program runs: the place to wait for the data",
        (ASYNC_ARRAYS,),
        _everywhere("jax._src.interpreters.pxla:shard_arg_handlers"),
        "none: jax.interpreters.pxla does not export it on any supported JAX; "
        "jax.make_array_from_callback and jax.device_put need the data when "
        "called, not when a program runs",
    ),
    Hook(
        "shard_args",
        "the handler delegates to it, so resharding and layouts work as for jax.Array",
        (ASYNC_ARRAYS,),
        _everywhere("jax._src.interpreters.pxla:shard_args"),
        "tried: jax.interpreters.pxla.shard_args, exported on 0.6.2 only (not on "
        "0.10.2 nor 0.12.0.1); jax.device_put(x, sharding) does not take the "
        "program's layouts and copy semantics",
    ),
    # An AsyncArray is a jax.Array, so a jitted function may close over one:
    # JAX embeds such a constant in the program through the handler of its type.
    Hook(
        "register_constant_handler",
        "a jitted function that closes over an AsyncArray embeds its value in "
        "the program (waited for when lowered), as for a jax.Array",
        (ASYNC_ARRAYS,),
        _everywhere(
            "jax.interpreters.mlir:register_constant_handler",
            adapt=_waiting_constant_registrar,
        ),
        _public("jax.interpreters.mlir:register_constant_handler")
        + " (with jax.interpreters.mlir.ir_constant). Pass the array as an "
        "argument instead and it is never waited for when lowered",
    ),
    # jax.make_array_from_callback raises UnexpectedTracerError at the call when
    # its data_callback returns a tracer (the call made under jit). Our sharded
    # load returns before any shard arrives; under a trace it fetches one shard
    # at the call, to fail there too. jax.core.trace_state_clean was public until
    # its deprecation (jax 0.4.36); nothing public replaced it.
    Hook(
        "trace_state_clean",
        "whether the caller is outside every trace (jit, vmap...): under one, "
        "async_array_from_callback fetches a shard at the call",
        (ASYNC_ARRAYS,),
        _everywhere("jax._src.core:trace_state_clean"),
        "tried: jax.core.trace_state_clean, deprecated (a warning) on 0.6.2 and "
        "gone on 0.10.2 and 0.12.0.1; its deprecation names no replacement",
    ),
    # jax.device_put of a small NumPy array costs 20-60 us in Python (argument
    # checks, a deferred-argument wrapper, a context manager); JAX's own
    # make_array_from_callback places with this call instead (3-5 us; the same
    # signature in 0.6.2 ... 0.12, plus enable_x64= since 0.10, left unset). A
    # thousand async def loads in flight finish within twice one load with it.
    Hook(
        "batched_device_put",
        "puts a background call's NumPy result on its one device, as "
        "jax.device_put does, without device_put's Python overhead",
        (FAST_PLACEMENT,),
        _everywhere("jax._src.interpreters.pxla:batched_device_put"),
        "tried: jax.device_put, which serves (it is the fallback where this hook "
        "is missing) at about 5x the cost per result (see the comment above); "
        "optional, so nothing fails without it",
    ),
    # The jax.Array surface of AsyncArray (issue 48 item 2). JAX defines the
    # methods, operators and properties of its arrays (and of tracers, through
    # the abstract value) from three tables of plain functions of the array, the
    # same module and names in 0.6.2 ... 0.12.0.1 (0.10 added `byteswap` and
    # `__contains__`). `_arrays/array_surface.py` runs each under jit with the
    # AsyncArray as argument, so that `y.sum()` dispatches without its data.
    Hook(
        "ArrayImpl",
        "the class of JAX's arrays: which of its methods that read the buffer "
        "(tolist, __dlpack__, unsafe_buffer_pointer...) this JAX has, each of "
        "which an AsyncArray gets as a wait in Python and a delegation",
        (ARRAY_SURFACE,),
        _everywhere("jaxlib.xla_client:ArrayImpl"),
        _public("jaxlib.xla_client:ArrayImpl")
        + ". type(jnp.zeros(())) is the same class but starts a backend at import",
    ),
    *(
        Hook(
            name,
            why,
            (ARRAY_SURFACE,),
            _everywhere(f"jax._src.numpy.array_methods:_{name}"),
            "tried: the methods of jax.Array's concrete class (ArrayImpl), which "
            "coerce their argument with __jax_array__ (that waits for an "
            "AsyncArray's value) or read its buffer; jax.Array's own attributes "
            "are abstract stubs that raise NotImplementedError. No public module "
            "exports the tables on any supported JAX",
        )
        for name, why in (
            ("array_methods", "jax.Array's methods (sum, astype, reshape...)"),
            ("array_operators", "jax.Array's operators (__add__, __getitem__...)"),
            ("array_properties", "jax.Array's properties (T, mT, real, at...)"),
        )
    ),
    # jax.random's eager rules (split, fold_in, bits, key_data...) read two
    # fields of a key array, `_impl` and `_base_array`; an AsyncArray of a key
    # dtype gives them: its dtype's implementation, and its key data (deferred).
    Hook(
        "PRNGKeyArray",
        "the fields jax.random reads of a key array (_impl, _base_array), which "
        "an AsyncArray of a key dtype provides; the implementation of a key dtype",
        (ARRAY_SURFACE,),
        (
            Form(
                (0, 10, 2),
                None,
                "jax._src.random.prng:PRNGKeyArray",
                "",
                _key_impl_reader,
            ),
            Form(
                OLDEST_JAX,
                (0, 10, 2),
                "jax._src.prng:PRNGKeyArray",
                "the module before it moved into jax._src.random",
                _key_impl_reader,
            ),
        ),
        "tried: jax.random.key_impl(k), public, which returns a PRNGSpec, not "
        "the implementation that the rules call (impl.split...); no public API "
        "makes an array that jax.random's eager rules take as a key array",
    ),
    Hook(
        "batched_device_put_impl",
        "every eager jax.device_put: wrapped, so that jax.device_put(x) of an "
        "AsyncArray with no target returns x itself, without waiting",
        (ARRAY_SURFACE,),
        _everywhere(
            "jax._src.dispatch:_batched_device_put_impl",
            "device_put_p's impl on 0.6 and 0.7, its callee from 0.8",
            _eager_device_put,
        ),
        "none: jax.device_put keeps x only where x is an ArrayImpl (a C++ "
        "class), and no public registry says where a type's value already is",
    ),
    # Async dispatch (issues 13, 48). A jitted call with pending `AsyncArray`
    # arguments returns at once: JAX's call that runs the compiled program
    # (ExecuteReplicated.__call__, which `ProgramRuns.install` wraps) is where the
    # program and its arguments are known and nothing has run yet, so the run is
    # deferred there (`_arrays/dispatch.py`) until the data lands.
    Hook(
        "ExecuteReplicated",
        "its __call__ runs a compiled program from Python (the argument "
        "handlers, then XLA's execute); wrapped, so that a program on pending "
        "data is deferred until the data lands (read: _local_devices, mut, "
        "name, ordered_effects, out_handler.out_avals and .out_shardings), "
        "and that a kernel's program on a device whose program waits for it "
        "is refused",
        (ASYNC_DISPATCH,),
        _everywhere("jax._src.interpreters.pxla:ExecuteReplicated"),
        "none: jax.stages.Compiled.__call__ runs only ahead-of-time compiled "
        "programs, and jax.jit's calls reach this class without a public hook; "
        "jax.interpreters.pxla does not export it on any supported JAX",
    ),
)


# --- resolution: guarded imports, driven by the table ---------------------------------


#: Hook name -> the object the package uses, or a :class:`Missing`.
RESOLVED: dict[str, Any] = {hook.name: resolve(hook) for hook in HOOKS}


def get(name: str, api: str = "jax_threadmap") -> Any:
    """The resolved hook ``name``; raises :class:`UnsupportedJaxError` if missing."""
    value = RESOLVED[name]
    if isinstance(value, Missing):
        raise UnsupportedJaxError(value.message(api))
    return value


def require(feature: str, api: str) -> None:
    """Raises :class:`UnsupportedJaxError` if a hook that ``feature`` needs is missing.

    The public entry point of each feature calls it first, so a JAX release that
    moved a hook fails there, with the hook's name, rather than deep inside JAX.
    """
    for name in _NEEDED_BY.get(feature, ()):
        if isinstance(RESOLVED[name], Missing):  # get()'s check, inline: per call
            get(name, api)


# The hooks each feature needs, from the table (require runs at every async_call).
_NEEDED_BY: dict[str, list[str]] = {}
for _hook in HOOKS:
    for _feature in _hook.features:
        _NEEDED_BY.setdefault(_feature, []).append(_hook.name)
# An AsyncArray is a jax.Array: async arrays need the surface's hooks too.
_NEEDED_BY[ASYNC_ARRAYS] += _NEEDED_BY.get(ARRAY_SURFACE, [])


def or_missing(name: str, fallback: Any) -> Any:
    """The resolved hook ``name``, or ``fallback`` where this JAX lacks it."""
    value = RESOLVED[name]
    return fallback if isinstance(value, Missing) else value


def missing_for(feature: str) -> str | None:
    """Why ``feature`` is unavailable (its first missing hook), or ``None``."""
    for name in _NEEDED_BY.get(feature, ()):
        value = RESOLVED[name]
        if isinstance(value, Missing):
            return f"{name} is missing: {value.reason}"
    return None
