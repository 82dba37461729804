"""The table of JAX hooks (jax_threadmap/_jax/hooks.py): the canary, and what a user
sees when a JAX release moves a hook.

Every test reads :data:`jax_threadmap._jax.hooks.HOOKS`, the table the package's
imports are driven by, so a hook added there is checked here without a second list.
"""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_script

import jax_threadmap
from jax_threadmap._arrays import dispatch as _dispatch
from jax_threadmap._jax import avals as _avals
from jax_threadmap._jax import hooks as _compat
from jax_threadmap._jax import placement as _placement

PACKAGE = pathlib.Path(_compat.__file__).parent.parent
ROOT = PACKAGE.parent
HOOKS = _compat.HOOKS
NEWEST = ".".join(map(str, _compat.NEWEST_TESTED_JAX))
OLDEST = ".".join(map(str, _compat.OLDEST_JAX))
SDS = jax.ShapeDtypeStruct


def _ids(hook):
    return hook.name


# --- the canary ----------------------------------------------------------------------


@pytest.mark.parametrize("hook", HOOKS, ids=_ids)
def test_every_jax_hook_is_still_where_we_expect_it(hook):
    form = _compat.form_for(hook)
    value = _compat.RESOLVED[hook.name]
    assert not isinstance(value, _compat.Missing), (
        f"JAX {jax.__version__} no longer provides {hook.name!r} ({hook.why}), "
        f"which jax_threadmap's {', '.join(hook.features)} needs: {value.reason}. "
        "Add a Form for this JAX to its entry in jax_threadmap/_jax/hooks.py HOOKS "
        "(and pin jax below this version until then)."
    )
    assert form is not None


@pytest.mark.parametrize("hook", HOOKS, ids=_ids)
def test_each_hook_has_one_form_for_every_supported_jax(hook):
    forms = sorted(hook.forms, key=lambda f: f.since)
    assert forms[0].since == _compat.OLDEST_JAX
    assert forms[-1].until is None, "the newest form must stay open for new JAX"
    for older, newer in zip(forms, forms[1:], strict=False):
        assert older.until == newer.since, f"{hook.name}: a gap or an overlap"
        assert older.note, f"{hook.name}: say what differs before {newer.since}"
    assert hook.why and hook.features
    assert set(hook.features) <= {
        _compat.THREADMAP,
        _compat.DERIVATIVES,
        _compat.ASYNC_ARRAYS,
        _compat.ASYNC_DISPATCH,
        _compat.SHARD_MAP,
        _compat.AUTO_PER_SHARD,
        _compat.FAST_PLACEMENT,
        _compat.ARRAY_SURFACE,
    }
    for form in hook.forms:
        assert re.fullmatch(r"[\w.]+:\w+", form.where), form.where


def _private(where: str) -> bool:
    """Whether a ``module:attribute`` location is private to JAX."""
    module, attr = where.split(":")
    return attr.startswith("_") or any(p.startswith("_") for p in module.split("."))


@pytest.mark.parametrize("hook", HOOKS, ids=_ids)
def test_each_hook_says_which_public_api_was_tried(hook):
    # Issue 33: each JAX internal earns its place. An entry with a private
    # location says which public API was tried and why it does not serve; an
    # entry found at public locations only says so, and has no private fallback.
    assert hook.public.strip(), f"{hook.name}: say which public API was tried"
    private = any(_private(f.where) for f in hook.forms)
    if private:
        assert re.search(r"\b(tried|none)\b", hook.public), hook.public
    else:
        assert "public" in hook.public, hook.public


