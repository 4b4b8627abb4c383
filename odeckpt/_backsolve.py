"""The continuous adjoint ("backsolve"): gradients from an augmented ODE solved backwards."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from ._adjoint import AbstractAdjoint, ForwardMode
from ._controllers import AbstractController, ConstantStep, PIDController
from ._integrate import Loop, LoopState, apply_writes
from ._saveat import SaveAt
from ._status import Status
from ._steppers._base import AbstractStepper, Step
from ._types import Args, Scalar, Y


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

    The error of the backward solve is measured by default on `y` and `a` only, not on the
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
    - `checkpoints`: number of forward states stored to re-anchor the reconstructed state;
        `None` stores none.
    - `seminorm`: leave the parameter integral out of the backward error estimate.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import odeckpt
    from odeckpt._backsolve import BacksolveAdjoint

    def loss(y0, k):
        sol = odeckpt.solve(lambda t, y, k: -k * y, y0, (0.0, 1.0), args=k,
                            adjoint=BacksolveAdjoint(checkpoints=4))
        return jnp.sum(sol.ys[-1] ** 2)

    jax.grad(loss, argnums=(0, 1))(jnp.array([1.0, 2.0]), jnp.array(0.5))
    ```

    **References:**

    - L. S. Pontryagin et al., *The Mathematical Theory of Optimal Processes* (1962).
    - R. T. Q. Chen, Y. Rubanova, J. Bettencourt, D. Duvenaud, "Neural Ordinary Differential
        Equations", NeurIPS 2018.
    - P. Kidger, R. T. Q. Chen, T. Lyons, "'Hey, that's not an ODE': Faster ODE Adjoints via
        Seminorms", ICML 2021.
    - A. C. Hindmarsh et al., "SUNDIALS: Suite of nonlinear and differential/algebraic equation
        solvers", ACM TOMS 31(3) (2005) (CVODES: checkpointed forward states for the adjoint).
    """

    solver: AbstractStepper | None = None
    rtol: float | None = None
    atol: float | None = None
    checkpoints: int | None = eqx.field(default=None, static=True)
    seminorm: bool = eqx.field(default=True, static=True)

    def __check_init__(self):
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
        if isinstance(controller, PIDController) and stepper.error_order is None:
            raise ValueError(
                f"BacksolveAdjoint: the backward stepper {type(stepper).__name__} has no error "
                "estimate for the adaptive backward solve. Fix: pass "
                "`BacksolveAdjoint(solver=odeckpt.Tsit5())` or another adaptive stepper."
            )
        return stepper


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


class _Checkpoints(eqx.Module):
    """`k` stored step-end states (times `inf` where none was stored)."""

    t: jax.Array
    y: Y


