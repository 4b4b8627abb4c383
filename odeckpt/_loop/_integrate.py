"""The integration loop, as a condition, a step and output buffers.

The loop is written once and run by whichever loop runner the adjoint chooses (a plain while loop,
a checkpointed one, ...). A step returns the new state and the rows it writes to the output
buffers (`Outputs`).

All times inside the loop are internal times `tau = direction * t`, so the loop always integrates
forwards: `f` is wrapped accordingly and step sizes are positive.
"""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._autodiff import cond
from .._checks import all_finite, leading_mask, with_nonfinite
from .._saveat import SaveAt
from .._status import Status
from .._steppers import AbstractStepper, Consistency, Step
from .._types import Args, IntScalar, Scalar, VectorField, Y
from ._controllers import AbstractController
from ._decision import checked_decision
from ._dense import derivative, polynomial
from ._events import Crossing, EventSet, EventState, restrict
from ._landing import after, before, lands, next_jump, next_stop, saves_in_step, saves_per_step
from ._outputs import Outputs, Rows, TimedRows, Writes
from ._progress import ProgressMeter
from ._state import LoopState, StepRecord, failure_status


class IntegrationLoop(eqx.Module):
    """The integration loop for one problem: `cond`, `step`, initial state and output buffers.

    **Fields:** the vector field `f` (in internal time) and its `args`, the `stepper` and the
    `controller`, the end of the span `t_end`, the distinct save times `ts` (or `None`), which
    outputs to keep (`saveat`), `max_steps`, an optional `progress` meter (which the runners
    drive: `milestone`, `report`), the number of steps
    when known before the solve (`num_steps`), and `throw`.
    """

    f: VectorField
    args: Args
    stepper: AbstractStepper
    controller: AbstractController
    t_end: Scalar
    ts: Float[Array, " n"] | None
    saveat: SaveAt
    max_steps: int = eqx.field(static=True)
    progress: ProgressMeter | None = None
    num_steps: int | None = eqx.field(default=None, static=True)
    """The number of steps, when known before the solve (constant steps over a concrete span):
    lets a checkpointing adjoint use the offline optimal schedule."""
    throw: bool = eqx.field(default=True, static=True)
    """Whether a failure raises (`solve(throw=...)`), in the backward pass too."""
    events: EventSet | None = None
    """The solve's events (`None`: none, and the loop is exactly the one without)."""
    jump_ts: Float[Array, " j"] | None = None
    """Known discontinuities (sorted internal times): steps land on them and restart."""
    jump_update: Callable | None = None
    """What a landing on one of `jump_ts` does to the state: `jump_update(tau, y, args) -> y`,
    `tau` the (internal) jump time (`None`: nothing; `ForwardSensitivity` jumps the
    sensitivities there)."""

    def cond(self, state: LoopState) -> Array:
        going = (state.t < self.t_end) & (state.status == Status.successful)
        if self.events is None:
            return going
        assert state.events is not None  # carried wherever the loop has events
        return going & (state.events.event < 0)

    def _running(self, state: LoopState) -> Array:
        """Whether the loop steps on from `state`: `cond` holds and steps remain."""
        return self.cond(state) & (state.num_steps < self.max_steps)

    def milestone(self, state: LoopState) -> IntScalar:
        """The whole percent of the span covered at `state` (`ProgressMeter.milestone`): a
        runner with a `progress` meter runs the steps in stretches until it reaches the one
        the last `report` returned, and `report`s after each."""
        assert self.progress is not None  # asked of a loop with a meter only
        return self.progress.milestone(state, self._running(state))

    def report(self, state: LoopState) -> IntScalar:
        """Tell the `progress` meter's bar where the solve is at `state`; **returns** the
        milestone at which to report next."""
        assert self.progress is not None  # asked of a loop with a meter only
        return self.progress.report(state, self._running(state))

    def final_status(self, state: LoopState) -> Status:
        """How a run that ended in `state` went: `max_steps_reached` if it stopped before
        `t_end` without failing (or a terminal event), else the state's status."""
        short = (state.status == Status.successful) & (state.t < self.t_end)
        if self.events is not None:
            assert state.events is not None  # carried wherever the loop has events
            short = short & (state.events.event < 0)
        return Status.where(short, Status.max_steps_reached, state.status)

    def step(
        self, state: LoopState, recorded: StepRecord | None = None
    ) -> tuple[LoopState, Writes, StepRecord]:
        """One attempted step: the new state, the output rows it writes, and the record of its
        discrete decisions. Given the `recorded` decisions of an earlier run of this step (the
        checkpointing engine's recomputation), the step follows them instead of deciding
        again, so that rounding differences between the two runs cannot send them down
        different branches."""
        t0 = state.t
        t1, clipped = self._step_end(state, None if recorded is None else recorded.clipped)
        step = self.stepper.step(self.f, t0, t1, state.y, self.args, state.stepper_state)
        # A NaN or inf in any stage shows in the new state, its derivative (the next step's
        # first stage) or the error estimate; folded into the error estimate, the controller's
        # norm of it checks all three.
        f1 = self.stepper.derivative(step.state)
        folded = self._folds_checks(step)
        y_error = with_nonfinite(step.y_error, step.y1, f1) if folded else step.y_error
        decision = self.controller.adapt(
            t0, t1, state.dt, state.y, step.y1, y_error, self.stepper,
            state.controller_state, clipped=clipped,
            accept=None if recorded is None else recorded.verdict == StepRecord.accepted,
            dt_factor=step.dt_factor,
        )  # fmt: skip
        decision = checked_decision(decision, self.controller, t0.dtype, state.controller_state)
        if recorded is None:
            finite = decision.finite if folded else decision.finite & all_finite((step.y1, f1))
            verdict = self._verdict(step, decision.accept, finite)
        else:
            verdict = recorded.verdict
        if step.failed is not None or step.nonfinite is not None or not folded:
            # A step that could not be completed (Newton did not converge, or something in it
            # is NaN or inf where the controller does not look) is rejected and retried
            # shorter, whatever its error estimate says. (Otherwise the controller has
            # rejected a non-finite step already.)
            incomplete = verdict >= StepRecord.newton_failed
            retry = self.controller.reject(t0, t1, state.dt, state.controller_state)
            retry = checked_decision(retry, self.controller, t0.dtype, state.controller_state)
            decision = jax.tree.map(lambda a, b: jnp.where(incomplete, a, b), retry, decision)
        accept = decision.accept
        next_dt = decision.next_dt if recorded is None else recorded.next_dt
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(accept, a, b), new, old)
        on_reject = state.stepper_state if step.state_on_reject is None else step.state_on_reject
        reached = Reached(jnp.where(clipped, self._stop(state), t1), step.y1, step.dense)
        crossing = None
        if self.events is not None:
            assert state.events is not None  # carried wherever the loop has events
            crossing = self.events.locate(
                t0, t1, state.y, step.y1, step.dense, self.args, state.events,
                None if recorded is None else recorded.event,
            )  # fmt: skip
            reached = reached.at_event(crossing, accept)
        t_rows = t1 if crossing is None else reached.t
        save_index, saves = self._save_rows(state, t1, t_rows, reached.y, step.dense, accept)
        fn_evals = step.num_fn_evals
        increments = LoopState.increments(
            save_index=save_index - state.save_index, num_steps=1, num_accepted=accept,
            num_rejected=~accept, num_jacobian_evals=step.num_jacobian_evals,
            num_lu_factorisations=step.num_lu_factorisations,
            num_fn_evals=self.stepper.fn_evals_per_step if fn_evals is None else fn_evals,
        )  # fmt: skip
        # A step size that is not positive (or NaN) from any controller would step backwards
        # or stall: the solve ends there, even after an accepted step.
        failed = (decision.underflow & ~accept) | ~(next_dt > 0)
        new = LoopState(
            t=jnp.where(accept, reached.t, t0),
            y=keep(reached.y, state.y),
            dt=next_dt,
            stepper_state=keep(step.state, on_reject),
            controller_state=decision.state,
            counts=state.counts + increments,
            status=Status.where(failed, failure_status(verdict), state.status),
            events=state.events,
        )
        if self.events is not None or self.jump_ts is not None:
            new = self._after_step(state, new, accept, crossing)
        fired = None if crossing is None else accept & crossing.found
        return (
            new,
            self._writes(state, accept, t_rows, reached, saves),
            StepRecord.make(verdict, clipped, next_dt, fired),
        )

    def _after_step(
        self, start: LoopState, new: LoopState, accept: Array, crossing: Crossing | None
    ) -> LoopState:
        """`new` after the step's event or known discontinuity: a terminal event ends the
        solve; an event's `update` jumps the state; a jump or a landing on one of `jump_ts`
        restarts the stepper (FSAL) and the controller there."""
        restart = jnp.zeros((), bool)
        landed = jump = None
        if self.jump_ts is not None:
            jump = next_jump(jnp, self.jump_ts, start.t, self.t_end)
            landed = accept & (new.t == before(jnp, jump))
            new = dataclasses.replace(new, t=jnp.where(landed, after(jnp, jump), new.t))
            restart = landed
        jumping = jnp.zeros((), bool)
        if crossing is not None:
            assert self.events is not None and start.events is not None  # a crossing of one
            outcome = self.events.outcome(start.events, crossing, accept)
            status = Status.where(outcome.too_many, Status.max_jumps_reached, new.status)
            status = Status.where(outcome.nonfinite, Status.nonfinite_event, status)
            new = dataclasses.replace(new, events=outcome.state, status=status)
            jumping = outcome.jumping
            restart = restart | jumping
        fresh = lambda new: self._restart(new, jumping, crossing, landed, jump)
        return cond(restart, fresh, lambda new: new, new)

    def _restart(
        self, new: LoopState, jumping: Array, crossing: Crossing | None, landed, jump
    ) -> LoopState:
        """`new` restarted at its point: after the event's jump if `jumping`, after
        `jump_update` if `landed` on the jump time `jump`, with a fresh stepper state (its FSAL
        stage evaluated there) and controller state."""
        y = new.y
        if self.jump_update is not None:
            jumped = self.jump_update(jump, y, self.args)
            y = jax.tree.map(lambda a, b: jnp.where(landed, a, b), jumped, y)
        if crossing is not None:
            assert self.events is not None  # a crossing of one of them
            jumped = self.events.update(crossing.index, new.t, y, self.args)
            y = jax.tree.map(lambda a, b: jnp.where(jumping, a, b), jumped, y)
        y, consistency = self.stepper.consistent(self.f, new.t, y, self.args)
        stepper_state = self.stepper.init(self.f, new.t, y, self.args)
        f0 = self.stepper.derivative(stepper_state)
        dt, controller_state, _ = self.controller.init(
            self.f, new.t, y, f0, self.args, self.stepper, new.dt
        )
        return dataclasses.replace(
            new, y=y, stepper_state=stepper_state, dt=dt, controller_state=controller_state,
            counts=new.counts + LoopState.increments(num_fn_evals=1) + _work(consistency),
            status=_unless_inconsistent(consistency, new.status),
        )  # fmt: skip

    def _folds_checks(self, step: Step) -> bool:
        """Whether the finiteness checks of a step ride on the controller's error norm."""
        return self.controller.judges_error and step.y_error is not None

    def _verdict(self, step: Step, accept: Array, finite: Array) -> Array:
        """The `StepRecord` verdict on an attempted step: `nonfinite` unless `finite` (its error
        estimate, its new state and the derivative there are finite) and the stepper's own
        solves met no NaN or inf."""
        if step.nonfinite is not None:
            finite = finite & ~step.nonfinite
        verdict = jnp.where(accept, StepRecord.accepted, StepRecord.rejected)
        if step.failed is not None:
            verdict = jnp.where(step.failed, StepRecord.newton_failed, verdict)
        return jnp.where(finite, verdict, StepRecord.nonfinite)

    def _writes(self, state: LoopState, accept, t1: Scalar, reached: "Reached", saves) -> Writes:
        """The rows a step writes: its save times, and its end `t1` and continuous extension
        (at the accepted step's number; a rejected step's go out of range)."""
        index = jnp.where(accept, state.num_accepted, self.max_steps)[None]
        one_row = lambda tree: jax.tree.map(lambda x: x[None], tree)
        steps = dense = None
        if self.saveat.steps:
            steps = Rows(index, one_row(TimedRows(t1, reached.y)))
        if self.saveat.dense:
            dense = Rows(index, one_row(TimedRows(t1, reached.dense)))
        return Writes(ts=saves, steps=steps, dense=dense)

    def _stop(self, state: LoopState) -> Scalar:
        """The next time a step must land on (see `_landing.next_stop`)."""
        stop = next_stop(jnp, self.ts, self.t_end, state.save_index, saves_per_step(self.stepper))
        if self.jump_ts is not None:
            stop = jnp.minimum(stop, before(jnp, next_jump(jnp, self.jump_ts, state.t, self.t_end)))
        return stop

    def _step_end(self, state: LoopState, clipped: Array | None) -> tuple[Scalar, Array]:
        """Where the step ends, and whether it was clipped to land on `_stop` (decided here
        unless `clipped` is given)."""
        stop = self._stop(state)
        t1 = state.t + state.dt
        if clipped is None:
            clipped = lands(jnp, state.t, t1, stop)
        return jnp.where(clipped, stop, t1), clipped

    def _save_rows(
        self, state: LoopState, t1: Scalar, t_reached: Scalar, y_reached: Y, dense: Y,
        accept: Array,
    ) -> tuple[IntScalar, Rows | None]:  # fmt: skip
        """The save times this step interpolates, as rows, and the save index after them: those
        up to `t_reached` (`t1`, or an event's time), interpolated on `dense` (over the step to
        `t1`), with `y_reached` at `t_reached` itself. (`_stop` makes the step end at or before
        the last save time the rows can hold.)"""
        if self.ts is None:
            return state.save_index, None
        rows = min(self.ts.shape[0], saves_per_step(self.stepper))
        index, valid = saves_in_step(jnp, self.ts, state.save_index, t_reached, rows)
        valid = accept & valid
        t_save = self.ts[jnp.minimum(index, self.ts.shape[0] - 1)]
        # A zero-length step (a lane that finished, stepped in lockstep under vmap) must not
        # make 0/0, nor a row of `ts` that is not finite (a repeated save time) inf * 0: their
        # NaN would leak into gradients through the masking.
        h = t1 - state.t
        moved = jnp.where(jnp.isfinite(t_save), t_save, state.t) - state.t
        theta = moved / jnp.where(h > 0, h, 1)
        # A save time that is the point reached takes its value, bit for bit, and its own
        # derivative in time, the slope of the extension there (the point reached depends on
        # another time: the end of the span, the step's stop, an event's time).
        at_reached = t_save == t_reached
        offset = jnp.where(at_reached, t_save, t_reached) - t_reached
        slope = _slope(dense, (t_reached - state.t) / jnp.where(h > 0, h, 1), h)

        def saved(c, y, s):
            interpolated = polynomial(c, theta)
            exact = y[None] + leading_mask(offset, interpolated) * s[None]
            return jnp.where(leading_mask(at_reached, interpolated), exact, interpolated)

        values = jax.tree.map(saved, dense, y_reached, slope)
        index = jnp.where(valid, index, self.ts.shape[0])
        return state.save_index + jnp.sum(valid, dtype=jnp.int32), Rows(index, values)

    def init_state(self, t0: Scalar, y0: Y, dt0: Scalar | None) -> tuple[LoopState, int]:
        """The initial loop state, and the vector-field evaluations spent making it. A solve
        that starts from a non-finite `y0` or `f(t0, y0, args)`, or with invalid (traced)
        controller settings, fails before its first step."""
        y0, consistency = self.stepper.consistent(self.f, t0, y0, self.args)
        stepper_state = self.stepper.init(self.f, t0, y0, self.args)
        f0 = self.stepper.derivative(stepper_state)
        dt, controller_state, evals = self.controller.init(
            self.f, t0, y0, f0, self.args, self.stepper, dt0
        )
        # Save times at t0 are written by `init_outputs`, not by a step.
        saved = 0 if self.ts is None else jnp.sum(self.ts <= t0, dtype=jnp.int32)
        status = _unless_inconsistent(consistency, Status.successful)
        status = Status.where(all_finite(f0), status, Status.nonfinite_f0)
        status = Status.where(self.controller.valid(), status, Status.invalid_settings)
        state = LoopState(
            t=t0,
            y=y0,
            dt=jnp.minimum(dt, self.t_end - t0),
            stepper_state=stepper_state,
            controller_state=controller_state,
            counts=LoopState.increments(save_index=saved) + _work(consistency),
            status=Status.where(all_finite(y0), status, Status.nonfinite_y0),
            events=None if self.events is None else EventState.make(len(self.events), t0.dtype),
        )
        return state, 1 + evals

    def init_outputs(self, init: LoopState) -> Outputs:
        """Output buffers, filled with `inf`. Save times at the initial time `init.t` are filled
        with `y0` (so a zero-length solve still returns them), with the derivatives in those
        times and in `t0` of the exact solution there; row 0 of the dense output starts as the
        constant `y0`, which a solve that takes no step returns."""
        t0, y0, n = init.t, init.y, self.max_steps
        ts = steps = dense = None
        if self.ts is not None:
            f0 = self.stepper.slope(self.f, t0, y0, self.args, init.stepper_state)
            at_t0 = self.ts <= t0
            rows = _start_rows(self.ts, t0, y0, f0)
            ts = jax.tree.map(lambda r: jnp.where(leading_mask(at_t0, r), r, jnp.inf), rows)
        if self.saveat.steps:
            steps = TimedRows(_filled(n, t0), jax.tree.map(lambda y: _filled(n, y), y0))
        if self.saveat.dense:
            state = self.stepper.init(self.f, t0, y0, self.args)
            shapes = jax.eval_shape(
                lambda: self.stepper.step(self.f, t0, t0, y0, self.args, state).dense
            )
            coeffs = lambda c, y: jnp.zeros((n, *c.shape), c.dtype).at[0, 0].set(y)
            dense = TimedRows(_filled(n, t0), jax.tree.map(coeffs, shapes, y0))
        return Outputs(ts, steps, dense)


