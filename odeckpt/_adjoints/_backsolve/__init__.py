"""The continuous adjoints ("backsolve", "interpolating"): gradients from the adjoint equations
solved backwards."""

from ._adjoint import BacksolveAdjoint as BacksolveAdjoint
from ._interpolating import InterpolatingAdjoint as InterpolatingAdjoint
