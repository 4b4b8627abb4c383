"""The state and its forward sensitivities as one system: a stepper that advances both, and a
controller that judges their errors together (CVODES' full error control).

A step of the sensitivities is the step of the state differentiated along each direction with
the step's times held fixed: for a Runge-Kutta, ESDIRK or Rosenbrock method that is the same
method applied to the sensitivity equations `s' = (df/dy) s + (df/dp) dp` (internal
differentiation; Hairer, Nørsett & Wanner, *Solving ODEs I*, Sec. II.6), its stages solved with
the state's linear algebra (see `odeckpt.Newton(tangent_solve="staggered")`), its error estimate
the embedded estimate of the sensitivities.
"""

import functools
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._checks import all_finite, tightest
from ..._error_norm import effective_tolerances, real_dtype
from ..._loop import AbstractAdaptiveController, AbstractController, all_positive_finite
from ..._steppers import AbstractStepper, AbstractWrapper, Step
from ..._types import Args, Scalar, VectorField, Y


class Augmented(eqx.Module):
    """The state `y` and its scaled sensitivities `s` (leaves like `y`'s with a leading axis,
    one entry per direction)."""

    y: Y
    s: Y


class SensitivityArgs(eqx.Module):
    """The solve's `args` and the directions of the parameters: the tangents (one per
    direction, on a leading axis) of the inexact arrays of `(f, args)`, and of the known
    discontinuities `jump_ts` (`None` without them)."""

    args: Args
    directions: Y
    jump_directions: Array | None = None


class SensitivityState(eqx.Module):
    """The stepper's state and the sensitivities of its differentiable part
    (`AbstractStepper.differentiable_state`: `f(t, y)`, and a multistep method's history), one
    per direction on a leading axis."""

    state: Y
    ds: Y


def differentiable_part(f: VectorField, args: Args):
    """`(diff, static)`: the inexact arrays of `(f, args)` (the parameters) and the rest."""
    return eqx.partition((f, args), eqx.is_inexact_array)


class SensitivityStepper(AbstractWrapper):
    """Advances `Augmented(y, s)` with `stepper`: the step of `y`, and its derivative along each
    direction (`s` for the state, `SensitivityArgs.directions` for the parameters, `ds` for the
    derivative part of the stepper state) with the step's times fixed."""

    stepper: AbstractStepper

    def init(self, f, t0, y0: Augmented, args: SensitivityArgs) -> SensitivityState:
        inner = self.stepper
        state = inner.init(f, t0, y0.y, args.args)
        diff, static = differentiable_part(f, args.args)

        def part(y, diff):
            f_, args_ = eqx.combine(diff, static)
            return inner.differentiable_state(inner.init(f_, t0, y, args_))

        along = lambda s, d: jax.jvp(part, (y0.y, diff), (s, d))[1]
        return SensitivityState(state, jax.vmap(along)(y0.s, args.directions))

    def derivative(self, state: SensitivityState) -> Augmented:
        inner = self.stepper
        along = lambda ds: inner.derivative(inner.with_differentiable_state(state.state, ds))
        return Augmented(inner.derivative(state.state), jax.vmap(along)(state.ds))

    def step(
        self, f: VectorField, t0: Scalar, t1: Scalar, y0: Augmented, args: SensitivityArgs,
        state: SensitivityState,
    ) -> Step:  # fmt: skip
        inner = self.stepper
        diff, static = differentiable_part(f, args.args)

        def step(y, diff, part):
            f_, args_ = eqx.combine(diff, static)
            before = inner.with_differentiable_state(state.state, part)
            step = inner.step(f_, t0, t1, y, args_, before)
            return step, (step.y1, step.y_error, step.dense, inner.differentiable_state(step.state))

        primals = (y0.y, diff, inner.differentiable_state(state.state))

        def along(s, d, ds):
            (step_, values), (_, tangents) = jax.jvp(step, primals, (s, d, ds))
            return (step_, values), tangents

        (taken, _), (s1, s_error, s_dense, ds1) = jax.vmap(along, out_axes=((None, None), 0))(
            y0.s, args.directions, state.ds
        )
        # The dense coefficients' leading axis is the power of theta: directions go second.
        s_dense = jax.tree.map(lambda c: jnp.moveaxis(c, 0, 1), s_dense)
        # A stage whose sensitivities did not converge (NaN from the staggered corrector, whose
        # matrix may come from an earlier point) fails the step, as a Newton failure does:
        # retried shorter, with a fresh Jacobian (as CVODES does).
        sens_failed = ~all_finite((s1, ds1))
        failed = sens_failed if taken.failed is None else taken.failed | sens_failed
        on_reject = taken.state_on_reject
        if on_reject is not None:
            fresh = inner.with_fresh_jacobian(on_reject)
            on_reject = jax.tree.map(lambda a, b: jnp.where(sens_failed, a, b), fresh, on_reject)
        return Step(
            y1=Augmented(taken.y1, s1),
            y_error=None if taken.y_error is None else Augmented(taken.y_error, s_error),
            dense=Augmented(taken.dense, s_dense),
            state=SensitivityState(taken.state, ds1),
            state_on_reject=None if on_reject is None else SensitivityState(on_reject, state.ds),
            failed=failed,
            nonfinite=taken.nonfinite,
            num_jacobian_evals=taken.num_jacobian_evals,
            num_lu_factorisations=taken.num_lu_factorisations,
            num_fn_evals=taken.num_fn_evals,
            dt_factor=taken.dt_factor,
        )


