"""What the steppers that solve implicit equations with a Newton method share: their
configuration checks, and the tolerances they take from the solve."""

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from .._error_norm import effective_tolerances, real_dtype, scaled_error
from .._types import Scalar, ScalarLike, Tolerance, Y
from ._base import AbstractStepper
from ._newton import AbstractNewton, Newton, NewtonKrylov
from ._rosenbrock import AbstractRosenbrock

_DEFAULT_RTOL, _DEFAULT_ATOL = 1e-6, 1e-8
"""Tolerances of a stepper's own step-size proposal outside `odeckpt.solve` (which passes its
own)."""


@jax.custom_jvp
def per_step(x: jax.Array, h: Scalar) -> jax.Array:
    """`x / h` (`x / 1` where `h` is 0): a stage's slope from its increment over a step of
    length `h`. Its derivatives never form `h**2`, which underflows to zero for steps below
    about 1e-154 in float64 (1e-19 in float32) and makes the derivative in `h` NaN."""
    return x / jnp.where(h == 0, 1, h).astype(x.dtype)


@per_step.defjvp
def _per_step_jvp(primals, tangents):
    (x, h), (dx, dh) = primals, tangents
    q = per_step(x, h)
    return q, per_step(dx - q * jnp.asarray(dh).astype(x.dtype), h)


class AbstractImplicit(AbstractStepper):
    """A stepper that solves implicit equations with a Newton method (`newton`), given the
    Jacobian of `f` by `jac` or by `jax.jacfwd` (`jac=None`)."""

    newton: eqx.AbstractVar[AbstractNewton]
    jac: eqx.AbstractVar[Callable | None]
    implicit: ClassVar[bool] = True

    def held_newton(self, dtype) -> AbstractNewton:
        """`newton` at the tolerances this stepper's steps are held to on a state of `dtype`
        (`effective_tolerances` of those set by the solve; unset ones stay unset)."""
        newton = self.newton
        if newton.rtol is None or newton.atol is None:
            return newton
        rtol, atol = effective_tolerances(newton.rtol, newton.atol, self.tolerance_exponent,
                                          dtype, self.tolerance_reference)  # fmt: skip
        return dataclasses.replace(newton, rtol=rtol, atol=atol)


class AbstractProposer(AbstractImplicit):
    """An implicit stepper that proposes its own step sizes (`Step.dt_factor`): it judges its
    steps with the controller's error norm (`odeckpt._error_norm.scaled_error`) at the
    tolerances `rtol` and `atol`, which `odeckpt.solve` sets to its own when they are `None`."""

    rtol: eqx.AbstractVar[float | None]
    atol: eqx.AbstractVar[float | None]

    def derivative(self, state) -> Y:
        """**Returns:** `f(t, y, args)` at the state's point (`state.implicit.f`: a proposer's
        state nests an `ImplicitState`)."""
        return state.implicit.f

    def with_differentiable_state(self, state, part: Y):
        """**Returns:** `state` with `implicit.f` replaced by `part` (`BDF` adds its history)."""
        return dataclasses.replace(state, implicit=dataclasses.replace(state.implicit, f=part))

    def with_fresh_jacobian(self, state):
        """**Returns:** `state`, its Newton cache asking for a Jacobian at the next attempt."""
        cache = self.newton.refreshed(state.implicit.cache)
        return dataclasses.replace(state, implicit=dataclasses.replace(state.implicit, cache=cache))

    def error_norm(self, y_error: Y, y0: Y, y1: Y) -> Scalar:
        """The error norm that the step-size controller computes for this step."""
        return scaled_error(y_error, y0, y1, *self._tolerances(real_dtype(y0)))

    def _tolerances(self, dtype) -> tuple[float, float]:
        rtol = _DEFAULT_RTOL if self.rtol is None else self.rtol
        atol = _DEFAULT_ATOL if self.atol is None else self.atol
        return effective_tolerances(rtol, atol, self.tolerance_exponent, dtype,
                                    self.tolerance_reference)  # fmt: skip

    def tight_newton(self, dtype) -> AbstractNewton:
        """`newton`, stopping at `min(kappa, max(10 eps / rtol, sqrt(rtol)))` times the
        tolerance, as Hairer and Wanner's RADAU5 and scipy's `Radau` and `BDF` do: these
        methods' steps are far more accurate than the tolerance at small `rtol` (their error
        estimates are of lower order than their steps), and a looser iteration would leave
        its own error, at `kappa` times the tolerance in every step, as the error of the
        solve."""
        rtol, _ = self._tolerances(dtype)
        floor = 10 * float(np.finfo(dtype).eps) / rtol
        newton = self.held_newton(dtype)
        kappa = jnp.minimum(newton.kappa, jnp.maximum(floor, rtol**0.5))
        return dataclasses.replace(newton, kappa=kappa)


