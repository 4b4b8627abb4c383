"""The solve of the state with its forward sensitivities along given directions, and the
tangents of the solve's outputs it gives."""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._autodiff import stack
from ..._error_norm import scaled_distance
from ..._loop import AbstractAdaptiveController, EventState, IntegrationLoop, LoopState
from ..._status import Status
from ..._types import Y
from .._base import while_loop
from .._custom_rule import RuleInputs
from ._events import crossing_tangents, sensitivity_events, sensitivity_jumps
from ._stepper import (
    Augmented,
    MaxNormController,
    SensitivityArgs,
    SensitivityStepper,
    differentiable_part,
)

SENSITIVITY_FAILED = (
    "ForwardSensitivity: the solve of the sensitivities failed (max_steps reached, step size "
    "underflow, a non-finite sensitivity, or traced `ForwardSensitivity(rtol=..., atol=...)` "
    "that are not positive and finite), although the solve of the state succeeded. The "
    "sensitivities' error control may need more steps than the state's. Fix: raise "
    "`max_steps`, loosen `rtol`/`atol` (positive, finite), or use adjoint='recursive' (the "
    "derivative of the discrete solve, without error control)."
)

EVENTS_DIFFER = (
    "ForwardSensitivity: the solve of the sensitivities met other events than the solve of the "
    "state (its steps, chosen for the sensitivities too, saw a crossing the state's steps did "
    "not, or missed one, or met it elsewhere: a short dip of an event function, or a crossing "
    "near a tangency), and ended on another trajectory. Its derivative would be that "
    "trajectory's. Fix: tighten `rtol`/`atol` so that both solves resolve the event function, "
    "or use adjoint='recursive' (the derivative of the discrete solve, whose events are the "
    "state's)."
)

MAX_TRAJECTORY_DIFFERENCE = 1000.0
"""With events, how far (in the root mean square of `(y - y') / (atol + rtol |y|)`) the final
states of the solve of the state and of the solve of its sensitivities may lie apart: both are
solutions to the tolerances, while one that met another crossing lies far from the other."""


class Integrated(eqx.Module):
    """The inputs whose tangents the sensitivity equations carry: the initial state, the
    parameters (inexact arrays of the vector field and of `args`), the initial time and the
    known discontinuities `jump_ts` (`None`: none, or not differentiated). (The final time and
    the save times enter the outputs' tangents through `f` at those times.)"""

    y0: object
    diff: object
    t0: object
    jump_ts: jax.Array | None = None


class Sensitivities(eqx.Module):
    """The tangents of a solve along one or more directions (leading axis), unscaled: at the
    end of the span and at the save times (`None` without them), of the final (internal) time
    when a terminal event ended the solve (`t_end`, zero otherwise), whether the solve of the
    sensitivities succeeded, and (with events) the events it met and the state it ended in."""

    end: object
    rows: object
    t_end: jax.Array
    succeeded: jax.Array
    events: EventState | None
    state_end: Y


def integrated(inputs: RuleInputs) -> Integrated:
    """The integrated part of `inputs` (or of their tangent)."""
    diff, _ = differentiable_part(inputs.loop.f, inputs.loop.args)
    return Integrated(inputs.init.y, diff, inputs.init.t, inputs.jump_ts)


def _scale(theta: Integrated, span, direction: Integrated):
    """CVODES' parameter scaling of one direction: the largest `|d_j| / pbar_j` with `pbar_j =
    |theta_j|` (1 where `theta_j = 0`; the span for the initial time and the jump times), or
    1 for a direction with no integrated part. The scaled sensitivity `s / scale` is then held
    to the state's tolerances."""
    pbar = lambda x: jnp.where(x == 0, 1, jnp.abs(x))
    spans = None if theta.jump_ts is None else jnp.full_like(theta.jump_ts, span)
    theta = dataclasses.replace(theta, t0=span, jump_ts=spans)
    ratios = jax.tree.map(lambda d, x: jnp.max(jnp.abs(d) / pbar(x), initial=0), direction, theta)
    scale = jnp.max(stack([r.astype(span.dtype) for r in jax.tree.leaves(ratios)]))
    return jnp.where(scale > 0, scale, 1).astype(span.dtype)


