"""Newton-CG through the gridder's second-order kernels, against the first-order loop.

The misfit of ``demo.loss`` is quadratic in the image, with Hessian ``Re A^H A``
(scaled). Its Hessian-vector product is forward over reverse,
``jax.jvp(jax.grad(loss), (x,), (v,))``: the gradient runs ``dirty2vis_bwd`` on
the cotangent alone (``dirty2vis`` keeps no residuals), so the product runs
``dirty2vis_fwd``'s JVP kernel (``dirty2vis`` of ``v``) and ``dirty2vis_bwd`` of
its result, two threaded maps under the two ``vmap`` levels (times, channels) of
the model; the misfit's curvature needs no residual, so ``dirty2vis`` of ``x``
is not run. Newton-CG solves ``H p = -g`` with conjugate gradients on those products;
the first-order loop is the accelerated gradient descent of ``demo.reconstruct``
without its projection, on the same (unconstrained) problem.

Run from the repository root::

    python -m examples.gridding.newton
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from examples.gridding.demo import Observation, loss, observe, step_size

#: Threaded maps (operator applications, each over every time and channel) per call.
MAPS_PER_GRADIENT = 2  # dirty2vis_fwd, then dirty2vis_bwd
MAPS_PER_HVP = 2  # dirty2vis_fwd's JVP kernel, then dirty2vis_bwd


@dataclasses.dataclass(frozen=True)
class Run:
    """One solver's trace: the loss after each iteration and what it cost."""

    losses: list[float]
    maps: list[int]  # threaded maps run so far, after each iteration
    seconds: float

    def maps_to(self, target: float) -> int | None:
        """The threaded maps run until the loss first fell to ``target``."""
        for value, maps in zip(self.losses, self.maps, strict=True):
            if value <= target:
                return maps
        return None


def hessian_vector_product(
    obs: Observation,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``(x, v) -> H(x) v`` of ``loss``: forward over reverse, jitted."""
    grad = jax.grad(lambda x: loss(x, obs))
    return jax.jit(lambda x, v: jax.jvp(grad, (x,), (v,))[1])


def newton_cg(obs: Observation, newton_steps: int = 2, cg_iters: int = 30) -> Run:
    """Newton's method, each step solving ``H p = -g`` by conjugate gradients.

    The loss of each iterate is computed after the timed loop, for the trace.
    """
    value_and_grad = jax.jit(jax.value_and_grad(lambda x: loss(x, obs)))
    hvp = hessian_vector_product(obs)

    @jax.jit
    def cg_step(x, p, r, d, rr):  # one conjugate-gradient iteration: one HVP
        hd = hvp(x, d)
        alpha = rr / jnp.vdot(d, hd)
        p, r = p + alpha * d, r - alpha * hd
        rr_new = jnp.vdot(r, r)
        return p, r, r + (rr_new / rr) * d, rr_new

    x = jnp.zeros_like(obs.sky)
    value, g = value_and_grad(x)  # compiles
    cg_step(x, x, g, g, jnp.vdot(g, g))[0].block_until_ready()
    iterates, maps, used = [x], [MAPS_PER_GRADIENT], MAPS_PER_GRADIENT
    start = time.perf_counter()
    for newton in range(newton_steps):
        if newton:
            value, g = value_and_grad(x)
            used += MAPS_PER_GRADIENT
        p, r = jnp.zeros_like(x), -g  # CG on H p = -g from p = 0
        d, rr = r, jnp.vdot(r, r)
        for _ in range(cg_iters):
            p, r, d, rr = cg_step(x, p, r, d, rr)
            used += MAPS_PER_HVP
            iterates.append(x + p)
            maps.append(used)
        x = x + p
    x.block_until_ready()
    seconds = time.perf_counter() - start
    value_of = jax.jit(lambda x: loss(x, obs))
    return Run([float(value_of(it)) for it in iterates], maps, seconds)


def first_order(obs: Observation, steps: int = 200) -> Run:
    """Accelerated gradient descent (Nesterov, step 1/L), no projection."""
    value_and_grad = jax.jit(jax.value_and_grad(lambda x: loss(x, obs)))
    step = step_size(obs)
    x = y = jnp.zeros_like(obs.sky)
    value, g = value_and_grad(y)  # compiles
    losses, maps = [float(value)], [MAPS_PER_GRADIENT]
    start = time.perf_counter()
    for k in range(steps):
        x_new = y - step * g
        y, x = x_new + k / (k + 3) * (x_new - x), x_new
        value, g = value_and_grad(y)
        losses.append(float(value))
        maps.append(maps[-1] + MAPS_PER_GRADIENT)
    return Run(losses, maps, time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> tuple[Run, Run]:
    del argv
    obs = observe()
    newton, first = newton_cg(obs), first_order(obs)
    start = newton.losses[0]
    print(f"initial loss {start:.3g}")
    for ratio in (1e-2, 1e-3, 1e-4):
        target = ratio * start
        print(
            f"loss <= {ratio:g} x initial: Newton-CG after "
            f"{newton.maps_to(target)} threaded maps, first order after "
            f"{first.maps_to(target)}"
        )
    for name, run in (("Newton-CG", newton), ("first order", first)):
        per_map = run.seconds / max(run.maps[-1] - run.maps[0], 1)
        print(
            f"{name}: loss {run.losses[-1]:.3g} after {run.maps[-1]} maps, "
            f"{run.seconds:.2f} s ({per_map * 1e3:.1f} ms per map)"
        )
    return newton, first


if __name__ == "__main__":
    main()
