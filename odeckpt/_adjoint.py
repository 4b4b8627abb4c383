"""Adjoints: how the integration loop is run, and so how it is differentiated."""

import abc

import equinox as eqx
import jax

from ._integrate import Loop, LoopState, apply_writes
from ._types import Y


class AbstractAdjoint(eqx.Module):
    """Runs the integration loop. Each adjoint picks the loop runner that gives its kind of
    derivative; the loop itself (`Loop.cond`, `Loop.body`) is the same for all of them.
    """

    @abc.abstractmethod
    def run(
        self, loop: Loop, state: LoopState, outputs: tuple[Y, ...]
    ) -> tuple[LoopState, tuple[Y, ...]]:
        """Run `loop` from `state` until `loop.cond` is false or `loop.max_steps` steps have been
        taken; return the final state and the filled output buffers."""


class ForwardMode(AbstractAdjoint):
    """Forward-mode differentiation (`jax.jvp`, `jax.jacfwd`): the loop is a plain
    `lax.while_loop`, which JAX differentiates in forward mode at the cost of one extra tangent
    per step. The right choice for problems with few parameters; it stores nothing per step.
    """

    def run(self, loop, state, outputs):
        def cond(carry):
            state, _, steps = carry
            return loop.cond(state) & (steps < loop.max_steps)

        def body(carry):
            state, outputs, steps = carry
            state, writes = loop.body(state)
            return state, apply_writes(outputs, writes), steps + 1

        state, outputs, _ = jax.lax.while_loop(cond, body, (state, outputs, 0))
        return state, outputs
