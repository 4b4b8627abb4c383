"""The integration loop, as a condition, a body and output buffers.

The loop is written once and run by whichever loop runner the adjoint chooses (a plain while loop,
a checkpointed one, ...). The body returns the new state and the rows it writes to the output
buffers; buffers are never part of the loop state, so a checkpointing runner never copies them.

All times inside the loop are internal times `tau = direction * t`, so the loop always integrates
forwards: `f` is wrapped accordingly and step sizes are positive.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._controllers import AbstractController, Decision, all_finite
from ._progress import ProgressMeter
from ._saveat import SaveAt
from ._status import Status
from ._steppers._base import AbstractStepper, Step
from ._types import Args, IntScalar, Scalar, VectorField, Y

MAX_SAVES_PER_STEP = 16
"""Distinct save times interpolated per step at most; a step is shortened to hit the last of
them."""


def saves_per_step(stepper: AbstractStepper) -> int:
    """How many save times one step may interpolate. A stepper whose continuous extension is
    less accurate than its steps (e.g. Dopri8 with a cubic Hermite) lands on every save time."""
    return MAX_SAVES_PER_STEP if stepper.dense_degree >= stepper.order - 1 else 1


Writes = tuple[tuple[Array, Y], ...]
"""One `(index, values)` pair per output buffer group; rows with an out-of-range index are
dropped."""


def _count(i: int, doc: str) -> property:
    return property(lambda state: state.counts[i], doc=doc)


class LoopState(eqx.Module):
    """What the loop carries from step to step (and all that a checkpoint must hold)."""

    t: Scalar
    y: Y
    dt: Scalar
    stepper_state: Y
    controller_state: Y
    counts: Int[Array, "7"]
    """The integer bookkeeping, read through the properties below: one vector, which XLA
    updates with one kernel per step instead of one per counter (on XLA:CPU every small kernel
    is launched at every step, and compiled separately)."""
    status: Status

    save_index = _count(0, "How many save times have been written.")
    num_steps = _count(1, "Steps attempted.")
    num_accepted = _count(2, "Steps accepted.")
    num_rejected = _count(3, "Steps rejected.")
    num_jacobian_evals = _count(4, "Jacobian evaluations of an implicit stepper.")
    num_lu_factorisations = _count(5, "LU factorisations of an implicit stepper.")
    num_fn_evals = _count(6, "Vector-field evaluations in the steps.")


class StepRecord(eqx.Module):
    """The discrete decisions of one attempted step (see `Loop.step`). The checkpointing
    engine keeps `max_steps` of them, so the verdict and the clipping share one byte: bits 0-1
    the verdict, bit 2 `clipped`."""

    rejected: ClassVar[int] = 0
    accepted: ClassVar[int] = 1
    newton_failed: ClassVar[int] = 2
    nonfinite: ClassVar[int] = 3

    code: Array
    """`uint8`: `verdict + 4 * clipped`."""
    next_dt: Scalar
    """The step size proposed for the next step. Step sizes are not differentiated, and an
    error estimate at its rounding-noise floor (Rodas5 at tight tolerances) can propose
    visibly different ones when the recomputation rounds differently."""

    @classmethod
    def make(cls, verdict: Array, clipped: Array, next_dt: Scalar):
        return cls(verdict.astype(jnp.uint8) + 4 * clipped.astype(jnp.uint8), next_dt)

    @property
    def verdict(self) -> Array:
        """`accepted`, `rejected` (error too large), `newton_failed` (an implicit stage did not
        converge) or `nonfinite` (a stage, the error estimate or the new state is NaN or
        inf)."""
        return self.code & 3

    @property
    def clipped(self) -> Array:
        """Whether the step was shortened to land on the end of the span or a save time."""
        return (self.code & 4) != 0


class Loop(eqx.Module):
    """The integration loop for one problem: `cond`, `body`, initial state and output buffers."""

    f: VectorField
    args: Args
    stepper: AbstractStepper
    controller: AbstractController
    t_end: Scalar
    ts: Float[Array, " n"] | None
    saveat: SaveAt
    max_steps: int = eqx.field(static=True)
    progress: ProgressMeter | None
    num_steps: int | None = eqx.field(default=None, static=True)
    """The number of steps, when known before the solve (constant steps over a concrete span):
    lets a checkpointing adjoint use the offline optimal schedule."""
    throw: bool = eqx.field(default=True, static=True)
    """Whether a failure raises (`solve(throw=...)`), in the backward pass too."""

    def cond(self, state: LoopState) -> Array:
        return (state.t < self.t_end) & (state.status == Status.successful)

    def final_status(self, state: LoopState) -> Status:
        """How a run that ended in `state` went: `max_steps_reached` if it stopped before
        `t_end` without failing, else the state's status."""
        short = (state.status == Status.successful) & (state.t < self.t_end)
        return Status.where(short, Status.max_steps_reached, state.status)

    def body(self, state: LoopState) -> tuple[LoopState, Writes]:
        new, writes, _ = self.step(state)
        return new, writes

    def step(
        self, state: LoopState, recorded: "StepRecord | None" = None
    ) -> tuple[LoopState, Writes, "StepRecord"]:
        """One attempted step: the new state, the output rows it writes, and the record of its
        discrete decisions. Given the `recorded` decisions of an earlier run of this step (the
        checkpointing engine's recomputation), the step follows them instead of deciding
        again, so that rounding differences between the two runs cannot send them down
        different branches."""
        t0 = state.t
        t1, clipped = self._step_end(state, None if recorded is None else recorded.clipped)
        step = self.stepper.step(self.f, t0, t1, state.y, self.args, state.stepper_state)
        decision = self.controller.adapt(
            t0, t1, state.dt, state.y, step.y1, step.y_error, self.stepper,
            state.controller_state, clipped=clipped,
            accept=None if recorded is None else recorded.verdict == StepRecord.accepted,
            dt_factor=step.dt_factor,
        )  # fmt: skip
        verdict = self._verdict(step, decision) if recorded is None else recorded.verdict
        # A step that could not be completed (Newton did not converge, or something in it is
        # NaN or inf) is rejected and retried shorter, whatever its error estimate says.
        incomplete = verdict >= StepRecord.newton_failed
        retry = self.controller.reject(t0, t1, state.dt, state.controller_state)
        decision = jax.tree.map(lambda a, b: jnp.where(incomplete, a, b), retry, decision)
        accept = decision.accept
        next_dt = decision.next_dt if recorded is None else recorded.next_dt
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(accept, a, b), new, old)
        status = Status.where(decision.underflow & ~accept, _failure(verdict), state.status)
        on_reject = state.stepper_state if step.state_on_reject is None else step.state_on_reject
        save_index, save_writes = self._save_writes(state, t1, step.y1, step.dense, accept)
        fn_evals = step.num_fn_evals
        fn_evals = self.stepper.fn_evals_per_step if fn_evals is None else fn_evals
        num_saved = save_index - state.save_index
        increments = _stack_counts(
            num_saved, 1, accept, ~accept, step.num_jacobian_evals,
            step.num_lu_factorisations, fn_evals,
        )  # fmt: skip
        new = LoopState(
            t=jnp.where(accept, jnp.where(clipped, self._stop(state), t1), t0),
            y=keep(step.y1, state.y),
            dt=next_dt,
            stepper_state=keep(step.state, on_reject),
            controller_state=decision.state,
            counts=state.counts + increments,
            status=status,
        )
        if self.progress is not None:
            new = self.progress.update(new, new.t)
        step_index = jnp.where(accept, state.num_accepted, self.max_steps)[None]
        one_row = lambda tree: jax.tree.map(lambda x: x[None], tree)
        writes = save_writes
        if self.saveat.steps:
            writes += ((step_index, one_row((t1, step.y1))),)
        if self.saveat.dense:
            writes += ((step_index, one_row((t1, step.dense))),)
        return new, writes, StepRecord.make(verdict, clipped, next_dt)

    def _verdict(self, step: Step, decision: Decision) -> Array:
        """The `StepRecord` verdict on an attempted step: `nonfinite` if its error estimate, its
        new state or the derivative there (`f(t1, y1)`, the next step's first stage) is NaN or
        inf, which a NaN or inf in any stage makes them."""
        finite = decision.finite & all_finite((step.y1, self.stepper.derivative(step.state)))
        if step.nonfinite is not None:
            finite = finite & ~step.nonfinite
        verdict = jnp.where(decision.accept, StepRecord.accepted, StepRecord.rejected)
        if step.failed is not None:
            verdict = jnp.where(step.failed, StepRecord.newton_failed, verdict)
        return jnp.where(finite, verdict, StepRecord.nonfinite)

    def _stop(self, state: LoopState) -> Scalar:
        """The next time a step must land on: the end of the span, or the last save time that
        one step may interpolate."""
        per_step = saves_per_step(self.stepper)
        if self.ts is None or self.ts.shape[0] <= per_step:
            return self.t_end
        last = state.save_index + per_step - 1
        save_stop = self.ts[jnp.minimum(last, self.ts.shape[0] - 1)]
        return jnp.where(last < self.ts.shape[0], jnp.minimum(save_stop, self.t_end), self.t_end)

    def _step_end(self, state: LoopState, clipped: Array | None) -> tuple[Scalar, Array]:
        """Where the step ends, and whether it was clipped to land on `_stop` (decided here
        unless `clipped` is given)."""
        stop = self._stop(state)
        t1 = state.t + state.dt
        if clipped is None:
            # Land exactly on `stop` when within rounding of it, so no sliver step is left.
            slack = 100 * jnp.finfo(t1.dtype).eps * jnp.maximum(jnp.abs(stop), jnp.abs(state.t))
            clipped = t1 >= stop - slack
        return jnp.where(clipped, stop, t1), clipped

    def _save_writes(
        self, state: LoopState, t1: Scalar, y1: Y, dense: Y, accept: Array
    ) -> tuple[IntScalar, Writes]:
        """The save times this step interpolates, as rows. (`_stop` makes the step end at or
        before the last save time that the rows can hold, and save times are distinct, see
        `distinct_save_times`.)"""
        if self.ts is None:
            return state.save_index, ()
        num_ts = self.ts.shape[0]
        k = min(num_ts, saves_per_step(self.stepper))
        index = state.save_index + jnp.arange(k)
        t_save = self.ts[jnp.minimum(index, num_ts - 1)]
        valid = accept & (index < num_ts) & (t_save <= t1)
        # A zero-length step (a lane that finished, stepped in lockstep under vmap) must not
        # make 0/0, whose NaN would leak into gradients through the masking.
        h = t1 - state.t
        theta = (t_save - state.t) / jnp.where(h > 0, h, 1)
        values = jax.tree.map(
            lambda c, y: jnp.where(_rows(t_save == t1, y), y, _horner(c, theta)), dense, y1
        )
        index = jnp.where(valid, index, num_ts)
        return state.save_index + jnp.sum(valid, dtype=jnp.int32), ((index, values),)

    def init_state(self, t0: Scalar, y0: Y, dt0: Scalar | None) -> tuple[LoopState, int]:
        """The initial loop state, and the vector-field evaluations spent making it. A solve
        that starts from a non-finite `y0` or `f(t0, y0, args)` fails before its first step."""
        stepper_state = self.stepper.init(self.f, t0, y0, self.args)
        f0 = self.stepper.derivative(stepper_state)
        dt, controller_state, evals = self.controller.init(
            self.f, t0, y0, f0, self.args, self.stepper, dt0
        )
        counts = jnp.zeros((7,), jnp.int32)
        if self.ts is not None:
            # Save times at t0 are written by `init_outputs`, not by a step.
            counts = counts.at[0].set(jnp.sum(self.ts <= t0, dtype=jnp.int32))
        status = Status.where(all_finite(f0), Status.successful, Status.nonfinite_f0)
        state = LoopState(
            t=t0,
            y=y0,
            dt=jnp.minimum(dt, self.t_end - t0),
            stepper_state=stepper_state,
            controller_state=controller_state,
            counts=counts,
            status=Status.where(all_finite(y0), status, Status.nonfinite_y0),
        )
        return state, 1 + evals

    def init_outputs(self, init: LoopState) -> tuple[Y, ...]:
        """Output buffers, one group per kind of write, filled with `inf`. Save times at the
        initial time `init.t` are filled with `y0` (so a zero-length solve still returns them),
        with the derivatives in those times and in `t0` of the exact solution there."""
        t0, y0 = init.t, init.y
        outputs = ()
        if self.ts is not None:
            f0 = self.stepper.derivative(init.stepper_state)
            at_t0 = self.ts <= t0
            rows = _start_rows(self.ts, t0, y0, f0)
            outputs += (jax.tree.map(lambda r: jnp.where(_rows(at_t0, r[0]), r, jnp.inf), rows),)
        if self.saveat.steps:
            n = self.max_steps
            outputs += ((_filled(n, t0), jax.tree.map(lambda y: _filled(n, y), y0)),)
        if self.saveat.dense:
            init = lambda: self.stepper.init(self.f, t0, y0, self.args)
            coeffs = jax.eval_shape(
                lambda: self.stepper.step(self.f, t0, t0, y0, self.args, init()).dense
            )
            # Row 0 starts as the constant `y0`, which a solve that takes no step returns.
            rows = lambda c, y: jnp.zeros((self.max_steps, *c.shape), c.dtype).at[0, 0].set(y)
            outputs += ((_filled(self.max_steps, t0), jax.tree.map(rows, coeffs, y0)),)
        return outputs