class MaxNormController(AbstractController):
    """`controller`, judging an augmented step by the largest of the weighted root-mean-square
    error norms of the state and of each direction's sensitivities (as CVODES does with
    `errconS`: its `cvSensUpdateNorm`), each with the weights `atol + rtol max(|y0|, |y1|)` of
    its own values. The sensitivities are scaled (see `ForwardSensitivity`), so one `atol`
    serves all of them: `atol` (and `rtol`) here, or the controller's where `None`. A
    controller that takes no tolerances (constant steps) steps the augmented state as it
    would the state."""

    controller: AbstractController
    rtol: float | None = None
    atol: float | None = None

    judges_error = False  # the loop checks the augmented step's finiteness itself

    def check(self, stepper, dt0):
        self.controller.check(stepper, dt0)

    def init(self, f, t0, y0, f0, args, stepper, dt0):
        return self.controller.init(f, t0, y0, f0, args, stepper, dt0)

    def reject(self, t0, t1, dt, state):
        return self.controller.reject(t0, t1, dt, state)

    def valid(self):
        # The sensitivities' own tolerances may be traced: checked here, as the controller's.
        own = [all_positive_finite(x) for x in (self.rtol, self.atol) if x is not None]
        return functools.reduce(jnp.logical_and, own, jnp.asarray(self.controller.valid()))

    def adapt(
        self, t0, t1, dt, y0, y1, y_error, stepper, state, *, clipped, accept=None, dt_factor=None
    ):
        controller = self.controller
        if y_error is None or not isinstance(controller, AbstractAdaptiveController):
            return controller.adapt(
                t0, t1, dt, y0, y1, y_error, stepper, state, clipped=clipped, accept=accept,
                dt_factor=dt_factor,
            )  # fmt: skip
        # One tolerance for every component (the tightest of those given per leaf): the
        # sensitivities are not shaped like the state.
        rtol, atol = tightest(controller.rtol), tightest(controller.atol)
        state_tolerances = (rtol, atol)
        sens_tolerances = (
            rtol if self.rtol is None else self.rtol,
            atol if self.atol is None else self.atol,
        )

        def mean_squares(error, a, b, axis):
            """Per group: the mean over its components of `(error / weight)^2`."""
            rtol, atol = state_tolerances if axis == 0 else sens_tolerances
            # Held as the controller holds the stepper's own steps (`held_tolerances`).
            exponent, reference = stepper.tolerance_exponent, stepper.tolerance_reference
            rtol, atol = effective_tolerances(rtol, atol, exponent, real_dtype(a), reference)
            weight = atol + rtol * jnp.maximum(jnp.abs(a), jnp.abs(b))
            squares = jnp.abs(error / weight) ** 2
            return jnp.mean(squares.reshape(squares.shape[:axis] + (-1,)), axis=-1)

        def group(error, a, b, axis) -> jax.Array:
            # An empty leaf has no components: no mean (0/0), and no weight in the group's.
            leaves = [
                (mean_squares(e, x, z, axis), e[(0,) * axis].size)
                for e, x, z in zip(*map(jax.tree.leaves, (error, a, b)), strict=True)
                if e[(0,) * axis].size
            ]
            size = sum(n for _, n in leaves)
            # The terms are arrays (`sum` starts at the int 0).
            return cast(jax.Array, sum(m * n for m, n in leaves) / max(size, 1))

        state_ms = group(y_error.y, y0.y, y1.y, 0)
        sens_ms = group(y_error.s, y0.s, y1.s, 1)
        # NaN anywhere stays NaN (jnp.max propagates it).
        worst = jnp.sqrt(jnp.max(jnp.concatenate([state_ms[None], sens_ms])))
        worst = jax.lax.stop_gradient(worst.astype(t0.dtype))
        return controller.judge(
            t0, t1, dt, worst, stepper, state, clipped=clipped, accept=accept, dt_factor=dt_factor
        )
