"""`ForwardSensitivity`: forward sensitivities integrated with the state, under its error
control."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..._checks import known_values, leading_mask
from ..._loop import AbstractAdaptiveController, AbstractController
from ..._real_coordinates import RealCoordinates
from ..._steppers import with_staggered_tangents
from .._base import GradientStats, while_loop
from .._custom_rule import AbstractCustomRuleAdjoint, RuleInputs, checked, loop_cotangent
from .._derivatives import OutputTimes, pair, terminated
from ._solve import Integrated, integrated, sensitivities, sensitivity_checks


class ForwardSensitivity(AbstractCustomRuleAdjoint):
    """Derivatives by forward sensitivities whose error the step-size control keeps within the
    solve's tolerances.

    The sensitivities `s = dy/dp` of the state with respect to the differentiated inputs are
    integrated with the state (each step of the state differentiated with its times held
    fixed: the same method applied to `s' = (df/dy) s + (df/dp) dp`), and a step is accepted
    only if the largest of the error norms of the state and of each direction's sensitivities
    is at most 1 (CVODES' full error control, `errconS`). Each direction is scaled as CVODES
    scales a parameter's sensitivity when it estimates its tolerances: with the same `rtol`
    and `atol / |pbar|`, `pbar` the input's value (1 where it is 0, the span for `t0`), so
    that `dy/dlog p` is held to `atol`. The derivative is then that of the exact solution to
    about the tolerance, where `RecursiveCheckpointAdjoint`, `DirectAdjoint` and `ForwardMode`
    give the exact derivative of the discrete solve, whose steps were chosen for the state
    alone (see docs/which-adjoint.md, "Gradient accuracy").

    The implicit steppers solve each stage's sensitivities with the state's LU factors of
    `I - h gamma J` (the staggered corrector: an iteration with those factors and exact
    Jacobian-vector products, converged to the tolerances); Rosenbrock stages reuse the
    step's factors too. With `BDF` the sensitivities carry their own history of differences
    (`AbstractStepper.differentiable_state`); a stepper that proposes its step sizes (`BDF`,
    `Radau5`) proposes them from the state's error, and a step whose sensitivities fail the
    error test is retried shorter; `BDF` chooses its order from the state's error alone.

    - `jax.jvp` / `jax.jacfwd`: one sensitivity solve per direction (under `jacfwd`, one per
        input component, batched), only along the directions asked for.
    - `jax.grad` / `jax.vjp` / `jax.jacrev`: one solve with a sensitivity for every component
        of `y0`, of the inexact arrays of `args` and of those `f` closes over, and of `t0`:
        the whole Jacobian, then contracted with the cotangent. For few parameters only.
    - The final time and the save times need no sensitivity: `dy(t)/dt = f(t, y(t))`.

    Events (`odeckpt.Event`) are located on the state; at each crossing the sensitivities
    follow the event time (the implicit function theorem), and through an `update` the jump
    condition of hybrid systems (see docs/events.md). An event's `fn` and `update` reach the
    parameters through `args` only. A sensitivity solve that meets other events than the
    state's (its steps differ) gives NaN derivatives, and raises with `throw=True`.

    Saves at `t0`, `t1` and save times (`SaveAt(ts=...)`); `SaveAt(steps=True)` and
    `SaveAt(dense=True)` raise. A failed solve of the sensitivities (which may need more
    steps than the state alone) raises with `throw=True`, and gives NaN derivatives.

    **Arguments:**

    - `rtol`, `atol`: the tolerances the (scaled) sensitivities are held to; `None` takes the
        solve's own (CVODES' choice). Tighter values buy a more accurate derivative with more
        steps. They may be traced arrays (one compilation for every tolerance).

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import odeckpt

    def van_der_pol(t, y, mu):
        return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])

    def loss(log_mu):
        sol = odeckpt.solve(van_der_pol, jnp.array([2.0, 0.0]), (0.0, 10.0),
                            args=jnp.exp(log_mu), solver=odeckpt.Kvaerno5(), rtol=1e-6,
                            atol=1e-10, adjoint=odeckpt.ForwardSensitivity())
        return jnp.sum(sol.ys[-1] ** 2)

    jax.grad(loss)(jnp.log(10.0)), jax.jvp(loss, (jnp.log(10.0),), (1.0,))
    ```

    **References:** A. C. Hindmarsh et al., "SUNDIALS: Suite of nonlinear and
    differential/algebraic equation solvers", ACM TOMS 31(3) (2005), 363-396; CVODES
    documentation, "Forward sensitivity analysis" (staggered corrector, full error control,
    tolerances of the sensitivity variables); M. Caracotsios & W. E. Stewart, "Sensitivity
    analysis of initial value problems with mixed ODEs and algebraic equations", Comput. Chem.
    Eng. 9 (1985) (the staggered direct method).
    """

    rtol: float | None = None
    atol: float | None = None

    forward_error: ClassVar[str | None] = None
    second_order_error: ClassVar[str] = (
        "ForwardSensitivity: reverse-mode differentiation of its derivatives, as "
        "`jax.jacrev(jax.jacfwd(f))` or `jax.grad(jax.grad(f))` take it, is not supported: they "
        "are sensitivity solves in a while loop, which JAX cannot reverse. Fix: take second "
        "derivatives forward over reverse, `jax.jacfwd(jax.jacrev(f))` or `jax.hessian(f)`, or "
        "forward over forward, `jax.jacfwd(jax.jacfwd(f))`."
    )

    def __check_init__(self):
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            known = known_values(f"ForwardSensitivity({name})", value)
            if known is not None and not np.all((known > 0) & np.isfinite(known)):
                raise ValueError(
                    f"ForwardSensitivity({name}={value!r}) must be positive and finite, or None "
                    "for the solve's own tolerance."
                )

    def check_mass_matrix(self, events):
        if events is not None and any(e.update is not None for e in events):
            raise ValueError(
                "ForwardSensitivity cannot carry the sensitivities of a DAE `M y' = f` across "
                "an event's `update` jump (the jump's new algebraic values would need their "
                "own consistent sensitivities). Fix: use adjoint='recursive' (the default) or "
                "'direct', or 'forward', which differentiate the jump with the solve."
            )

    def prepare(self, loop):
        if loop.saveat.steps or loop.saveat.dense:
            raise ValueError(
                "adjoint=ForwardSensitivity() saves at t0, t1 and save times only. Fix: drop "
                "SaveAt(steps=True) / SaveAt(dense=True) and pass the times you need as "
                "SaveAt(ts=...), or use adjoint='recursive'."
            )
        self._check_controller(loop.controller)
        loop = dataclasses.replace(loop, stepper=with_staggered_tangents(loop.stepper))
        return loop, (self.rtol, self.atol)

    def forward(self, inputs):
        final, outputs, _ = while_loop(inputs.full_loop, inputs.init, inputs.outputs)
        return (final, outputs), (final, outputs)

    def reverse(self, inputs, saved, ct_out, want):
        return _reverse(inputs, saved, ct_out, want)

    def tangent(self, inputs, saved, t_inputs):
        return _tangent(inputs, saved, t_inputs)

    def gradient_stats(self, settings, final):
        return GradientStats.none()

    def _check_controller(self, controller: AbstractController) -> None:
        """Raise, naming the fix, where the sensitivities' error control cannot be applied:
        a controller that judges the error estimate but takes no tolerances, or tolerances of
        the sensitivities with constant steps."""
        if isinstance(controller, AbstractAdaptiveController):
            return
        name = type(controller).__name__
        if controller.judges_error:
            raise ValueError(
                f"ForwardSensitivity holds the sensitivities' error to tolerances in the "
                f"step-size control, and the controller {name} judges the error estimate "
                "without taking tolerances. Fix: make it a subclass of "
                "`odeckpt.AbstractAdaptiveController`, or use adjoint='recursive'."
            )
        if self.rtol is not None or self.atol is not None:
            raise ValueError(
                f"ForwardSensitivity(rtol=..., atol=...) hold the sensitivities' error in the "
                f"step-size control, and the controller {name} takes steps whatever the error. "
                "Fix: drop ForwardSensitivity's tolerances, or solve with an adaptive "
                "controller (`odeckpt.PIDController()`)."
            )


