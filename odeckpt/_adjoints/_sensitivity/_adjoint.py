"""`ForwardSensitivity`: forward sensitivities integrated with the state, under its error
control."""

import dataclasses
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..._autodiff import Sweeps, differentiable
from ..._checks import known_values
from ..._loop import (
    AbstractAdaptiveController,
    AbstractController,
    IntegrationLoop,
    LoopState,
    Outputs,
)
from ..._real_coordinates import RealCoordinates
from ..._steppers import with_staggered_tangents
from .._base import AbstractAdjoint, GradientStats, RunResult, while_loop
from ._solve import Integrated, SensitivityInputs, checked, integrated, sensitivities


class ForwardSensitivity(AbstractAdjoint):
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

    def __check_init__(self):
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            known = known_values(f"ForwardSensitivity({name})", value)
            if known is not None and not np.all((known > 0) & np.isfinite(known)):
                raise ValueError(
                    f"ForwardSensitivity({name}={value!r}) must be positive and finite, or None "
                    "for the solve's own tolerance."
                )

    def run(self, loop, state, outputs):
        if loop.saveat.steps or loop.saveat.dense:
            raise ValueError(
                "adjoint=ForwardSensitivity() saves at t0, t1 and save times only. Fix: drop "
                "SaveAt(steps=True) / SaveAt(dense=True) and pass the times you need as "
                "SaveAt(ts=...), or use adjoint='recursive'."
            )
        self._check_controller(loop.controller)
        # Closed-over arrays of `f` become explicit leaves: they get sensitivities like `args`.
        f = eqx.filter_closure_convert(loop.f, state.t, state.y, loop.args)
        events = loop.events
        if events is not None:
            events = events.closure_converted("ForwardSensitivity", state.t, state.y, loop.args)
        loop = dataclasses.replace(
            loop, f=f, stepper=with_staggered_tangents(loop.stepper), events=events
        )
        inputs = SensitivityInputs(loop, state, outputs)
        arguments = _Arguments.of(inputs, (self.rtol, self.atol))
        arrays, static = eqx.partition(arguments, eqx.is_array)
        whole = lambda arrays: eqx.combine(arrays, static)

        def primal(arrays):
            final, outputs, _ = while_loop(*whole(arrays).inputs)
            return final, outputs

        def sweeps() -> Sweeps:
            def forward(arrays):
                out = primal(arrays)
                return out, out

            def tangent(arrays, saved, t_arrays):
                arguments = whole(arrays)
                return _tangent(arguments.inputs, saved, t_arrays.inputs, arguments.tolerances)

            def reverse(arrays, saved, ct_out, want):
                arguments = whole(arrays)
                ct = _reverse(arguments.inputs, saved, ct_out, want, arguments.tolerances)
                return _Arguments.of(ct, None)

            return Sweeps(forward, reverse, tangent)

        final, outputs = differentiable(
            primal, sweeps, arrays, second_order_error=SECOND_ORDER_ERROR
        )
        return RunResult(final, outputs, GradientStats.none())

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


SECOND_ORDER_ERROR = (
    "ForwardSensitivity: reverse-mode differentiation of its derivatives, as "
    "`jax.jacrev(jax.jacfwd(f))` or `jax.grad(jax.grad(f))` take it, is not supported: they are "
    "sensitivity solves in a while loop, which JAX cannot reverse. Fix: take second "
    "derivatives forward over reverse, `jax.jacfwd(jax.jacrev(f))` or `jax.hessian(f)`, or "
    "forward over forward, `jax.jacfwd(jax.jacfwd(f))`."
)


class _Arguments(NamedTuple):
    """What the rule is differentiated with respect to: the inputs, and the sensitivities'
    `(rtol, atol)` (`None` for the state's), which may be traced arrays and so must be
    arguments of the rule, never values it closes over. The loop's `jump_ts` are an entry of
    their own: the reverse sweep integrates their sensitivities only when they are
    differentiated (`want.jump_ts`)."""

    loop: IntegrationLoop
    init: LoopState
    outputs: Outputs
    tolerances: tuple
    jump_ts: jax.Array | None

    @classmethod
    def of(cls, inputs: SensitivityInputs, tolerances) -> "_Arguments":
        loop = dataclasses.replace(inputs.loop, jump_ts=None)
        return cls(loop, inputs.init, inputs.outputs, tolerances, inputs.loop.jump_ts)

    @property
    def inputs(self) -> SensitivityInputs:
        loop = dataclasses.replace(self.loop, jump_ts=self.jump_ts)
        return SensitivityInputs(loop, self.init, self.outputs)


