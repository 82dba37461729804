"""Placing a background call's NumPy result on its device, as ``jax.device_put``
does, at a fraction of its cost (on the hooks of :mod:`.hooks`); keeping a ready
``jax.Array`` for a deferred program (:func:`alias_or_copy`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from .hooks import RESOLVED, Missing


def put_on_device(aval: Any, x: Any, device: Any) -> Any:
    """NumPy ``x`` on ``device`` as ``jax.device_put(x, device)`` puts it.

    ``device=None``: on the default device, uncommitted, as ``jax.device_put(x)``.
    ``aval`` is ``x``'s abstract value. The result may share ``x``'s buffer on
    CPU: pass only arrays that nobody writes to. ``None`` where a hook is
    missing (use ``jax.device_put`` then).
    """
    put = RESOLVED["batched_device_put"]
    if isinstance(put, Missing):
        return None
    target = default_device() if device is None else device
    sharding = _one_device(target)
    return put(aval, sharding, [x], [target], device is not None)


_one_device = functools.cache(jax.sharding.SingleDeviceSharding)  # (devices are few)


def default_device() -> Any:
    """The device ``jax.device_put(x)`` puts ``x`` on: ``jax_default_device``
    (a device, or a platform's first local device), else the first local device.

    What ``jax._src.interpreters.pxla.get_default_device`` does (the same source
    on every supported JAX), from public names.
    """
    # The option's current value (jax.default_device(...) included); typed
    # stubs do not list the options as attributes of jax.config.
    chosen = getattr(jax.config, "jax_default_device")  # noqa: B009
    if isinstance(chosen, str):
        return jax.local_devices(backend=chosen)[0]
    return chosen or jax.local_devices()[0]


def alias_or_copy(a: jax.Array) -> jax.Array:
    """What a deferred program reads for the ready array ``a``: on one CPU
    device, an alias of its buffer (DLPack: XLA's CPU client then copies at a
    later donation instead of donating, and ``a.delete()`` leaves the alias:
    no copy unless a conflict comes); elsewhere, a copy (dispatched, not
    waited for)."""
    if len(a.devices()) == 1 and next(iter(a.devices())).platform == "cpu":
        try:
            alias = jax.dlpack.from_dlpack(a)
        except Exception:  # noqa: BLE001 - a dtype or layout DLPack refuses: copy
            alias = None
        if alias is not None and alias.sharding == a.sharding:
            if alias.dtype == a.dtype and alias.shape == a.shape:
                return alias
    return jax.device_put(a, may_alias=False)
