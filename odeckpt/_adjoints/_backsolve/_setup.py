"""What the backward pass of the continuous adjoints is set up with: the backward solve (a
strategy, data), its stepper and controller, and those of the forward re-solves."""

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

import equinox as eqx

from ..._loop import AbstractController, IntegrationLoop
from ..._saveat import SaveAt
from ..._steppers import AbstractStepper
from ..._types import Scalar
from ._anchors import Anchoring
from ._problem import Problem, Seminorm

# equinox's documented import: pyright reads `eqx.AbstractClassVar` as an instance field, so
# a subclass's `ClassVar` would look like an incompatible override (pyright#4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar

    from ._backward import Backward, BackwardStats
else:
    from equinox import AbstractClassVar


class AbstractBackwardSolve(eqx.Module):
    """How the adjoint equations are solved from the final time back to `t0`: the backward
    system integrated (of `Problem`, in the time `s = -tau`) and where the forward state `y(t)`
    it needs comes from. A continuous adjoint is a `ContinuousAdjoint` that hands its backward
    solve to `BackwardSetup`; a new one (say, the parameter integral by quadrature over the
    adjoint's dense output) is one module with one such class."""

    reads_forward_states: AbstractClassVar[bool]
    """Whether `y(t)` is read from forward re-solves starting at stored states (which then
    need not re-anchor anything), rather than integrated backwards with the adjoint."""

    @abc.abstractmethod
    def __call__(
        self, backward: "Backward", stored, a, g, ct_jumps
    ) -> tuple[tuple, "BackwardStats"]:
        """`((a, g, ct_jumps), stats)`: the adjoint `a` and parameter integral `g` at `t0`
        from their values at the final time, and the cotangents of the jump times added to
        `ct_jumps` (`None` without jump times), given the states the forward solve `stored`
        (`None`: none); stopping at every stop of `backward.stops`."""


class BackwardSetup(eqx.Module):
    """How the backward solve runs, fixed when the forward solve is traced.

    **Fields:**

    - `stepper`, `controller`: the backward solve's (Newton tolerances set).
    - `seminorm`: leave the parameter integral out of the error estimate (only with `y`
        integrated backwards).
    - `solve`: the backward solve (`AbstractBackwardSolve`).
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
    solve: AbstractBackwardSolve
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
