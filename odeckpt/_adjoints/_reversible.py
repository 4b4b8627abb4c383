"""`ReversibleAdjoint`: reverse mode through a reversible solve, undoing its steps."""

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._error_norm import scaled_distance
from .._loop import IntegrationLoop, LoopState, StepRecord, index_unless_dropped, written_groups
from .._steppers import Reversible, ReversibleState
from ..checkpointing import lockstep_while_loop
from ._base import AbstractWatch, GradientStats, while_loop
from ._custom_rule import AbstractCustomRuleAdjoint, RuleInputs, checked, loop_cotangent
from ._derivatives import pair
from ._on_backward import check_on_backward, report


class ReversibleAdjoint(AbstractCustomRuleAdjoint):
    """Reverse mode through a solve with an `odeckpt.Reversible` stepper, by undoing its steps.

    The forward solve stores no state: for each accepted step only its start time, its step
    size, its save index and its decisions (`StepRecord`), about 30 bytes, in buffers of
    `max_steps` entries. The reverse sweep reconstructs each step's start from its end
    (`Reversible.undo`) and runs the step's VJP there, following the recorded decisions: the
    exact derivative of the discrete solve (that of `DirectAdjoint`), up to the round-off of
    the reconstruction, with the state's memory independent of the number of steps. Each step
    is computed three times in all (forward, undone, and differentiated).

    The reconstruction's round-off grows with the number of steps (and with a `coupling` of
    the stepper below 1). The reverse sweep measures it where the truth is known: the
    reconstructed `y0` (and second state) against the solve's. Beyond `max_drift` (relative
    and absolute, as a scaled distance) the derivatives are NaN, and with `throw=True` an error
    names the fixes.

    Reverse mode only (`jax.grad`, `jax.vjp`, `jax.jacrev`); forward mode through a reversible
    solve is `adjoint="forward"`. Events and `jump_ts`, which restart the second state, are
    refused.

    The reconstructed `y0` is a proxy: the states in the middle of the solve can drift more
    than it, and their drift is what the gradient sees. The default bound is therefore tight.

    **Arguments:**

    - `max_drift`: how far the reconstructed `y0'` (and second state) may lie from `y0`: within
        `max_drift * (1 + |y0|)` in the root mean square. `None`: `100 * eps**0.75` of the
        state's dtype (1.8e-10 in float64, 6.4e-4 in float32).
    - `on_backward`: `None`, or a function called (through `jax.debug.callback`, once per
        evaluation of the gradient and per batch element under `vmap`) with a `dict` of Python
        values: `num_undone_steps`, `drift` (the root mean square of
        `(y0' - y0) / (1 + |y0|)` over both states, in the units of `max_drift`) and
        `succeeded` (`drift <= max_drift`). It must be hashable (a function or bound method):
        `jax.jit` caches on it. Call `jax.effects_barrier()` before reading what it recorded.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -args * y

    def loss(k):
        sol = odeckpt.solve(f, jnp.array([1.0, 2.0]), (0.0, 1.0), k,
                            solver=odeckpt.Reversible(odeckpt.Tsit5()),
                            adjoint=odeckpt.ReversibleAdjoint())
        return jnp.sum(sol.ys**2)

    grad = jax.grad(loss)(0.5)
    ```

    **References:** S. McCallum and J. Foster, "Efficient, accurate and stable gradients for
    neural ODEs", arXiv:2410.11648 (2024).
    """

    max_drift: float | None = None
    on_backward: Callable[[dict], None] | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        check_on_backward("ReversibleAdjoint", self.on_backward)
        drift = self.max_drift
        if drift is not None and not (
            isinstance(drift, int | float)
            and not isinstance(drift, bool)
            and 0 < drift < float("inf")
        ):
            raise ValueError(
                f"ReversibleAdjoint(max_drift={drift!r}) must be a positive, finite number (or "
                "None for the default). Fix: pass e.g. ReversibleAdjoint(max_drift=1e-8)."
            )

    forward_error: ClassVar[str | None] = (
        "adjoint=ReversibleAdjoint() is reverse mode (jax.grad, jax.vjp, jax.jacrev). Fix: for "
        "jax.jvp / jax.jacfwd pass adjoint='forward', which differentiates the reversible "
        "stepper itself."
    )
    second_order_error: ClassVar[str] = (
        "adjoint=ReversibleAdjoint() differentiates once. Fix: for second derivatives use "
        "adjoint='direct' (reverse over reverse) or adjoint='forward' (forward over forward)."
    )

    def check_events(self, events: tuple) -> None:
        del events
        raise ValueError(
            "adjoint=ReversibleAdjoint() cannot undo a solve with events: an event that stops "
            "or jumps the solve restarts the reversible stepper's second state. Fix: use "
            "adjoint='recursive' (the default) with the reversible stepper."
        )

    def prepare(self, loop: IntegrationLoop):
        if not isinstance(loop.stepper, Reversible):
            raise ValueError(
                "adjoint=ReversibleAdjoint() undoes the steps of a reversible stepper, and "
                f"solver={type(loop.stepper).__name__}() is not one. Fix: pass "
                "solver=odeckpt.Reversible(odeckpt.Tsit5()) (any explicit stepper can be "
                "wrapped)."
            )
        if loop.jump_ts is not None:
            raise ValueError(
                "adjoint=ReversibleAdjoint() cannot undo a solve with jump_ts: a landing on a "
                "known discontinuity restarts the reversible stepper's second state. Fix: use "
                "adjoint='recursive' (the default) with the reversible stepper."
            )
        dtype = loop.t_end.dtype
        eps = float(jnp.finfo(dtype).eps)
        max_drift = 100 * eps**0.75 if self.max_drift is None else self.max_drift
        return loop, jnp.asarray(max_drift, dtype)

    def forward(self, inputs: RuleInputs):
        loop = inputs.full_loop
        steps = _Steps.empty(loop.max_steps, inputs.init.t.dtype)
        final, outputs, steps = while_loop(loop, inputs.init, inputs.outputs, steps)
        return (final, outputs), (final, steps)

    def reverse(self, inputs, saved, ct_out, want):
        del want  # every cotangent comes out of the same sweep
        return _reverse(inputs, saved, ct_out, self.on_backward)

    def tangent(self, inputs, saved, t_inputs):
        raise AssertionError("forward mode is refused (`forward_error`)")

    def gradient_stats(self, settings, final):
        return GradientStats.none()


