"""The contract between `solve` and the adjoints, and the plain while-loop runner.

An adjoint runs the integration loop, and the loop runner it picks decides how the solve is
differentiated. Every adjoint meets one contract: `run(loop, state, outputs) -> RunResult`.
"""

import abc
import dataclasses
from typing import TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp

from .._loop import IntegrationLoop, LoopState, Outputs, StepRecord
from .._types import IntScalar
from ..checkpointing import lockstep_while_loop


class GradientStats(eqx.Module):
    """What reverse-mode differentiation of a run will do: the snapshot slots it keeps and the
    steps it recomputes (both 0 for an adjoint that does neither)."""

    num_checkpoints: IntScalar
    num_recomputed_steps: IntScalar

    @classmethod
    def none(cls) -> "GradientStats":
        zero = jnp.zeros((), jnp.int32)
        return cls(zero, zero)


class RunResult(eqx.Module):
    """What an adjoint's run returns: the final loop state, the filled output buffers and the
    statistics of its gradient."""

    state: LoopState
    outputs: Outputs
    stats: GradientStats


class AbstractAdjoint(eqx.Module):
    """Runs the integration loop. Each adjoint picks the loop runner that gives its kind of
    derivative; the loop itself (`IntegrationLoop.cond`, `IntegrationLoop.step`) is the same
    for all of them. A new adjoint is one module with one class meeting this contract.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    adjoint: odeckpt.AbstractAdjoint = odeckpt.DirectAdjoint()  # or "direct", "recursive"
    sol = odeckpt.solve(f, y0, (0.0, 1.0), adjoint=adjoint)
    ```
    """

    @abc.abstractmethod
    def run(self, loop: IntegrationLoop, state: LoopState, outputs: Outputs) -> RunResult:
        """Run `loop` from `state` until `loop.cond` is false or `loop.max_steps` steps have been
        taken, writing into `outputs`."""

    def check_events(self, events: tuple) -> None:
        """Raise (naming the fix) if this adjoint cannot differentiate a solve with `events`
        (`odeckpt.Event`s); every adjoint that differentiates the discrete solve can."""
        del events

    def check_mass_matrix(self, events: tuple | None) -> None:
        """Raise (naming the fix) if this adjoint cannot differentiate a solve of `M y' = f`
        (a DAE) with `events` (or none); every adjoint that differentiates the discrete solve
        can."""
        del events


class AbstractWatch(eqx.Module):
    """Something the plain runner keeps up to date as the loop steps (stored states, a window of
    recent steps): `update` sees every attempted step and returns the watch after it.

    A finished lane under `vmap` steps on with `after` equal to `before` and every write out of
    range: `update` must then return the watch unchanged (the runner does not mask it, so that
    its buffers are not copied at every step)."""

    @abc.abstractmethod
    def update(
        self, before: LoopState, after: LoopState, writes, record: StepRecord
    ) -> "AbstractWatch":
        """This watch after the step from `before` to `after`, which wrote `writes` and took
        the decisions `record`."""


_Watch = TypeVar("_Watch", bound=AbstractWatch)


@overload
def while_loop(
    loop: IntegrationLoop, state: LoopState, outputs: Outputs, watch: None = None
) -> tuple[LoopState, Outputs, None]: ...
@overload
def while_loop(
    loop: IntegrationLoop, state: LoopState, outputs: Outputs, watch: _Watch
) -> tuple[LoopState, Outputs, _Watch]: ...
@overload
def while_loop(
    loop: IntegrationLoop, state: LoopState, outputs: Outputs, watch: _Watch | None
) -> tuple[LoopState, Outputs, _Watch | None]: ...
def while_loop(
    loop: IntegrationLoop, state: LoopState, outputs: Outputs, watch: AbstractWatch | None = None
) -> tuple[LoopState, Outputs, AbstractWatch | None]:
    """Run `loop` from `state` in a plain `lax.while_loop` (forward-mode differentiable, storing
    nothing per step), writing into `outputs` and updating `watch` at every step. With a
    `progress` meter, the loop runs in stretches until `loop.milestone` reaches the one the
    last report returned, and reports before the first and after each."""

    def cond(carry):
        state, _, _, steps = carry
        return loop.cond(state) & (steps < loop.max_steps)

    def body(carry, running):
        # A finished lane (under `vmap`) steps on in lockstep: its state and count are kept by
        # a select, its writes go out of range, so that the buffers are never copied.
        state, outputs, watch, steps = carry
        new, writes, record = loop.step(state)
        new = jax.tree.map(lambda a, b: jnp.where(running, a, b), new, state)
        writes = writes.only_where(running)
        watch = None if watch is None else watch.update(state, new, writes, record)
        return new, outputs.write(writes), watch, jnp.where(running, steps + 1, steps)

    carry = (state, outputs, watch, jnp.zeros((), jnp.int32))
    if loop.progress is None:
        state, outputs, watch, _ = lockstep_while_loop(cond, body, carry, body_masks=True)
        return state, outputs, watch

    def stretch(reporting, running):
        # (Every lane that runs on here runs on in the inner loop, which masks the others.)
        del running
        carry, target = reporting
        short = lambda carry: cond(carry) & (loop.milestone(carry[0]) < target)
        carry = lockstep_while_loop(short, body, carry, body_masks=True)
        return carry, loop.report(carry[0])

    reporting = (carry, loop.report(state))
    carry, _ = lockstep_while_loop(lambda r: cond(r[0]), stretch, reporting, body_masks=True)
    state, outputs, watch, _ = carry
    return state, outputs, watch


def span_derivative(loop: IntegrationLoop, init: LoopState, final: LoopState) -> LoopState:
    """`final`, given the derivatives in `t0` and `t_end` of the exact solution when the loop
    took no step (`t0 = t_end`): the discrete solution `y0` depends on neither, the exact one
    `y0 + (t_end - t0) y'(t0)` on both (`y' = f` for an ODE; `AbstractStepper.slope`). The
    term added is zero. For the adjoints that differentiate the discrete solve."""
    span = loop.t_end - init.t
    span = span - jax.lax.stop_gradient(span)
    f0 = loop.stepper.slope(loop.f, init.t, init.y, loop.args, init.stepper_state)
    none = final.num_steps == 0

    def leaf(y, f):
        f = jnp.where(jnp.isfinite(f), f, 0)  # a non-finite f0 has failed the solve already
        return jnp.where(none, y + span.astype(y.dtype) * f, y)

    return dataclasses.replace(final, y=jax.tree.map(leaf, final.y, f0))
