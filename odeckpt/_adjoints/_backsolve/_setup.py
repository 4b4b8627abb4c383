"""What the backward pass of `BacksolveAdjoint` is set up with."""

from collections.abc import Callable

import equinox as eqx

from ..._controllers import AbstractController
from ..._integrate import IntegrationLoop
from ..._saveat import SaveAt
from ..._steppers._base import AbstractStepper
from ..._types import Scalar
from ._problem import Problem, Seminorm


class BackwardSetup(eqx.Module):
    """How the backward solve runs, fixed when the forward solve is traced.

    **Fields:**

    - `stepper`, `controller`: the backward solve's (Newton tolerances set).
    - `seminorm`: leave the parameter integral out of the error estimate.
    - `reconstruct_forward`: read `y(t)` from forward re-solves instead of integrating it
        backwards.
    - `window`: steps of dense output a forward re-solve keeps.
    - `window_controller`: the controller of the forward re-solves of windows.
    - `max_drift`: the largest drift of the reconstructed state from the forward one that
        the backward solve accepts (see `BacksolveAdjoint`).
    - `on_backward`: the user's callback for the backward solve's statistics, or `None`.
    - `failure`: the error message (with the fixes) when the backward solve fails.
    """

    stepper: AbstractStepper
    controller: AbstractController
    window_controller: AbstractController
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
        forward stepper at the backward tolerances (when it can adapt to them), keeping its
        dense output."""
        return IntegrationLoop(
            f=problem.f,
            args=diff,
            stepper=loop.stepper,
            controller=self.window_controller,
            t_end=t_end,
            ts=None,
            saveat=SaveAt(dense=True),
            max_steps=loop.max_steps,
        )