class _Steps(AbstractWatch):
    """Of every accepted step, what its reversal needs beside the state it undoes: its start
    time `t`, step size `dt`, save index and decisions, at the step's number."""

    t: Float[Array, " n"]
    dt: Float[Array, " n"]
    save_index: Int[Array, " n"]
    record: StepRecord

    @classmethod
    def empty(cls, n: int, dtype) -> "_Steps":
        zeros = jnp.zeros((n,), dtype)
        record = StepRecord(jnp.zeros((n,), jnp.uint8), zeros)
        return cls(zeros, zeros, jnp.zeros((n,), jnp.int32), record)

    def update(self, before, after, writes, record: StepRecord) -> "_Steps":
        del writes
        accepted = after.num_accepted > before.num_accepted
        index = jnp.where(accepted, before.num_accepted, self.t.shape[0])
        put = lambda buffer, value: buffer.at[index].set(value, mode="drop")
        return _Steps(
            put(self.t, before.t),
            put(self.dt, before.dt),
            put(self.save_index, before.save_index),
            StepRecord(
                put(self.record.code, record.code), put(self.record.next_dt, record.next_dt)
            ),
        )


class _Sweep(eqx.Module):
    """The reverse sweep's carry: the step `k` to reverse next, the state at its end (`y`,
    `stepper_state`), the cotangents of its time, state and stepper state, those of the loop's
    inexact arrays, and those of the output buffers still to be given to steps."""

    k: Array
    y: object
    stepper_state: ReversibleState
    ct_t: Array
    ct_y: object
    ct_stepper_state: object
    ct_loop: IntegrationLoop
    ct_groups: list


