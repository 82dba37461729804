"""Training loops as users of Equinox, Optax and Flax write them, unchanged for
batches that are still loading (``async_call``) or ready (NumPy arrays).

Used by ``tests/_arrays/test_libraries.py`` (bit for bit, loading against ready) and
``benchmarks/library_loops.py`` (the overlap of loading and steps); the same loops
are on docs/async-libraries.md. Each ``*_loop(batches)`` trains a small model on
``batches`` (pairs ``(x, y)``) and returns its final parameters and the losses;
its jitted step is made once per process (``_equinox()``...), so that only the first
loop compiles.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_threadmap as jtm

BATCH, FEATURES, OUTPUTS = 32, 4, 2
SHAPES = (
    jax.ShapeDtypeStruct((BATCH, FEATURES), jnp.float32),
    jax.ShapeDtypeStruct((BATCH, OUTPUTS), jnp.float32),
)


def load(i: int, seconds: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``i`` (the same for every ``seconds``, the time the load takes)."""
    time.sleep(seconds)
    rng = np.random.default_rng(i)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    return x, np.tanh(x[:, :OUTPUTS] - x[:, OUTPUTS:]).astype(np.float32)


def loading(steps: int, seconds: float) -> list:
    """``steps`` batches that start loading now, each taking ``seconds``."""
    return [jtm.async_call(load, SHAPES, i, seconds) for i in range(steps)]


def ready(steps: int) -> list:
    return [load(i) for i in range(steps)]


def _train(step, params, opt_state, batches):
    """The steps of an Optax-style loop: the parameters (or model) trained on
    ``batches``, and each step's loss."""
    losses = []
    for x, y in batches:
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
    return params, losses


@functools.cache
def _equinox():
    import equinox as eqx
    import optax

    opt = optax.adam(1e-2)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = opt.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    return eqx, opt, step


def equinox_loop(batches):
    eqx, opt, step = _equinox()
    model = eqx.nn.MLP(FEATURES, OUTPUTS, 16, 2, key=jax.random.key(0))
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    model, losses = _train(step, model, opt_state, batches)
    return eqx.filter(model, eqx.is_array), losses


@functools.cache
def _optax():
    import optax

    opt = optax.adam(1e-2)

    def loss_fn(params, x, y):
        return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return opt, step


def optax_loop(batches):
    opt, step = _optax()
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w": jax.random.normal(k1, (FEATURES, OUTPUTS)) * 0.1,
        "b": jax.random.normal(k2, (OUTPUTS,)) * 0.1,
    }
    opt_state = opt.init(params)
    return _train(step, params, opt_state, batches)


@functools.cache
def _nnx():
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
            self.out = nnx.Linear(16, OUTPUTS, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return nnx, optax, MLP, step


def nnx_loop(batches):
    nnx, optax, MLP, step = _nnx()
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    losses = [step(model, optimizer, x, y) for x, y in batches]
    return nnx.state(model, nnx.Param), losses


@functools.cache
def _linen():
    import flax.linen as nn
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(OUTPUTS)(nn.relu(nn.Dense(16)(x)))

    model = MLP()
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(params):
            return jnp.mean((model.apply(params, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return model, opt, step


def linen_loop(batches):
    model, opt, step = _linen()
    params = model.init(jax.random.key(0), jnp.zeros((BATCH, FEATURES)))
    opt_state = opt.init(params)
    return _train(step, params, opt_state, batches)


LOOPS = {
    "equinox": equinox_loop,
    "optax": optax_loop,
    "nnx": nnx_loop,
    "linen": linen_loop,
}
#: The packages each loop needs.
NEEDS = {
    "equinox": ("equinox", "optax"),
    "optax": ("optax",),
    "nnx": ("flax", "optax"),
    "linen": ("flax", "optax"),
}
