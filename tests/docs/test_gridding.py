"""The gridding example (examples/gridding): ducc0's w-gridder as threaded kernels.

Everything is checked against references that do not go through the kernels: a
per-element loop calling ducc0 directly, and the measurement equation as an
explicit direct Fourier sum in jax.numpy (examples/gridding/direct.py), which
JAX differentiates itself. The float64 tests run ducc0 at epsilon 1e-10 (x64 on
for the test); the float32 ones at ducc0's float32 limit, 1e-5.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

pytest.importorskip(
    "ducc0",
    reason="the gridding example needs ducc0: pip install '.[examples]'",
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # examples/ lives beside the package, not in it
    sys.path.insert(0, str(ROOT))

import ducc0  # noqa: E402

from examples.gridding import Gridder, demo, direct_dirty2vis  # noqa: E402

NPIX = 32
ROWS = 12
PIXSIZE = 2e-4  # a 0.4 degree field: w-terms and 1/n matter at 1e-10


def problem(seed=0, *, times=(), channels=2, images=(), dtype=np.float64):
    """Random baselines, channels, weights, images and visibilities."""
    rng = np.random.default_rng(seed)
    uvw = rng.uniform(-300.0, 300.0, (*times, ROWS, 3))
    freq = np.linspace(1.0e9, 1.3e9, channels)
    wgt = rng.uniform(0.5, 1.0, (ROWS, channels)).astype(dtype)
    dirty = rng.standard_normal((*images, NPIX, NPIX)).astype(dtype)
    shape = (*times, ROWS, channels)
    cdtype = np.result_type(dtype, np.complex64)
    vis = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(cdtype)
    return uvw, freq, wgt, dirty, vis


def gridder(epsilon=1e-10, **kw):
    return Gridder(
        npix_x=NPIX,
        npix_y=NPIX,
        pixsize_x=PIXSIZE,
        pixsize_y=PIXSIZE * 1.25,
        epsilon=epsilon,
        **kw,
    )


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.mark.parametrize("do_wgridding", [False, True])
@pytest.mark.parametrize("divide_by_n", [False, True])
def test_dirty2vis_is_the_direct_fourier_sum(x64, do_wgridding, divide_by_n):
    g = gridder(do_wgridding=do_wgridding, divide_by_n=divide_by_n)
    uvw, freq, wgt, dirty, _ = problem()
    vis = g.dirty2vis(dirty, uvw, freq, wgt)
    assert vis.dtype == jnp.complex128 and vis.shape == (ROWS, 2)
    direct = jax.jit(lambda *a: direct_dirty2vis(g, *a))  # one compile, not many
    assert rel(vis, direct(dirty, uvw, freq, wgt)) < 1e-9


@pytest.mark.parametrize("do_wgridding", [False, True])
def test_adjoint_dot_product_float64(x64, do_wgridding):
    # <A x, y> = <x, A^H y>, complex: vis2dirty gives Re(A^H y), and
    # Im(A^H y) = -Re(A^H (i y)).
    g = gridder(do_wgridding=do_wgridding)
    uvw, freq, wgt, x, y = problem(1)
    lhs = np.vdot(g.dirty2vis(x, uvw, freq, wgt), y)
    adj = g.vis2dirty(y, uvw, freq, wgt) - 1j * g.vis2dirty(1j * y, uvw, freq, wgt)
    rhs = np.vdot(x, adj)
    scale = np.linalg.norm(g.dirty2vis(x, uvw, freq, wgt)) * np.linalg.norm(y)
    assert abs(lhs - rhs) / scale < 1e-9


def test_adjoint_dot_product_float32():
    g = gridder(epsilon=1e-5)
    uvw, freq, wgt, x, y = problem(2, dtype=np.float32)
    vis = g.dirty2vis(x, uvw, freq, wgt)
    assert vis.dtype == jnp.complex64
    lhs = np.vdot(np.asarray(vis, np.complex128), y)
    rhs = np.vdot(x.astype(np.float64), np.asarray(g.vis2dirty(y, uvw, freq, wgt)))
    scale = np.linalg.norm(vis) * np.linalg.norm(y)
    assert abs(lhs.real - rhs) / scale < 1e-4


def test_nested_vmap_is_one_map_and_matches_ducc0_per_element(x64):
    # polarisations (images) x times (baselines) x channels (one frequency each)
    g = gridder()
    uvw, freq, wgt, dirty, vis = problem(3, times=(3,), channels=2, images=(2,))
    freq = freq[:, None]  # (channels, 1): one channel per element
    per_chan = jax.vmap(g.dirty2vis, (None, None, 0))
    per_time = jax.vmap(per_chan, (None, 0, None))
    per_pol = jax.jit(jax.vmap(per_time, (0, None, None)))
    out = per_pol(dirty, uvw, freq)
    assert out.shape == (2, 3, 2, ROWS, 1)
    eqns = jax.make_jaxpr(per_pol)(dirty, uvw, freq).jaxpr.eqns[0].params["jaxpr"]
    assert [e.primitive.name for e in eqns.eqns] == ["threadmap"]
    for p, t, c in np.ndindex(2, 3, 2):
        ref = ducc0.wgridder.dirty2vis(
            uvw=uvw[t],
            freq=freq[c],
            dirty=dirty[p],
            pixsize_x=g.pixsize_x,
            pixsize_y=g.pixsize_y,
            epsilon=g.epsilon,
        )
        np.testing.assert_array_equal(out[p, t, c], ref)


def test_vis2dirty_under_vmap_matches_ducc0_per_element(x64):
    g = gridder()
    uvw, freq, wgt, _, vis = problem(4, times=(3,))
    out = jax.jit(jax.vmap(g.vis2dirty, (0, 0, None, None)))(vis, uvw, freq, wgt)
    for t in range(3):
        ref = ducc0.wgridder.vis2dirty(
            uvw=uvw[t],
            freq=freq,
            vis=vis[t],
            wgt=wgt,
            npix_x=NPIX,
            npix_y=NPIX,
            pixsize_x=g.pixsize_x,
            pixsize_y=g.pixsize_y,
            epsilon=g.epsilon,
        )
        np.testing.assert_array_equal(out[t], ref)


@pytest.mark.parametrize("do_wgridding", [False, True])
def test_check_grads_both_operators(x64, do_wgridding):
    g = gridder(do_wgridding=do_wgridding)
    uvw, freq, wgt, x, y = problem(5)
    d2v = lambda x: g.dirty2vis(x, uvw, freq, wgt)  # noqa: E731
    v2d = lambda y: g.vis2dirty(y, uvw, freq, wgt)  # noqa: E731
    check_grads(d2v, (x,), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)
    check_grads(v2d, (y,), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def _imaging_loss(dirty2vis, sky, uvw, freq, wgt, observed):
    """Least squares over polarisations x times x channels (3 nested vmaps).

    The sky (pol, x, y) is not batched over times or channels and the baselines
    are not batched over polarisations or channels: their cotangents are sums.
    """
    one = lambda im, u, f, w: dirty2vis(im, u, f[None], w[:, None])  # noqa: E731
    per_chan = jax.vmap(one, (None, None, 0, 1), 0)
    per_time = jax.vmap(per_chan, (None, 0, None, None), 0)
    per_pol = jax.vmap(per_time, (0, None, None, None), 0)
    residual = per_pol(sky, uvw, freq, wgt) - observed
    return 0.5 * jnp.sum(jnp.abs(residual) ** 2)


@pytest.mark.parametrize("do_wgridding", [False, True])
def test_grad_of_imaging_loss_under_nested_vmap_matches_direct_sum(x64, do_wgridding):
    g = gridder(do_wgridding=do_wgridding)
    rng = np.random.default_rng(6)
    uvw, freq, wgt, _, _ = problem(6, times=(3,), channels=2)
    sky = np.zeros((2, NPIX, NPIX))  # two polarisations, a few point sources
    for p, i, j, flux in [(0, 10, 20, 1.0), (0, 25, 7, 0.5), (1, 16, 16, 0.8)]:
        sky[p, i, j] = flux
    observed = rng.standard_normal((2, 3, 2, ROWS, 1)) * (1 + 1j)
    model = sky + 0.1 * rng.standard_normal(sky.shape)

    def direct(im, u, f, w):
        return direct_dirty2vis(g, im, u, f, w)

    args = (model, uvw, freq, wgt, observed)
    got_value, got = jax.jit(
        jax.value_and_grad(lambda x: _imaging_loss(g.dirty2vis, x, *args[1:]))
    )(model)
    want_value, want = jax.jit(
        jax.value_and_grad(lambda x: _imaging_loss(direct, x, *args[1:]))
    )(model)
    assert abs(got_value - want_value) / abs(want_value) < 1e-9
    assert rel(got, want) < 1e-8
    # The gradient is the primal map (fwd, with no residuals) and the adjoint
    # map, nothing else threaded; the adjoint takes the cotangent and the
    # keyword arguments, never the image.
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda x: _imaging_loss(g.dirty2vis, x, *args[1:]))
    )(model)
    eqns = [e for e in jaxpr.eqns if e.primitive.name == "threadmap"]
    kernels = [str(e.params["kernel"]) for e in eqns]
    assert kernels == ["ducc0.dirty2vis_fwd", "ducc0.dirty2vis_bwd"]
    assert jaxpr.jaxpr.invars[0] not in eqns[1].invars
    assert not [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]


def test_hessian_vector_products_match_direct_sum_and_finite_differences(x64):
    # Second order through the derivative kernels' own kernels
    # (docs/derivatives-second-order.md): forward over reverse, reverse over
    # reverse, and check_grads at order 2, on the loss under three nested vmaps.
    g = gridder(do_wgridding=True)
    rng = np.random.default_rng(8)
    uvw, freq, wgt, _, _ = problem(8, times=(2,), channels=2)
    observed = rng.standard_normal((1, 2, 2, ROWS, 1)) * (1 + 1j)
    model = rng.standard_normal((1, NPIX, NPIX))
    v = rng.standard_normal(model.shape)

    def direct(im, u, f, w):
        return direct_dirty2vis(g, im, u, f, w)

    def loss(op):
        return lambda x: _imaging_loss(op, x, uvw, freq, wgt, observed)

    def hvp(op):
        return jax.jit(lambda x: jax.jvp(jax.grad(loss(op)), (x,), (v,))[1])

    def rev_rev(op):  # d/dx <grad(x), v>: reverse over reverse
        return jax.jit(jax.grad(lambda x: jnp.vdot(jax.grad(loss(op))(x), v)))

    assert rel(hvp(g.dirty2vis)(model), hvp(direct)(model)) < 1e-8
    assert rel(rev_rev(g.dirty2vis)(model), rev_rev(direct)(model)) < 1e-8
    kernels = [
        str(e.params["kernel"])
        for e in jax.make_jaxpr(hvp(g.dirty2vis))(model).eqns[0].params["jaxpr"].eqns
        if e.primitive.name == "threadmap"
    ]
    # fwd and its JVP, bwd of the cotangent (the gradient itself, not returned:
    # jit drops it) and bwd of the cotangent's tangent (bwd is linear in it).
    assert [k.rpartition(".")[2] for k in kernels] == [
        "dirty2vis_fwd",
        "dirty2vis_fwd_jvp",
        "dirty2vis_bwd",
        "dirty2vis_bwd",
    ]
    # check_grads of the jitted loss: the same kernels and rules run, each
    # derivative as one program (a compile each, not one per eager operation).
    check_grads(
        jax.jit(loss(g.dirty2vis)), (model,), order=2, modes=("fwd", "rev"), eps=1e-3
    )


def test_newton_products_run_two_maps(monkeypatch):
    # The demo's misfit needs no residual for its curvature, and dirty2vis keeps
    # none for its backward pass: a product is dirty2vis of v and the adjoint
    # of that, the model's own dirty2vis(x) is not run (it was, before).
    from examples.gridding import newton
    from jax_threadmap._core import lowering as _lowering

    ran = []
    host_map = _lowering.HostMap

    def RecordingHostMap(caller, *args):  # noqa: N802 - stands for the class
        ran.append(caller.name.rpartition(".")[2])
        return host_map(caller, *args)

    obs = demo.observe(times=2, channels=2)
    hvp = newton.hessian_vector_product(obs)
    x = jnp.asarray(obs.sky)
    v = jnp.asarray(np.random.default_rng(9).standard_normal(x.shape), x.dtype)
    monkeypatch.setattr(_lowering, "HostMap", RecordingHostMap)
    got = np.asarray(hvp(x, v))
    monkeypatch.undo()
    assert sorted(ran) == ["dirty2vis_bwd", "dirty2vis_fwd_jvp"]
    assert len(ran) == newton.MAPS_PER_HVP
    # The loss is quadratic: the product is (1 / n) Re A^H A v, whatever x.
    vis = np.asarray(demo.forward(obs.gridder, v, obs.uvw, obs.freq))
    want = (
        np.asarray(
            jax.vmap(jax.vmap(obs.gridder.vis2dirty, (0, None, 0)), (0, 0, None))(
                jnp.asarray(vis), obs.uvw, obs.freq
            ).sum((0, 1))
        )
        / vis.size
    )
    assert rel(got, want) < 1e-4


def test_newton_cg_takes_fewer_maps_than_the_first_order_loop():
    from examples.gridding import newton

    obs = demo.observe(times=2, channels=2)
    solved = newton.newton_cg(obs, newton_steps=1, cg_iters=20)
    first = newton.first_order(obs, steps=40)
    target = 1e-2 * solved.losses[0]
    assert solved.maps_to(target) is not None and first.maps_to(target) is not None
    assert solved.maps_to(target) < first.maps_to(target)
    assert min(solved.losses) < 1e-3 * solved.losses[0]


def test_jvp_under_vmap_matches_direct_sum(x64):
    g = gridder(do_wgridding=True)
    uvw, freq, wgt, x, _ = problem(7, times=(3,), images=(3,))
    t = np.random.default_rng(7).standard_normal(x.shape)

    def f(op):
        return lambda x: jax.vmap(lambda im, u: op(im, u, freq, wgt))(x, uvw)

    out, tan = jax.jvp(f(g.dirty2vis), (x,), (t,))
    ref_out, ref_tan = jax.jit(
        lambda x, t: jax.jvp(f(lambda *a: direct_dirty2vis(g, *a)), (x,), (t,))
    )(x, t)
    assert rel(out, ref_out) < 1e-9
    assert rel(tan, ref_tan) < 1e-9


def test_grad_of_vis2dirty_is_conj_dirty2vis(x64):
    # f(v) = <c, vis2dirty(v)> = Re <A c, v>: JAX's gradient is conj(A c).
    g = gridder()
    uvw, freq, wgt, c, v = problem(8)
    got = jax.grad(lambda v: jnp.vdot(c, g.vis2dirty(v, uvw, freq, wgt)).real)(v)
    want = jax.jit(
        jax.grad(
            lambda v: jnp.sum(direct_dirty2vis(g, c, uvw, freq, wgt).conj() * v).real
        )
    )(v)
    assert rel(got, want) < 1e-9


def test_derivative_in_baselines_is_an_error_not_a_zero(x64):
    g = gridder()
    uvw, freq, wgt, x, _ = problem(9)
    with pytest.raises(TypeError, match="keyword argument 'uvw'"):
        jax.grad(lambda u: jnp.abs(g.dirty2vis(x, u, freq)).sum())(uvw)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"npix_x": 33}, "npix_x must be an even int of at least 32"),
        ({"npix_y": 16}, "npix_y must be an even int of at least 32"),
        ({"pixsize_x": 0.0}, "pixsize_x must be a positive angle"),
        ({"epsilon": 1e-14}, "epsilon must be above 2e-13"),
        ({"nthreads": 0}, "nthreads must be an int of at least 1"),
    ],
)
def test_bad_geometry_is_a_clear_error(kwargs, match):
    base = dict(npix_x=NPIX, npix_y=NPIX, pixsize_x=PIXSIZE, pixsize_y=PIXSIZE)
    with pytest.raises(ValueError, match=match):
        Gridder(**{**base, **kwargs})


def test_bad_arguments_are_clear_errors():
    g = gridder(epsilon=1e-5)
    uvw, freq, wgt, x, y = problem(10, dtype=np.float32)
    with pytest.raises(ValueError, match=r"dirty must have shape .* \(32, 32\)"):
        g.dirty2vis(np.zeros((2, NPIX, NPIX), np.float32), uvw, freq)
    with pytest.raises(TypeError, match="dirty must be a real float image"):
        g.dirty2vis(x + 0j, uvw, freq)
    with pytest.raises(ValueError, match=r"uvw must have shape \(nrows, 3\)"):
        g.dirty2vis(x, uvw[:, :2], freq)
    with pytest.raises(ValueError, match=r"wgt must have shape"):
        g.dirty2vis(x, uvw, freq, wgt[:, :1])
    with pytest.raises(TypeError, match="vis must be complex"):
        g.vis2dirty(y.real, uvw, freq)
    with pytest.raises(ValueError, match=r"vis must have shape"):
        g.vis2dirty(y[:3], uvw, freq)


def test_demo_recovers_the_two_sources():
    result = demo.main(["--steps", "40", "--times", "4", "--channels", "2"])
    assert result.losses[-1] < 0.05 * result.losses[0]
    found = sorted((r, c) for r, c, _ in result.peaks)
    assert found == sorted((r, c) for r, c, _ in demo.SOURCES)
    for (_, _, flux), (_, _, true) in zip(result.peaks, demo.SOURCES, strict=True):
        assert abs(flux - true) < 0.3 * true


def test_demo_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    png = tmp_path / "gridding.png"
    demo.main(["--steps", "1", "--times", "2", "--channels", "1", "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 1000 < png.stat().st_size < 200_000


def test_demo_plot_shows_the_docs_coordinates_and_colour_bars(tmp_path, monkeypatch):
    # Was: three bare images, no axes or colour bar, in an orientation that the
    # page's coordinates did not say.
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    import matplotlib.figure

    saved = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure,
        "savefig",
        lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k))[1],
    )
    demo.main(
        [
            "--steps",
            "1",
            "--times",
            "2",
            "--channels",
            "1",
            "--plot",
            str(tmp_path / "g.png"),
        ]
    )
    (fig,) = saved
    panels = [ax for ax in fig.axes if ax.images]
    bars = [ax for ax in fig.axes if not ax.images]
    assert len(panels) == 3 and len(bars) == 3
    assert [b.get_ylabel() for b in bars] == ["Jy per pixel"] * 3
    assert all(ax.get_xlabel().startswith("pixel i") for ax in panels)
    assert panels[0].get_ylabel().startswith("pixel j")
    # The true sky: pixel (i, j) of the image, as docs/gridding.md names the
    # sources, is drawn at x = i, y = j with y upwards.
    (truth,) = panels[0].images
    assert truth.origin == "lower"
    shown = np.asarray(truth.get_array())  # rows are y (j), columns x (i)
    for i, j, flux in demo.SOURCES:
        assert shown[j, i] == np.float32(flux)
    assert np.count_nonzero(shown) == len(demo.SOURCES)


def test_docstring_examples():
    import doctest

    from examples.gridding import operators

    assert doctest.testmod(operators).failed == 0