def _start_rows(ts: Array, t0: Scalar, y0: Y, f0: Y) -> Y:
    """`y0` once per save time, plus `(ts - t0) * f0` whose value is zero: its derivatives in
    `ts` and `t0` are those of the exact solution at `ts = t0`."""
    moved = ts - t0
    moved = moved - jax.lax.stop_gradient(moved)

    def rows(y, f):
        f = jnp.where(jnp.isfinite(f), f, 0)  # a non-finite f0 has failed the solve already
        return y[None] + _rows(moved.astype(y.dtype), y) * f[None]

    return jax.tree.map(rows, y0, f0)


def _failure(verdict: Array) -> Status:
    """How the solve ends when a step with this `StepRecord` verdict cannot be shortened."""
    status = Status.where(verdict == StepRecord.nonfinite, Status.nonfinite, Status.dt_underflow)
    return Status.where(verdict == StepRecord.newton_failed, Status.newton_failed, status)


def _stack_counts(*increments) -> Int[Array, "7"]:
    """The increments of `LoopState.counts`, in the order of its properties."""
    return jnp.stack([jnp.asarray(x).astype(jnp.int32) for x in increments])


def _horner(coeffs: Array, theta: Array) -> Array:
    """Evaluate the polynomial with coefficients `coeffs[j]` (lowest first) at each `theta`:
    rows of shape `coeffs.shape[1:]`, one per entry of the 1-D `theta`."""
    theta = _rows(theta.astype(coeffs.dtype), coeffs[0])
    value = jnp.broadcast_to(coeffs[-1][None], theta.shape[:1] + coeffs.shape[1:])
    for c in coeffs[-2::-1]:
        value = value * theta + c[None]
    return value