def _zeros_like_out(out):
    """A tangent of `out`: zeros on its inexact leaves, `None` elsewhere."""
    return jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_inexact_array(x) else None, out)


def _times_part(inputs: SensitivityInputs, saved, dt_end, dts):
    """The outputs' tangents from moving the final time and the save times: `f(t, y(t)) dt`."""
    loop = inputs.loop
    final, outputs = saved
    f_end = loop.stepper.derivative(final.stepper_state)
    # A terminal event ends the solve where it fires, however the end of the span moves.
    dt_end = jnp.where(_fired(loop, final), 0, dt_end)
    end = jax.tree.map(lambda f: f * dt_end.astype(f.dtype), f_end)
    if loop.ts is None:
        return end, None
    written = _written(inputs, outputs)

    def row(t, y, dt, keep):
        rate = loop.f(t, y, loop.args)
        return jax.tree.map(lambda r: jnp.where(keep, r * dt.astype(r.dtype), 0), rate)

    safe = lambda t, y: (jnp.where(jnp.isfinite(t), t, 0), y)
    ts, ys = safe(loop.ts, outputs.ts)
    ys = jax.tree.map(lambda y: jnp.where(_rows(written, y), y, 0), ys)
    return end, jax.vmap(row)(ts, ys, dts, written)


def _fired(loop, final) -> jax.Array:
    """Whether a terminal event ended the solve."""
    return jnp.zeros((), bool) if loop.events is None else final.events.event >= 0


def _written(inputs: SensitivityInputs, outputs) -> jax.Array:
    """Which save-time rows the loop writes (times after `t0`, reached); the others keep the
    values (and tangents) they had on input."""
    loop, init, _ = inputs
    m = loop.ts.shape[0]
    reached = jax.vmap(lambda y: jnp.all(jnp.isfinite(y)))(
        jax.tree.leaves(outputs.ts)[0].reshape(m, -1)
    )
    return (jnp.arange(m) >= init.save_index) & reached & jnp.isfinite(loop.ts)


def _rows(mask, y):
    return mask.reshape(mask.shape + (1,) * (y.ndim - 1))


def _tangent(inputs: SensitivityInputs, saved, t_inputs: SensitivityInputs, tolerances):
    """The tangent of `(final state, outputs)` along `t_inputs`: one sensitivity solve."""
    loop = inputs.loop
    final, outputs = saved
    direction = integrated(t_inputs)
    sens = sensitivities(inputs, jax.tree.map(lambda x: x[None], direction), tolerances)
    end, rows = _times_part(inputs, saved, t_inputs.loop.t_end, t_inputs.loop.ts)
    sens = checked(loop, final, sens, sens)
    t_final = _zeros_like_out(final)
    dy = jax.tree.map(lambda s, e: s[0] + e, sens.end, end)
    t_end = jnp.where(_fired(loop, final), sens.t_end[0], t_inputs.loop.t_end)
    t_final = dataclasses.replace(t_final, y=dy, t=t_end.astype(final.t.dtype))
    t_outputs = _zeros_like_out(outputs)
    if rows is not None:
        written = _written(inputs, outputs)
        values = jax.tree.map(
            lambda s, e, given: jnp.where(_rows(written, e), s[:, 0] + e, given),
            sens.rows, rows, t_inputs.outputs.ts,
        )  # fmt: skip
        t_outputs = dataclasses.replace(t_outputs, ts=values)
    return t_final, t_outputs


def _pair(ct, t):
    """`Re sum(ct * t)`, JAX's pairing of a cotangent with a tangent (complex included)."""
    return sum(
        jnp.sum(jnp.real(c * x)) for c, x in zip(*map(jax.tree.leaves, (ct, t)), strict=True)
    )


