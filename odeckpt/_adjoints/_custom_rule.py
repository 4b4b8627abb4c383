"""The skeleton of the adjoints that differentiate the loop by a rule of their own
(`BacksolveAdjoint` and `InterpolatingAdjoint`: reverse mode by a backward solve;
`ForwardSensitivity`: forward sensitivities): how the loop is prepared for the rule, what the
rule is differentiated with respect to, how its failures are reported, and the loop's
cotangent. A subclass supplies the sweeps."""

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from .._autodiff import Sweeps, closure_convert, differentiable
from .._errors import error_if
from .._loop import IntegrationLoop, LoopState, Outputs
from .._status import Status
from .._types import BoolScalar
from ._base import AbstractAdjoint, GradientStats, RunResult


class RuleInputs(NamedTuple):
    """What the rule is differentiated with respect to: the loop without its known
    discontinuities, the initial state, the output buffers, the adjoint's `settings` (whose
    arrays, traced tolerances, must be arguments of the rule, never values it closes over), and
    the loop's `jump_ts`, an entry of their own so that the reverse sweep's `want.jump_ts`
    says whether they are differentiated. Tangents and cotangents have this type too."""

    loop: IntegrationLoop
    init: LoopState
    outputs: Outputs
    settings: Any
    jump_ts: jax.Array | None

    @classmethod
    def of(cls, loop: IntegrationLoop, init, outputs, settings=None) -> "RuleInputs":
        """`loop` (or its tangent or cotangent) with its `jump_ts` made an entry of their own."""
        return cls(dataclasses.replace(loop, jump_ts=None), init, outputs, settings, loop.jump_ts)

    @property
    def full_loop(self) -> IntegrationLoop:
        """The loop with its `jump_ts`."""
        return dataclasses.replace(self.loop, jump_ts=self.jump_ts)


class AbstractCustomRuleAdjoint(AbstractAdjoint):
    """An adjoint that runs the loop in a plain while loop and differentiates it by a rule of
    its own (`odeckpt._autodiff.differentiable`). `run` closure-converts the vector field and
    the events (their closed-over arrays become leaves, which get derivatives like `args`),
    lets the subclass `prepare` the loop, and wires its sweeps into the rule.

    The sweeps read the adjoint's settings from `RuleInputs.settings`, never from the
    adjoint's own fields (which may be traced arrays).
    """

    forward_error: ClassVar[str | None]
    """With a message: forward mode (`jax.jvp`, `jax.jacfwd`) raises it."""
    second_order_error: ClassVar[str]
    """The message raised by reverse mode over the rule's derivatives."""

    @abc.abstractmethod
    def prepare(self, loop: IntegrationLoop) -> tuple[IntegrationLoop, Any]:
        """`(loop, settings)`: the loop as the rule runs it, and the settings its sweeps read;
        raises, naming the fix, on a configuration the adjoint cannot differentiate."""

    @abc.abstractmethod
    def forward(self, inputs: RuleInputs) -> tuple[tuple[LoopState, Outputs], Any]:
        """`((final state, outputs), saved)`: the loop run from `inputs`, and what the other
        sweeps need of it."""

    @abc.abstractmethod
    def reverse(self, inputs: RuleInputs, saved, ct_out, want: RuleInputs) -> RuleInputs:
        """The cotangents of `inputs` from those of `(final state, outputs)` (see
        `odeckpt._autodiff.Sweeps`); that of the loop from `loop_cotangent`."""

    @abc.abstractmethod
    def tangent(self, inputs: RuleInputs, saved, t_inputs: RuleInputs) -> tuple[LoopState, Outputs]:
        """The tangent of `(final state, outputs)` along `t_inputs` (never asked for where
        `forward_error` refuses forward mode)."""

    @abc.abstractmethod
    def gradient_stats(self, settings, final: LoopState) -> GradientStats:
        """What the reverse sweep of a run that ended in `final` keeps and recomputes."""

    def run(self, loop, state, outputs):
        loop, settings = self.prepare(loop)
        f = closure_convert(loop.f, state.t, state.y, loop.args)
        events = loop.events
        if events is not None:
            events = events.closure_converted(type(self).__name__, state.t, state.y, loop.args)
        loop = dataclasses.replace(loop, f=f, events=events)
        arrays, static = eqx.partition(RuleInputs.of(loop, state, outputs, settings), eqx.is_array)
        combined = lambda arrays: eqx.combine(arrays, static)

        def sweeps() -> Sweeps:
            return Sweeps(
                forward=lambda arrays: self.forward(combined(arrays)),
                reverse=lambda arrays, saved, ct_out, want: self.reverse(
                    combined(arrays), saved, ct_out, want
                ),
                tangent=lambda arrays, saved, t_inputs: self.tangent(
                    combined(arrays), saved, t_inputs
                ),
            )

        final, outputs = differentiable(
            lambda arrays: self.forward(combined(arrays))[0], sweeps, arrays,
            forward_error=self.forward_error, second_order_error=self.second_order_error,
        )  # fmt: skip
        return RunResult(final, outputs, self.gradient_stats(settings, final))


_SETTINGS = ("stepper", "controller", "saveat", "progress", "events")
"""The loop's fields that hold settings (traced tolerances, the save times' array, the
progress bar's span, the events' time direction), which the rules do not differentiate. (The
events' functions close over no inexact arrays, `EventSet.closure_converted`: their parameters
are in `args`.)"""


def loop_cotangent(loop: IntegrationLoop, **cotangents) -> IntegrationLoop:
    """The cotangent of `loop`: `cotangents` by field name (`None`: none), `None` for its
    settings. Raises at trace time if a field that holds inexact arrays is given no cotangent,
    so that no field of the loop silently gets a zero gradient."""
    inexact = lambda value: any(eqx.is_inexact_array(x) for x in jax.tree.leaves(value))
    missing = [
        field.name
        for field in dataclasses.fields(loop)
        if field.name not in cotangents
        and field.name not in _SETTINGS
        and inexact(getattr(loop, field.name))
    ]
    if missing:
        raise TypeError(
            f"The cotangent of the integration loop gives none for {missing}, which hold "
            "inexact arrays and would get a zero gradient. Fix: pass each one's cotangent (or "
            "`None`, where it has none) to `loop_cotangent`."
        )
    return dataclasses.replace(jax.tree.map(lambda _: None, loop), **cotangents)


def checked(tree, loop: IntegrationLoop, final: LoopState, checks: Sequence[tuple]):
    """`tree` (a rule's derivatives), NaN on its inexact leaves unless the forward solve (which
    ended in `final`) succeeded and every check `(ok, message)` of the rule passed; with
    `throw`, raising the message of the first check that fails after a successful forward
    solve. A failed forward solve has raised already (with `throw`) and has NaN derivatives:
    the checks after it say nothing more."""
    ok: BoolScalar = loop.final_status(final) == Status.successful
    for passed, message in checks:
        if loop.throw:
            tree = error_if(tree, ok & ~passed, message)
        ok = ok & passed
    nan = lambda x: jnp.where(ok, x, jnp.nan).astype(x.dtype)
    return jax.tree.map(lambda x: nan(x) if eqx.is_inexact_array(x) else x, tree)
