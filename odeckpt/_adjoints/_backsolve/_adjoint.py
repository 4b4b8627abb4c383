"""`BacksolveAdjoint`: the continuous adjoint, solved backwards in time."""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..._checks import known_values, tightest
from ..._controllers import AbstractController, PIDController
from ..._events import EventSet
from ..._integrate import IntegrationLoop
from ..._saveat import SaveAt
from ..._steppers._base import AbstractStepper
from ..._steppers._implicit import AbstractImplicit, with_newton_tolerances
from ..._steppers._rosenbrock import AbstractRosenbrock
from ..._validate import count, python_int
from .._base import AbstractAdjoint, GradientStats, RunResult
from ._gradient import BacksolveInputs, backsolve
from ._setup import BackwardSetup


class BacksolveAdjoint(AbstractAdjoint):
    """Differentiate a solve by solving the continuous adjoint equations backwards in time.

    The forward solve stores nothing per step; the gradient solves, from the final time back
    to `t0`, the adjoint `a = dL/dy(t)` and the parameter integral `g` (and the state `y`,
    integrated backwards or re-solved forwards from stored states), so memory is independent of
    the number of steps. Gradients flow to `y0`, the inexact arrays of `args` and of arrays the
    vector field closes over, `t0`, `t1` and the save times. The gradient approximates the
    exact one to the tolerance of the backward solve; it is not the derivative of the discrete
    forward solve (`RecursiveCheckpointAdjoint`, `DirectAdjoint`). Reverse mode only: for
    `jax.jvp`/`jax.jacfwd` use `ForwardMode` (or `DirectAdjoint`). How it works, and when to
    choose it: docs/concepts.md.

    **Arguments:**

    - `solver`: the stepper of the backward solve; `None` uses the forward one.
    - `rtol`, `atol`: tolerances of the backward solve; `None` uses the forward controller's.
        After a `ConstantStep` forward solve, `None` for both means constant steps of the
        forward `dt0` backwards; giving both uses an adaptive `PIDController`.
    - `checkpoints`: number of forward states stored (at the first step ends past `k` evenly
        spaced times) to re-anchor the reconstructed state, or to start the forward re-solves
        from; `None` stores none.
    - `seminorm`: leave the parameter integral out of the backward error estimate.
    - `reconstruct`: how the backward solve obtains `y(t)`: `"backward"` integrates it
        backwards with the adjoint (re-anchored at the stored states); `"forward"` re-solves
        it forwards from the stored states and reads it from the last `window` steps' dense
        output; `"auto"` is `"forward"` when the backward stepper is implicit (a stiff
        problem) and `"backward"` otherwise.
    - `window`: steps of dense output `reconstruct="forward"` keeps.
    - `max_drift`: how far the reconstructed `y(t)` may stray from the forward solution
        before the gradient counts as failed (NaN, and an error with `throw=True`). The drift
        is measured wherever a forward state is known (`y0`, the stored states, the saved
        outputs, and `y(t1)` against a forward re-solve) as the root mean square of
        `(y - y_forward) / (atol + rtol |y_forward|)`, each tolerance the looser of the forward
        and the backward solve's; it is not measured after constant backward steps (which
        have no tolerances).
    - `on_backward`: `None`, or a function called (through `jax.debug.callback`, once per
        evaluation of the gradient and per batch element under `vmap`) with a `dict` of
        Python values: `num_backward_steps`, `num_accepted_backward_steps`,
        `num_rejected_backward_steps`, `num_window_solves` (forward re-solves of windows),
        `max_drift` (the largest drift measured) and `succeeded`. It must be hashable (a
        function or bound method): `jax.jit` caches on it. Call `jax.effects_barrier()`
        before reading what it recorded.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import odeckpt

    def loss(y0, k, adjoint):
        sol = odeckpt.solve(lambda t, y, k: -k * y, y0, (0.0, 1.0), args=k, adjoint=adjoint)
        return jnp.sum(sol.ys[-1] ** 2)

    y0, k = jnp.array([1.0, 2.0]), jnp.array(0.5)
    jax.grad(loss, argnums=(0, 1))(y0, k, odeckpt.BacksolveAdjoint(checkpoints=4))

    records = []
    adjoint = odeckpt.BacksolveAdjoint(rtol=1e-8, atol=1e-8, on_backward=records.append)
    jax.jit(jax.grad(loss), static_argnums=2)(y0, k, adjoint)
    jax.effects_barrier()
    print(records[-1]["num_backward_steps"], records[-1]["succeeded"])
    ```

    **References:**

    - L. S. Pontryagin et al., *The Mathematical Theory of Optimal Processes* (1962).
    - R. T. Q. Chen, Y. Rubanova, J. Bettencourt, D. Duvenaud, "Neural Ordinary Differential
        Equations", NeurIPS 2018.
    - P. Kidger, R. T. Q. Chen, T. Lyons, "'Hey, that's not an ODE': Faster ODE Adjoints via
        Seminorms", ICML 2021.
    - R. Serban & A. C. Hindmarsh, "CVODES: the sensitivity-enabled ODE solver in SUNDIALS",
        ASME IDETC 2005 (the forward solution re-solved from checkpoints and interpolated).
    """

    solver: AbstractStepper | None = None
    rtol: float | None = None
    atol: float | None = None
    checkpoints: int | None = eqx.field(default=None, static=True, converter=python_int)
    seminorm: bool = eqx.field(default=True, static=True)
    reconstruct: str = eqx.field(default="auto", static=True)
    window: int = eqx.field(default=64, static=True, converter=python_int)
    max_drift: float = 1000.0
    on_backward: Callable[[dict], None] | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if self.reconstruct not in ("auto", "backward", "forward"):
            raise ValueError(
                f"BacksolveAdjoint(reconstruct={self.reconstruct!r}) must be 'auto', 'backward' "
                "or 'forward'."
            )
        count("BacksolveAdjoint(window=...)", self.window, "e.g. window=64")
        if self.checkpoints is not None:
            count("BacksolveAdjoint(checkpoints=...)", self.checkpoints,
                  "e.g. checkpoints=8, or checkpoints=None for no stored states")  # fmt: skip
        examples = {
            "rtol": "rtol=1e-6",
            "atol": "atol=1e-8",
            "max_drift": "max_drift=1000.0, or max_drift=math.inf for no check",
        }
        for name, example in examples.items():
            value = known_values(f"BacksolveAdjoint({name})", getattr(self, name))
            if value is not None and not np.all(value > 0):
                raise ValueError(
                    f"BacksolveAdjoint({name}={getattr(self, name)}) must be positive. Fix: "
                    f"pass e.g. BacksolveAdjoint({example})."
                )
        if self.solver is not None and not isinstance(self.solver, AbstractStepper):
            raise TypeError(
                f"BacksolveAdjoint(solver={self.solver!r}) is not a stepper. Fix: pass e.g. "
                "`odeckpt.Tsit5()`."
            )
        _check_callback(self.on_backward)

    def check_events(self, events):
        if any(e.update is not None for e in events):
            raise ValueError(
                "BacksolveAdjoint supports terminal events only, not events with `update=` "
                "(a jump needs the state before it, which the backward solve does not keep). "
                "Fix: use adjoint='recursive' (the default), 'direct' or 'forward'."
            )

    def run(self, loop, state, outputs):
        setup = self.setup(loop)
        # Closed-over arrays of `f` become explicit leaves, so they may cross the custom_vjp
        # boundary (and get gradients like `args`).
        f = eqx.filter_closure_convert(loop.f, state.t, state.y, loop.args)
        loop = dataclasses.replace(
            loop, f=f, saveat=_flags_only(loop.saveat), events=_events(loop, state)
        )
        checkpoints = None if self.checkpoints is None else int(self.checkpoints)
        final, outputs = backsolve(BacksolveInputs(loop, state, outputs), setup, checkpoints)
        num_checkpoints = jnp.asarray(checkpoints or 0, jnp.int32)
        return RunResult(final, outputs, GradientStats(num_checkpoints, jnp.zeros((), jnp.int32)))

    def setup(self, loop: IntegrationLoop) -> BackwardSetup:
        """How the backward solve runs after a forward solve of `loop` (raises, naming the fix,
        on a configuration it cannot run)."""
        controller = self._controller(loop.controller)
        stepper = loop.stepper if self.solver is None else self.solver
        if isinstance(controller, PIDController):
            if stepper.error_order is None:
                raise ValueError(
                    f"BacksolveAdjoint: the backward stepper {type(stepper).__name__} has no "
                    "error estimate for the adaptive backward solve. Fix: pass "
                    "`BacksolveAdjoint(solver=odeckpt.Tsit5())` or another adaptive stepper."
                )
            # Newton's increments are measured at the backward tolerances (a small `atol` for
            # tiny components), not at the stepper's standalone defaults.
            stepper = with_newton_tolerances(stepper, controller.rtol, controller.atol)
        forward = self.reconstruct == "forward" or (
            self.reconstruct == "auto"
            and isinstance(stepper, AbstractImplicit | AbstractRosenbrock)
        )
        # The forward re-solves run at the backward tolerances when they can adapt.
        window_controller = loop.controller if loop.stepper.error_order is None else controller
        return BackwardSetup(
            stepper=stepper, controller=controller, window_controller=window_controller,
            seminorm=self.seminorm, reconstruct_forward=forward, window=self.window,
            max_drift=self.max_drift, on_backward=self.on_backward,
        )  # fmt: skip

    def _controller(self, controller: AbstractController) -> AbstractController:
        """The backward solve's controller: the forward one at the backward tolerances."""
        if isinstance(controller, PIDController):
            # The augmented state is not shaped like y: tolerances per leaf become one number.
            return dataclasses.replace(
                controller,
                rtol=tightest(controller.rtol) if self.rtol is None else self.rtol,
                atol=tightest(controller.atol) if self.atol is None else self.atol,
            )
        if self.rtol is None and self.atol is None:
            return controller
        if self.rtol is None or self.atol is None:
            raise ValueError(
                "BacksolveAdjoint after a constant-step solve needs both `rtol` and `atol` "
                "for an adaptive backward solve (or neither, for constant steps)."
            )
        return PIDController(rtol=self.rtol, atol=self.atol)


