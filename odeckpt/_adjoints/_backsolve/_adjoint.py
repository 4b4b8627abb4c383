"""`BacksolveAdjoint`: the continuous adjoint, solved backwards in time."""

from collections.abc import Callable

import equinox as eqx

from ..._checks import count, python_int
from ..._steppers import AbstractStepper
from ._anchors import Anchoring
from ._backward import IntegrateStateBackwards, ReadForwardStates
from ._continuous import ContinuousAdjoint
from ._setup import AbstractBackwardSolve


class BacksolveAdjoint(ContinuousAdjoint):
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
    - `seminorm`: leave the parameter integral out of the backward error estimate when `y` is
        integrated backwards beside it (its error follows the integrand's changes in time).
        With `y` re-solved forwards the adjoint alone would be measured, which misses them (a
        forcing of `f`), and the integral stays in.
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
        if self.checkpoints is not None:
            count("BacksolveAdjoint(checkpoints=...)", self.checkpoints,
                  "e.g. checkpoints=8, or checkpoints=None for no stored states")  # fmt: skip

    def anchoring(self) -> Anchoring | None:
        return None if self.checkpoints is None else Anchoring(int(self.checkpoints), None)

    def backward_solve(self, stepper: AbstractStepper) -> AbstractBackwardSolve:
        forward = self.reconstruct == "forward" or (self.reconstruct == "auto" and stepper.implicit)
        return ReadForwardStates() if forward else IntegrateStateBackwards()

    @property
    def re_solves_from_start(self) -> bool:
        return False

    def window_controller(self, loop, backward):
        # At the backward tolerances when the forward stepper can adapt to them.
        return loop.controller if loop.stepper.error_order is None else backward

    @property
    def seminormed(self) -> bool:
        return self.seminorm

    @property
    def failure_fix(self) -> str:
        return (
            "re-anchor with `BacksolveAdjoint(checkpoints=...)` or use `reconstruct='forward'` "
            "or `InterpolatingAdjoint`"
        )
