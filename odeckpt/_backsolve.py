"""The continuous adjoint ("backsolve"): gradients from an augmented ODE solved backwards."""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from ._adjoint import AbstractAdjoint, ForwardMode
from ._backsolve_ode import (
    BackwardStats,
    Checkpoints,
    Problem,
    all_finite,
    dense_group,
    event_groups,
    has_ct,
    pair,
    solve_backwards,
    solve_with_forward_states,
    zeros_for_none,
)
from ._controllers import AbstractController, PIDController
from ._integrate import Loop, LoopState, apply_writes
from ._saveat import SaveAt
from ._status import Status
from ._steppers._base import AbstractStepper
from ._steppers._implicit import AbstractImplicit, with_newton_tolerances
from ._steppers._rosenbrock import AbstractRosenbrock
from ._types import Scalar


class BacksolveAdjoint(AbstractAdjoint):
    """Differentiate a solve by solving the continuous adjoint equations backwards in time.

    The forward solve is an ordinary while loop (its values are exactly those of `ForwardMode`)
    that stores nothing per step. The gradient solves, from the final time back to `t0`, the
    augmented ODE of the state `y` (reconstructed backwards), the adjoint `a = dL/dy(t)` and the
    parameter integral `g`:

    `dy/dt = f(t, y)`, `da/dt = -a^T df/dy`, `dg/dt = -a^T df/dargs`,

    so memory is independent of the number of steps. Cotangents on saved outputs enter as jumps
    in `a` at their times; the backward solve stops at each of them. Gradients are returned for
    `y0`, the inexact arrays of `args` (any pytree, equinox modules included; arrays closed over
    by the vector field too), `t0`, `t1` (`dL/dt1 = <dL/dy(t1), f(t1, y(t1))>`) and the save
    times (`dL/dts_i = <dL/dy(ts_i), f(ts_i, y(ts_i))>`).

    The gradient approximates the exact one to the tolerance of the backward solve (it is not
    the derivative of the discrete forward solve, which `DirectAdjoint` and
    `RecursiveCheckpointAdjoint` give). Plain backsolve reconstructs `y` by integrating it
    backwards, which drifts on stiff or chaotic problems; every state the forward solve already
    returns re-anchors the reconstruction for free (saved `ts` values, `SaveAt(steps=True)`
    states, dense-output step starts), and `checkpoints=k` stores `k` more.

    Which states are checkpointed: the first accepted step end at or after each of the `k`
    times `t0 + j (t1 - t0) / (k + 1)`, `j = 1..k`. Spacing them evenly in time (not in steps,
    whose number is unknown in advance) bounds the longest stretch integrated backwards without
    an anchor, and the error of the reconstructed state grows with that length (exponentially on
    unstable problems); storing step ends (not interpolated values) keeps them exact.

    On stiff problems `y` cannot be integrated backwards: the modes that decay quickly forwards
    grow as quickly backwards, and the steps the adjoint needs amplify them (on Robertson's
    kinetics the reconstructed state leaves the slow manifold within 0.01 time units and the
    adjoint overflows). `reconstruct="forward"` (the default with an implicit backward stepper)
    instead solves the forward problem again from the nearest stored state below the current
    time, keeps the continuous extensions of its last `window` steps, and reads `y(t)` from
    them, as CVODES does; the backward solve then integrates only `a` and `g`. Memory is the
    `checkpoints` states plus `window` steps of dense output; a stretch between two stored
    states that takes more than `window` steps is solved again for each further `window` steps
    (its cost grows quadratically in its length, so give enough `checkpoints`). The re-solves
    use the forward stepper at the backward tolerances, so `y(t)` is as accurate as the
    backward solve asks, up to the stepper's continuous extension.

    The error of the backward solve is measured by default on `y` and `a` (or `a` alone, when
    `y` is re-solved forwards) only, not on the
    parameter integral `g` (a "seminorm"): `g` does not feed back into the dynamics, and
    including it forces needlessly small steps when there are many parameters.

    Not differentiated: the cached `f(t0, y0)` of the stepper state, the step-size and
    controller state, counters and status; the times of the saved steps (`SaveAt(steps=True)`)
    and of the dense output are held fixed (only the states there are differentiated), as in
    the discrete adjoints, which do not differentiate the step-size controller either.
    Each stretch of the backward solve between two stops may take up to `max_steps` steps.
    Reverse mode only: for `jax.jvp`/`jax.jacfwd` use `ForwardMode` (or `DirectAdjoint`).

    **Arguments:**

    - `solver`: the stepper of the backward solve; `None` uses the forward one.
    - `rtol`, `atol`: tolerances of the backward solve; `None` uses the forward controller's.
        After a `ConstantStep` forward solve, `None` for both means constant steps of the
        forward `dt0` backwards; giving both uses an adaptive `PIDController`.
    - `checkpoints`: number of forward states stored to re-anchor the reconstructed state (or
        to start the forward re-solves from); `None` stores none (re-solves start at `t0`).
    - `seminorm`: leave the parameter integral out of the backward error estimate.
    - `reconstruct`: how the backward solve obtains `y(t)`: `"backward"` integrates it
        backwards with the adjoint (re-anchored at the stored states); `"forward"` re-solves
        it forwards from the stored states (see above); `"auto"` is `"forward"` when the
        backward stepper is implicit (ESDIRK or Rosenbrock: a stiff problem) and `"backward"`
        otherwise.
    - `window`: steps of dense output `reconstruct="forward"` keeps.
    - `on_backward`: `None`, or a function called with a `dict` of Python values each time the
        backward solve runs (once per evaluation of the gradient):
        - `num_backward_steps`: steps the backward ODE solve attempted (accepted + rejected),
            summed over its stretches between stops;
        - `num_accepted_backward_steps`, `num_rejected_backward_steps`: as named;
        - `num_forward_resolves`: how often `y` was re-solved forwards from a stored state
            (`reconstruct="forward"`; `0` otherwise; the steps of these re-solves are not in
            the counts above);
        - `succeeded`: whether the backward solve succeeded (when it did not, the gradient
            raises, or is NaN with `EQX_ON_ERROR=nan`).

        These counts cannot be in `sol.stats`: the `Solution` is made by the forward solve,
        before the backward pass runs (and whether it runs at all is up to the caller). The
        function is called through `jax.debug.callback`, so it works under `jax.jit` and
        `jax.grad`; under `jax.vmap` (and `jax.jacrev`, which maps the backward pass over the
        output rows) it is called once per batch element with that element's values. It is a
        static field, part of what `jax.jit` caches on, so it must be hashable (a function or
        bound method is). Call `jax.effects_barrier()` before reading what it recorded.

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

    # What the backward solve did:
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
    - A. C. Hindmarsh et al., "SUNDIALS: Suite of nonlinear and differential/algebraic equation
        solvers", ACM TOMS 31(3) (2005) (CVODES: checkpointed forward states for the adjoint).
    - R. Serban & A. C. Hindmarsh, "CVODES: the sensitivity-enabled ODE solver in SUNDIALS",
        ASME IDETC 2005 (the forward solution re-solved from checkpoints and interpolated).
    """

    solver: AbstractStepper | None = None
    rtol: float | None = None
    atol: float | None = None
    checkpoints: int | None = eqx.field(default=None, static=True)
    seminorm: bool = eqx.field(default=True, static=True)
    reconstruct: str = eqx.field(default="auto", static=True)
    window: int = eqx.field(default=64, static=True)
    on_backward: Callable[[dict], None] | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if self.reconstruct not in ("auto", "backward", "forward"):
            raise ValueError(
                f"BacksolveAdjoint(reconstruct={self.reconstruct!r}) must be 'auto', 'backward' "
                "or 'forward'."
            )
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"BacksolveAdjoint(window={self.window!r}) must be a positive int.")
        if self.checkpoints is not None and (
            not isinstance(self.checkpoints, int) or self.checkpoints < 1
        ):
            raise ValueError(
                f"BacksolveAdjoint(checkpoints={self.checkpoints!r}) must be a positive int or "
                "None (no re-anchoring)."
            )
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"BacksolveAdjoint({name}={value}) must be positive.")
        if self.solver is not None and not isinstance(self.solver, AbstractStepper):
            raise TypeError(
                f"BacksolveAdjoint(solver={self.solver!r}) is not a stepper. Fix: pass e.g. "
                "`odeckpt.Tsit5()`."
            )
        if self.on_backward is not None and not callable(self.on_backward):
            raise TypeError(
                f"BacksolveAdjoint(on_backward={self.on_backward!r}) is not callable. Fix: pass "
                "a function taking one dict, e.g. `on_backward=records.append` or "
                "`on_backward=print`."
            )
        if self.on_backward is not None and not _hashable(self.on_backward):
            raise TypeError(
                f"BacksolveAdjoint(on_backward={self.on_backward!r}) is not hashable, and "
                "`jax.jit` caches on it. Fix: pass a function or a bound method (e.g. "
                "`on_backward=recorder.record`)."
            )

    def gradient_stats(self, loop, state, outputs, num_steps):
        del loop, state, outputs, num_steps
        return self.checkpoints or 0, jnp.zeros((), jnp.int32)

    def run(self, loop, state, outputs):
        self._backward_stepper(loop)  # configuration errors at trace time
        # Closed-over arrays of `f` become explicit leaves, so they may cross the custom_vjp
        # boundary (and get gradients like `args`).
        f = eqx.filter_closure_convert(loop.f, state.t, state.y, loop.args)
        loop = dataclasses.replace(loop, f=f, saveat=_flags_only(loop.saveat))
        return _backsolve((loop, state, outputs), self)

    def _backward_controller(self, controller: AbstractController) -> AbstractController:
        if isinstance(controller, PIDController):
            controller = dataclasses.replace(
                controller,
                rtol=controller.rtol if self.rtol is None else self.rtol,
                atol=controller.atol if self.atol is None else self.atol,
            )
        elif self.rtol is not None or self.atol is not None:
            if self.rtol is None or self.atol is None:
                raise ValueError(
                    "BacksolveAdjoint after a constant-step solve needs both `rtol` and `atol` "
                    "for an adaptive backward solve (or neither, for constant steps)."
                )
            controller = PIDController(rtol=self.rtol, atol=self.atol)
        return controller

    def _backward_stepper(self, loop: Loop) -> AbstractStepper:
        stepper = loop.stepper if self.solver is None else self.solver
        controller = self._backward_controller(loop.controller)
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
        return stepper

    def _forward_reconstruction(self, loop: Loop) -> bool:
        if self.reconstruct == "auto":
            stepper = self._backward_stepper(loop)
            return isinstance(stepper, AbstractImplicit | AbstractRosenbrock)
        return self.reconstruct == "forward"

    def _resolve_loop(self, loop: Loop, problem: Problem, diff, t_end: Scalar) -> Loop:
        """The forward problem from a stored state to `t_end`, at the backward tolerances
        when the forward stepper can adapt to them."""
        controller = self._backward_controller(loop.controller)
        if loop.stepper.error_order is None:
            controller = loop.controller
        return Loop(
            f=problem.f,
            args=diff,
            stepper=loop.stepper,
            controller=controller,
            t_end=t_end,
            ts=None,
            saveat=SaveAt(dense=True),
            max_steps=loop.max_steps,
            progress=None,
        )


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def forward_mode_error() -> TypeError:
    """What `jax.jvp` through a backsolve solve raises (JAX's own message names no fix)."""
    return TypeError(
        "adjoint=BacksolveAdjoint() supports reverse mode only (jax.grad, jax.vjp, jax.jacrev). "
        "Fix: for jax.jvp / jax.jacfwd use adjoint='forward' (ForwardMode) or adjoint='direct' "
        "(DirectAdjoint)."
    )