def _rows(mask: Array, y: Array) -> Array:
    """`mask` reshaped to broadcast against rows of shape `y.shape`."""
    return mask.reshape(mask.shape + (1,) * y.ndim)


def _filled(n: int, like: Array) -> Array:
    """`n` rows shaped like `like`, all `inf`."""
    return jnp.full((n, *jnp.shape(like)), jnp.inf, dtype=jnp.result_type(like))


def apply_writes(outputs: tuple[Y, ...], writes: Writes) -> tuple[Y, ...]:
    """Scatter each group's rows into its buffers, dropping out-of-range rows."""

    def scatter(group: Y, index: Array, values: Y) -> Y:
        return jax.tree.map(
            lambda buffer, rows: buffer.at[index].set(rows, mode="drop"), group, values
        )

    return tuple(
        scatter(group, index, values)
        for group, (index, values) in zip(outputs, writes, strict=True)
    )


def constant_step_count(
    t0: float, t1: float, dt0: float, ts: np.ndarray | None, per_step: int, dtype, max_steps: int
) -> int | None:
    """The steps a constant-step solve from `t0` to `t1` takes, replaying the arithmetic of
    `Loop._stop` and `Loop._step_end` in `dtype`; `None` past `max_steps`."""
    direction = 1 if t1 >= t0 else -1
    tau, end, dt = (np.asarray(x, dtype) for x in (direction * t0, direction * t1, abs(dt0)))
    saves = None
    if ts is not None:  # as `DistinctSaveTimes`: each value once, the repeats as inf at the end
        distinct = np.unique(np.asarray(direction * np.asarray(ts), dtype))
        saves = np.full(len(ts), np.inf, dtype)
        saves[: len(distinct)] = distinct
    eps = np.finfo(dtype).eps
    save_index = 0 if saves is None else int(np.sum(saves <= tau))
    for count in range(max_steps + 1):
        if not tau < end:
            return count
        stop = end
        if saves is not None and saves.shape[0] > per_step:
            last = save_index + per_step - 1
            if last < saves.shape[0]:
                stop = min(saves[last], end)
        step_end = tau + dt
        slack = 100 * eps * max(abs(stop), abs(tau))
        tau = stop if step_end >= stop - slack else step_end
        if saves is not None:
            save_index += int(np.sum(saves[save_index : save_index + per_step] <= tau))
    return None