class Reached(eqx.Module):
    """Where an accepted step ends: its end time `t` and state `y` (the step's own, or an
    event's), and the continuous extension over the part of the step up to `t`."""

    t: Scalar
    y: Y
    dense: Y

    def at_event(self, crossing: Crossing, accept: Array) -> "Reached":
        """Ended at `crossing` instead, if it is found and the step `accept`ed."""
        fired = accept & crossing.found
        pick = lambda a, b: jax.tree.map(lambda x, z: jnp.where(fired, x, z), a, b)
        dense = pick(restrict(self.dense, crossing.theta), self.dense)
        return Reached(jnp.where(fired, crossing.t, self.t), pick(crossing.y, self.y), dense)


def _start_rows(ts: Array, t0: Scalar, y0: Y, f0: Y) -> Y:
    """`y0` once per save time, plus `(ts - t0) * f0` whose value is zero: its derivatives in
    `ts` and `t0` are those of the exact solution at `ts = t0`. (Rows of `ts` that are not
    finite, the repeats of a save time, move nothing: `inf - inf` would make their derivatives
    NaN, and NaN times the zero cotangent of an overwritten row is NaN.)"""
    moved = jnp.where(jnp.isfinite(ts), ts, t0) - t0
    moved = moved - jax.lax.stop_gradient(moved)

    def rows(y, f):
        f = jnp.where(jnp.isfinite(f), f, 0)  # a non-finite f0 has failed the solve already
        ys = jnp.broadcast_to(y, moved.shape + y.shape)
        return ys + leading_mask(moved.astype(y.dtype), ys) * f[None]

    return jax.tree.map(rows, y0, f0)


