"""The backward system of the continuous adjoints: the augmented ODE and its seminorm."""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._steppers import AbstractStepper, AbstractWrapper, Step, map_jac
from ..._types import Args, Y


class Problem(eqx.Module):
    """The vector field split into the differentiated arrays `diff` (of `(f, args)`) and the
    rest, and the backward systems in the time `s = -tau` (so their loops run forwards):
    `dy/ds = -f`, `da/ds = a^T df/dy`, `dg/ds = a^T df/ddiff`."""

    nondiff: Args

    def f(self, tau, y, diff):
        f, args = eqx.combine(diff, self.nondiff)
        return f(tau, y, args)

    def stepper_for_f(self, stepper: AbstractStepper) -> AbstractStepper:
        """`stepper`, a stepper of `f`, as one of `self.f`: its user `jac(t, y, args)` called
        with the `args` that `diff` stands for."""
        return map_jac(stepper, lambda jac: _JacobianOfF(jac, self.nondiff))

    def augmented(self, s, z, diff):
        """The system of `(y, a, g)`: `y` integrated backwards with the adjoint."""
        y, a, _ = z
        dy, vjp = jax.vjp(lambda y, d: self.f(-s, y, d), y, diff)
        a_y, a_g = vjp(a)
        return jax.tree.map(jnp.negative, dy), a_y, a_g

    def adjoint(self, s, z, args):
        """The system of `(a, g)` alone in the time `s = origin - tau` (which resolves short
        steps near `origin` however far it lies from 0), with `y(t)` read from a forward
        window, and `tau` kept at or above `floor`, the end of the stretch (which `origin - s`
        may round past, onto the far side of a known discontinuity):
        `args = (diff, window, origin, floor)`."""
        a, _ = z
        diff, window, origin, floor = args
        tau = jnp.maximum(origin - s, floor)
        y = window.evaluate(tau)
        _, vjp = jax.vjp(lambda y, d: self.f(tau, y, d), y, diff)
        return vjp(a)

    def adjoint_at(self, y: Y, origin):
        """The system of `(a, g)` in `s = origin - tau` with `y` frozen (to choose the first
        backward step size)."""

        def field(s, z, diff):
            a, _ = z
            _, vjp = jax.vjp(lambda y, d: self.f(origin - s, y, d), y, diff)
            return vjp(a)

        return field


class _JacobianOfF(eqx.Module):
    """A user's `jac(t, y, args)` of `f` as the Jacobian of `Problem.f(tau, y, diff)`."""

    jac: Callable
    nondiff: Args

    def __call__(self, tau, y, diff):
        _, args = eqx.combine(diff, self.nondiff)
        return self.jac(tau, y, args)


class Seminorm(AbstractWrapper):
    """`stepper` with the error estimate of the parameter integral (the last part of the
    backward state) set to zero, and that of the rest (the state and adjoint, or the adjoint
    alone) rescaled so that the controller's root mean square over all components equals the
    one over the rest alone.

    **References:** P. Kidger, R. T. Q. Chen, T. Lyons, "'Hey, that's not an ODE': Faster ODE
    Adjoints via Seminorms", ICML 2021.
    """

    stepper: AbstractStepper

    def init(self, f, t0, y0, args):
        return self.stepper.init(f, t0, y0, args)

    def derivative(self, state):
        return self.stepper.derivative(state)

    def step(self, f, t0, t1, y0, args, state) -> Step:
        step = self.stepper.step(f, t0, t1, y0, args, state)
        if step.y_error is None:
            return step
        *error_state, error_g = step.y_error
        size_state, size_g = _size(error_state), _size(error_g)
        if size_g == 0:
            return step
        scale = ((size_state + size_g) / size_state) ** 0.5
        error_state = jax.tree.map(lambda e: e * scale, error_state)
        y_error = (*error_state, jax.tree.map(jnp.zeros_like, error_g))
        return dataclasses.replace(step, y_error=y_error)


def _size(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))