class DistinctSaveTimes(eqx.Module):
    """Save times with each value once, as the loop takes them: `ts` sorted, the repeats of a
    value replaced by `inf` at the end (never reached), and `rows[i]`, the row of `ts` that
    holds the `i`-th save time of the original array."""

    ts: Float[Array, " n"]
    rows: Int[Array, " n"]

    @classmethod
    def make(cls, ts: Float[Array, " n"]) -> "DistinctSaveTimes":
        """From sorted save times `ts` (internal times: increasing)."""
        n = ts.shape[0]
        first = jnp.searchsorted(ts, ts, side="left") == jnp.arange(n)
        rows = (jnp.cumsum(first) - 1).astype(jnp.int32)
        distinct = jnp.full_like(ts, jnp.inf).at[jnp.where(first, rows, n)].set(ts, mode="drop")
        return cls(distinct, rows)

    def gather(self, ys: Y) -> Y:
        """The saved values `ys` (one row per distinct time) as one row per original time."""
        return jax.tree.map(lambda y: y[self.rows], ys)


def vector_field_in_internal_time(f: VectorField, direction: Scalar | float) -> VectorField:
    """`f` as a function of internal time `tau = direction * t`."""
    if isinstance(direction, float | int) and direction == 1:
        return f

    def f_internal(tau, y, args):
        dy = f(direction * tau, y, args)
        return jax.tree.map(lambda d: (direction * d).astype(d.dtype), dy)

    return f_internal
