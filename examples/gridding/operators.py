"""ducc0's w-gridder for one image and one set of baselines, as threaded kernels.

ducc0 (``pip install ducc0``) documents, in ``help(ducc0.wgridder.dirty2vis)``:

- ``dirty2vis(uvw, freq, dirty, wgt, ...)``: a real image ``dirty`` of shape
  ``(npix_x, npix_y)`` to complex visibilities of shape ``(nrows, nchan)``,
  ``vis[r, c] = wgt[r, c] * sum_{l, m} dirty[l, m] / n(l, m)
  * exp(-2 pi i freq[c] / SPEED_OF_LIGHT * (u_r l + v_r m - w_r (n(l, m) - 1)))``,
  with ``l = (i - npix_x / 2) * pixsize_x``, ``m = (j - npix_y / 2) * pixsize_y``,
  and ``n = sqrt(1 - l^2 - m^2)`` (``n = 1`` without ``do_wgridding``; no
  division by ``n`` without ``divide_by_n``), to a relative accuracy
  ``epsilon``.
- ``vis2dirty(uvw, freq, vis, wgt, npix_x, npix_y, ...)``: the real part of the
  adjoint, ``dirty = Re(A^H (wgt * vis))``.

So ``dirty2vis`` is linear in the image and ``vis2dirty`` is its adjoint for the
real inner product ``Re <u, v>`` of the visibilities (same ``wgt``, same
``divide_by_n``). In JAX's convention (``jax.vjp`` transposes without
conjugating):

- the JVP of ``dirty2vis`` in the image is ``dirty2vis`` of the tangent, and its
  VJP maps a complex cotangent ``ct`` to ``vis2dirty(conj(ct))``;
- the JVP of ``vis2dirty`` in the visibilities is ``vis2dirty`` of the tangent,
  and its VJP maps a real cotangent ``ct`` to ``conj(dirty2vis(ct))``.

``dirty2vis``, the model of the imaging loss, gives its VJP as ``fwd``/``bwd``
with no residuals (``defvjp(fwd, bwd, residuals=())``): being linear, its
backward pass needs nothing of the forward one, so ``bwd`` gets the cotangent
alone, never the image, and a Hessian-vector product of a loss whose second
derivative needs no residual runs two maps instead of three
(docs/derivatives-second-order.md, "Newton steps through a solver").

The image (or visibilities) is the one differentiable, positional argument;
``uvw``, ``freq`` and ``wgt`` reach the kernels as keywords, so ``jax.grad``
with respect to them raises instead of returning a wrong zero.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import ducc0
import jax
import jax.numpy as jnp
import numpy as np

import jax_threadmap

SPEED_OF_LIGHT = 299792458.0  # m/s, the value ducc0 uses


class _Kernels(NamedTuple):
    dirty2vis: jax_threadmap.KernelFunction
    vis2dirty: jax_threadmap.KernelFunction


@dataclasses.dataclass(frozen=True)
class Gridder:
    """The geometry and accuracy of one imaging problem.

    Attributes:
        npix_x, npix_y: Image size in pixels (even, at least 32: ducc0's rule).
        pixsize_x, pixsize_y: Pixel size in projected radians.
        epsilon: ducc0's relative accuracy: above 1e-5 for float32 images, above
            2e-13 for float64 ones.
        do_wgridding: Whether the w term is taken into account.
        divide_by_n: Whether image pixels are divided by ``n = sqrt(1 - l^2 - m^2)``.
        nthreads: ducc0's own threads per call (1: let the map's threads do the
            parallel work; see docs/gridding.md).
        executor: The ``executor`` of the threaded map (``None``: the shared pool).

    Examples:
        >>> import jax.numpy as jnp, numpy as np
        >>> g = Gridder(npix_x=64, npix_y=64, pixsize_x=1e-5, pixsize_y=1e-5)
        >>> uvw = np.zeros((10, 3)); freq = np.array([1e9])
        >>> g.dirty2vis(jnp.ones((64, 64)), uvw, freq).shape
        (10, 1)
    """

    npix_x: int
    npix_y: int
    pixsize_x: float
    pixsize_y: float
    epsilon: float = 1e-5
    do_wgridding: bool = False
    divide_by_n: bool = True
    nthreads: int = 1
    executor: Any = None

    def __post_init__(self) -> None:
        for name in ("npix_x", "npix_y"):
            n = getattr(self, name)
            if not isinstance(n, int) or n < 32 or n % 2:
                raise ValueError(
                    f"Gridder: {name} must be an even int of at least 32 (ducc0's "
                    f"rule); got {name}={n!r}. Pad the image to an even size."
                )
        for name in ("pixsize_x", "pixsize_y"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"Gridder: {name} must be a positive angle in radians; got "
                    f"{name}={getattr(self, name)!r}."
                )
        if not self.epsilon > 2e-13:
            raise ValueError(
                f"Gridder: epsilon must be above 2e-13 (ducc0's limit; above 1e-5 "
                f"for float32 images); got epsilon={self.epsilon!r}."
            )
        if not isinstance(self.nthreads, int) or self.nthreads < 1:
            raise ValueError(
                f"Gridder: nthreads must be an int of at least 1; got "
                f"nthreads={self.nthreads!r}."
            )

    def dirty2vis(
        self, dirty: Any, uvw: Any, freq: Any, wgt: Any | None = None
    ) -> jax.Array:
        """Visibilities of one image on one set of baselines (the operator ``A``).

        Args:
            dirty: Real image ``(npix_x, npix_y)``, float32 or float64 (its
                dtype sets the precision; the result is complex64/complex128).
            uvw: Baseline coordinates in metres, ``(nrows, 3)``.
            freq: Channel frequencies in Hz, ``(nchan,)``.
            wgt: Optional real weights ``(nrows, nchan)`` multiplied to the result.

        Returns:
            The visibilities ``(nrows, nchan)``. Differentiable in ``dirty``.
        """
        dirty = jnp.asarray(dirty)
        if not jnp.issubdtype(dirty.dtype, jnp.floating):
            raise TypeError(
                f"Gridder.dirty2vis: dirty must be a real float image; got dtype "
                f"{dirty.dtype}. Pass the real part, or a float array."
            )
        self._check_image(dirty, "dirty2vis", "dirty")
        nrows, nchan = _check_baselines(uvw, freq, wgt, "dirty2vis")
        kernels = _kernels(self, nrows, nchan, np.dtype(dirty.dtype).name)
        return kernels.dirty2vis(dirty, **_keywords(uvw, freq, wgt))

    def vis2dirty(
        self, vis: Any, uvw: Any, freq: Any, wgt: Any | None = None
    ) -> jax.Array:
        """The dirty image of one set of visibilities (the adjoint ``Re A^H``).

        Args:
            vis: Complex visibilities ``(nrows, nchan)``, complex64 or complex128.
            uvw: Baseline coordinates in metres, ``(nrows, 3)``.
            freq: Channel frequencies in Hz, ``(nchan,)``.
            wgt: Optional real weights ``(nrows, nchan)`` multiplied to ``vis``.

        Returns:
            The real image ``(npix_x, npix_y)``. Differentiable in ``vis``.
        """
        vis = jnp.asarray(vis)
        if not jnp.issubdtype(vis.dtype, jnp.complexfloating):
            raise TypeError(
                f"Gridder.vis2dirty: vis must be complex; got dtype {vis.dtype}. "
                "Convert it with vis.astype(jnp.complex64) (or complex128)."
            )
        nrows, nchan = _check_baselines(uvw, freq, wgt, "vis2dirty")
        if vis.shape != (nrows, nchan):
            raise ValueError(
                f"Gridder.vis2dirty: vis must have shape (nrows, nchan) = "
                f"{(nrows, nchan)} from uvw and freq; got {vis.shape}."
            )
        real = np.dtype(jnp.finfo(vis.dtype).dtype).name
        return _kernels(self, nrows, nchan, real).vis2dirty(
            vis, **_keywords(uvw, freq, wgt)
        )

    def _check_image(self, dirty: jax.Array, api: str, name: str) -> None:
        if dirty.shape != (self.npix_x, self.npix_y):
            raise ValueError(
                f"Gridder.{api}: {name} must have shape (npix_x, npix_y) = "
                f"{(self.npix_x, self.npix_y)}; got {dirty.shape}. One call takes "
                "one image: jax.vmap over the leading axes of a stack of images."
            )


def _check_baselines(uvw: Any, freq: Any, wgt: Any, api: str) -> tuple[int, int]:
    """(nrows, nchan) of one element's baselines, or a ValueError naming the culprit."""
    if np.ndim(uvw) != 2 or np.shape(uvw)[1] != 3:
        raise ValueError(
            f"Gridder.{api}: uvw must have shape (nrows, 3); got {np.shape(uvw)}. "
            "One call takes one set of baselines: jax.vmap over times."
        )
    if np.ndim(freq) != 1:
        raise ValueError(
            f"Gridder.{api}: freq must have shape (nchan,); got {np.shape(freq)}."
        )
    shape = (np.shape(uvw)[0], np.shape(freq)[0])
    if wgt is not None and np.shape(wgt) != shape:
        raise ValueError(
            f"Gridder.{api}: wgt must have shape (nrows, nchan) = {shape}; got "
            f"{np.shape(wgt)}."
        )
    return shape


