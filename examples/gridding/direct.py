"""The measurement equation as an explicit direct Fourier sum in jax.numpy.

The reference for tests and docs: exact (no gridding, no accuracy parameter),
differentiable by JAX itself, and slow (``nrows * nchan * npix_x * npix_y``
terms), so only for tiny problems.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from examples.gridding.operators import SPEED_OF_LIGHT, Gridder


def direct_dirty2vis(
    g: Gridder, dirty: jax.Array, uvw: jax.Array, freq: jax.Array, wgt=None
) -> jax.Array:
    """What ``g.dirty2vis(dirty, uvw, freq, wgt)`` computes, term by term."""
    l = (jnp.arange(g.npix_x) - g.npix_x // 2) * g.pixsize_x  # noqa: E741
    m = (jnp.arange(g.npix_y) - g.npix_y // 2) * g.pixsize_y
    l, m = jnp.meshgrid(l, m, indexing="ij")  # noqa: E741
    if g.do_wgridding:
        n = jnp.sqrt(1.0 - l**2 - m**2)
    else:
        n = jnp.ones_like(l)
    image = dirty / n if g.divide_by_n else dirty
    u, v, w = (uvw[:, k, None, None, None] for k in range(3))
    scale = freq[None, :, None, None] / SPEED_OF_LIGHT  # wavelengths per metre
    phase = -2 * jnp.pi * scale * (u * l + v * m - w * (n - 1))
    vis = jnp.sum(image * jnp.exp(1j * phase), axis=(-2, -1))
    return vis if wgt is None else vis * wgt
