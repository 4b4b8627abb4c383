"""`ForwardMode`: the integration loop in a plain while loop, differentiated in forward mode."""

import jax
import jax.numpy as jnp

from ..checkpointing._linear import linear_call
from ._base import AbstractAdjoint, GradientStats, RunResult, span_derivative, while_loop


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
        final, outputs, _ = while_loop(loop, state, outputs)
        # The results pass through an identity whose transpose raises, so that `jax.grad`
        # fails with a message naming the adjoints that support reverse mode.
        leaves, treedef = jax.tree.flatten((span_derivative(loop, state, final), outputs))
        inexact = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
        guarded = linear_call(lambda _, x: x, _no_reverse_mode, [], [leaves[i] for i in inexact])
        for i, x in zip(inexact, guarded, strict=True):
            leaves[i] = x
        final, outputs = jax.tree.unflatten(treedef, leaves)
        return RunResult(final, outputs, GradientStats.none())


def _no_reverse_mode(residuals, cotangents):
    raise TypeError(
        "adjoint=ForwardMode() supports forward mode only (jax.jvp, jax.jacfwd). Fix: for "
        "jax.grad / jax.vjp / jax.jacrev use adjoint='recursive' (RecursiveCheckpointAdjoint, "
        "the default) or adjoint='direct' (DirectAdjoint)."
    )