def _keywords(uvw: Any, freq: Any, wgt: Any) -> dict[str, Any]:
    kw = {"uvw": uvw, "freq": freq}
    if wgt is not None:
        kw["wgt"] = wgt
    return kw


def _options(g: Gridder) -> dict[str, Any]:
    return dict(
        pixsize_x=g.pixsize_x,
        pixsize_y=g.pixsize_y,
        epsilon=g.epsilon,
        do_wgridding=g.do_wgridding,
        divide_by_n=g.divide_by_n,
        nthreads=g.nthreads,
    )


def ducc0_dirty2vis(
    g: Gridder, dirty: np.ndarray, *, uvw: Any, freq: Any, wgt: Any = None
) -> np.ndarray:
    """The host function: ``ducc0.wgridder.dirty2vis`` on one image's NumPy arrays."""
    return ducc0.wgridder.dirty2vis(
        uvw=np.asarray(uvw, np.float64),  # ducc0 wants float64 coordinates
        freq=np.asarray(freq, np.float64),
        dirty=dirty,
        wgt=None if wgt is None else np.asarray(wgt, dirty.dtype),
        **_options(g),
    )


def ducc0_vis2dirty(
    g: Gridder, vis: np.ndarray, *, uvw: Any, freq: Any, wgt: Any = None
) -> np.ndarray:
    """The host function: ``ducc0.wgridder.vis2dirty`` on one element's arrays."""
    return ducc0.wgridder.vis2dirty(
        uvw=np.asarray(uvw, np.float64),
        freq=np.asarray(freq, np.float64),
        vis=vis,
        wgt=None if wgt is None else np.asarray(wgt, vis.real.dtype),
        npix_x=g.npix_x,
        npix_y=g.npix_y,
        **_options(g),
    )


