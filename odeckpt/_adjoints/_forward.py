"""`ForwardMode`: the integration loop in a plain while loop, differentiated in forward mode."""

from .._autodiff import forward_only
from ._base import AbstractAdjoint, GradientStats, RunResult, span_derivative, while_loop


class ForwardMode(AbstractAdjoint):
    """Forward-mode differentiation (`jax.jvp`, `jax.jacfwd`): the loop is a plain
    `lax.while_loop`, which JAX differentiates in forward mode at the cost of one extra tangent
    per step. The right choice for problems with few parameters; it stores nothing per step.
    Reverse mode (`jax.grad`) raises, naming the adjoints that support it.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    final = lambda y0: odeckpt.solve(f, y0, (0.0, 1.0), adjoint=odeckpt.ForwardMode()).ys[-1]
    jac = jax.jacfwd(final)(y0)
    ```
    """

    def run(self, loop, state, outputs):
        final, outputs, _ = while_loop(loop, state, outputs)
        # The results pass through an identity whose transpose raises, so that `jax.grad`
        # fails with a message naming the adjoints that support reverse mode.
        final, outputs = forward_only((span_derivative(loop, state, final), outputs), _REVERSE)
        return RunResult(final, outputs, GradientStats.none())


_REVERSE = TypeError(
    "adjoint=ForwardMode() supports forward mode only (jax.jvp, jax.jacfwd). Fix: for "
    "jax.grad / jax.vjp / jax.jacrev use adjoint='recursive' (RecursiveCheckpointAdjoint, "
    "the default) or adjoint='direct' (DirectAdjoint)."
)