def _flags_only(saveat: SaveAt) -> SaveAt:
    """`saveat` without its `ts` array: the loop reads `loop.ts`, and only the flags here."""
    return SaveAt(t1=True, steps=saveat.steps, dense=saveat.dense)


# ---------------------------------------------------------------------------------------------
# Forward pass.


def _forward(adjoint: BacksolveAdjoint, loop: Loop, state: LoopState, outputs):
    """`ForwardMode`'s loop, storing `adjoint.checkpoints` step-end states on the way."""
    k = adjoint.checkpoints
    if k is None:
        final, outputs = ForwardMode().run(loop, state, outputs)
        return final, outputs, None
    fractions = jnp.arange(1, k + 1, dtype=state.t.dtype) / (k + 1)
    targets = state.t + fractions * (loop.t_end - state.t)
    store = Checkpoints(
        t=jnp.full((k,), jnp.inf, state.t.dtype),
        y=jax.tree.map(lambda y: jnp.full((k, *y.shape), jnp.inf, y.dtype), state.y),
        dt=jnp.zeros((k,), state.dt.dtype),
    )

    def cond(carry):
        state, _, _, _, steps = carry
        return loop.cond(state) & (steps < loop.max_steps)

    def body(carry):
        state, outputs, store, next_slot, steps = carry
        new, writes = loop.body(state)
        accepted = new.num_accepted > state.num_accepted
        hit = accepted & (next_slot < k) & (new.t >= targets[jnp.minimum(next_slot, k - 1)])
        index = jnp.where(hit, next_slot, k)
        store = Checkpoints(
            t=store.t.at[index].set(new.t, mode="drop"),
            y=jax.tree.map(lambda b, y: b.at[index].set(y, mode="drop"), store.y, new.y),
            dt=store.dt.at[index].set(new.dt, mode="drop"),
        )
        # A long step may pass several targets; they share this one checkpoint.
        passed = jnp.sum(targets <= new.t, dtype=next_slot.dtype)
        next_slot = jnp.where(hit, passed, next_slot)
        return new, apply_writes(outputs, writes), store, next_slot, steps + 1

    zero = jnp.zeros((), jnp.int32)
    state, outputs, store, _, _ = jax.lax.while_loop(
        cond, body, (state, outputs, store, zero, zero)
    )
    return state, outputs, store