def check_jac(stepper: AbstractStepper, newton: AbstractNewton, jac: Callable | None) -> None:
    """Raise, naming the fix, on a configuration the stepper cannot use."""
    name = type(stepper).__name__
    if not isinstance(newton, AbstractNewton):
        raise TypeError(
            f"{name}(newton={newton!r}) is not a Newton method. Fix: pass `odeckpt.Newton()` "
            "or `odeckpt.NewtonKrylov()`."
        )
    if jac is not None and not callable(jac):
        raise TypeError(f"{name}(jac={jac!r}) must be a function `jac(t, y, args)` or None.")
    if jac is not None and isinstance(newton, NewtonKrylov):
        raise ValueError(
            f"{name}(jac=..., newton=NewtonKrylov()): Newton-Krylov never forms the Jacobian, "
            "so a user `jac` would be ignored. Fix: drop `jac=` (Jacobian-vector products come "
            "from `jax.linearize` of f), or use `newton=odeckpt.Newton()` with your `jac`."
        )


def check_tolerances(stepper: AbstractProposer) -> None:
    """Raise, naming the fix, on tolerances that are neither positive nor `None`. (Traced ones,
    the solve's passed on, are checked at run time: `Status.invalid_settings`.)"""
    for name in ("rtol", "atol"):
        value = getattr(stepper, name)
        if value is None or isinstance(value, jax.core.Tracer):
            continue
        if not np.all(np.asarray(value) > 0):
            raise ValueError(
                f"{type(stepper).__name__}({name}={value!r}) must be positive, or None to take "
                f"the solve's. Fix: pass e.g. `{name}=1e-8`, or leave it out."
            )


def with_newton_tolerances(
    stepper: AbstractStepper, rtol: ScalarLike, atol: ScalarLike, *, replace: bool = False
) -> AbstractStepper:
    """`stepper` with its unset tolerances taken from `rtol` and `atol` (those of the solve): its
    Newton method's and, for an `AbstractProposer`, those of its step-size proposal; any other
    stepper unchanged. With `replace`, tolerances already set are replaced too (a stepper that
    `odeckpt.solve` prepared, run again at other tolerances). (A step transforms them into
    those it is held to: `AbstractImplicit.held_newton`.)"""
    if not isinstance(stepper, AbstractImplicit):
        return stepper
    changes: dict[str, Any] = dict(newton=stepper.newton.with_tolerances(rtol, atol, replace))
    if isinstance(stepper, AbstractProposer):
        changes["rtol"] = rtol if replace or stepper.rtol is None else stepper.rtol
        changes["atol"] = atol if replace or stepper.atol is None else stepper.atol
    return dataclasses.replace(stepper, **changes)


def newton_rtol(stepper: AbstractStepper) -> Tolerance | None:
    """The `rtol` an implicit stepper's Newton iteration converges to (`None`: none set, or a
    stepper without one)."""
    return stepper.newton.rtol if isinstance(stepper, AbstractImplicit) else None


def with_staggered_tangents(stepper: AbstractStepper) -> AbstractStepper:
    """`stepper` with its (chord) Newton method solving the stages' tangents by the staggered
    corrector (the step's LU factors, `odeckpt.Newton(tangent_solve="staggered")`); a stepper
    without one unchanged."""
    if isinstance(stepper, AbstractImplicit) and isinstance(stepper.newton, Newton):
        newton = dataclasses.replace(stepper.newton, tangent_solve="staggered")
        return dataclasses.replace(stepper, newton=newton)
    return stepper


def map_jac(stepper: AbstractStepper, change: Callable) -> AbstractStepper:
    """`stepper` with its user Jacobian `jac` replaced by `change(jac)` (`None`: `jax.jacfwd`),
    for a solve of another system than `f(t, y, args)`, whose Jacobian `jac` is; a stepper
    that takes no `jac`, or was given none, unchanged."""
    if isinstance(stepper, AbstractImplicit | AbstractRosenbrock) and stepper.jac is not None:
        return dataclasses.replace(stepper, jac=change(stepper.jac))
    return stepper
