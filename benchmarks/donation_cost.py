"""What keeping a deferred program's ready arguments safe costs (issue 48 item 1).

A deferred program (async dispatch's one mechanism, on every platform) is held
back until its pending data lands; meanwhile the caller may donate
or delete its ready ``jax.Array`` arguments. The ways to keep them, for a 1 GiB
parameter set, each measured here on this machine's default device:

- **copy at the deferral** (what the package does): one device copy per ready
  argument, dispatched at the call and not waited for; the copy lives until the
  program runs.
- **copy at the conflict** (a hook at the donation): costs nothing without a
  conflict, but jit's C++ fast path donates without passing any Python hook: the
  script counts how many of 20 donating calls a hook on ``ExecuteReplicated`` sees.
- **a reference the runtime honours** (the CPU only: a DLPack alias, which makes
  XLA's CPU client copy instead of donating): costs a copy at the donation, none
  without one. No such reference exists for a TPU's buffers.
- **defer the donating program behind the readers**: the donation waits for the
  load (the same hook problem: the fast path is not seen).

Usage::

    python benchmarks/donation_cost.py [GiB]
"""

from __future__ import annotations

import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_threadmap as jtm
from jax_threadmap._arrays import dispatch as _dispatch

ROUNDS = 3


def _best(fn) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    n = int(gib * 2**30) // 4
    params = jnp.ones((n,), jnp.float32).block_until_ready()
    loss = jax.jit(lambda b, p: jnp.sum(p[:4] * b))
    update = jax.jit(lambda p: p * 0.5, donate_argnums=0)
    status = _dispatch.mechanism.status() or "async"
    print(f"{status}; {gib:g} GiB of parameters")

    copy = _best(lambda: jax.device_put(params, may_alias=False).block_until_ready())
    print(f"one device copy of the parameters: {copy * 1e3:.1f} ms")

    def deferred_step() -> tuple[float, float]:
        landed = threading.Event()
        batch = jtm.async_call(
            lambda: (landed.wait(60), np.ones(4, np.float32))[1],
            jax.ShapeDtypeStruct((4,), jnp.float32),
        )
        p = jnp.array(params, copy=True).block_until_ready()
        start = time.perf_counter()
        y = loss(batch, p)
        called = time.perf_counter() - start
        p2 = update(p)  # donates p before the batch lands
        start = time.perf_counter()
        landed.set()
        jax.block_until_ready((y, p2))
        return called, time.perf_counter() - start

    def plain_step() -> float:
        # The same on a batch that is there: JAX's own dispatch, for scale.
        batch = jnp.ones(4, jnp.float32)
        p = jnp.array(params, copy=True).block_until_ready()
        start = time.perf_counter()
        jax.block_until_ready((loss(batch, p), update(p)))
        return time.perf_counter() - start

    deferred_step(), plain_step()  # compiles
    steps, plain = [], []
    for _ in range(ROUNDS):  # the two ways alternated, best of each
        steps.append(deferred_step())
        plain.append(plain_step())
    print(
        "deferred loss(batch, params), then a donating update: the call returns in "
        f"{min(s[0] for s in steps) * 1e3:.1f} ms, both results "
        f"{min(s[1] for s in steps) * 1e3:.1f} ms after the batch lands "
        f"(on a batch already there: {min(plain) * 1e3:.1f} ms)"
    )

    # Copy at the conflict: how many donations a Python hook on program runs sees.
    seen = []
    cls = type(jax.jit(lambda: 0).lower().compile()._executable.unsafe_call)
    original = cls.__call__

    def hooked(self, *args):
        seen.append(1)
        return original(self, *args)

    cls.__call__ = hooked
    try:
        small = jax.jit(lambda p: p * 0.5, donate_argnums=0)
        q = jnp.ones(4)
        for _ in range(20):
            q = small(q)
    finally:
        cls.__call__ = original
    print(f"copy at the conflict: a hook sees {len(seen)} of 20 donating calls")

    if jax.default_backend() == "cpu":

        def donate(alias: bool) -> float:
            p = jnp.array(params, copy=True).block_until_ready()
            kept = jax.dlpack.from_dlpack(p) if alias else None
            start = time.perf_counter()
            update(p).block_until_ready()
            del kept
            return time.perf_counter() - start

        plain = aliased = float("inf")
        for _ in range(ROUNDS):  # alternated, best of each
            plain = min(plain, donate(False))
            aliased = min(aliased, donate(True))
        print(
            "a runtime reference (DLPack alias, CPU only): a donating update takes "
            f"{aliased * 1e3:.1f} ms with the alias held, {plain * 1e3:.1f} ms without"
        )


if __name__ == "__main__":
    main()
