"""Helpers shared by the tests (fixtures live in conftest.py)."""

import jax
import jax.extend


def count_eqns(jaxpr, name: str) -> int:
    """Counts equations of primitive ``name``, sub-jaxprs included."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count_eqns(sub, name)
    return n
