"""Fails loudly when a JAX upgrade moves an internal hook this package relies on."""

import pathlib
import re

import jax

from jax_threadmap import _compat

PACKAGE = pathlib.Path(_compat.__file__).parent


def test_every_jax_hook_is_still_where_we_expect_it():
    missing = _compat.missing_hooks()
    assert not missing, (
        f"JAX {jax.__version__} no longer provides these internals that "
        f"jax_threadmap relies on: {missing}. Update jax_threadmap/_compat.py "
        "(and pin jax below this version until then)."
    )


def test_jax_internals_are_used_only_in_compat():
    pattern = re.compile(r"^\s*(from|import)\s+jax\._src", re.MULTILINE)
    offenders = [
        p.name
        for p in PACKAGE.glob("*.py")
        if p.name != "_compat.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_batching_rule_is_registered():
    from jax_threadmap import threadmap_p

    assert _compat.is_batching_rule_registered(threadmap_p)