def test_the_private_locations_are_few():
    # Hooks removed in issue 33 because public names serve on every supported
    # JAX: get_cur_mesh_sharding (NamedSharding(get_abstract_mesh(), P())),
    # get_default_device (jax.config.jax_default_device, jax.local_devices) and
    # get_/set_execution_stream_id (jaxlib.xla_client.execution_stream_id).
    # Removed with the gate programs (deferred dispatch everywhere): the
    # transfer server's three, callback_logger and execution_stream_id.
    names = {h.name for h in HOOKS}
    assert not names & {
        "get_cur_mesh_sharding",
        "get_default_device",
        "get_execution_stream_id",
        "set_execution_stream_id",
        "start_transfer_server",
        "callback_logger",
        "execution_stream_id",
    }
    private = sorted(h.name for h in HOOKS if any(_private(f.where) for f in h.forms))
    assert private == sorted(
        [
            "callback_op_sharding",
            "prim_requires_devices_during_lowering",
            "varying_axes",
            "pytype_aval_mappings",
            "canonicalize_value",
            "shard_arg_handlers",
            "shard_args",
            "trace_state_clean",
            "batched_device_put",
            "batched_device_put_impl",
            "PRNGKeyArray",
            "ExecuteReplicated",
            "array_methods",
            "array_operators",
            "array_properties",
            "use_abstract_mesh",
        ]
    )


def test_versions_in_the_table_are_those_declared_and_tested():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"jax>={OLDEST}"' in pyproject and f'"jaxlib>={OLDEST}"' in pyproject
    assert 'requires-python = ">=3.10"' in pyproject
    ci = (ROOT / ".ci" / "run").read_text()
    # A leg is "PYTHON JAX LANE SEED HOW" in the LEGS table of .ci/run.
    assert re.search(rf'"3\.10 {re.escape(OLDEST)} [ab] \d+ [\w-]+"', ci)
    assert re.search(rf'"3\.13 {re.escape(NEWEST)} [ab] \d+ [\w-]+"', ci)


def modules_outside(found, home: pathlib.Path) -> list[str]:
    """The package's modules other than those under ``home`` (a file or a
    folder) whose source ``found`` accepts."""
    return [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p != home and home not in p.parents and found(p.read_text())
    ]


def test_jax_internals_are_imported_only_in_the_hook_table():
    # tests/project/test_architecture.py checks the same on the syntax tree, with
    # importlib.import_module of a literal too.
    pattern = re.compile(r"^\s*(from|import)\s+jax\._src", re.MULTILINE)
    assert modules_outside(pattern.search, pathlib.Path(_compat.__file__)) == []


def test_typeof_is_called_only_through_the_jax_home():
    # Everywhere else, _jax.avals.typeof (with the shim for JAX < 0.8.2).
    home = pathlib.Path(_compat.__file__).parent
    assert modules_outside(lambda text: "jax.typeof(" in text, home) == []


def test_batching_rule_is_registered():
    assert jax_threadmap.threadmap_p in _compat.get("fancy_primitive_batchers")


def test_typeof_rejects_a_sharding_of_the_wrong_rank_on_every_jax():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    with pytest.raises(ValueError):
        _avals.typeof(SDS((3,), jnp.float32, sharding=rows))


def test_varying_axes_of_an_aval_outside_shard_map_is_empty():
    assert _avals.varying_axes(_avals.typeof(jnp.ones(3))) == frozenset()


def test_an_aval_without_varying_axes_is_an_error_not_an_empty_set():
    # A wrong empty set here would give wrong cotangent types inside shard_map.
    class Unknown:
        shape, dtype = (3,), np.dtype(np.float32)

    with pytest.raises(_compat.UnsupportedJaxError, match="'varying_axes'"):
        _avals.varying_axes(Unknown())


# --- a JAX that moved a hook -------------------------------------------------------


def _use_threadmap():
    x = np.arange(3, dtype=np.float32)
    out = jax_threadmap.threadmap(np.sin, SDS((3,), jnp.float32), x)
    np.testing.assert_allclose(out, np.sin(x), rtol=1e-6)


def _use_derivatives():
    @jax_threadmap.kernel(SDS((), jnp.float32))
    def sin(x):
        return np.sin(x)

    @sin.defvjp
    def sin_vjp(x, ct):
        return (ct * np.cos(x),)

    g = jax.grad(lambda x: jax.vmap(sin)(x).sum())(jnp.arange(3.0))
    np.testing.assert_allclose(g, np.cos(np.arange(3.0)), rtol=1e-6)