def _reverse(inputs: SensitivityInputs, saved, ct_out, want: "_Arguments", tolerances):
    """The cotangents of the inputs: the Jacobian along every integrated input component (one
    sensitivity solve), contracted with the cotangent."""
    loop, init, outputs_in = inputs
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
    written = None if loop.ts is None else _written(inputs, outputs)
    if flat.shape[0] == 0:
        values = flat  # only times are differentiated: `dy/dt = f` needs no sensitivity
    else:
        basis = jax.vmap(coordinates.unravel)(jnp.eye(flat.shape[0], dtype=flat.dtype))
        sens = sensitivities(inputs, _completed(basis, inputs), tolerances)
        values = _contracted(checked(loop, final, sens, sens), ct_final, ct_outputs, written)
    # A complex input's cotangent is (pairing with 1) - i (pairing with i).
    ct_theta = jax.tree.map(jnp.conj, coordinates.unravel(values.astype(flat.dtype)))
    times = lambda dt_end, dts: _times_part(inputs, saved, dt_end, dts)
    dts0 = None if loop.ts is None else jnp.zeros_like(loop.ts)
    ct_end, ct_ts = _times_transpose(times, loop.t_end, dts0, ct_final, ct_outputs)
    empty = lambda tree: jax.tree.map(lambda _: None, tree)
    ct_loop = empty(loop)
    if want.loop:
        g_f, g_args = ct_theta.diff
        ct_loop = dataclasses.replace(ct_loop, f=g_f, args=g_args)
    ct_end = ct_end + jnp.where(_fired(loop, final), 0, ct_final.t)
    ct_loop = dataclasses.replace(ct_loop, t_end=ct_end, ts=ct_ts, jump_ts=ct_theta.jump_ts)
    ct_init = empty(init)
    if want.init:
        ct_init = dataclasses.replace(ct_init, y=ct_theta.y0, t=ct_theta.t0)
    ct_outputs_in = None
    if loop.ts is not None and want.outputs:
        kept = jax.tree.map(lambda c: jnp.where(_rows(written, c), 0, c), ct_outputs.ts)
        ct_outputs_in = dataclasses.replace(empty(outputs_in), ts=kept)
    return SensitivityInputs(ct_loop, ct_init, ct_outputs_in)


def _contracted(sens, ct_final, ct_outputs, written) -> jax.Array:
    """The cotangents of the integrated inputs' real coordinates: each direction's
    sensitivities (leading axis) paired with the outputs' cotangents."""
    if sens.rows is not None:
        # Rows the loop does not write (the repeats of a save time) hold inf: 0 * inf is NaN.
        ct_rows = jax.tree.map(lambda c: jnp.where(_rows(written, c), c, 0), ct_outputs.ts)
        rows = jax.tree.map(lambda s: jnp.where(_rows(written, s), s, 0), sens.rows)

    def column(k):
        value = _pair(ct_final.y, jax.tree.map(lambda s: s[k], sens.end))
        value = value + ct_final.t * sens.t_end[k]
        if sens.rows is not None:
            value = value + _pair(ct_rows, jax.tree.map(lambda s: s[:, k], rows))
        return value

    return jax.vmap(column)(jnp.arange(sens.t_end.shape[0]))


def _times_transpose(times, t_end, dts0, ct_final, ct_outputs):
    """The cotangents of the final time and the save times through `f(t, y(t)) dt`."""
    _, vjp = jax.vjp(times, t_end, dts0)
    ct_rows = None if dts0 is None else ct_outputs.ts
    ct_end, ct_ts = vjp((ct_final.y, ct_rows))
    return ct_end, ct_ts


def _completed(basis: Integrated, inputs: SensitivityInputs) -> Integrated:
    """`basis` with zero directions for the inputs it leaves out."""
    theta = integrated(inputs)
    k = jax.tree.leaves(basis)[0].shape[0]
    zeros = lambda x: jnp.zeros((k, *jnp.shape(x)), jnp.result_type(x))
    fill = lambda b, x: jax.tree.map(zeros, x) if b is None else b
    return jax.tree.map(fill, basis, theta, is_leaf=lambda x: x is None)