def sensitivities(inputs: RuleInputs, directions: Integrated) -> Sensitivities:
    """Solve the state with its sensitivities along `directions` (each leaf with a leading axis
    of directions), under one error control (`MaxNormController`), the sensitivities held to
    the tolerances `inputs.settings` (`(rtol, atol)`, `None` for the state's)."""
    loop, init = inputs.full_loop, inputs.init
    theta = integrated(inputs)
    span = loop.t_end - init.t
    scales = jax.vmap(lambda d: _scale(theta, span, d))(directions)
    f0 = loop.stepper.slope(loop.f, init.t, init.y, loop.args, init.stepper_state)
    consistent = _consistent_tangent(loop, init.t, init.y)

    def start(d, scale):
        s0 = jax.tree.map(lambda dy, f: dy - f * d.t0.astype(f.dtype), d.y0, f0)
        s0 = jax.tree.map(lambda s: (s / scale).astype(s.dtype), consistent(s0, d.diff))
        jumps = None if d.jump_ts is None else d.jump_ts / scale
        return s0, jax.tree.map(lambda x: x / scale.astype(x.dtype), d.diff), jumps

    s0, dtheta, djumps = jax.vmap(start)(directions, scales)
    aug = sensitivity_loop(loop, dtheta, *inputs.settings, jump_directions=djumps)
    aug_init, _ = aug.init_state(init.t, Augmented(init.y, s0), init.dt)
    final, outputs, _ = while_loop(aug, aug_init, aug.init_outputs(aug_init))
    end, t_end = final.y.s, jnp.zeros(scales.shape, final.t.dtype)
    if loop.events is not None:
        end, t_end = _at_terminal_event(loop, final, dtheta)
    unscale = lambda s, axis: jax.tree.map(
        lambda x: (
            x * scales.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1)).astype(x.dtype)
        ),
        s,
    )
    rows = None if outputs.ts is None else unscale(outputs.ts.s, 1)
    succeeded = aug.final_status(final) == Status.successful
    return Sensitivities(
        unscale(end, 0), rows, unscale(t_end, 0), succeeded, final.events, final.y.y
    )


def sensitivity_loop(
    loop, directions: Y, rtol: float | None, atol: float | None, jump_directions=None
):
    """`loop` advancing the state with the sensitivities along `directions` (the parameters'
    tangents, one per direction on a leading axis), these held to `rtol` and `atol` (`None`:
    the state's); at its known discontinuities the sensitivities jump as their times move
    along `jump_directions` (the tangents of `loop.jump_ts`, one row per direction)."""
    events = None if loop.events is None else sensitivity_events(loop.events, loop.f)
    jumps = None if loop.jump_ts is None else sensitivity_jumps(loop.f, loop.jump_ts)
    return dataclasses.replace(
        loop,
        args=SensitivityArgs(loop.args, directions, jump_directions),
        stepper=SensitivityStepper(loop.stepper),
        controller=MaxNormController(loop.controller, rtol, atol),
        progress=None,
        events=events,
        jump_update=jumps,
    )


def _consistent_tangent(loop: IntegrationLoop, t0, y0) -> Callable:
    """`(s, dp) -> s'`: the initial sensitivity `s` (along the parameters' tangent `dp`) made
    consistent with the differentiated algebraic equations of a DAE, `Q^T (J s' + f_p dp) = 0`,
    by moving its algebraic part (the tangent of the stepper's consistent initial values, whose
    map fixes consistent ones); for an ODE, `s` itself. Directions of the initial state alone
    (a reverse sweep's unit vectors) need not be consistent: the derivative of the consistent
    values in the user's `y0` projects them so, and this is that projection."""
    if not loop.stepper.has_mass_matrix:
        return lambda s, dp: s
    diff, static = differentiable_part(loop.f, loop.args)

    def made(y, diff):
        f, args = eqx.combine(diff, static)
        return loop.stepper.consistent(f, t0, y, args)[0]

    return lambda s, dp: jax.jvp(made, (y0, diff), (s, dp))[1]


def _at_terminal_event(loop: IntegrationLoop, final: LoopState, directions: Y):
    """The (scaled) sensitivities at the end of the solve and the tangents of its final time:
    where a terminal event ended it, those of the crossing, which moves with the parameters."""
    events = loop.events
    assert events is not None and final.events is not None  # asked only with events
    fired = final.events.event >= 0
    index = jnp.maximum(final.events.event, 0)
    g = lambda tau, y, args: events.values(tau, y, args)[index]
    args = SensitivityArgs(loop.args, directions)
    rate = loop.stepper.slope(loop.f, final.t, final.y.y, loop.args)
    at = crossing_tangents(g, loop.f, final.t, final.y.y, args, final.y.s, rate)
    pick = lambda a, b: jnp.where(fired, a, b)
    return jax.tree.map(pick, at.y, final.y.s), pick(at.tau, jnp.zeros_like(at.tau))


def sensitivity_checks(loop: IntegrationLoop, primal: LoopState, sens: Sensitivities) -> list:
    """The checks (`_custom_rule.checked`) of a sensitivity solve after the solve of the state
    (`primal`, its final state): that it met the same events (first: a sensitivity solve may
    fail because of other events, at `max_jumps`), and that it succeeded."""
    same_events = jnp.array(True)
    if sens.events is not None:
        assert primal.events is not None  # the sensitivities meet the state's events
        same_events = (sens.events.event == primal.events.event) & jnp.all(
            sens.events.num_jumps == primal.events.num_jumps
        )
        same_events = same_events & _near(loop.controller, primal.y, sens.state_end)
    return [(same_events, EVENTS_DIFFER), (sens.succeeded, SENSITIVITY_FAILED)]


def _near(controller, y: Y, other: Y) -> jax.Array:
    """Whether `other` lies within `MAX_TRAJECTORY_DIFFERENCE` of `y` in the tolerances of
    `controller` (always, for constant steps: both solves then take the same steps, and the
    same crossings)."""
    if not isinstance(controller, AbstractAdaptiveController):
        return jnp.array(True)
    distance = scaled_distance(y, other, controller.rtol, controller.atol)
    return distance <= MAX_TRAJECTORY_DIFFERENCE