def _zeros_like_out(out):
    """A tangent of `out`: zeros on its inexact leaves, `None` elsewhere."""
    return jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_inexact_array(x) else None, out)


def _output_times(inputs: RuleInputs, saved) -> OutputTimes:
    """The final time and the save times, and how the outputs move with them."""
    loop = inputs.full_loop
    final, outputs = saved
    f_end = loop.stepper.slope(loop.f, final.t, final.y, loop.args, final.stepper_state)
    field = lambda t, y: loop.stepper.slope(loop.f, t, y, loop.args)
    written = None if loop.ts is None else _written(inputs, outputs)
    return OutputTimes(f_end, terminated(loop, final), field, loop.ts, outputs.ts, written)


def _written(inputs: RuleInputs, outputs) -> jax.Array:
    """Which save-time rows the loop writes (times after `t0`, reached); the others keep the
    values (and tangents) they had on input."""
    loop, init = inputs.loop, inputs.init
    assert loop.ts is not None  # asked only with save times
    m = loop.ts.shape[0]
    reached = jax.vmap(lambda y: jnp.all(jnp.isfinite(y)))(
        jax.tree.leaves(outputs.ts)[0].reshape(m, -1)
    )
    return (jnp.arange(m) >= init.save_index) & reached & jnp.isfinite(loop.ts)