@functools.cache
def _kernels(g: Gridder, nrows: int, nchan: int, real: str) -> _Kernels:
    """The threaded kernels of one geometry (cached: the same objects each call,
    so that jit reuses compiled programs)."""
    real_dtype = np.dtype(real)
    complex_dtype = np.result_type(real_dtype, np.complex64)
    image = jax.ShapeDtypeStruct((g.npix_x, g.npix_y), real_dtype)
    visibilities = jax.ShapeDtypeStruct((nrows, nchan), complex_dtype)
    host_dirty2vis = functools.partial(ducc0_dirty2vis, g)
    host_vis2dirty = functools.partial(ducc0_vis2dirty, g)

    # The kernels: one image or one set of visibilities each. Both operators are
    # linear, so every derivative kernel is one of the two operators again.
    def dirty2vis(dirty, **kw):
        return host_dirty2vis(dirty, **kw)

    def dirty2vis_jvp(dirty, dirty_dot, **kw):
        return host_dirty2vis(dirty_dot, **kw)  # linear: the operator itself

    # Reverse mode with residuals (none: the operator is linear): fwd returns
    # the visibilities and (), bwd maps the cotangent alone.
    def dirty2vis_fwd(dirty, **kw):
        return host_dirty2vis(dirty, **kw), ()

    def dirty2vis_bwd(res, vis_ct, **kw):
        return (host_vis2dirty(np.conj(vis_ct), **kw),)  # one per positional arg

    def vis2dirty(vis, **kw):
        return host_vis2dirty(vis, **kw)

    def vis2dirty_jvp(vis, vis_dot, **kw):
        return host_vis2dirty(vis_dot, **kw)

    def vis2dirty_vjp(vis, dirty_ct, **kw):
        return (np.conj(host_dirty2vis(dirty_ct, **kw)),)

    # Second order (Newton steps, Hessian-vector products): the derivative
    # kernels' own JVP and VJP kernels. Each is linear in its last argument and
    # constant in the others (None: a zero cotangent).
    def dirty2vis_jvp_jvp(dirty, dirty_dot, d_dirty, d_dirty_dot, **kw):
        return host_dirty2vis(d_dirty_dot, **kw)

    def dirty2vis_jvp_vjp(dirty, dirty_dot, vis_ct, **kw):
        return None, host_vis2dirty(np.conj(vis_ct), **kw)

    # fwd is differentiated like the operator (its result: the visibilities and
    # no residuals); bwd is linear in the cotangent, so its JVP is bwd itself
    # (no kernel needed) and its VJP is dirty2vis again.
    def dirty2vis_fwd_jvp(dirty, d_dirty, **kw):
        return host_dirty2vis(d_dirty, **kw), ()

    def dirty2vis_fwd_vjp(dirty, ct, **kw):
        vis_ct, _ = ct  # the cotangent of (visibilities, ())
        return (host_vis2dirty(np.conj(vis_ct), **kw),)

    def dirty2vis_bwd_vjp(res, vis_ct, ct, **kw):
        return (), host_dirty2vis(ct[0], **kw)

    def vis2dirty_jvp_jvp(vis, vis_dot, d_vis, d_vis_dot, **kw):
        return host_vis2dirty(d_vis_dot, **kw)

    def vis2dirty_jvp_vjp(vis, vis_dot, dirty_ct, **kw):
        return None, np.conj(host_dirty2vis(dirty_ct, **kw))

    def vis2dirty_vjp_jvp(vis, dirty_ct, d_vis, d_dirty_ct, **kw):
        return (np.conj(host_dirty2vis(d_dirty_ct, **kw)),)

    def vis2dirty_vjp_vjp(vis, dirty_ct, ct, **kw):
        return None, host_vis2dirty(ct[0], **kw)

    def make(result, fn, jvp, vjp=None):
        k = jax_threadmap.kernel(result, executor=g.executor)(_named(fn))
        k.defjvp(jvp)
        if vjp is not None:
            k.defvjp(vjp)
        return k

    def second(result, fn, jvp, vjp):  # a derivative kernel with its own rules
        return make(result, fn, _named(jvp), _named(vjp))

    forward = make(
        visibilities,
        dirty2vis,
        second(visibilities, dirty2vis_jvp, dirty2vis_jvp_jvp, dirty2vis_jvp_vjp),
    )
    bwd = jax_threadmap.kernel((image,), executor=g.executor)(_named(dirty2vis_bwd))
    bwd.defvjp(_named(dirty2vis_bwd_vjp))  # its JVP: itself, by linearity
    forward.defvjp(
        second((visibilities, ()), dirty2vis_fwd, dirty2vis_fwd_jvp, dirty2vis_fwd_vjp),
        bwd,
        residuals=(),
    )
    adjoint = make(
        image,
        vis2dirty,
        second(image, vis2dirty_jvp, vis2dirty_jvp_jvp, vis2dirty_jvp_vjp),
        second((visibilities,), vis2dirty_vjp, vis2dirty_vjp_jvp, vis2dirty_vjp_vjp),
    )
    return _Kernels(forward, adjoint)


def _named(fn: Any) -> Any:
    """``fn`` shown in jaxprs and errors as ``ducc0.<name>`` rather than as a
    local function of ``_kernels``."""
    fn.__qualname__ = f"ducc0.{fn.__name__}"
    return fn