def _forward(adjoint: BacksolveAdjoint, loop: Loop, state: LoopState, outputs):
    """`ForwardMode`'s loop, storing `adjoint.checkpoints` step-end states on the way."""
    k = adjoint.checkpoints
    if k is None:
        final, outputs = ForwardMode().run(loop, state, outputs)
        return final, outputs, None
    fractions = jnp.arange(1, k + 1, dtype=state.t.dtype) / (k + 1)
    targets = state.t + fractions * (loop.t_end - state.t)
    store = _Checkpoints(
        t=jnp.full((k,), jnp.inf, state.t.dtype),
        y=jax.tree.map(lambda y: jnp.full((k, *y.shape), jnp.inf, y.dtype), state.y),
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
        store = _Checkpoints(
            t=store.t.at[index].set(new.t, mode="drop"),
            y=jax.tree.map(lambda b, y: b.at[index].set(y, mode="drop"), store.y, new.y),
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


# ---------------------------------------------------------------------------------------------
# Backward pass.


class _Seminorm(AbstractStepper):
    """`inner` with the error estimate of the parameter integral set to zero, and that of the
    state and adjoint rescaled so that the controller's root mean square over all components
    equals the one over the state and adjoint alone (Kidger, Chen & Lyons 2021)."""

    inner: AbstractStepper

    name = property(lambda self: self.inner.name)
    order = property(lambda self: self.inner.order)
    error_order = property(lambda self: self.inner.error_order)
    fn_evals_per_step = property(lambda self: self.inner.fn_evals_per_step)
    dense_degree = property(lambda self: self.inner.dense_degree)

    def init(self, f, t0, y0, args):
        return self.inner.init(f, t0, y0, args)

    def step(self, f, t0, t1, y0, args, state) -> Step:
        step = self.inner.step(f, t0, t1, y0, args, state)
        if step.y_error is None:
            return step
        error_y, error_a, error_g = step.y_error
        size_state = _size((error_y, error_a))
        size_g = _size(error_g)
        if size_g == 0:
            return step
        scale = ((size_state + size_g) / size_state) ** 0.5
        error_y, error_a = jax.tree.map(lambda e: e * scale, (error_y, error_a))
        y_error = (error_y, error_a, jax.tree.map(jnp.zeros_like, error_g))
        return Step(y1=step.y1, y_error=y_error, dense=step.dense, state=step.state)


def _size(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def _zeros_for_none(ct, like):
    """The cotangent `ct` (with `None` for symbolic zeros) as arrays shaped like `like`."""
    if ct is None:
        return jax.tree.map(jnp.zeros_like, like)
    return jax.tree.map(
        lambda c, y: jnp.zeros_like(y) if c is None else c, ct, like, is_leaf=lambda x: x is None
    )


def _has_ct(ct) -> bool:
    return any(leaf is not None for leaf in jax.tree.leaves(ct, is_leaf=lambda x: x is None))


def _pair(ct: Y, v: Y) -> Scalar:
    """`<ct, v>`: the cotangent pairing (real part, as for JAX's complex cotangents)."""
    terms = jax.tree.leaves(jax.tree.map(lambda c, x: jnp.sum(jnp.real(c * x)), ct, v))
    return sum(terms[1:], terms[0])


def _rows(tree, row):
    return jax.tree.map(lambda x: x[row], tree)


def _select(mask, new, old):
    return jax.tree.map(lambda a, b: jnp.where(mask, a, b), new, old)


def _masked(mask, tree):
    return jax.tree.map(lambda x: jnp.where(mask, x, jnp.zeros_like(x)), tree)


class _Problem(eqx.Module):
    """The vector field split into the differentiated arrays `diff` (of `(f, args)`) and the
    rest, and the augmented backward system in the time `s = -tau` (so its loop runs
    forwards): `dy/ds = -f`, `da/ds = a^T df/dy`, `dg/ds = a^T df/ddiff`."""

    nondiff: Args

    def f(self, tau, y, diff):
        f, args = eqx.combine(diff, self.nondiff)
        return f(tau, y, args)

    def augmented(self, s, z, diff):
        y, a, _ = z
        dy, vjp = jax.vjp(lambda y, d: self.f(-s, y, d), y, diff)
        a_y, a_g = vjp(a)
        return jax.tree.map(jnp.negative, dy), a_y, a_g


class _Group(eqx.Module):
    """Events of one kind (rows of a saved-output group, or checkpoints): their times, which
    rows are real, the jumps in `a` (cotangents of the saved states) and the stored states that
    re-anchor `y`."""

    times: jax.Array
    valid: jax.Array
    jump_a: Y | None
    anchor: Y | None


def _event_groups(loop, final, outputs, store, ct_outputs) -> list[_Group]:
    groups = []
    outputs, ct_outputs = list(outputs), list(ct_outputs)
    num_rows = jnp.arange(loop.max_steps)
    if loop.ts is not None:
        ys, ct_ys = outputs.pop(0), ct_outputs.pop(0)
        if _has_ct(ct_ys):
            finite = jax.vmap(lambda y: _all_finite(y))(ys)
            groups.append(_Group(loop.ts, finite, _zeros_for_none(ct_ys, ys), ys))
    if loop.saveat.steps:
        (step_ts, step_ys), (_, ct_step_ys) = outputs.pop(0), ct_outputs.pop(0)
        if _has_ct(ct_step_ys):
            valid = num_rows < final.num_accepted
            groups.append(_Group(step_ts, valid, _zeros_for_none(ct_step_ys, step_ys), step_ys))
    if store is not None:
        groups.append(_Group(store.t, jnp.isfinite(store.t), None, store.y))
    return groups


def _all_finite(y) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(y)]))


