"""Radio-interferometric gridding with ducc0 as threaded JAX kernels.

``Gridder(...).dirty2vis`` and ``Gridder(...).vis2dirty`` wrap
``ducc0.wgridder.dirty2vis`` and ``ducc0.wgridder.vis2dirty`` for one image and
one set of baselines; ``jax.vmap`` over times, channels, directions or
polarisations (any nesting) runs them as one flat threaded map, and ``jax.grad``
/ ``jax.jvp`` run the adjoint and the operator itself as threaded kernels.
See docs/gridding.md; ``python -m examples.gridding`` runs the imaging demo.
"""

from examples.gridding.direct import direct_dirty2vis as direct_dirty2vis
from examples.gridding.operators import SPEED_OF_LIGHT as SPEED_OF_LIGHT
from examples.gridding.operators import Gridder as Gridder

__all__ = ["SPEED_OF_LIGHT", "Gridder", "direct_dirty2vis"]
