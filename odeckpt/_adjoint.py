"""Adjoints: how the integration loop is run, and so how it is differentiated."""

import abc
import dataclasses
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ._integrate import Loop, LoopState, apply_writes
from ._types import IntScalar, Y
from .checkpointing import bounded_while_loop, forward_only, parse_memory
from .checkpointing._cost import offload_recomputed_steps, recomputed_steps
from .checkpointing._while_loop import checked_plan
from .checkpointing.schedules import offline_schedule, online_schedule, plan as plan_schedule


class AbstractAdjoint(eqx.Module):
    """Runs the integration loop. Each adjoint picks the loop runner that gives its kind of
    derivative; the loop itself (`Loop.cond`, `Loop.body`) is the same for all of them.

    **Example:**

    ```python
    adjoint: odeckpt.AbstractAdjoint = odeckpt.DirectAdjoint()  # or "direct", "recursive"
    sol = odeckpt.solve(f, y0, (0.0, 1.0), adjoint=adjoint)
    ```
    """

    @abc.abstractmethod
    def run(
        self, loop: Loop, state: LoopState, outputs: tuple[Y, ...]
    ) -> tuple[LoopState, tuple[Y, ...]]:
        """Run `loop` from `state` until `loop.cond` is false or `loop.max_steps` steps have been
        taken; return the final state and the filled output buffers."""

    def gradient_stats(
        self, loop: Loop, state: LoopState, outputs: tuple[Y, ...], num_steps: IntScalar
    ) -> tuple[int, IntScalar]:
        """What reverse-mode differentiation of the run from `state` does once the loop has
        taken `num_steps` steps: the snapshot slots it keeps and the steps it recomputes
        (`0, 0` for an adjoint that recomputes nothing)."""
        del loop, state, outputs, num_steps
        return 0, jnp.zeros((), jnp.int32)


def _checkpointed(
    loop: Loop, state: LoopState, outputs: tuple[Y, ...], **plan
) -> tuple[LoopState, tuple[Y, ...]]:
    """`loop` run by the checkpointing engine's `bounded_while_loop` with the given plan."""
    body, kwargs = _engine_form(loop, state, outputs, plan)
    if not outputs:
        return bounded_while_loop(loop.cond, body, state, **kwargs), outputs
    final, outputs = bounded_while_loop(loop.cond, body, state, **kwargs)
    return final, tuple(outputs)


def _checkpointed_stats(
    loop: Loop, state: LoopState, outputs: tuple[Y, ...], num_steps: IntScalar, **plan
) -> tuple[int, IntScalar]:
    """Snapshot slots and recomputed steps of `_checkpointed`'s reverse sweep after
    `num_steps` steps."""
    body, kwargs = _engine_form(loop, state, outputs, plan)
    # `bounded_while_loop` has checked the body: plan without tracing it again.
    the_plan = checked_plan(loop.cond, body, state, kwargs, check=False)
    if the_plan.regime == "residuals":
        return 0, jnp.zeros((), jnp.int32)
    c = the_plan.checkpoints
    if the_plan.offload is not None:
        slots = c + the_plan.host_checkpoints
        return slots, offload_recomputed_steps(the_plan.segment, c, num_steps)
    if the_plan.regime == "states":
        # A slot for every step: the sweep recomputes nothing (and a table of binomials for
        # `max_steps` slots would cost seconds to trace and compile).
        return c, jnp.zeros((), jnp.int32)
    schedule = (online_schedule if the_plan.online else offline_schedule)(the_plan.steps, c)
    return c, recomputed_steps(schedule, num_steps)


def _engine_form(loop: Loop, state: LoopState, outputs: tuple[Y, ...], plan: dict):
    """The body and keyword arguments `bounded_while_loop` takes for `loop`. Steps record
    their decisions (`Loop.step`), so that the reverse sweep recomputes the same steps."""
    kwargs = dict(plan, record_decisions=True, snapshot=_snapshot(loop, state))
    if not outputs:
        return lambda s, recorded: (lambda new, _, made: (new, made))(
            *loop.step(s, recorded)
        ), kwargs
    # Output groups have different lengths: the engine takes them as a list of groups.
    body = lambda s, recorded: (lambda new, writes, made: (new, list(writes), made))(
        *loop.step(s, recorded)
    )
    return body, dict(kwargs, outputs=list(outputs))


_RECOMPUTE_CACHE_FROM = 16 * 1024
"""State size (bytes) from which snapshots leave out a stepper state that is `f(t, y)`."""