class _Dense(eqx.Module):
    """Dense-output events at each step's start `t_i`: the cotangent of the step's coefficients
    pulled back to the state there (a jump in `a`) and to the parameters (added to `g`)."""

    times: jax.Array
    valid: jax.Array
    ends: jax.Array
    coeffs: Y
    ct_coeffs: Y

    def start_state(self, row):
        return jax.tree.map(lambda c: c[row, 0], self.coeffs)

    def pullback(self, stepper, problem: _Problem, diff, row):
        def coeffs(y, d):
            t0, t1 = self.times[row], self.ends[row]
            f = lambda t, y, d: problem.f(t, y, d)
            return stepper.step(f, t0, t1, y, d, stepper.init(f, t0, y, d)).dense

        _, vjp = jax.vjp(coeffs, self.start_state(row), diff)
        return vjp(_rows(self.ct_coeffs, row))


def _dense_group(loop, state, final, outputs, ct_outputs) -> _Dense | None:
    if not loop.saveat.dense:
        return None
    (t_ends, coeffs), (_, ct_coeffs) = outputs[-1], ct_outputs[-1]
    if not _has_ct(ct_coeffs):
        return None
    starts = jnp.concatenate([state.t[None], t_ends[:-1]])
    valid = jnp.arange(loop.max_steps) < final.num_accepted
    return _Dense(starts, valid, t_ends, coeffs, _zeros_for_none(ct_coeffs, coeffs))


def _initial_dt(controller, stepper, problem, s0, z, diff, seminorm: bool):
    """The first backward step size. With the seminorm the parameter integral `g` takes no
    part in error control, so it takes none in choosing the first step either (its derivative,
    measured against `atol` while `g = 0`, would make that step vanishingly small)."""
    if not seminorm:
        f0 = stepper.init(problem.augmented, s0, z, diff)
        return controller.init(problem.augmented, s0, z, f0, diff, stepper, None)[0]
    y, a, g = z
    state_part = lambda s, ya, d: problem.augmented(s, (*ya, g), d)[:2]
    f0 = state_part(s0, (y, a), diff)
    return controller.init(state_part, s0, (y, a), f0, diff, stepper, None)[0]