def _tangent(inputs: RuleInputs, saved, t_inputs: RuleInputs):
    """The tangent of `(final state, outputs)` along `t_inputs`: one sensitivity solve."""
    loop = inputs.full_loop
    final, outputs = saved
    direction = integrated(t_inputs)
    sens = sensitivities(inputs, jax.tree.map(lambda x: x[None], direction))
    times = _output_times(inputs, saved)
    end, rows = times.tangent(t_inputs.loop.t_end, t_inputs.loop.ts)
    sens = checked(sens, loop, final, sensitivity_checks(loop, final, sens))
    t_final = _zeros_like_out(final)
    dy = jax.tree.map(lambda s, e: s[0] + e, sens.end, end)
    t_end = jnp.where(times.ended_by_event, sens.t_end[0], t_inputs.loop.t_end)
    t_final = dataclasses.replace(t_final, y=dy, t=t_end.astype(final.t.dtype))
    t_outputs = _zeros_like_out(outputs)
    if rows is not None:
        keep = times.keep
        assert keep is not None  # given with the save times
        values = jax.tree.map(
            lambda s, e, given: jnp.where(leading_mask(keep, e), s[:, 0] + e, given),
            sens.rows, rows, t_inputs.outputs.ts,
        )  # fmt: skip
        t_outputs = dataclasses.replace(t_outputs, ts=values)
    return t_final, t_outputs


def _reverse(inputs: RuleInputs, saved, ct_out, want: RuleInputs) -> RuleInputs:
    """The cotangents of the inputs: the Jacobian along every integrated input component (one
    sensitivity solve), contracted with the cotangent."""
    loop, init, outputs_in = inputs.full_loop, inputs.init, inputs.outputs
    final, outputs = saved
    ct_final, ct_outputs = ct_out
    theta = integrated(inputs)
    if not want.loop:
        theta = dataclasses.replace(theta, diff=jax.tree.map(lambda _: None, theta.diff))
    if not want.init:
        theta = dataclasses.replace(theta, y0=None, t0=None)
    if not want.jump_ts:
        theta = dataclasses.replace(theta, jump_ts=None)
    coordinates, flat = RealCoordinates.make(theta)
    times = _output_times(inputs, saved)
    if flat.shape[0] == 0:
        values = flat  # only times are differentiated: `dy/dt = f` needs no sensitivity
    else:
        basis = jax.vmap(coordinates.unravel)(jnp.eye(flat.shape[0], dtype=flat.dtype))
        sens = sensitivities(inputs, _completed(basis, inputs))
        sens = checked(sens, loop, final, sensitivity_checks(loop, final, sens))
        values = _contracted(sens, ct_final, ct_outputs, times.keep)
    # A complex input's cotangent is (pairing with 1) - i (pairing with i).
    ct_theta = jax.tree.map(jnp.conj, coordinates.unravel(values.astype(flat.dtype)))
    ct_end, ct_ts = times.cotangents(loop.t_end, ct_final.t, ct_final.y, ct_outputs.ts)
    g_f, g_args = ct_theta.diff if want.loop else (None, None)
    ct_loop = loop_cotangent(loop, f=g_f, args=g_args, t_end=ct_end, ts=ct_ts,
                             jump_ts=ct_theta.jump_ts)  # fmt: skip
    empty = lambda tree: jax.tree.map(lambda _: None, tree)
    ct_init = empty(init)
    if want.init:
        ct_init = dataclasses.replace(ct_init, y=ct_theta.y0, t=ct_theta.t0)
    ct_outputs_in = None
    if loop.ts is not None and want.outputs:
        keep = times.keep
        assert keep is not None  # given with the save times
        written = lambda c: leading_mask(keep, c)
        kept = jax.tree.map(lambda c: jnp.where(written(c), 0, c), ct_outputs.ts)
        ct_outputs_in = dataclasses.replace(empty(outputs_in), ts=kept)
    return RuleInputs.of(ct_loop, ct_init, ct_outputs_in)


def _contracted(sens, ct_final, ct_outputs, written) -> jax.Array:
    """The cotangents of the integrated inputs' real coordinates: each direction's
    sensitivities (leading axis) paired with the outputs' cotangents."""
    ct_rows = rows = None
    if sens.rows is not None:
        # Rows the loop does not write (the repeats of a save time) hold inf: 0 * inf is NaN.
        ct_rows = jax.tree.map(lambda c: jnp.where(leading_mask(written, c), c, 0), ct_outputs.ts)
        rows = jax.tree.map(lambda s: jnp.where(leading_mask(written, s), s, 0), sens.rows)

    def column(k):
        value = pair(ct_final.y, jax.tree.map(lambda s: s[k], sens.end))
        value = value + ct_final.t * sens.t_end[k]
        if sens.rows is not None:
            value = value + pair(ct_rows, jax.tree.map(lambda s: s[:, k], rows))
        return value

    return jax.vmap(column)(jnp.arange(sens.t_end.shape[0]))


def _completed(basis: Integrated, inputs: RuleInputs) -> Integrated:
    """`basis` with zero directions for the inputs it leaves out."""
    theta = integrated(inputs)
    k = jax.tree.leaves(basis)[0].shape[0]
    zeros = lambda x: jnp.zeros((k, *jnp.shape(x)), jnp.result_type(x))
    fill = lambda b, x: jax.tree.map(zeros, x) if b is None else b
    return jax.tree.map(fill, basis, theta, is_leaf=lambda x: x is None)
