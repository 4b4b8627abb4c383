"""Continuous extensions: polynomials in a step's normalised time, and piecewise ones over
consecutive steps (a solve's dense output, a window of re-solved steps)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._autodiff import on_auto_axes
from .._types import IntScalar, Scalar, Y


def polynomial(coeffs: Array, theta: Array) -> Array:
    """`sum_j coeffs[j] * theta**j` by Horner's rule (`coeffs` lowest degree first), for a
    scalar `theta` or one row per entry of a 1-D `theta`."""
    rows = theta.shape
    theta = theta.astype(coeffs.dtype).reshape(rows + (1,) * (coeffs.ndim - 1))
    value = jnp.broadcast_to(coeffs[-1], rows + coeffs.shape[1:])
    for c in coeffs[-2::-1]:
        value = value * theta + c.reshape((1,) * len(rows) + c.shape)
    return value


def derivative(coeffs: Array, theta: Array) -> Array:
    """The derivative in `theta` of `polynomial(coeffs, theta)`."""
    degree = coeffs.shape[0] - 1
    if degree == 0:
        return polynomial(jnp.zeros_like(coeffs), theta)
    powers = jnp.arange(1, degree + 1).reshape((degree,) + (1,) * (coeffs.ndim - 1))
    return polynomial(coeffs[1:] * powers.astype(coeffs.dtype), theta)


def piecewise(starts: Array, ends: Array, coeffs: Y, t: Scalar, count: IntScalar | int) -> Y:
    """The piecewise polynomial over `count` consecutive pieces `[starts[i], ends[i]]` (times
    increasing; leaves of `coeffs` shaped `(pieces, degree + 1, ...)`) at time `t`: the first
    piece that ends at or after `t` (the last piece past the end)."""
    # (Under `vmap` the pieces may be shared and `t` a lane's own: see `on_auto_axes`.)
    return on_auto_axes(_piecewise, starts, ends, coeffs, t, count)


def _piecewise(starts: Array, ends: Array, coeffs: Y, t: Scalar, count: IntScalar | int) -> Y:
    index = jnp.clip(jnp.searchsorted(ends, t, side="left"), 0, jnp.maximum(count - 1, 0))
    start, h = starts[index], ends[index] - starts[index]
    # A zero-length or unused piece must not make 0/0.
    theta = (t - start) / jnp.where(h > 0, h, 1)
    return jax.tree.map(lambda c: polynomial(c[index], theta), coeffs)


class DenseOutput(eqx.Module):
    """Every accepted step's continuous extension, as polynomial coefficients in the step's
    normalised time `theta`. Times are internal times `direction * t`, so they increase.
    """

    t_start: Scalar
    t_ends: Float[Array, " max_steps"]
    coeffs: Y
    num_accepted: IntScalar

    @property
    def t_last(self) -> Scalar:
        """The end of the last accepted step (the start if none was taken)."""
        last = self.num_accepted - 1
        return jnp.where(last >= 0, self.t_ends[jnp.maximum(last, 0)], self.t_start)

    def covers(self, t: Array) -> Array:
        """Whether each (internal) time in `t` lies in the span the steps cover."""
        return (t >= self.t_start) & (t <= self.t_last)

    def evaluate(self, t: Scalar) -> Y:
        """The solution at (internal) time `t`."""
        starts = jnp.concatenate([self.t_start[None], self.t_ends[:-1]])
        return piecewise(starts, self.t_ends, self.coeffs, t, self.num_accepted)