def _check_callback(on_backward) -> None:
    if on_backward is None:
        return
    if not callable(on_backward):
        raise TypeError(
            f"BacksolveAdjoint(on_backward={on_backward!r}) is not callable. Fix: pass a "
            "function taking one dict, e.g. `on_backward=records.append` or `on_backward=print`."
        )
    try:
        hash(on_backward)
    except TypeError:
        raise TypeError(
            f"BacksolveAdjoint(on_backward={on_backward!r}) is not hashable, and `jax.jit` "
            "caches on it. Fix: pass a function or a bound method (e.g. "
            "`on_backward=recorder.record`)."
        ) from None


def _flags_only(saveat: SaveAt) -> SaveAt:
    """`saveat` without its `ts` array: the loop reads `loop.ts`, and only the flags here."""
    return SaveAt(t1=True, steps=saveat.steps, dense=saveat.dense)


def _events(loop: IntegrationLoop, state) -> EventSet | None:
    """The loop's events with their functions closure-converted (so that they may cross the
    custom_vjp boundary), raising if one closes over arrays: the backward solve differentiates
    an event's `fn` through `args` only."""
    if loop.events is None:
        return None
    events = []
    for event in loop.events.events:
        fn = eqx.filter_closure_convert(event.fn, state.t, state.y, loop.args)
        if any(eqx.is_inexact_array(x) for x in jax.tree.leaves(fn)):
            raise ValueError(
                "BacksolveAdjoint: an Event's fn closes over arrays, whose gradients the "
                "backward solve cannot reach. Fix: pass them through `args` "
                "(`fn(t, y, args)`), or use adjoint='recursive'."
            )
        events.append(dataclasses.replace(event, fn=fn))
    return dataclasses.replace(loop.events, events=tuple(events))