def _use_async_arrays():
    x = jax_threadmap.async_call(np.ones, SDS((2,), jnp.float32), 2, dtype=np.float32)
    np.testing.assert_array_equal(jax.jit(lambda a: a * 2)(x), [2.0, 2.0])


def _use_shard_map():
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    # A kernel of its own: JAX caches abstract evaluation by the equation's params,
    # and an equation traced earlier in this process (np.sin, the same shapes,
    # inside shard_map) would skip the hook this test hides.
    def kernel(v):
        return np.sin(v)

    body = jax.shard_map(
        lambda x: jax.vmap(
            lambda v: jax_threadmap.threadmap(kernel, SDS((), jnp.float32), v)
        )(x),
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec("d"),
        out_specs=jax.sharding.PartitionSpec("d"),
    )
    x = np.arange(3, dtype=np.float32)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    sharded = jax.device_put(x, spec)
    np.testing.assert_allclose(jax.jit(body)(sharded), np.sin(x), rtol=1e-6)


FEATURE_USES = {
    _compat.THREADMAP: _use_threadmap,
    _compat.DERIVATIVES: _use_derivatives,
    _compat.ASYNC_ARRAYS: _use_async_arrays,
    _compat.SHARD_MAP: _use_shard_map,
}


def _hidden(hook):
    """``hook`` as a JAX release that moved it would look to the package."""
    return dataclasses.replace(
        hook,
        forms=tuple(
            dataclasses.replace(f, where=f.where + "_moved") for f in hook.forms
        ),
    )


#: Optional features: without one of their hooks nothing fails, and the
#: dispatch's reason to block starts with this.
OPTIONAL_STATUS = {
    # No wrapped program runs: dispatch on pending data waits for the data.
    (_compat.ASYNC_DISPATCH,): "unavailable",
}


@pytest.mark.parametrize("hook", HOOKS, ids=_ids)
def test_a_missing_hook_fails_first_use_of_its_feature_by_name(hook, monkeypatch):
    monkeypatch.setitem(_compat.RESOLVED, hook.name, _compat.resolve(_hidden(hook)))
    if hook.features in OPTIONAL_STATUS:  # optional: the status says why
        status = _dispatch.mechanism.status()
        assert status.startswith(OPTIONAL_STATUS[hook.features]), status
        assert f"{hook.name} is missing" in status and "_moved" in status
        for use in FEATURE_USES.values():
            use()
        return
    if hook.features == (_compat.FAST_PLACEMENT,):  # optional: jax.device_put
        assert _placement.put_on_device(None, np.zeros(2), None) is None
        for use in FEATURE_USES.values():
            use()
        return
    if hook.features == (_compat.AUTO_PER_SHARD,):  # optional: one device maps
        # (with one INFO line; tests/sharding_checks.py runs that on 8 devices)
        reason = _compat.missing_for(_compat.AUTO_PER_SHARD)
        assert reason is not None and reason.startswith(f"{hook.name} is missing")
        for use in FEATURE_USES.values():
            use()
        return
    needs = set(hook.features)
    if _compat.THREADMAP in needs:  # derivative kernels are threadmap equations
        needs.update((_compat.DERIVATIVES, _compat.SHARD_MAP))
    if _compat.ARRAY_SURFACE in needs:  # async arrays require it with theirs
        needs = (needs - {_compat.ARRAY_SURFACE}) | {_compat.ASYNC_ARRAYS}
    for feature in sorted(needs):
        with pytest.raises(_compat.UnsupportedJaxError) as info:
            FEATURE_USES[feature]()
        message = str(info.value)
        assert f"needs the JAX internal {hook.name!r}" in message, message
        assert f"JAX {jax.__version__} does not provide" in message
        location = _compat.form_for(hook).where.replace(":", ".")
        assert location + "_moved" in message  # where it was looked for
        assert f"pip install 'jax>={OLDEST},<={NEWEST}'" in message
        assert "or upgrade jax_threadmap" in message
    for feature in sorted(set(FEATURE_USES) - needs):  # the others still work
        FEATURE_USES[feature]()


