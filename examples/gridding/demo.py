"""Imaging two point sources by gradient descent through ducc0, under nested vmap.

A small interferometer (random antennas, a few hundred baselines) observes a sky of
two point sources at several times (the Earth rotates the baselines) and several
channels. The model maps one sky image to every (time, channel) element's
visibilities with ``jax.vmap(jax.vmap(gridder.dirty2vis))``, one threaded map;
``jax.grad`` of the least-squares misfit runs ``vis2dirty`` (the adjoint) as
another, and sums the image's cotangents over times and channels on the host.
Projected gradient descent (the sky is non-negative) then recovers the sources.

Run from the repository root::

    python -m examples.gridding                       # prints the numbers
    python -m examples.gridding --plot docs/img/gridding.png
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from examples.gridding.operators import SPEED_OF_LIGHT, Gridder

# The sky: two point sources, (i, j, flux in Jy), on a 64 x 64 image: pixel indices,
# the first (i) along l, the second (j) along m, as in docs/gridding.md.
SOURCES = ((22, 40, 1.0), (42, 24, 0.6))


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the telescope measured, and the geometry to image it with."""

    gridder: Gridder
    uvw: np.ndarray  # (times, rows, 3) metres
    freq: np.ndarray  # (channels, 1) Hz: one channel per element
    vis: np.ndarray  # (times, channels, rows, 1) complex
    sky: np.ndarray  # (npix, npix) the truth, for the comparison


