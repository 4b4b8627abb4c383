"""What the continuous adjoints (`BacksolveAdjoint`, `InterpolatingAdjoint`) share: their
settings' checks, their rule's sweeps, and how their backward solve is set up."""

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar, cast

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ..._autodiff import NoForwardMode
from ..._checks import count, known_values, tightest
from ..._loop import AbstractAdaptiveController, AbstractController, IntegrationLoop, PIDController
from ..._saveat import SaveAt
from ..._steppers import AbstractStepper, map_jac, with_newton_tolerances
from ..._types import ScalarLike
from .._base import GradientStats
from .._custom_rule import AbstractCustomRuleAdjoint
from .._on_backward import check_on_backward
from ._anchors import Anchoring
from ._gradient import forward, reverse
from ._setup import AbstractBackwardSolve, BackwardSetup


class ContinuousAdjoint(AbstractCustomRuleAdjoint):
    """A gradient from the adjoint equations solved backwards in time (see `BacksolveAdjoint`
    for the fields); a subclass says how the forward state is reconstructed."""

    solver: eqx.AbstractVar[AbstractStepper | None]
    rtol: eqx.AbstractVar[float | None]
    atol: eqx.AbstractVar[float | None]
    checkpoints: eqx.AbstractVar[int | None]
    window: eqx.AbstractVar[int]
    max_drift: eqx.AbstractVar[float]
    on_backward: eqx.AbstractVar[Callable[[dict], None] | None]

    forward_error: ClassVar[str | None] = (
        "The continuous adjoints (BacksolveAdjoint, InterpolatingAdjoint) support reverse mode "
        "only (jax.grad, jax.vjp, jax.jacrev). Fix: for jax.jvp / jax.jacfwd use "
        "adjoint='forward_sensitivity' (error-controlled sensitivities), adjoint='forward' "
        "(ForwardMode) or adjoint='direct' (DirectAdjoint)."
    )
    second_order_error: ClassVar[str] = (
        "The continuous adjoints (BacksolveAdjoint, InterpolatingAdjoint): reverse mode over "
        "their gradient (jax.grad(jax.grad(f))) is not supported, as their backward solve is a "
        "while loop, which JAX cannot reverse. Fix: take second derivatives forward over "
        "reverse, `jax.jacfwd(jax.jacrev(f))` or `jax.hessian(f)`."
    )

    @abc.abstractmethod
    def anchoring(self) -> Anchoring | None:
        """Where the forward solve stores states for the backward solve (`None`: nowhere)."""

    @abc.abstractmethod
    def backward_solve(self, stepper: AbstractStepper) -> AbstractBackwardSolve:
        """The backward solve with the backward stepper `stepper`."""

    @abc.abstractmethod
    def window_controller(
        self, loop: IntegrationLoop, backward: AbstractController
    ) -> AbstractController:
        """The controller of the forward re-solves of windows, given the backward solve's."""

    @property
    @abc.abstractmethod
    def re_solves_from_start(self) -> bool:
        """Whether the backward solve reads `y(t)` from a re-solve of the whole forward solution
        from `t0` at the backward tolerances, rather than from the states the forward solve
        stored."""

    @property
    @abc.abstractmethod
    def seminormed(self) -> bool:
        """Whether the parameter integral is left out of the backward error estimate."""

    @property
    @abc.abstractmethod
    def failure_fix(self) -> str:
        """What to do when the backward solve fails (the end of the error message)."""

    def __check_init__(self):
        name = type(self).__name__
        count(f"{name}(window=...)", self.window, "e.g. window=64")
        examples = {
            "rtol": "rtol=1e-6",
            "atol": "atol=1e-8",
            "max_drift": "max_drift=1000.0, or max_drift=math.inf for no check",
        }
        for field, example in examples.items():
            value = known_values(f"{name}({field})", getattr(self, field))
            finite = field != "max_drift"  # an infinite drift allowance turns the check off
            if value is not None and not np.all((value > 0) & (np.isfinite(value) | ~finite)):
                kind = "positive and finite" if finite else "positive"
                raise ValueError(
                    f"{name}({field}={getattr(self, field)}) must be {kind}. Fix: pass e.g. "
                    f"{name}({example})."
                )
        if self.solver is not None and not isinstance(self.solver, AbstractStepper):
            raise TypeError(
                f"{name}(solver={self.solver!r}) is not a stepper. Fix: pass e.g. "
                "`odeckpt.Tsit5()`."
            )
        check_on_backward(name, self.on_backward)

    def check_events(self, events):
        if any(e.update is not None for e in events):
            raise ValueError(
                f"{type(self).__name__} supports terminal events only, not events with "
                "`update=` (a jump needs the state before it, which the backward solve does "
                "not keep). Fix: use adjoint='recursive' (the default), 'direct' or 'forward'."
            )

    def check_mass_matrix(self, events):
        del events
        raise ValueError(
            f"{type(self).__name__} integrates the adjoint equation backwards, and for a DAE "
            "`M y' = f` that adjoint is itself a DAE whose algebraic part needs consistent "
            "values at the end of the span and at every save time (Cao, Li, Petzold & Serban, "
            "SIAM J. Sci. Comput. 24 (2003)), which odeckpt does not solve. Fix: use "
            "adjoint='recursive' (the default) or 'direct' (the discrete adjoint, exact for the "
            "steps taken), or odeckpt.ForwardSensitivity() (sensitivities under error control)."
        )

    def prepare(self, loop):
        # The loop reads the save times from `loop.ts`: its `saveat` keeps only the flags.
        return dataclasses.replace(loop, saveat=_flags_only(loop.saveat)), self.setup(loop)

    def forward(self, inputs):
        return forward(inputs)

    def reverse(self, inputs, saved, ct_out, want):
        return reverse(inputs, saved, ct_out, want)

    def tangent(self, inputs, saved, t_inputs):
        """Never reached: the rule refuses forward mode (`forward_error`) before it."""
        raise NoForwardMode(self.forward_error)

    def gradient_stats(self, settings: BackwardSetup, final):
        """The forward checkpoints, and the forward steps re-solved for the backward solve,
        counted in the forward solve's steps: at least each once where the backward solve
        reads `y(t)` from re-solves (more where stored states lie over `window` steps apart),
        and once more for a re-solve from `t0`."""
        anchoring = self.anchoring()
        num_checkpoints = jnp.asarray(0 if anchoring is None else anchoring.slots, jnp.int32)
        passes = int(settings.solve.reads_forward_states) + int(settings.restart is not None)
        return GradientStats(num_checkpoints, (passes * final.num_steps).astype(jnp.int32))

    def setup(self, loop: IntegrationLoop) -> BackwardSetup:
        """How the backward solve runs after a forward solve of `loop` (raises, naming the fix,
        on a configuration it cannot run)."""
        name = type(self).__name__
        if self.re_solves_from_start and loop.stepper.error_order is None:
            raise ValueError(
                f"{name}(rtol=..., atol=...) re-solves the forward solution at those "
                f"tolerances, and the forward stepper {type(loop.stepper).__name__} has no "
                f"error estimate to adapt its steps to them. Fix: leave `{name}`'s rtol and "
                "atol at None (the re-solves retrace the forward steps), or solve with an "
                "adaptive stepper."
            )
        controller = self._controller(loop.controller)
        stepper = loop.stepper if self.solver is None else self.solver
        held = loop.stepper
        if isinstance(controller, AbstractAdaptiveController):
            if stepper.error_order is None:
                raise ValueError(
                    f"{name}: the backward stepper {type(stepper).__name__} has no error "
                    "estimate for the adaptive backward solve. Fix: pass "
                    f"`{name}(solver=odeckpt.Tsit5())` or another adaptive stepper."
                )
            # `_controller` made the backward tolerances single numbers.
            rtol, atol = cast(ScalarLike, controller.rtol), cast(ScalarLike, controller.atol)
            # The forward stepper, run backwards or in re-solves at the backward tolerances, is
            # held to them (Newton's increments, a proposer's steps), not to the forward solve's.
            held = with_newton_tolerances(held, rtol, atol, replace=True)
            # A stepper of its own is measured at the backward tolerances, not at its
            # standalone defaults (unless it sets its own).
            stepper = held if self.solver is None else with_newton_tolerances(
                self.solver, rtol, atol)  # fmt: skip
        failure = (
            f"{name}: the backward (adjoint) solve failed (max_steps reached, step size "
            "underflow, a non-finite adjoint, the reconstructed state drifted from the "
            "forward solution by more than `max_drift`, or traced backward `rtol`/`atol` that "
            f"are not positive and finite). Fix: {self.failure_fix}, tighten the "
            "backward `rtol`/`atol`, raise `max_steps`, or use `RecursiveCheckpointAdjoint`, "
            "whose gradients do not solve a backward ODE."
        )
        window_controller = self.window_controller(loop, controller)
        solve = self.backward_solve(stepper)
        window_stepper = held if window_controller is controller else loop.stepper
        return BackwardSetup(
            # A user's `jac` is that of `f`, not of the backward system (`jax.jacfwd` of which
            # serves); the windows re-solve `f` and keep it (`Problem.stepper_for_f`).
            stepper=map_jac(stepper, lambda _: None), controller=controller,
            window_stepper=window_stepper,
            window_controller=window_controller,
            # A re-solve from `t0` stores its own states: the forward solve stores none.
            forward_anchoring=None if self.re_solves_from_start else self.anchoring(),
            restart=self.anchoring() if self.re_solves_from_start else None,
            # The seminorm leaves the integral `g` to the error control of the rest. With `y`
            # integrated backwards that holds `y`, whose derivative `-f` carries f's explicit
            # dependence on time; with `y` read from re-solves it is the adjoint alone, which
            # does not change at all where `f` does not depend on `y` (a forcing): `g` stays in.
            seminorm=self.seminormed and not solve.reads_forward_states, solve=solve,
            window=self.window, max_drift=self.max_drift, on_backward=self.on_backward,
            failure=failure,
        )  # fmt: skip

    def _controller(self, controller: AbstractController) -> AbstractController:
        """The backward solve's controller: the forward one at the backward tolerances (after a
        solve whose controller takes no tolerances: an adaptive `PIDController` at the
        backward tolerances, or the forward controller itself if it does not judge errors)."""
        name = type(self).__name__
        if isinstance(controller, AbstractAdaptiveController):
            # The augmented state is not shaped like y: tolerances per leaf become one number.
            return controller.with_tolerances(
                tightest(controller.rtol) if self.rtol is None else self.rtol,
                tightest(controller.atol) if self.atol is None else self.atol,
            )
        if controller.judges_error:
            raise ValueError(
                f"{name}: the forward controller {type(controller).__name__} judges the error "
                "estimate but takes no tolerances, so neither the backward solve nor the check "
                "of the reconstructed state against the forward one (`max_drift`) knows how "
                "accurate the forward solution is. Fix: make the controller a subclass of "
                "`odeckpt.AbstractAdaptiveController` (fields `rtol` and `atol`), or use "
                "adjoint='recursive'."
            )
        if self.rtol is None and self.atol is None:
            return controller
        if self.rtol is None or self.atol is None:
            raise ValueError(
                f"{name} after a solve whose controller takes no tolerances needs both `rtol` "
                "and `atol` for an adaptive backward solve (or neither, for the forward "
                "controller's steps)."
            )
        return PIDController(rtol=self.rtol, atol=self.atol)


def _flags_only(saveat: SaveAt) -> SaveAt:
    """`saveat` without its `ts` array: the loop reads `loop.ts`, and only the flags here."""
    return SaveAt(t1=True, steps=saveat.steps, dense=saveat.dense)