def test_a_missing_manual_axis_type_disables_only_shard_map(monkeypatch):
    # Was: every threadmap call failed, inside shard_map or not.
    hook = next(h for h in HOOKS if h.name == "varying_axes")
    monkeypatch.setitem(_compat.RESOLVED, hook.name, _compat.resolve(_hidden(hook)))
    _use_threadmap()
    _use_derivatives()
    with pytest.raises(jax_threadmap.UnsupportedJaxError) as info:
        _use_shard_map()
    message = str(info.value)
    assert "jax_threadmap inside jax.shard_map needs the JAX internal" in message
    assert "'varying_axes'" in message


def test_unsupported_jax_error_is_public():
    assert "UnsupportedJaxError" in jax_threadmap.__all__
    assert jax_threadmap.UnsupportedJaxError is _compat.UnsupportedJaxError
    assert issubclass(jax_threadmap.UnsupportedJaxError, RuntimeError)


def test_a_jax_older_than_supported_is_told_to_upgrade():
    hook = next(h for h in HOOKS if h.name == "canonicalize_value")
    missing = _compat.resolve(hook, version=(0, 5, 3))
    assert isinstance(missing, _compat.Missing)
    assert f"known from JAX {OLDEST} on" in missing.reason
    assert f"Install a JAX from {OLDEST} to {NEWEST}" in missing.message("api")


_HIDE_EVERY_HOOK = """
import importlib, importlib.util, pathlib, sys
import jax
root = sys.argv[1]
sys.path.insert(0, root)
# Where each hook lives in this JAX, read from the table without importing the
# package (its import must work without them): the table and its forms, under
# stand-ins for the package and its _jax folder, dropped afterwards.
import types
for name, folder in (("jax_threadmap", ()), ("jax_threadmap._jax", ("_jax",))):
    stand_in = types.ModuleType(name)
    stand_in.__path__ = [str(pathlib.Path(root, "jax_threadmap", *folder))]
    sys.modules[name] = stand_in
table = importlib.import_module("jax_threadmap._jax.hooks")
for name in [n for n in sys.modules if n.split(".")[0] == "jax_threadmap"]:
    del sys.modules[name]
for hook in table.HOOKS:
    module_name, attr = table.form_for(hook).where.split(":")
    module = importlib.import_module(module_name)
    if attr in vars(module):
        delattr(module, attr)

import jax_threadmap  # must not fail
from jax_threadmap._jax import hooks as _compat
from jax_threadmap._arrays import dispatch as _dispatch
from jax_threadmap._jax import avals as _avals
from jax_threadmap._jax import placement as _placement
from jax_threadmap._jax import mlir as _mlir
from jax_threadmap._jax import rule_tables as _tables
from jax_threadmap._jax import traces as _traces

missing = [n for n, v in _compat.RESOLVED.items() if isinstance(v, _compat.Missing)]
assert len(missing) == len(_compat.HOOKS), set(_compat.RESOLVED) - set(missing)
for use in (
    lambda: jax_threadmap.threadmap(abs, jax.ShapeDtypeStruct((), "float32"), 1.0),
    lambda: jax_threadmap.kernel(jax.ShapeDtypeStruct((), "float32")),
    lambda: jax_threadmap.async_call(abs, jax.ShapeDtypeStruct((), "float32"), 1.0),
):
    try:
        use()
    except _compat.UnsupportedJaxError as e:
        print(e)
    else:
        raise AssertionError("a feature ran without its hooks")
"""


def test_import_never_fails_when_every_hook_is_missing():
    proc = run_script(_HIDE_EVERY_HOOK, ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("jax_threadmap.threadmap needs the JAX internal")
    assert lines[1].startswith("jax_threadmap.kernel needs the JAX internal")
    assert lines[2].startswith("jax_threadmap.async_call needs the JAX internal")
    assert all(f"'jax>={OLDEST},<={NEWEST}'" in line for line in lines)