@eqx.filter_custom_vjp
def _backsolve(inputs, adjoint: BacksolveAdjoint):
    loop, state, outputs = inputs
    final, outputs, _ = _forward(adjoint, loop, state, outputs)
    return final, outputs


@_backsolve.def_fwd
def _backsolve_fwd(perturbed, inputs, adjoint: BacksolveAdjoint):
    del perturbed
    loop, state, outputs = inputs
    final, outputs, store = _forward(adjoint, loop, state, outputs)
    return (final, outputs), (final, outputs, store)


_BACKWARD_FAILED = (
    "BacksolveAdjoint: the backward (adjoint) solve failed (max_steps reached, step size "
    "underflow or a non-finite adjoint). Fix: raise `max_steps`, loosen the backward `rtol`/"
    "`atol`, re-anchor with `BacksolveAdjoint(checkpoints=...)`, or use "
    "`RecursiveCheckpointAdjoint`, whose gradients do not solve a backward ODE."
)


@_backsolve.def_bwd
def _backsolve_bwd(residuals, ct, perturbed, inputs, adjoint: BacksolveAdjoint):
    final, outputs, store = residuals
    loop, state, _ = inputs
    ct_final, ct_outputs = ct
    if ct_outputs is None:
        ct_outputs = jax.tree.map(lambda _: None, outputs)
    p_loop, p_state, _ = perturbed
    diff, nondiff = eqx.partition((loop.f, loop.args), (p_loop.f, p_loop.args))
    problem = Problem(nondiff)
    ct_final = jax.tree.map(lambda _: None, final) if ct_final is None else ct_final
    ct_y1 = zeros_for_none(ct_final.y, final.y)
    groups = event_groups(loop, final, outputs, store, ct_outputs)
    dense = dense_group(loop, state, final, outputs, ct_outputs)
    g = jax.tree.map(jnp.zeros_like, diff)
    if adjoint._forward_reconstruction(loop):
        groups = [group for group in groups if group.jump_a is not None]
        (a, g), stats = solve_with_forward_states(
            adjoint, loop, state, final, store, problem, diff, groups, dense, (ct_y1, g)
        )
    else:
        (a, g), stats = solve_backwards(
            adjoint, loop, state, final, problem, diff, groups, dense, (final.y, ct_y1, g)
        )
    if adjoint.on_backward is not None:
        _report(adjoint.on_backward, stats)
    # A failed forward solve has NaN derivatives already (and raised, with `throw`): its
    # backward solve fails too, and says nothing more.
    forward_ok = loop.final_status(final) == Status.successful
    if loop.throw:
        a, g = eqx.error_if((a, g), forward_ok & ~stats.succeeded, _BACKWARD_FAILED)
    failed = ~(forward_ok & stats.succeeded)
    a, g = jax.tree.map(lambda x: jnp.where(failed, jnp.nan, x), (a, g))

    ct_t0 = None
    if p_state.t:
        ct_t0 = -pair(a, problem.f(state.t, state.y, diff)).astype(state.t.dtype)
    ct_t_end = None
    if p_loop.t_end:
        ct_t_end = pair(ct_y1, problem.f(final.t, final.y, diff)).astype(final.t.dtype)
        if ct_final.t is not None:
            ct_t_end = ct_t_end + ct_final.t
    ct_ts = None
    if loop.ts is not None and p_loop.ts and has_ct(ct_outputs[0]):
        ys = outputs[0]
        ct_ys = zeros_for_none(ct_outputs[0], ys)
        rate = lambda t, y, c: pair(c, problem.f(t, y, diff))
        values = jax.vmap(rate)(loop.ts, ys, ct_ys).astype(loop.ts.dtype)
        ct_ts = jnp.where(jax.vmap(all_finite)(ys), values, 0)

    none = lambda tree: jax.tree.map(lambda _: None, tree)
    g_f, g_args = g
    grad_loop = dataclasses.replace(none(loop), f=g_f, args=g_args, t_end=ct_t_end, ts=ct_ts)
    grad_state = dataclasses.replace(none(state), y=a, t=ct_t0)
    return grad_loop, grad_state, none(inputs[2])


def _report(on_backward: Callable[[dict], None], stats: BackwardStats) -> None:
    """Hand `stats` to `on_backward` on the host, as the Python values it documents. Under
    `vmap` `jax.debug.callback` unrolls over the batch: one call per element, with scalars."""

    def on_host(stats: BackwardStats) -> None:
        accepted, rejected = stats.num_accepted.item(), stats.num_rejected.item()
        on_backward(
            {
                "num_backward_steps": accepted + rejected,
                "num_accepted_backward_steps": accepted,
                "num_rejected_backward_steps": rejected,
                "num_forward_resolves": stats.num_resolves.item(),
                "succeeded": stats.succeeded.item(),
            }
        )

    jax.debug.callback(on_host, stats)
