"""The front door: `odeckpt.solve`."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _habits as habits, _validate as validate
from ._adjoints import ADJOINTS, AbstractAdjoint, GradientStats
from ._autodiff import mesh_of, varying
from ._checks import count, tightest
from ._error_norm import below_resolution
from ._errors import on_host
from ._failure_message import Failure
from ._loop import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    AbstractAdaptiveController,
    AbstractController,
    ConstantStep,
    DenseOutput,
    DistinctSaveTimes,
    Event,
    EventSet,
    IntegrationLoop,
    LoopState,
    Outputs,
    PIDController,
    ProgressBar,
    ProgressMeter,
    constant_step_count,
    saves_per_step,
    vector_field_in_internal_time,
)
from ._mass_matrix import MassMatrix
from ._on_failure import Solved, nan_derivatives_if, raised
from ._saveat import SaveAt
from ._solution import Solution, Stats
from ._status import Status
from ._steppers import (
    AbstractMassMatrix,
    AbstractStepper,
    Tsit5,
    newton_rtol,
    stepper_from_name,
    with_newton_tolerances,
)
from ._types import Args, BoolScalar, Scalar, ScalarLike, Tolerance, VectorField, Y


def solve(
    f: VectorField,
    y0: Y,
    t_span=None,
    args: Args = None,
    *unexpected_positional,
    solver: AbstractStepper | str = Tsit5(),
    adjoint: AbstractAdjoint | str = "recursive",
    rtol: Tolerance | None = None,
    atol: Tolerance | None = None,
    dt0: ScalarLike | None = None,
    controller: AbstractController | None = None,
    saveat: SaveAt | jax.Array | np.ndarray | None = None,
    max_steps: int = 4096,
    throw: bool = True,
    progress: bool = False,
    event: Event | tuple[Event, ...] | None = None,
    jump_ts: jax.Array | np.ndarray | None = None,
    mass_matrix: MassMatrix | jax.Array | np.ndarray | None = None,
    **unexpected_keywords,
) -> Solution:
    """Solve the initial value problem `dy/dt = f(t, y, args)`, `y(t0) = y0`, over `t_span`.

    **Arguments:**

    - `f`: the vector field `f(t, y, args)`, returning a pytree like `y`.
    - `y0`: the initial state: any pytree of float32/float64/complex arrays.
    - `t_span`: `(t0, t1)`; `t1 < t0` integrates backwards, `t1 == t0` returns `y0` in zero
        steps.
    - `args`: anything `f` needs (arrays, equinox modules, ...).
    - `solver`: a stepper (`odeckpt.Tsit5()`, ...) or its name (`"dopri5"`).
    - `adjoint`: how the solve is differentiated (an adjoint object or its name).
    - `rtol`, `atol`: tolerances of the adaptive step-size controller (`None`: 1e-6 and 1e-8,
        or the controller's own where it sets them; setting one in both places is an error),
        and of an implicit stepper's Newton iteration: positive numbers, or
        pytrees like `y0` whose leaves are numbers or arrays of the leaf's shape (a tolerance
        per component). They may be traced (`jax.jit` over a function of `rtol` compiles once
        for every value); a traced invalid value (NaN, zero, negative) ends the solve with
        `Status.invalid_settings`. An `rtol` below the resolution of the state's dtype (its
        machine epsilon: 1.2e-7 in float32) is clamped to it, which `sol.stats.rtol_clamped`
        reports (a known one also warns).
    - `dt0`: the first step size (`None`: chosen automatically); required by `ConstantStep`.
        May be traced.
    - `controller`: `odeckpt.PIDController(...)` (the default for steppers with an error
        estimate) or `odeckpt.ConstantStep()` (the default for the others).
    - `saveat`: a `SaveAt`, or an array of times meaning `SaveAt(ts=...)`; `None` saves `t1`.
    - `max_steps`: most steps (accepted and rejected) before the solve stops.
    - `throw`: raise if the solve fails at run time; with `False`, inspect `sol.status`.
    - `progress`: show a tqdm progress bar of the part of the span covered, in `log|t|` when t0
        and t1 have one sign and differ by more than a factor 1000 (a span over decades), and
        under `vmap` of the slowest lane still running. It works under `jit` and `vmap`, and
        costs a few scalar operations per step and at most 102 host callbacks per solve (one
        before the first step, at most one per whole percent passed, one at the end), whatever
        the number of steps: the bar asks for its next report about 0.1 s ahead at the solve's
        rate, so a quick solve calls the host a few times. The bar closes where the solve ended
        (below 100% if it failed or stopped). A gradient's reverse sweep does not move it, and
        one that stores every step's residuals moves it at its start and end only. Off (the
        default), the program has none of it.
    - `event`: an `odeckpt.Event` or a tuple of them: stop at, or jump at, a sign change of
        `fn(t, y, args)` (see `Event`); `sol.event` says which terminal event ended the solve.
    - `jump_ts`: known discontinuities of `f` in time (dosing times, piecewise forcing): the
        steps land exactly on each and the stepper and controller restart there. They may be
        traced: the derivative in a jump time is the change of `f` there (see docs/events.md).
    - `mass_matrix`: solve the differential-algebraic equation `M y' = f(t, y, args)` with
        this constant mass matrix (an `odeckpt.MassMatrix`, or the `(n, n)` array for
        `MassMatrix(array)`): singular for algebraic equations (index 1), with consistent
        initial values found from `y0` (see `MassMatrix`). Steppers: `Radau5`, `BDF`,
        `Rodas5`; adjoints: all but the continuous ones (see docs/dae.md).

    Only `f`, `y0`, `t_span` and `args` are positional. Keywords of diffrax's `diffeqsolve`,
    scipy's `solve_ivp` or torchdiffeq's `odeint` (`stepsize_controller=`, `t0=`, `method=`,
    `t_eval=`, ...) raise a `TypeError` naming the odeckpt spelling.

    **Returns:**

    A `Solution` with `ts`, `ys`, `stats`, `status`, `event` (with events) and, with
    `SaveAt(dense=True)`, `evaluate(t)`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def lotka_volterra(t, y, args):
        prey, predator = y
        a, b, c, d = args
        return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])

    sol = odeckpt.solve(lotka_volterra, jnp.array([10.0, 5.0]), (0.0, 20.0),
                        args=(1.1, 0.4, 0.4, 0.1), saveat=jnp.linspace(0.0, 20.0, 101))
    ```
    """
    habits.check_call(unexpected_positional, unexpected_keywords)
    with mesh_of((y0, t_span, args)):  # (arrays on a mesh with `Explicit` axes)
        problem, options, invalid = prepare(
            f, y0, t_span, args, solver=solver, adjoint=adjoint, rtol=rtol, atol=atol,
            dt0=dt0, controller=controller, saveat=saveat, max_steps=max_steps, throw=throw,
            progress=progress, event=event, jump_ts=jump_ts, mass_matrix=mass_matrix,
        )  # fmt: skip
        solved = validate.with_traced_numbers(
            args, lambda args: _solve(dataclasses.replace(problem, args=args), options, invalid)
        )
    failure = Failure(
        options.stepper, options.controller, options.max_steps, dict(options.failure_notes)
    )
    return raised(solved, failure, options.throw)


class Problem(eqx.Module):
    """One solve's inputs, checked: the vector field `f`, `y0`, the span `t0`, `t1`, the save
    times `ts` and known discontinuities `jump_ts` (or `None`) and `args`."""

    f: VectorField
    y0: Y
    t0: Scalar
    t1: Scalar
    ts: jax.Array | None
    args: Args
    jump_ts: jax.Array | None


def prepare(
    f, y0, t_span, args, *, solver, adjoint, rtol, atol, dt0, controller, saveat, max_steps,
    throw, progress, event, jump_ts, mass_matrix=None,
) -> tuple[Problem, "Options", jax.Array | None]:  # fmt: skip
    """`solve`'s arguments checked (raising, naming the fix, at call time where possible):
    the `Problem`, the `Options`, and whether a traced input failed its check (`None` when
    none is traced or `throw=True`, which raises instead)."""
    if t_span is None:
        raise TypeError("solve() needs the time span. Fix: `solve(f, y0, (t0, t1), args)`.")
    habits.check_objects(
        f=f, y0=y0, solver=solver, adjoint=adjoint, controller=controller, saveat=saveat,
        progress=progress, event=event,
    )  # fmt: skip
    habits.check_signature(f)
    habits.check_list_state(y0)
    throw, progress = validate.flag("throw", throw), validate.flag("progress", progress)
    stepper = _stepper(solver)
    if mass_matrix is not None:
        _check_mass_matrix_stepper(stepper)
    adjoint = _adjoint(adjoint)
    y0 = validate.as_state(y0)
    checks = validate.TracedChecks(throw)
    t0, t1 = validate.time_span(t_span, validate.time_dtype(y0), checks)
    rtol = None if rtol is None else validate.tolerance("rtol", rtol, y0)
    atol = None if atol is None else validate.tolerance("atol", atol, y0)
    max_steps = count("max_steps", max_steps, "e.g. max_steps=4096")
    dt0 = validate.step_size(dt0, t0, t1, checks)
    controller = _controller(controller, stepper, dt0, rtol, atol, y0)
    stepper = _newton_tolerances(stepper, controller, rtol, atol)
    stepper = _with_mass_matrix(stepper, mass_matrix, y0, controller, rtol, atol)
    for name, held in _held_rtols(controller, stepper, adjoint):
        validate.warn_below_resolution(name, held, y0)
    saveat = _saveat(saveat)
    events = validate.events(event)
    if events is not None:
        adjoint.check_events(events)
    if mass_matrix is not None:
        adjoint.check_mass_matrix(events)
    validate.check_finite(y0)
    jumps = validate.jump_times(jump_ts, t0.dtype, checks)
    t0_value, t1_value = validate.concrete(t0), validate.concrete(t1)
    ts = None
    if saveat.ts is not None:
        ts = validate.check_save_times(saveat.ts.astype(t0.dtype), t0, t1, checks)
    # A direction known at trace time keeps `f` unwrapped for forward solves.
    direction = (
        None if t0_value is None or t1_value is None else (1.0 if t1_value >= t0_value else -1.0)
    )
    num_steps = None
    dt_value, ts_value = validate.concrete(dt0), None if ts is None else validate.concrete(ts)
    jumps_value = None if jumps is None else validate.concrete(jumps)
    known = direction is not None and dt_value is not None and (ts is None or ts_value is not None)
    known = known and (jumps is None or jumps_value is not None)
    # A terminal event or a jump changes the steps: their number is not known before the solve.
    if controller.fixed_steps and known and events is None:
        per_step = saves_per_step(stepper)
        assert t0_value is not None and t1_value is not None and dt_value is not None  # known
        num_steps = constant_step_count(
            t0_value, t1_value, dt_value, ts_value, per_step, t0.dtype, max_steps, jumps_value
        )
    options = Options(
        stepper, adjoint, controller, saveat, dt0, max_steps, throw, progress, direction,
        num_steps, _failure_notes(y0), ts is not None and ts_value is None, events, on_host(),
    )  # fmt: skip
    return Problem(f, y0, t0, t1, ts, args, jumps), options, checks.failed()


class Options(eqx.Module):
    """Everything about a solve that is not an input array (static under `jit`, except any
    arrays inside the stepper, adjoint or controller)."""

    stepper: AbstractStepper
    adjoint: AbstractAdjoint
    controller: AbstractController
    saveat: SaveAt
    dt0: float | jax.Array | None
    max_steps: int = eqx.field(static=True)
    throw: bool = eqx.field(static=True)
    progress: bool = eqx.field(static=True)
    direction: float | None = eqx.field(static=True)
    num_steps: int | None = eqx.field(static=True)
    failure_notes: tuple[tuple[str, str], ...] = eqx.field(static=True)
    """Text added to the messages of failures (by `Status` name), from what the inputs are."""
    ts_traced: bool = eqx.field(static=True)
    """Whether the save times are traced (and may be differentiated)."""
    events: tuple[Event, ...] | None = None
    failures_on_host: bool = eqx.field(static=True, default=False)
    """Whether failures raise on the host after the call (`odeckpt.jit`), not by callbacks: part
    of the compiled solve's cache key, as the two programs differ."""


def _check_functions(f: VectorField, events, t0, y0: Y, args: Args) -> None:
    """Raise unless `f` and the events' functions take these arguments and return what they
    should."""
    validate.check_vector_field(f, t0, y0, args)
    if events is not None:
        validate.check_events(events, t0, y0, args)


def _failure_notes(y0: Y) -> tuple[tuple[str, str], ...]:
    """In single precision, running out of steps is often rounding stalling the step-size
    control: say so."""
    if any(jnp.finfo(leaf.dtype).bits <= 32 for leaf in jax.tree.leaves(y0)):
        note = (
            " The state is single precision (float32): rounding can stall the step-size "
            "control, notably on stiff problems. Fix: solve in float64, with "
            '`jax.config.update("jax_enable_x64", True)` at the start of the program and '
            "a float64 y0."
        )
        return (("max_steps_reached", note), ("dt_underflow", note))
    return ()


@eqx.filter_jit
def _solve(problem: Problem, options: Options, invalid_inputs: jax.Array | None) -> Solved:
    # Inside `jax.shard_map`, every input varies over the manual axes (see `_autodiff.varying`).
    problem, options = varying((problem, options))
    _check_functions(problem.f, options.events, problem.t0, problem.y0, problem.args)
    setup = Setup.make(problem, options)
    init, init_evals = setup.loop.init_state(setup.tau0, problem.y0, setup.dt)
    # A DAE's initial values made consistent: the solution starts there.
    problem = dataclasses.replace(problem, y0=init.y)
    if invalid_inputs is not None:
        init = dataclasses.replace(init, status=_unless_invalid(invalid_inputs, init.status))
    result = options.adjoint.run(setup.loop, init, setup.loop.init_outputs(init))
    solution = finish(
        problem, options, setup, result.state, result.outputs, result.stats, init_evals,
        invalid_inputs,
    )  # fmt: skip
    return Solved(solution, jax.lax.stop_gradient(setup.direction * result.state.t))


class Setup(eqx.Module):
    """What a solve runs: the integration `loop` (in internal time `direction * t`), its start
    `tau0`, first step size `dt` (`None`: chosen), and the distinct `save_times`."""

    loop: IntegrationLoop
    tau0: Scalar
    dt: Scalar | None
    save_times: DistinctSaveTimes | None
    direction: Scalar | float

    @classmethod
    def make(
        cls, problem: Problem, options: Options, save_times: DistinctSaveTimes | None = None
    ) -> "Setup":
        """The setup of `problem`; with its `save_times` when they are known already (made
        once for many trajectories)."""
        f, t0, t1, ts, jump_ts = problem.f, problem.t0, problem.t1, problem.ts, problem.jump_ts
        direction = cls.direction_of(problem, options)
        tau0, tau_end = direction * t0, direction * t1
        if save_times is None and ts is not None:
            save_times = DistinctSaveTimes.make(direction * ts)
        loop = IntegrationLoop(
            f=vector_field_in_internal_time(f, direction),
            args=problem.args,
            stepper=options.stepper,
            controller=options.controller,
            t_end=tau_end,
            ts=None if save_times is None else save_times.ts,
            saveat=options.saveat,
            max_steps=options.max_steps,
            progress=ProgressMeter(tau0, tau_end, ProgressBar()) if options.progress else None,
            num_steps=options.num_steps,
            throw=options.throw,
            events=None if options.events is None else EventSet(options.events, direction),
            jump_ts=None if jump_ts is None else jnp.sort(direction * jump_ts),
        )
        dt = None if options.dt0 is None else jnp.abs(jnp.asarray(options.dt0, t0.dtype))
        return cls(loop, tau0, dt, save_times, direction)

    @staticmethod
    def direction_of(problem: Problem, options: Options) -> Scalar | float:
        """The direction of integration: `1.0` or `-1.0` (traced when the span is)."""
        if options.direction is not None:
            return options.direction
        return jnp.where(problem.t1 >= problem.t0, 1.0, -1.0).astype(problem.t0.dtype)


def finish(
    problem: Problem, options: Options, setup: Setup, state: LoopState, outputs: Outputs,
    gradient_stats: GradientStats, init_evals: int, invalid_inputs: jax.Array | None,
) -> Solution:  # fmt: skip
    """The `Solution` of a run that ended in `state` with `outputs`: its status (raising with
    `throw=True`), the saved values (with NaN derivatives if the solve failed) and stats."""
    f, y0, t0, t1, ts, args = (
        problem.f, problem.y0, problem.t0, problem.t1, problem.ts, problem.args
    )  # fmt: skip
    status = setup.loop.final_status(state)
    if invalid_inputs is not None:
        status = _unless_invalid(invalid_inputs, status)
    rate = (lambda t, y: options.stepper.slope(f, t, y, args)) if options.ts_traced else None
    collected = _collect(
        options.saveat, setup.direction, t0, y0, ts, setup.save_times, rate, state, outputs
    )
    inputs = (f, y0, t0, t1, ts, args, problem.jump_ts)
    collected = nan_derivatives_if(status != Status.successful, collected, inputs)
    ts_out, ys_out, dense = collected
    stats = Stats(
        num_steps=state.num_steps,
        num_accepted_steps=state.num_accepted,
        num_rejected_steps=state.num_rejected,
        num_fn_evals=init_evals + state.num_fn_evals,
        num_jacobian_evals=state.num_jacobian_evals,
        num_lu_factorisations=state.num_lu_factorisations,
        num_checkpoints=gradient_stats.num_checkpoints,
        num_recomputed_steps=gradient_stats.num_recomputed_steps,
        rtol_clamped=_rtol_clamped(options, y0),
        max_steps=options.max_steps,
    )
    event = None if state.events is None else state.events.event
    return Solution(
        ts=ts_out, ys=ys_out, stats=stats, status=status, t0=t0, t1=t1, dense=dense, event=event
    )


def _unless_invalid(invalid: jax.Array, status: Status) -> Status:
    """`status`, or `invalid_inputs` where a traced input failed its check (`throw=False`)."""
    return Status.where(invalid, Status.invalid_inputs, status)


def _collect(
    saveat: SaveAt, direction, t0: Scalar, y0: Y, ts, save_times, rate, state: LoopState,
    outputs: Outputs,
) -> tuple[jax.Array | None, Y | None, DenseOutput | None]:  # fmt: skip
    """Assemble the saved blocks t0 | ts | steps | t1 (see `SaveAt`) and the dense output
    (`rate`: the vector field in `(t, y)`, which moves repeated save times, or `None` for save
    times that are not differentiated)."""
    blocks = []
    if saveat.t0:
        blocks.append((t0[None], jax.tree.map(lambda y: y[None], y0)))
    if ts is not None:
        ys = save_times.gather(outputs.ts, None if rate is None else ts, rate)
        blocks.append((ts, ys))
    if saveat.steps:
        assert outputs.steps is not None  # saved where `saveat.steps`
        step_ts = outputs.steps.t
        blocks.append(
            (jnp.where(jnp.isfinite(step_ts), direction * step_ts, jnp.inf), outputs.steps.values)
        )
    if saveat.t1:
        blocks.append(((direction * state.t)[None], jax.tree.map(lambda y: y[None], state.y)))
    dense = None
    if saveat.dense:
        assert outputs.dense is not None  # saved where `saveat.dense`
        max_steps = outputs.dense.t.shape[0]
        t_ends = jnp.where(jnp.arange(max_steps) < state.num_accepted, outputs.dense.t, jnp.inf)
        dense = DenseOutput(direction * t0, t_ends, outputs.dense.values, state.num_accepted)
    if not blocks:
        return None, None, dense
    ts_out = jnp.concatenate([block_ts for block_ts, _ in blocks])
    ys_out = jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *[ys for _, ys in blocks])
    return ts_out, ys_out, dense


def _stepper(solver) -> AbstractStepper:
    if isinstance(solver, str):
        try:
            return stepper_from_name(solver)
        except ValueError as error:
            raise ValueError(f"{error}{habits.solver_hint(solver)}") from None
    if not isinstance(solver, AbstractStepper):
        raise TypeError(
            f"solver={solver!r} is not a stepper. Fix: pass e.g. `odeckpt.Tsit5()` or a name "
            "such as 'tsit5'."
        )
    return solver


def _adjoint(adjoint) -> AbstractAdjoint:
    if isinstance(adjoint, str):
        try:
            return ADJOINTS[adjoint.lower()]()
        except KeyError:
            raise ValueError(
                f"Unknown adjoint {adjoint!r}. Fix: use one of {sorted(ADJOINTS)}."
            ) from None
    if not isinstance(adjoint, AbstractAdjoint):
        raise TypeError(
            f"adjoint={adjoint!r} is not an adjoint. Fix: pass an odeckpt adjoint (e.g. "
            f"`odeckpt.RecursiveCheckpointAdjoint()`) or its name, one of {sorted(ADJOINTS)}."
        )
    return adjoint


def _controller(controller, stepper: AbstractStepper, dt0, rtol, atol, y0) -> AbstractController:
    """The solve's controller, an adaptive one holding the steps to the solve's tolerances
    (those it leaves `None`); raises, naming the fix, if tolerances are given twice, or to a
    controller that judges the error estimate without taking tolerances."""
    if controller is None:
        controller = ConstantStep() if stepper.error_order is None else PIDController()
    if not isinstance(controller, AbstractController):
        raise TypeError(
            f"controller={controller!r} is not a step-size controller. Fix: pass "
            "`odeckpt.PIDController(...)` or `odeckpt.ConstantStep()`."
        )
    controller.check(stepper, dt0)
    name = type(controller).__name__
    if not isinstance(controller, AbstractAdaptiveController):
        given = [n for n, value in (("rtol", rtol), ("atol", atol)) if value is not None]
        if controller.judges_error and given:
            raise ValueError(
                f"solve({given[0]}=...) cannot reach controller={name}(...): it judges the error "
                "estimate but takes no tolerances. Fix: make it a subclass of "
                "`odeckpt.AbstractAdaptiveController` (fields `rtol` and `atol`, which the solve "
                f"fills), or drop `{given[0]}=` from `solve` and set the controller's own."
            )
        return controller
    for field, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and getattr(controller, field) is not None:
            raise ValueError(
                f"{field} is given twice: to `solve` and to {name}({field}=...). Fix: pass it "
                "in one place (the controller's is kept when `solve`'s is None)."
            )
    # A controller's own tolerances get the checks of solve's (structure, shapes).
    return controller.with_tolerances(
        validate.tolerance(f"{name}(rtol)", _given(controller.rtol, rtol, DEFAULT_RTOL), y0),
        validate.tolerance(f"{name}(atol)", _given(controller.atol, atol, DEFAULT_ATOL), y0),
    )


def _given(*values):
    """The first of `values` that is not `None`."""
    return next(value for value in values if value is not None)


def _held_rtols(controller, stepper, adjoint) -> list[tuple[str, Tolerance]]:
    """The `rtol`s that steps are held to, with their names: an adaptive controller's (else an
    implicit stepper's Newton iteration's), and an adjoint's own (of its backward solve, or of
    the sensitivities: `BacksolveAdjoint`, `InterpolatingAdjoint`, `ForwardSensitivity`)."""
    held = []
    if isinstance(controller, AbstractAdaptiveController):
        held.append(("rtol", controller.rtol))
    elif newton_rtol(stepper) is not None:
        held.append(("rtol", newton_rtol(stepper)))
    own = getattr(adjoint, "rtol", None)
    if own is not None:
        held.append((f"{type(adjoint).__name__}(rtol)", own))
    return held


def _rtol_clamped(options: Options, y0: Y) -> BoolScalar:
    """Whether an `rtol` that steps are held to is below the resolution of the state, so that
    the steps are held to that resolution instead (`resolvable_rtol`)."""
    held = _held_rtols(options.controller, options.stepper, options.adjoint)
    return functools.reduce(
        jnp.logical_or, [below_resolution(r, y0) for _, r in held], jnp.array(False)
    )


def _newton_tolerances(stepper, controller, rtol, atol) -> AbstractStepper:
    """An implicit stepper's Newton iteration converges to the tolerances of the controller
    (of the solve, with a controller that takes none)."""
    rtol, atol = _step_tolerances(controller, rtol, atol)
    # Newton's norm is over flattened coordinates: one tolerance, the tightest.
    return with_newton_tolerances(stepper, tightest(rtol), tightest(atol))


def _step_tolerances(controller, rtol, atol) -> tuple:
    """The tolerances the steps are held to: the adaptive controller's, else the solve's."""
    if isinstance(controller, AbstractAdaptiveController):
        rtol, atol = controller.rtol, controller.atol
    return _given(rtol, DEFAULT_RTOL), _given(atol, DEFAULT_ATOL)


def _with_mass_matrix(stepper, mass_matrix, y0, controller, rtol, atol) -> AbstractStepper:
    """`stepper` solving `M y' = f` with `mass_matrix` (unchanged without one); raises, naming
    the steppers that can, for a stepper that cannot."""
    if mass_matrix is None:
        return stepper
    if not isinstance(mass_matrix, MassMatrix):
        mass_matrix = MassMatrix(mass_matrix)
    assert isinstance(stepper, AbstractMassMatrix)  # `_check_mass_matrix_stepper`
    rtol, atol = _step_tolerances(controller, rtol, atol)
    return dataclasses.replace(stepper, mass=mass_matrix.resolve(y0, rtol, atol))


def _check_mass_matrix_stepper(stepper: AbstractStepper) -> None:
    if not isinstance(stepper, AbstractMassMatrix):
        raise ValueError(
            f"solver={type(stepper).__name__}() cannot solve with a mass matrix "
            "(`M y' = f`, a DAE when M is singular). Fix: use a stepper for index-1 DAEs: "
            "`odeckpt.Radau5()`, `odeckpt.BDF()` or `odeckpt.Rodas5()`."
        )


def _saveat(saveat) -> SaveAt:
    if saveat is None:
        return SaveAt(t1=True)
    if isinstance(saveat, SaveAt):
        return saveat
    return SaveAt(ts=saveat)