def _snapshot(loop: Loop, state: LoopState):
    """What a snapshot keeps of the loop state (`None`: all of it). For a large state whose
    stepper state is just `f(t, y)` (explicit Runge-Kutta, Rosenbrock), snapshots drop it and
    a restore recomputes it: half the memory, one evaluation of `f` per restore."""
    stepper = loop.stepper
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.y))
    if not stepper.state_is_derivative or size < _RECOMPUTE_CACHE_FROM:
        return None

    def pack(state: LoopState) -> LoopState:
        return dataclasses.replace(state, stepper_state=stepper.pack_state(state.stepper_state))

    def unpack(packed: LoopState) -> LoopState:
        stepper_state = stepper.unpack_state(
            loop.f, packed.t, packed.y, loop.args, packed.stepper_state
        )
        return dataclasses.replace(packed, stepper_state=stepper_state)

    return pack, unpack


class RecursiveCheckpointAdjoint(AbstractAdjoint):
    """Reverse mode by recursive (binomial) checkpointing: the default.

    The loop keeps `checkpoints` snapshots of the step state (time, state, step size,
    controller state, stepper state; never the saved outputs) and recomputes the rest in the
    backward pass with the optimal number of recomputations: the online schedule of Stumm &
    Walther (2010) for adaptive steps, the offline Revolve schedule for constant steps (whose
    count is known before the solve). With neither argument, adaptive solves keep the fewest
    `c` with `C(c+2, 2) >= max_steps` (each step recomputed at most twice), and constant-step
    solves follow the engine's default rule (every step's VJP residuals when they fit a default
    budget, else binomial checkpointing; see `odeckpt.checkpointing`). `sol.stats` reports
    the snapshots and the recomputed steps. Also supports `jax.jvp`/`jacfwd`.

    **Arguments:**

    - `checkpoints`: number of snapshots `c >= 1`; memory is `c` step states.
    - `memory_budget`: bytes (int) or a string such as `"2GB"`; `c` is chosen from the size of
        the step state.
    - `offload`: `None`, or `"host"`: the snapshots go to host memory
        (`memory_kind="pinned_host"`) every `segment` steps, and the backward pass copies each
        segment's start back to the device and reverses the segment there by Revolve (two
        levels; see `odeckpt.checkpointing.bounded_while_loop`). `checkpoints` and
        `memory_budget` may then be dicts `{"device": ..., "host": ...}` (a plain value is the
        host's; defaults: 4 device slots, a 4 GiB host budget). `sol.stats.num_checkpoints`
        counts the slots on both levels. Raises a `ValueError` on a backend without host
        memory; on CPU (one RAM for both) the schedule runs and nothing is copied.

    **Example:**

    ```python
    adjoint = odeckpt.RecursiveCheckpointAdjoint(checkpoints=16)
    grad = jax.grad(lambda y0: odeckpt.solve(f, y0, (0.0, 1.0), adjoint=adjoint).ys[-1].sum())
    offloaded = odeckpt.RecursiveCheckpointAdjoint(
        memory_budget={"device": "1GB", "host": "32GB"}, offload="host"
    )
    ```

    **References:** Griewank & Walther (2000), ACM TOMS 26, Algorithm 799 (Revolve); Stumm &
    Walther (2010), SIAM J. Sci. Comput. 32(2); two levels: Stumm & Walther (2009), SIAM J.
    Sci. Comput. 31(3); Aupy & Herrmann (2019), Optim. Methods Softw. 34(6).
    """

    checkpoints: int | dict[str, int] | None = None
    memory_budget: int | str | dict[str, int | str] | None = None
    offload: Literal["host"] | None = None

    def __check_init__(self):
        if self.checkpoints is not None and self.memory_budget is not None:
            raise ValueError(
                "RecursiveCheckpointAdjoint takes checkpoints= or memory_budget=, not both. "
                "Fix: drop one of them."
            )
        two_level = any(isinstance(v, dict) for v in (self.checkpoints, self.memory_budget))
        if self.offload is not None or two_level:
            try:  # the planner's checks of the offload value and the two-level budgets
                plan_schedule(1, 1, checkpoints=self.checkpoints,
                              memory_budget=self.memory_budget, offload=self.offload)  # fmt: skip
            except ValueError as e:
                raise ValueError(f"RecursiveCheckpointAdjoint: {e}") from None
            return
        if self.checkpoints is not None and (
            isinstance(self.checkpoints, bool)
            or not isinstance(self.checkpoints, int)
            or self.checkpoints < 1
        ):
            raise ValueError(
                f"RecursiveCheckpointAdjoint(checkpoints={self.checkpoints!r}) needs an int >= 1. "
                "Fix: e.g. checkpoints=16 (more snapshots: less recomputation, more memory)."
            )
        if self.memory_budget is not None:
            parse_memory(self.memory_budget)

    def run(self, loop, state, outputs):
        final, outputs = _checkpointed(loop, state, outputs, **self._plan(loop))
        return span_derivative(loop, state, final), outputs

    def gradient_stats(self, loop, state, outputs, num_steps):
        return _checkpointed_stats(loop, state, outputs, num_steps, **self._plan(loop))

    def _plan(self, loop: Loop) -> dict:
        plan = dict(checkpoints=self.checkpoints, memory_budget=self.memory_budget)
        if self.offload is not None:
            plan["offload"] = self.offload
        if loop.num_steps is not None:
            # Constant steps over a known span: the offline optimal schedule (one spare step
            # guards against the count being off by rounding; a finished loop skips it).
            max_steps = min(loop.num_steps + 1, loop.max_steps)
            return dict(plan, max_steps=max_steps, online=False)
        return dict(plan, max_steps=loop.max_steps)


