"""The adjoints that run the loop through the checkpointing engine: `RecursiveCheckpointAdjoint`
and `DirectAdjoint`. Both differentiate the discrete solve exactly; they differ in the plan."""

import abc
import dataclasses
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import count
from .._loop import IntegrationLoop, LoopState, Outputs, written_groups
from ..checkpointing import (
    Plan,
    bounded_while_loop,
    parse_memory,
    recomputed_steps,
    while_loop_plan,
)
from ..checkpointing.schedules import plan as plan_schedule
from ._base import AbstractAdjoint, GradientStats, RunResult, span_derivative

_RECOMPUTE_CACHE_FROM = 16 * 1024
"""State size (bytes) from which snapshots leave out a stepper state that is `f(t, y)`."""


class EngineForm(eqx.Module):
    """The integration loop in the form the engine takes: a condition, a body that records
    its decisions (`IntegrationLoop.step`, so that the reverse sweep recomputes the same steps),
    the initial state, the output groups and what a snapshot keeps."""

    loop: IntegrationLoop
    init: LoopState
    outputs: Outputs

    def cond(self, state: LoopState):
        return self.loop.cond(state)

    def body(self, state: LoopState, recorded):
        new, writes, made = self.loop.step(state, recorded)
        if not self.outputs.groups():
            return new, made
        return new, written_groups(writes), made

    def engine_args(self) -> dict:
        """The keyword arguments this loop takes besides its budget."""
        args = dict(record_decisions=True, snapshot=_snapshot(self.loop, self.init))
        groups = self.outputs.groups()
        return dict(args, outputs=groups) if groups else args

    def plan(self, **budget) -> Plan:
        """The engine's `Plan` for this loop under `budget` (`max_steps`, `checkpoints`, ...)."""
        return while_loop_plan(self.cond, self.body, self.init, **budget, **self.engine_args())

    def run(self, plan: Plan) -> tuple[LoopState, Outputs]:
        """Run the loop by the engine, as `plan` says (a gradient past the recorded decisions
        that the recomputation cannot follow raises with `throw`)."""
        progress = None
        if self.loop.progress is not None:
            progress = (self.loop.milestone, self.loop.report)
        out = bounded_while_loop(
            self.cond, self.body, self.init, plan=plan, throw=self.loop.throw, pack_state=True,
            progress=progress, **self.engine_args(),
        )  # fmt: skip
        if not self.outputs.groups():
            return out, self.outputs
        final, groups = out
        return final, self.outputs.from_groups(list(groups))


def _snapshot(loop: IntegrationLoop, state: LoopState):
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


class AbstractCheckpointedAdjoint(AbstractAdjoint):
    """An adjoint that runs the loop through the checkpointing engine under a `Plan`; concrete
    ones say how they plan. Also supports `jax.jvp`/`jacfwd` (the engine's forward mode)."""

    @abc.abstractmethod
    def plan(self, form: EngineForm) -> Plan:
        """The engine's plan for the loop `form`."""

    def run(self, loop, state, outputs):
        form = EngineForm(loop, state, outputs)
        plan = self.plan(form)
        final, outputs = form.run(plan)
        stats = GradientStats(
            num_checkpoints=jnp.asarray(plan.slots, jnp.int32),
            num_recomputed_steps=recomputed_steps(plan, final.num_steps),
        )
        return RunResult(span_derivative(loop, state, final), outputs, stats)


class RecursiveCheckpointAdjoint(AbstractCheckpointedAdjoint):
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
    import jax
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    adjoint = odeckpt.RecursiveCheckpointAdjoint(checkpoints=16)
    grad = jax.grad(lambda y0: odeckpt.solve(f, y0, (0.0, 1.0), adjoint=adjoint).ys[-1].sum())(y0)
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

    def __init__(self, checkpoints=None, memory_budget=None, offload=None):
        if checkpoints is not None and not isinstance(checkpoints, dict):
            checkpoints = count(
                "RecursiveCheckpointAdjoint(checkpoints=...)", checkpoints,
                "e.g. checkpoints=16 (more snapshots: less recomputation, more memory)",
            )  # fmt: skip
        self.checkpoints, self.memory_budget, self.offload = checkpoints, memory_budget, offload

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
        elif self.memory_budget is not None:
            assert not isinstance(self.memory_budget, dict)  # two-level, checked above
            parse_memory(self.memory_budget)

    def plan(self, form):
        budget = dict(checkpoints=self.checkpoints, memory_budget=self.memory_budget)
        if self.offload is not None:
            budget["offload"] = self.offload
        loop = form.loop
        if loop.num_steps is not None:
            # Constant steps over a known span: the offline optimal schedule (one spare step
            # guards against the count being off by rounding; a finished loop skips it).
            max_steps = min(loop.num_steps + 1, loop.max_steps)
            return form.plan(max_steps=max_steps, online=False, **budget)
        return form.plan(max_steps=loop.max_steps, **budget)


class DirectAdjoint(AbstractCheckpointedAdjoint):
    """Reverse mode storing everything: the state before every step up to `max_steps` is
    kept, so the reverse sweep differentiates each step straight from its input and recomputes
    nothing else, at memory `O(max_steps)` states (whatever the number of steps actually taken;
    a state here is the whole step state, solution and step size included). Fast for small
    states and short solves; also supports `jax.jvp`/`jacfwd`. For bounded memory use
    `RecursiveCheckpointAdjoint`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    adjoint = odeckpt.DirectAdjoint()  # memory grows with max_steps: keep it small
    loss = lambda y0: odeckpt.solve(f, y0, (0.0, 1.0), adjoint=adjoint, max_steps=256).ys[-1].sum()
    grad = jax.grad(loss)(y0)
    ```
    """

    def plan(self, form):
        # A snapshot slot for every step: the engine then stores every state, never advances.
        return form.plan(max_steps=form.loop.max_steps, checkpoints=form.loop.max_steps)