def _solve_backwards(adjoint, loop, state, final, problem, diff, groups, dense, z):
    """Integrate the augmented system from the final time back to `t0`, stopping at every event
    (in decreasing time) to re-anchor `y` and add the jumps. Returns `(y, a, g)` at `t0`,
    whether every backward segment succeeded, and the backward steps taken."""
    stepper = adjoint._backward_stepper(loop)
    stepper = _Seminorm(stepper) if adjoint.seminorm else stepper
    controller = adjoint._backward_controller(loop.controller)
    end = _Group(state.t[None], jnp.ones((1,), bool), None, None)
    events = [*groups, *([dense] if dense is not None else []), end]
    offsets = [0]
    for group in events:
        offsets.append(offsets[-1] + group.times.shape[0])
    times = jnp.concatenate([jnp.where(g.valid, g.times, -jnp.inf) for g in events])
    # Decreasing time; `end` is concatenated last, so a stable sort keeps it after ties at t0.
    order = jnp.argsort(-times, stable=True)
    count = jnp.sum(times > -jnp.inf)

    def segment(s0, s1, z, dt):
        piece = Loop(
            f=problem.augmented,
            args=diff,
            stepper=stepper,
            controller=controller,
            t_end=s1,
            ts=None,
            saveat=SaveAt(t1=True),
            max_steps=loop.max_steps,
            progress=None,
        )
        start, _ = piece.init_state(s0, z, dt)
        done, _ = ForwardMode().run(piece, start, ())
        ok = (done.status == Status.successful) & (done.t >= s1)
        # A segment shorter than `dt` says little about the step size beyond it.
        one_step = (done.num_steps == 1) & (done.num_accepted == 1)
        dt = jnp.where(
            done.num_steps == 0, dt, jnp.where(one_step, jnp.maximum(dt, done.dt), done.dt)
        )
        return done.y, dt, ok, done.num_steps

    def body(carry):
        i, s, z, dt, ok, num_steps = carry
        j = order[i]
        s_event = jnp.maximum(-times[j], s)
        z, dt, ok_segment, steps = segment(s, s_event, z, dt)
        y, a, g = z
        for group, offset in zip(events, offsets, strict=False):
            size = group.times.shape[0]
            here = (j >= offset) & (j < offset + size)
            row = jnp.clip(j - offset, 0, size - 1)
            if isinstance(group, _Dense):
                jump_a, jump_g = group.pullback(loop.stepper, problem, diff, row)
                a = jax.tree.map(jnp.add, a, _masked(here, jump_a))
                g = jax.tree.map(jnp.add, g, _masked(here, jump_g))
                anchor = group.start_state(row)
            else:
                if group.jump_a is not None:
                    a = jax.tree.map(jnp.add, a, _masked(here, _rows(group.jump_a, row)))
                anchor = None if group.anchor is None else _rows(group.anchor, row)
            if anchor is not None:
                y = _select(here, anchor, y)
        return i + 1, s_event, (y, a, g), dt, ok & ok_segment, num_steps + steps

    s0 = -final.t
    if isinstance(controller, ConstantStep):
        dt = state.dt
    else:
        dt = _initial_dt(controller, stepper, problem, s0, z, diff, adjoint.seminorm)
    zero = jnp.zeros((), jnp.int32)
    carry = (zero, s0, z, dt, jnp.array(True), zero)
    _, _, z, _, ok, num_steps = jax.lax.while_loop(lambda c: c[0] < count, body, carry)
    return z, ok, num_steps


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
    problem = _Problem(nondiff)
    ct_final = jax.tree.map(lambda _: None, final) if ct_final is None else ct_final
    ct_y1 = _zeros_for_none(ct_final.y, final.y)
    groups = _event_groups(loop, final, outputs, store, ct_outputs)
    dense = _dense_group(loop, state, final, outputs, ct_outputs)
    z = (final.y, ct_y1, jax.tree.map(jnp.zeros_like, diff))
    (_, a, g), ok, _ = _solve_backwards(
        adjoint, loop, state, final, problem, diff, groups, dense, z
    )
    a, g = eqx.error_if((a, g), ~ok, _BACKWARD_FAILED)

    ct_t0 = None
    if p_state.t:
        ct_t0 = -_pair(a, problem.f(state.t, state.y, diff)).astype(state.t.dtype)
    ct_t_end = None
    if p_loop.t_end:
        ct_t_end = _pair(ct_y1, problem.f(final.t, final.y, diff)).astype(final.t.dtype)
        if ct_final.t is not None:
            ct_t_end = ct_t_end + ct_final.t
    ct_ts = None
    if loop.ts is not None and p_loop.ts and _has_ct(ct_outputs[0]):
        ys = outputs[0]
        ct_ys = _zeros_for_none(ct_outputs[0], ys)
        pair = lambda t, y, c: _pair(c, problem.f(t, y, diff))
        values = jax.vmap(pair)(loop.ts, ys, ct_ys).astype(loop.ts.dtype)
        ct_ts = jnp.where(jax.vmap(_all_finite)(ys), values, 0)

    none = lambda tree: jax.tree.map(lambda _: None, tree)
    g_f, g_args = g
    grad_loop = dataclasses.replace(none(loop), f=g_f, args=g_args, t_end=ct_t_end, ts=ct_ts)
    grad_state = dataclasses.replace(none(state), y=a, t=ct_t0)
    return grad_loop, grad_state, none(inputs[2])