class DirectAdjoint(AbstractAdjoint):
    """Reverse mode storing everything: the state before every step up to `max_steps` is
    kept, so the reverse sweep differentiates each step straight from its input and recomputes
    nothing else, at memory `O(max_steps)` states (whatever the number of steps actually taken;
    a state here is the whole step state, solution and step size included). Fast for small
    states and short solves; also supports `jax.jvp`/`jacfwd`. For bounded memory use
    `RecursiveCheckpointAdjoint`.

    **Example:**

    ```python
    adjoint = odeckpt.DirectAdjoint()  # memory grows with max_steps: keep it small
    loss = lambda y0: odeckpt.solve(f, y0, (0.0, 1.0), adjoint=adjoint, max_steps=256).ys[-1].sum()
    grad = jax.grad(loss)(y0)
    ```
    """

    def run(self, loop, state, outputs):
        final, outputs = _checkpointed(loop, state, outputs, **self._plan(loop))
        return span_derivative(loop, state, final), outputs

    def gradient_stats(self, loop, state, outputs, num_steps):
        return _checkpointed_stats(loop, state, outputs, num_steps, **self._plan(loop))

    @staticmethod
    def _plan(loop: Loop) -> dict:
        # A snapshot slot for every step: the engine then stores every state, never advances.
        return dict(max_steps=loop.max_steps, checkpoints=loop.max_steps)


class ForwardMode(AbstractAdjoint):
    """Forward-mode differentiation (`jax.jvp`, `jax.jacfwd`): the loop is a plain
    `lax.while_loop`, which JAX differentiates in forward mode at the cost of one extra tangent
    per step. The right choice for problems with few parameters; it stores nothing per step.
    Reverse mode (`jax.grad`) raises, naming the adjoints that support it.

    **Example:**

    ```python
    final = lambda y0: odeckpt.solve(f, y0, (0.0, 1.0), adjoint=odeckpt.ForwardMode()).ys[-1]
    jac = jax.jacfwd(final)(y0)
    ```
    """

    def run(self, loop, state, outputs):
        # The results pass through an identity whose transpose raises, so that `jax.grad`
        # fails with a message naming the adjoints that support reverse mode.
        final, outputs = _while_loop(loop, state, outputs)
        return forward_only((span_derivative(loop, state, final), outputs), _NO_REVERSE_MODE)


def span_derivative(loop: Loop, init: LoopState, final: LoopState) -> LoopState:
    """`final`, given the derivatives in `t0` and `t_end` of the exact solution when the loop
    took no step (`t0 = t_end`): the discrete solution `y0` depends on neither, the exact one
    `y0 + (t_end - t0) f(t0, y0)` on both. The term added is zero."""
    span = loop.t_end - init.t
    span = span - jax.lax.stop_gradient(span)
    f0 = loop.stepper.derivative(init.stepper_state)
    none = final.num_steps == 0

    def leaf(y, f):
        f = jnp.where(jnp.isfinite(f), f, 0)  # a non-finite f0 has failed the solve already
        return jnp.where(none, y + span.astype(y.dtype) * f, y)

    return dataclasses.replace(final, y=jax.tree.map(leaf, final.y, f0))


def _while_loop(loop: Loop, state: LoopState, outputs: tuple[Y, ...]):
    def cond(carry):
        state, _, steps = carry
        return loop.cond(state) & (steps < loop.max_steps)

    def body(carry):
        state, outputs, steps = carry
        state, writes = loop.body(state)
        return state, apply_writes(outputs, writes), steps + 1

    state, outputs, _ = jax.lax.while_loop(cond, body, (state, outputs, 0))
    return state, outputs


_NO_REVERSE_MODE = TypeError(
    "adjoint=ForwardMode() supports forward mode only (jax.jvp, jax.jacfwd). Fix: for "
    "jax.grad / jax.vjp / jax.jacrev use adjoint='recursive' (RecursiveCheckpointAdjoint, "
    "the default) or adjoint='direct' (DirectAdjoint)."
)
