"""The forms of the hook table (:mod:`.hooks`): how a hook is described, found
and adapted, whatever the JAX version.

- the versions: this JAX, the oldest supported, the newest tested;
- the features a hook can be needed by (:data:`THREADMAP`, :data:`ASYNC_ARRAYS`...);
- :class:`Hook` (an entry of the table) and :class:`Form` (where it lives in a range
  of JAX versions), and :func:`resolve`, which finds a hook's object by its form's
  locations, or says why not (:class:`Missing`, which raises
  :class:`UnsupportedJaxError` when called);
- the adapters that give a hook one calling convention across its forms.

It names no hook and no JAX internal (the table does), and imports no package
module, so that the table can be read without importing the package.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import jax

#: The JAX version this process runs, e.g. ``(0, 10, 2)``; every gate reads it.
JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__)
#: The oldest JAX supported: the first whose ``shard_map`` tracks varying axes
#: (``vma``), which reverse mode inside ``shard_map`` needs. pyproject.toml
#: declares ``jax>=`` this; CI tests it.
OLDEST_JAX: tuple[int, ...] = (0, 6, 2)
#: The newest JAX that CI tests (.ci/run pins it); errors suggest the range up to it.
NEWEST_TESTED_JAX: tuple[int, ...] = (0, 12, 0, 1)

#: The features a hook can be needed by; :func:`require` checks one at its entry.
THREADMAP = "threadmap"
DERIVATIVES = "derivatives"
ASYNC_ARRAYS = "async arrays"
#: threadmap inside jax.shard_map (and under pmap where JAX runs it as shard_map).
SHARD_MAP = "shard_map"
#: Optional: where its hook is missing, a jitted call on pending data waits for
#: the data (blocking dispatch) instead of returning at once with deferred
#: results.
ASYNC_DISPATCH = "async dispatch"
#: Optional: a result of a background call is put on its one device by JAX's own
#: batched placement (what ``make_array_from_callback`` uses), about 5x faster
#: than ``jax.device_put``; where a hook is missing, by ``jax.device_put``.
FAST_PLACEMENT = "fast placement"
#: Optional: under ``jit`` on several devices (explicit or automatic mesh axes,
#: GSPMD or Shardy), a map whose batch axes are sharded is lowered through
#: ``custom_partitioning`` and mapped per shard (:mod:`.._core.lowering`).
#: Where a hook is missing, it is mapped on one device, with one INFO log line
#: (:func:`.mlir.per_shard_mesh`).
AUTO_PER_SHARD = "per-shard jit"
#: Needed by async arrays with the others (:func:`.._arrays.leaves.leaf_specs`
#: requires both): the ``jax.Array`` methods of an ``AsyncArray`` run JAX's own
#: under ``jit`` (deferred).
ARRAY_SURFACE = "jax.Array surface"


def version_text(version: tuple[int, ...]) -> str:
    """``(0, 10, 2)`` as ``"0.10.2"``."""
    return ".".join(map(str, version))


class UnsupportedJaxError(RuntimeError):
    """This JAX lacks an internal hook that a jax_threadmap feature needs.

    Raised by the first use of that feature only (importing the package never
    fails on a missing hook, and the other features keep working); the message
    names the hook, the installed JAX and what to do: install a JAX release from
    the supported range, or a jax_threadmap that knows the new one.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax_threadmap import UnsupportedJaxError, threadmap
        >>> try:
        ...     y = threadmap(np.sin, jax.ShapeDtypeStruct((), jnp.float32), 0.0)
        ... except UnsupportedJaxError as e:  # a JAX release that moved a hook
        ...     print(e)
        ... else:
        ...     print(y)
        0.0
        >>> issubclass(UnsupportedJaxError, RuntimeError)
        True
    """


@dataclasses.dataclass(frozen=True)
class Form:
    """Where a hook lives in the JAX releases ``since <= version < until``.

    Attributes:
        since: The first JAX version with this form.
        until: The first JAX version without it; ``None``: still current (also
            tried on JAX releases newer than the newest tested).
        where: The ``"module:attribute"`` location.
        note: What differs from the other forms, and why this one is used there.
        adapt: Turns the object found into what the package calls (a uniform
            signature across forms); ``None``: used as found.
    """

    since: tuple[int, ...]
    until: tuple[int, ...] | None
    where: str
    note: str = ""
    adapt: Callable[[Any], Any] | None = None

    def covers(self, version: tuple[int, ...]) -> bool:
        return self.since <= version and (self.until is None or version < self.until)


@dataclasses.dataclass(frozen=True)
class Hook:
    """A JAX internal the package relies on.

    Attributes:
        name: The key in :data:`HOOKS` and in messages.
        why: Why the package needs it.
        features: The features that fail without it.
        forms: Where it lives, one :class:`Form` per range of JAX versions.
        public: The public API tried in its place, on every supported JAX
            (0.6.2, 0.10.2 and 0.12.0.1 were run), and why it does not serve;
            or, for a hook found at a public location on all of them, which
            one (the private fallback then removed) and why it stays guarded.
    """

    name: str
    why: str
    features: tuple[str, ...]
    forms: tuple[Form, ...]
    public: str


# --- adapters: one calling convention per hook, whatever the version -------------


def _register_lowering_without_cacheable(register: Callable[..., Any]) -> Any:
    def register_lowering(
        prim: Any, rule: Callable[..., Any], *, cacheable: bool = True, **kwargs: Any
    ) -> Any:
        # JAX 0.6 has no per-equation lowering cache: every equation is lowered
        # inline, which is what cacheable=False asks for.
        del cacheable
        return register(prim, rule, **kwargs)

    return register_lowering


def _emit_python_callback_without_returns_token(emit: Callable[..., Any]) -> Any:
    def emit_python_callback(
        *args: Any, returns_token: bool = True, **kwargs: Any
    ) -> Any:
        # Before 0.8.2 the flag did not exist, and callbacks behaved as with
        # returns_token=False (True adds a dummy result to TPU callbacks that
        # have none).
        del returns_token
        return emit(*args, **kwargs)

    return emit_python_callback


def _typeof_checking_sharding_rank(typeof: Callable[[Any], Any]) -> Any:
    def checked_typeof(x: Any) -> Any:
        # Before 0.8.2 a ShapeDtypeStruct accepts a sharding of another rank than
        # its shape, and typeof does not check it either; the sharding's own check
        # is the one later releases run in ShapeDtypeStruct.
        check = getattr(getattr(x, "sharding", None), "check_compatible_aval", None)
        if isinstance(x, jax.ShapeDtypeStruct) and check is not None:
            check(tuple(x.shape))
        return typeof(x)

    return checked_typeof


def _register_identity_in(table: dict[Any, Any]) -> Callable[[type], None]:
    def register(cls: type) -> None:
        # These tables call the handler: the identity keeps the value as it is.
        table[cls] = _identity

    return register


def _identity(x: Any) -> Any:
    return x


def _register_with_none(register: Callable[[type, Any], None]) -> Any:
    def register_canonicalize_value(cls: type) -> None:
        # `None` is JAX's own way to say "keep the value as it is" here.
        register(cls, None)

    return register_canonicalize_value


def _waiting_constant_registrar(register: Callable[[type, Any], None]) -> Any:
    ir_constant = importlib.import_module("jax.interpreters.mlir").ir_constant

    def register_waiting_constant(cls: type, value_of: Callable[[Any], Any]) -> None:
        # A jitted function that closes over such an array embeds its value in
        # the program, as JAX does for its own arrays: the lowering waits for it.
        # The handler gets (value) on 0.6 and (value, aval) from 0.7.
        register(cls, lambda x, *aval: ir_constant(value_of(x)))

    return register_waiting_constant


def _key_impl_reader(key_array: type) -> Any:
    fields = getattr(key_array, "__annotations__", {})
    if not {"_impl", "_base_array"} <= set(fields):
        raise AttributeError("PRNGKeyArray has no _impl and _base_array fields")

    def impl_of(dtype: Any) -> Any:
        # A key dtype (key<fry>) holds its PRNG implementation, which JAX's key
        # arrays hold as _impl.
        return dtype._impl

    return impl_of


def _eager_device_put(impl: Callable[..., Any]) -> Any:
    module = importlib.import_module(impl.__module__)
    copies = getattr(module, "ArrayCopySemantics", None) or module.CopySemantics
    reuse = getattr(copies, "REUSE_INPUT", None) or copies.ALIAS  # (ALIAS on 0.6)

    def install(keeps: Callable[[Any], bool]) -> None:
        # Every eager jax.device_put(x) with no target, no copy asked for, and
        # keeps(x): x itself, as JAX does for its own arrays.
        def put(*xs: Any, devices: Any, copy_semantics: Any, **kw: Any) -> Any:
            kw.update(devices=devices, copy_semantics=copy_semantics)
            keep = [
                d is None and c == reuse and keeps(x)
                for x, d, c in zip(xs, devices, copy_semantics, strict=True)
            ]
            rest = [i for i, k in enumerate(keep) if not k]
            picked = {k: [v[i] for i in rest] for k, v in kw.items()}
            outs = iter(impl(*(xs[i] for i in rest), **picked) if rest else ())
            return [x if k else next(outs) for x, k in zip(xs, keep, strict=True)]

        setattr(module, impl.__name__, put)  # what jax.device_put calls (0.8 on)
        if module.device_put_p.impl is impl:  # the primitive's own impl (0.6, 0.7)
            module.device_put_p.impl = put

    return install


def _everywhere(where: str, note: str = "", adapt: Any = None) -> tuple[Form, ...]:
    """One form for every supported JAX (no version gate needed so far)."""
    return (Form(OLDEST_JAX, None, where, note, adapt),)


def _adapted_before(
    until: tuple[int, ...], where: str, note: str, adapt: Callable[[Any], Any]
) -> tuple[Form, ...]:
    """One location on every supported JAX; the releases before ``until`` need
    ``adapt`` (``note`` says what differs there)."""
    return (Form(until, None, where), Form(OLDEST_JAX, until, where, note, adapt))


#: JAX's FFI targets of host callbacks, by platform (what emit_python_callback
#: emits on every supported JAX: ``xla_ffi_python_{cpu,gpu}_callback`` with an
#: ``index`` attribute into the program's host callbacks). TPU callbacks are
#: send/recv pairs instead; there per-shard maps under jit fall back.
PYTHON_CALLBACK_TARGETS: dict[str, str] = {
    "cpu": "xla_ffi_python_cpu_callback",
    "cuda": "xla_ffi_python_gpu_callback",
    "rocm": "xla_ffi_python_gpu_callback",
}


def _host_callback_registrar(module_context_class: Any) -> Any:
    if not hasattr(module_context_class, "add_host_callback"):
        raise AttributeError("ModuleContext has no add_host_callback")

    def register_host_callback(module_context: Any, callback: Any) -> int:
        # The callback's index in the program's host callbacks, which the FFI
        # call names (emit_python_callback computes it the same way).
        module_context.add_host_callback(callback)
        return len(module_context.host_callbacks) - 1

    return register_host_callback


def _automatic_mesh_of(sharding_context: type) -> Any:
    def automatic_mesh(axis_context: Any) -> Any:
        # jit with shardings on several devices, not inside shard_map: the
        # mesh custom_partitioning reads (None without one, or on one device).
        if not isinstance(axis_context, sharding_context):
            return None
        devices = getattr(axis_context, "device_assignment", None) or ()
        # None where no operand names a mesh (NumPy operands under jax.set_mesh):
        # then the context's, which the program's results are typed on.
        mesh = getattr(axis_context, "abstract_mesh", None)
        mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
        if len(devices) < 2 or getattr(mesh, "empty", True):
            return None
        return mesh

    return automatic_mesh


#: What the ``public`` field says of a hook whose every location is public.
_PUBLIC_MODULE = (
    "found at this public location on every supported JAX, so the jax._src "
    "fallback is removed; kept in the table because {module} is public but "
    "comes with no compatibility promise, so its import stays guarded"
)


def _public(where: str) -> str:
    return _PUBLIC_MODULE.format(module=where.split(":")[0])


# --- resolution: guarded imports, driven by the table ---------------------------------


@dataclasses.dataclass(frozen=True)
class Missing:
    """What a hook resolves to when this JAX does not have it."""

    hook: Hook
    reason: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        raise UnsupportedJaxError(self.message("jax_threadmap"))

    def message(self, api: str) -> str:
        # One advice for a JAX older than supported and one newer than tested.
        oldest, newest = version_text(OLDEST_JAX), version_text(NEWEST_TESTED_JAX)
        return (
            f"{api} needs the JAX internal {self.hook.name!r} ({self.hook.why}), "
            f"which JAX {jax.__version__} does not provide: {self.reason}. Install "
            f"a JAX from {oldest} to {newest}, the range this jax_threadmap "
            f"supports (pip install 'jax>={oldest},<={newest}' "
            f"'jaxlib>={oldest},<={newest}'), or upgrade jax_threadmap."
        )


def form_for(hook: Hook, version: tuple[int, ...] = JAX_VERSION) -> Form | None:
    """The form of ``hook`` for JAX ``version`` (``None``: older than any)."""
    for form in hook.forms:
        if form.covers(version):
            return form
    return None


def resolve(hook: Hook, version: tuple[int, ...] = JAX_VERSION) -> Any:
    """The object the package uses for ``hook``, or a :class:`Missing`."""
    form = form_for(hook, version)
    if form is None:
        first = min(f.since for f in hook.forms)
        return Missing(hook, f"it is known from JAX {version_text(first)} on")
    module_name, attr = form.where.split(":")
    try:  # an adapter that finds no field it needs says so by AttributeError
        found = getattr(importlib.import_module(module_name), attr)
        return form.adapt(found) if form.adapt is not None else found
    except (ImportError, AttributeError) as e:
        return Missing(
            hook, f"looked for {module_name}.{attr} ({type(e).__name__}: {e})"
        )