def _reverse(
    inputs: RuleInputs, saved, ct_out, on_backward: Callable[[dict], None] | None
) -> RuleInputs:
    loop, init = inputs.loop, inputs.init
    final, steps = saved
    ct_final, ct_outputs = ct_out
    diff, static = eqx.partition(loop, eqx.is_inexact_array)
    count = final.num_accepted
    stepper = loop.stepper
    assert isinstance(stepper, Reversible)  # checked by `prepare`

    def body(sweep: _Sweep, running) -> _Sweep:
        # A finished lane (under `vmap`) reverses on in lockstep: its carry is kept by a select
        # and its rows are out of range, so that the cotangent buffers are never copied.
        k = sweep.k
        t_start = steps.t[k]
        t_end = jnp.where(k + 1 < count, steps.t[jnp.minimum(k + 1, steps.t.shape[0] - 1)], final.t)
        y, state = stepper.undo(loop.f, t_start, t_end, sweep.y, loop.args, sweep.stepper_state)
        before = LoopState(
            t=t_start, y=y, dt=steps.dt[k], stepper_state=state,
            controller_state=final.controller_state,
            counts=LoopState.increments(save_index=steps.save_index[k], num_accepted=k),
            status=final.status,
        )  # fmt: skip
        record = StepRecord(steps.record.code[k], steps.record.next_dt[k])

        def step(diff, t, y, state):
            new, writes, _ = eqx.combine(diff, static).step(
                dataclasses.replace(before, t=t, y=y, stepper_state=state), record
            )
            groups = written_groups(writes)
            return ((new.t, new.y, new.stepper_state), [v for _, v in groups]), [
                index_unless_dropped(running, i) for i, _ in groups
            ]

        _, vjp, indices = jax.vjp(step, diff, t_start, y, state, has_aux=True)
        ct_rows = [
            jax.tree.map(lambda b, i=i: b.at[i].get(mode="fill", fill_value=0), group)
            for group, i in zip(sweep.ct_groups, indices, strict=True)
        ]
        # A row is written once: its cotangent is this step's, and no one else's.
        ct_groups = [
            jax.tree.map(lambda b, i=i: b.at[i].set(0, mode="drop"), group)
            for group, i in zip(sweep.ct_groups, indices, strict=True)
        ]
        ct_in = ((sweep.ct_t, sweep.ct_y, sweep.ct_stepper_state), ct_rows)
        ct_diff, ct_t, ct_y, ct_state = vjp(ct_in)
        ct_loop = jax.tree.map(lambda a, d: a + jnp.where(running, d, 0), sweep.ct_loop, ct_diff)
        pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(running, a, b), new, old)
        return _Sweep(
            k=pick(k - 1, k), y=pick(y, sweep.y), stepper_state=pick(state, sweep.stepper_state),
            ct_t=pick(ct_t, sweep.ct_t), ct_y=pick(ct_y, sweep.ct_y),
            ct_stepper_state=pick(ct_state, sweep.ct_stepper_state), ct_loop=ct_loop,
            ct_groups=ct_groups,
        )  # fmt: skip

    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    ct_stepper_state = jax.tree.map(
        lambda c, x: jnp.zeros_like(x) if c is None else c,
        ct_final.stepper_state, final.stepper_state, is_leaf=lambda c: c is None,
    )  # fmt: skip
    start = _Sweep(
        count - 1, final.y, final.stepper_state, ct_final.t, ct_final.y, ct_stepper_state,
        zeros(diff), ct_outputs.groups(),
    )  # fmt: skip
    sweep = lockstep_while_loop(lambda sweep: sweep.k >= 0, body, start, body_masks=True)
    ct_t0, ct_t_end = _span_terms(loop, init, final, ct_final)
    drift = scaled_distance(
        (sweep.y, sweep.stepper_state.z), (init.y, init.stepper_state.z),
        inputs.settings, inputs.settings, symmetric=False,
    )  # fmt: skip
    ct_loop = loop_cotangent(
        loop, f=sweep.ct_loop.f, args=sweep.ct_loop.args,
        t_end=sweep.ct_loop.t_end + ct_t_end, ts=sweep.ct_loop.ts, jump_ts=None,
    )  # fmt: skip
    ct_init = dataclasses.replace(
        jax.tree.map(lambda _: None, init),
        t=sweep.ct_t + ct_t0, y=sweep.ct_y, stepper_state=sweep.ct_stepper_state,
    )  # fmt: skip
    succeeded = drift <= 1
    if on_backward is not None:
        values = {"num_undone_steps": count, "drift": drift * inputs.settings}
        values |= {"succeeded": succeeded}
        report(on_backward, values, lambda values: {k: v.item() for k, v in values.items()})
    result = RuleInputs(ct_loop, ct_init, ct_outputs.from_groups(sweep.ct_groups), None, None)
    message = (
        "adjoint=ReversibleAdjoint(): undoing the solve's steps did not return to y0 (the "
        "reconstruction drifted beyond max_drift), so the gradient would be wrong. Fix: use "
        "adjoint='recursive' (the default), a stepper coupling closer to 1, float64, or raise "
        "ReversibleAdjoint(max_drift=...)."
    )
    return checked(result, loop, final, [(succeeded, message)])


def _span_terms(loop: IntegrationLoop, init: LoopState, final: LoopState, ct_final):
    """The cotangents of `t0` and `t_end` of a solve that took no step (`t0 = t_end`): those of
    the exact solution `y0 + (t_end - t0) f(t0, y0)` there (zero after a step: the steps carry
    them)."""
    f0 = loop.stepper.derivative(init.stepper_state)
    none = final.num_accepted == 0
    f0 = jax.tree.map(lambda f: jnp.where(jnp.isfinite(f), f, 0), f0)
    term = jnp.where(none, pair(ct_final.y, f0), 0).astype(init.t.dtype)
    return -term, term
