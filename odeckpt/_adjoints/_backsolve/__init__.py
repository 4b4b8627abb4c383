"""The continuous adjoint ("backsolve"): gradients from the adjoint equations solved backwards."""

from ._adjoint import BacksolveAdjoint as BacksolveAdjoint
