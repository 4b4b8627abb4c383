"""What the backward pass of `BacksolveAdjoint` is set up with."""

from collections.abc import Callable

import equinox as eqx

from ..._loop import AbstractController, IntegrationLoop
from ..._saveat import SaveAt
from ..._steppers import AbstractStepper
from ..._types import Scalar
from ._anchors import Anchoring
from ._problem import Problem, Seminorm


class BackwardSetup(eqx.Module):
    """How the backward solve runs, fixed when the forward solve is traced.

    **Fields:**

    - `stepper`, `controller`: the backward solve's (Newton tolerances set).
    - `seminorm`: leave the parameter integral out of the error estimate (only with `y`
        integrated backwards).
    - `reconstruct_forward`: read `y(t)` from forward re-solves instead of integrating it
        backwards.
    - `window`: steps of dense output a forward re-solve keeps.
    - `window_stepper`, `window_controller`: the stepper and controller of the forward
        re-solves.
    - `forward_anchoring`: where the forward solve stores states for the backward solve
        (`None`: nowhere).
    - `restart`: where a re-solve of the forward solution from `t0` with `window_controller`
        stores the states the windows start from (`None`: the windows start from the states
        the forward solve stored).
    - `max_drift`: the largest drift of the reconstructed state from the forward one that
        the backward solve accepts (see `BacksolveAdjoint`).
    - `on_backward`: the user's callback for the backward solve's statistics, or `None`.
    - `failure`: the error message (with the fixes) when the backward solve fails.
    """

    stepper: AbstractStepper
    controller: AbstractController
    window_stepper: AbstractStepper
    window_controller: AbstractController
    forward_anchoring: Anchoring | None
    restart: Anchoring | None
    seminorm: bool = eqx.field(static=True)
    reconstruct_forward: bool = eqx.field(static=True)
    window: int = eqx.field(static=True)
    max_drift: float
    on_backward: Callable[[dict], None] | None = eqx.field(static=True)
    failure: str = eqx.field(static=True)

    @property
    def error_stepper(self) -> AbstractStepper:
        """The backward stepper as the backward solve uses it: with the seminorm's error
        estimate if asked for."""
        return Seminorm(self.stepper) if self.seminorm else self.stepper

    def window_loop(
        self, loop: IntegrationLoop, problem: Problem, diff, t_end: Scalar
    ) -> IntegrationLoop:
        """The forward problem from a stored state to `t_end`, for a forward re-solve: the
        forward stepper and controller at the re-solves' tolerances, keeping its dense
        output."""
        return IntegrationLoop(
            f=problem.f,
            args=diff,
            stepper=problem.stepper_for_f(self.window_stepper),
            controller=self.window_controller,
            t_end=t_end,
            ts=None,
            saveat=SaveAt(dense=True),
            max_steps=loop.max_steps,
            jump_ts=loop.jump_ts,
        )
