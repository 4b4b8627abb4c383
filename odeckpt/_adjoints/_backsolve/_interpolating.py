"""`InterpolatingAdjoint`: the continuous adjoint with error control on the whole adjoint, reading
the forward solution from checkpointed forward re-solves."""

from collections.abc import Callable

import equinox as eqx

from ..._checks import count, python_int
from ..._steppers import AbstractStepper
from ._anchors import Anchoring
from ._backward import ReadForwardStates
from ._continuous import ContinuousAdjoint
from ._setup import AbstractBackwardSolve


class InterpolatingAdjoint(ContinuousAdjoint):
    """Differentiate a solve by solving the continuous adjoint equations backwards in time,
    reading the forward solution `y(t)` from the dense output of forward re-solves that start
    from checkpoints.

    The forward solve stores its state every `window // 2` accepted steps in `checkpoints`
    slots (when they are full, every other state is dropped and the spacing doubles, so the
    slots always span the whole solve). The gradient then solves, from the final time back to
    `t0`, the adjoint `a = dL/dy(t)` and the parameter integral `g = dL/dparams`, both under
    error control (no seminorm), with `y(t)` read from the continuous extension of the last
    `window` steps of a forward re-solve (with the forward solve's controller) from the latest
    checkpoint before the current time.
    While the checkpoints are at most `window // 2` steps apart (solves of up to
    `checkpoints * window // 2` steps), each stretch of the solve is re-solved once: one extra
    forward integration in all, as in CVODES; beyond that, a stretch between checkpoints
    takes several re-solves. Memory: `checkpoints` states and `window` steps of dense output,
    whatever the number of steps. A stiff problem (an implicit forward stepper) gets the same
    implicit stepper backwards. Gradients flow to `y0`, the inexact arrays of `args` and of
    arrays the vector field closes over, `t0`, `t1` and the save times. Reverse mode only.

    The gradient approximates the derivative of the exact solution, not the derivative of the
    discrete forward solve (that is `RecursiveCheckpointAdjoint`): choose it when the discrete
    derivative cannot be trusted (stiff problems at loose tolerances, see
    docs/which-adjoint.md) and the parameters are too many for `ForwardSensitivity`. It reads
    `y(t)` from a numerical solution, whose error it inherits: by default the forward
    solution, retraced from the checkpoints the forward solve stored; given tolerances of
    its own, a solution re-solved from `y0` at them (one forward integration more, storing
    its own checkpoints; the forward solve stores none), so that the gradient is accurate to
    them whatever the forward solve's accuracy (the loss still sees the forward solve). On
    sensitive problems the gradient needs `y(t)` far more accurately than the loss does
    (docs/which-adjoint.md: two decades tighter than the solve is a good start). The
    re-solved state is compared with the forward solution wherever that is known (the
    checkpoints, the saved outputs, `y(t1)`), and the gradient fails beyond `max_drift` (as
    for `BacksolveAdjoint`).

    **Arguments:**

    - `checkpoints`: slots for stored forward states; `None` uses `window`.
    - `rtol`, `atol`: tolerances of the backward solve and of the solution `y(t)` is read
        from. `None` for both: the backward solve uses the forward controller's, and the
        forward re-solves retrace the forward solution (that the loss saw) step for step
        from its checkpoints (after a `ConstantStep` forward solve: constant steps of the
        forward `dt0` backwards). Either given (the other `None` takes the forward
        controller's): `y(t)` is re-solved from `y0` at these tolerances, which needs a
        forward stepper with an error estimate.
    - `solver`: the stepper of the backward solve; `None` uses the forward one.
    - `window`: steps of dense output a forward re-solve keeps (at least 2).
    - `max_drift`, `on_backward`: as `BacksolveAdjoint`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import odeckpt

    def loss(k):
        sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.array([1.0, 2.0]), (0.0, 1.0),
                            args=k, adjoint=odeckpt.InterpolatingAdjoint())
        return jnp.sum(sol.ys[-1] ** 2)

    jax.grad(loss)(jnp.array(0.5))
    ```

    **References:**

    - R. Serban & A. C. Hindmarsh, "CVODES: the sensitivity-enabled ODE solver in SUNDIALS",
        ASME IDETC 2005 (checkpoints every `Nd` steps, the forward solution re-solved and
        interpolated between them).
    - Y. Ma, V. Dixit, M. Innes, X. Guo, C. Rackauckas, "A Comparison of Automatic
        Differentiation and Continuous Sensitivity Analysis for Derivatives of Differential
        Equation Solutions", IEEE HPEC 2021 (SciMLSensitivity's `InterpolatingAdjoint`).
    """

    checkpoints: int | None = eqx.field(default=None, static=True, converter=python_int)
    rtol: float | None = None
    atol: float | None = None
    solver: AbstractStepper | None = None
    window: int = eqx.field(default=64, static=True, converter=python_int)
    max_drift: float = 1000.0
    on_backward: Callable[[dict], None] | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if isinstance(self.window, int) and self.window == 1:
            raise ValueError(
                "InterpolatingAdjoint(window=1) must be at least 2 (checkpoints are stored "
                "every window // 2 steps). Fix: pass e.g. window=64."
            )
        if self.checkpoints is not None:
            count("InterpolatingAdjoint(checkpoints=...)", self.checkpoints,
                  "e.g. checkpoints=64, or checkpoints=None for as many as `window`")  # fmt: skip

    def anchoring(self) -> Anchoring:
        slots = self.window if self.checkpoints is None else self.checkpoints
        return Anchoring(int(slots), int(self.window) // 2)

    def backward_solve(self, stepper: AbstractStepper) -> AbstractBackwardSolve:
        return ReadForwardStates()

    @property
    def re_solves_from_start(self) -> bool:
        return self.rtol is not None or self.atol is not None

    def window_controller(self, loop, backward):
        # At tolerances of its own, `y(t)` is re-solved at them; else the re-solves retrace the
        # forward solution, step for step.
        return backward if self.re_solves_from_start else loop.controller

    @property
    def seminormed(self) -> bool:
        return False

    @property
    def failure_fix(self) -> str:
        return "raise `InterpolatingAdjoint(checkpoints=...)` or `window`"