def observe(
    *,
    npix: int = 64,
    antennas: int = 24,
    times: int = 8,
    channels: int = 4,
    noise: float = 0.0,
    seed: int = 0,
) -> Observation:
    """Simulates an observation of ``SOURCES`` (float32, ducc0 accuracy 1e-5)."""
    rng = np.random.default_rng(seed)
    xy = rng.uniform(-500.0, 500.0, (antennas, 2))  # antenna positions, metres
    i, j = np.triu_indices(antennas, 1)
    base = xy[i] - xy[j]  # one baseline per pair: antennas * (antennas - 1) / 2
    angles = np.linspace(0.0, np.pi / 3, times)  # the sky turns by 60 degrees
    rot = np.stack(
        [[np.cos(angles), -np.sin(angles)], [np.sin(angles), np.cos(angles)]]
    )
    uv = np.einsum("abt,rb->tra", rot, base)
    uvw = np.concatenate([uv, np.zeros(uv.shape[:2] + (1,))], axis=-1)
    freq = np.linspace(1.0e9, 1.4e9, channels)[:, None]
    # Pixels small enough that the longest baseline at the highest frequency
    # stays inside the image's Fourier grid.
    longest = np.abs(uv).max() * freq.max() / SPEED_OF_LIGHT
    pixsize = float(1.0 / (2.2 * longest))
    gridder = Gridder(npix_x=npix, npix_y=npix, pixsize_x=pixsize, pixsize_y=pixsize)
    sky = np.zeros((npix, npix), np.float32)
    for i, j, flux in SOURCES:
        sky[i * npix // 64, j * npix // 64] = flux
    vis = np.asarray(forward(gridder, sky, uvw, freq))
    vis = vis + noise * (
        rng.standard_normal(vis.shape) + 1j * rng.standard_normal(vis.shape)
    )
    return Observation(gridder, uvw, freq, vis.astype(np.complex64), sky)


def forward(gridder: Gridder, sky, uvw, freq) -> jax.Array:
    """One sky image to the visibilities of every (time, channel): one map."""
    per_channel = jax.vmap(gridder.dirty2vis, in_axes=(None, None, 0))  # freq
    per_time = jax.vmap(per_channel, in_axes=(None, 0, None))  # uvw
    return per_time(sky, uvw, freq)


def loss(sky, obs: Observation) -> jax.Array:
    """Half the squared misfit of the model's visibilities, per visibility.

    ``|r|^2`` is written ``Re(r)^2 + Im(r)^2``: the same value, but JAX's
    derivative of ``jnp.abs`` divides by ``|r|``, so its second derivative needs
    ``r`` (one more map per Hessian-vector product); this one's does not.
    """
    residual = forward(obs.gridder, sky, obs.uvw, obs.freq) - obs.vis
    squares = jnp.real(residual) ** 2 + jnp.imag(residual) ** 2
    return 0.5 * jnp.sum(squares) / residual.size


def step_size(obs: Observation, iterations: int = 20) -> float:
    """1 / the largest eigenvalue of the misfit's Hessian, by power iteration."""
    hvp = jax.jit(
        jax.grad(lambda x: loss(x, dataclasses.replace(obs, vis=0 * obs.vis)))
    )
    x = jnp.ones_like(obs.sky)
    for _ in range(iterations):
        y = hvp(x)
        x = y / jnp.linalg.norm(y)
    return float(1.0 / jnp.vdot(x, hvp(x)))


@dataclasses.dataclass(frozen=True)
class Result:
    """The recovered image and the numbers the docs quote."""

    dirty: np.ndarray  # the first step's image (the scaled back-projection)
    image: np.ndarray  # after ``steps`` steps
    losses: list[float]
    peaks: list[tuple[int, int, float]]  # the two brightest pixels: i, j, flux
    seconds_per_step: float


def reconstruct(obs: Observation, steps: int = 100) -> Result:
    """Projected gradient descent with Nesterov momentum on ``loss`` (FISTA)."""
    grad = jax.jit(jax.value_and_grad(lambda x: loss(x, obs)))
    step = step_size(obs)

    @jax.jit
    def update(x, x_old, g, momentum):
        x_new = jnp.maximum(x - step * g, 0.0)  # the sky is non-negative
        return x_new, x_new + momentum * (x_new - x_old)

    x = y = jnp.zeros_like(obs.sky)
    value, g = grad(y)  # compiles
    dirty = np.asarray(-step * g)
    losses = [float(value)]
    start = time.perf_counter()
    for k in range(steps):
        x, y = update(y, x, g, k / (k + 3))
        value, g = grad(y)
        losses.append(float(value))
    seconds = (time.perf_counter() - start) / max(steps, 1)
    image = np.asarray(x)
    return Result(dirty, image, losses, find_peaks(image), seconds)


def find_peaks(image: np.ndarray, count: int = 2, box: int = 2):
    """The ``count`` brightest sources: pixel i, j and the flux summed over a
    ``(2 box + 1)^2`` box, each found outside the boxes of the brighter ones."""
    rest = image.copy()
    peaks = []
    for _ in range(count):
        r, c = np.unravel_index(np.argmax(rest), rest.shape)
        window = np.s_[max(r - box, 0) : r + box + 1, max(c - box, 0) : c + box + 1]
        peaks.append((int(r), int(c), float(image[window].sum())))
        rest[window] = -np.inf
    return peaks


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def plot(obs: Observation, result: Result, path: str) -> None:
    """Truth, first-step image and recovered image side by side, as a PNG.

    In the coordinates of docs/gridding.md: pixel ``i`` (the first index, the
    ``l`` direction) left to right, pixel ``j`` (the second, ``m``) bottom to top,
    and a colour bar per panel in the image's units (Jy per pixel). Circles mark
    the true sources.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    npix_x, npix_y = obs.sky.shape
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), layout="constrained")
    panels = [
        ("true sky", obs.sky),
        ("after 1 step (dirty image)", result.dirty),
        (f"after {_steps(len(result.losses) - 1)}", result.image),
    ]
    for k, (ax, (title, img)) in enumerate(zip(axes, panels, strict=True)):
        # imshow draws img[row, col] at (x=col, y=row): transposed, x is i and y is j.
        shown = ax.imshow(
            img.T,
            origin="lower",
            cmap="inferno",
            extent=(-0.5, npix_x - 0.5, -0.5, npix_y - 0.5),
        )
        ax.scatter(
            [i for i, _, _ in SOURCES],
            [j for _, j, _ in SOURCES],
            s=160,
            facecolors="none",
            edgecolors="cyan",
            linewidths=0.8,
        )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("pixel i  (l →)")
        if k == 0:
            ax.set_ylabel("pixel j  (m →)")
        ticks = range(0, max(npix_x, npix_y) + 1, 16)
        ax.set_xticks([t for t in ticks if t < npix_x])
        ax.set_yticks([t for t in ticks if t < npix_y])
        fig.colorbar(shown, ax=ax, shrink=0.85, label="Jy per pixel")
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(
        prog="python -m examples.gridding", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=100, help="gradient steps")
    parser.add_argument("--times", type=int, default=8, help="time steps")
    parser.add_argument("--channels", type=int, default=4, help="channels")
    parser.add_argument("--plot", metavar="FILE.png", help="save the images")
    args = parser.parse_args(argv)
    obs = observe(times=args.times, channels=args.channels)
    t, c, rows, _ = obs.vis.shape
    print(f"{t} times x {c} channels x {rows} baselines, {obs.sky.shape} image")
    print(jax.make_jaxpr(lambda x: forward(obs.gridder, x, obs.uvw, obs.freq))(obs.sky))
    result = reconstruct(obs, args.steps)
    print(
        f"loss {result.losses[0]:.3g} -> {result.losses[-1]:.3g} in "
        f"{args.steps} steps, {result.seconds_per_step * 1e3:.1f} ms per step"
    )
    for (i, j, flux), (i0, j0, f0) in zip(result.peaks, SOURCES, strict=True):
        print(f"source at ({i0}, {j0}) flux {f0}: found ({i}, {j}) {flux:.3f}")
    if args.plot:
        plot(obs, result, args.plot)
        print(f"saved {args.plot}")
    return result