def _work(consistency: Consistency | None) -> Array | int:
    """The counters' increments for making a DAE's values consistent (0: an ODE)."""
    if consistency is None:
        return 0
    n = consistency.num_iterations
    return LoopState.increments(num_fn_evals=n, num_jacobian_evals=n)


def _unless_inconsistent(consistency: Consistency | None, status: Status) -> Status:
    """`status`, or the failure to make a DAE's values consistent (`None`: an ODE)."""
    if consistency is None:
        return status
    status = Status.where(consistency.inconsistent, Status.inconsistent_initial_values, status)
    return Status.where(consistency.singular, Status.dae_index, status)


def _slope(dense: Y, theta: Scalar, h: Scalar) -> Y:
    """The time derivative of the continuous extension `dense` of a step of length `h` at
    normalised time `theta`."""
    return jax.tree.map(
        lambda c: derivative(c, theta) / jnp.where(h > 0, h, 1).astype(c.dtype), dense
    )


def _filled(n: int, like: Array) -> Array:
    """`n` rows shaped like `like`, all `inf`."""
    return jnp.full((n, *jnp.shape(like)), jnp.inf, dtype=jnp.result_type(like))


def vector_field_in_internal_time(f: VectorField, direction: Scalar | float) -> VectorField:
    """`f` as a function of internal time `tau = direction * t`."""
    if isinstance(direction, float | int) and direction == 1:
        return f

    def f_internal(tau, y, args):
        dy = f(direction * tau, y, args)
        return jax.tree.map(lambda d: (direction * d).astype(d.dtype), dy)

    return f_internal
