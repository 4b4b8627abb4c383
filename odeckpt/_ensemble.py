"""The ensemble front door: `odeckpt.ensemble`, many trajectories of one problem at once."""

import dataclasses
import os
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _validate as validate
from ._adjoints import GradientStats
from ._fused import KernelSettings, Start, Trajectory, Unsupported, run_ensemble
from ._loop import DistinctSaveTimes, Event, Outputs
from ._on_failure import raise_if_failed
from ._saveat import SaveAt
from ._solution import Solution
from ._solve import Options, Problem, Setup, finish, prepare, solve
from ._status import Status
from ._steppers import AbstractStepper, Tsit5
from ._types import Args, Tolerance, VectorField, Y

BACKENDS = ("auto", "fused", "vmap")


def ensemble(
    f: VectorField,
    y0: Y,
    t_span=None,
    args: Args = None,
    *,
    args_axes=0,
    solver: AbstractStepper | str = Tsit5(),
    rtol: Tolerance | None = None,
    atol: Tolerance | None = None,
    dt0=None,
    controller=None,
    saveat: SaveAt | jax.Array | np.ndarray | None = None,
    max_steps: int = 4096,
    throw: bool = True,
    event: Event | tuple[Event, ...] | None = None,
    mass_matrix=None,
    backend: str = "auto",
    lanes_per_block: int | None = None,
) -> Solution:
    """Solve many trajectories of `dy/dt = f(t, y, args)` at once: one per row of `y0` (and of
    the per-trajectory leaves of `args`), each with its own adaptive steps.

    The result is that of `jax.vmap(odeckpt.solve)` over the trajectories, step for step. On a
    GPU it is computed by one fused kernel (`backend="fused"`, the default there for explicit
    steppers): each trajectory is one lane of the kernel, its state and stages held in
    registers, stepping until it ends while its neighbours go on. Elsewhere, and for what the
    kernel does not run (implicit steppers, events, dense output, complex states), the
    `jax.vmap(solve)` path computes it (`backend="vmap"`).

    Derivatives (`jax.jvp`, `jax.jacfwd`, `jax.grad`, `jax.jacrev`) with respect to `y0` and
    `args` are those of the discrete solve, as every adjoint of `solve` computes them. The
    fused kernel computes them by forward sensitivities in the same kernel, one direction per
    differentiated input component of one trajectory (`y0`, its own `args`, the shared `args`):
    meant for small systems with a handful of parameters. It does not differentiate the times
    or tolerances (a `ValueError` says so; `backend="vmap"` does).

    **Arguments:**

    - `f`, `t_span`, `solver`, `rtol`, `atol`, `dt0`, `controller`, `saveat`, `max_steps`,
        `event`, `mass_matrix`: as for `odeckpt.solve`, shared by every trajectory (a DAE's
        implicit steppers run on the `vmap` path).
    - `y0`: the initial states, each leaf with a leading axis of trajectories.
    - `args`: the parameters; `args_axes` says, as `jax.vmap`'s `in_axes` for it, which leaves
        hold one row per trajectory along an axis (`0`, the default: every leaf) and which are
        shared (`None`).
    - `throw`: raise if any trajectory fails, naming the trajectories (outside `jit`; under
        `jit`, naming the first failed one, with its message). With `False`, `sol.status`
        holds one status per trajectory; a failed trajectory's derivatives are NaN, the
        others' are exact.
    - `backend`: `"auto"` (fused on a GPU when the problem allows it, else `"vmap"`),
        `"fused"` (the kernel; raises naming what it cannot run; off a GPU it runs in Pallas'
        interpret mode, slowly: for tests), or `"vmap"`.
    - `lanes_per_block`: trajectories per program instance of the kernel (a power of two;
        `None`: 128 on a GPU).

    **Returns:**

    A `Solution` whose every leaf has a leading axis of trajectories. On the fused path
    `stats.num_checkpoints` and `stats.num_recomputed_steps` are 0: its derivatives store and
    recompute nothing.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import odeckpt

    def lorenz(t, y, args):
        sigma, rho, beta = args
        return jnp.stack([sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1],
                          y[0] * y[1] - beta * y[2]])

    n = 64
    params = jnp.array([10.0, 28.0, 8 / 3]) * (1 + 0.1 * jax.random.uniform(
        jax.random.PRNGKey(0), (n, 3)))
    y0 = jnp.tile(jnp.array([1.0, 0.0, 0.0]), (n, 1))
    sol = odeckpt.ensemble(lorenz, y0, (0.0, 1.0), params, rtol=1e-6, atol=1e-8)
    sol.ys.shape  # (64, 1, 3): the state at t1 of each trajectory
    ```

    **References:** U. Utkarsh, V. Churavy, Y. Ma, T. Besard, P. Srisuma, T. Gymnich,
    A. R. Gerlach, A. Edelman, G. Barbastathis, R. D. Braatz, C. Rackauckas, "Automated
    translation and accelerated solving of differential equations on multiple GPU platforms",
    *Comput. Methods Appl. Mech. Engrg.* 419 (2024) 116591 (one trajectory per GPU thread).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}. Fix: pass e.g. 'auto'.")
    if t_span is None:
        raise TypeError("ensemble() needs the time span. Fix: `ensemble(f, y0, (t0, t1), args)`.")
    y0 = validate.as_state(y0)
    throw = validate.flag("throw", throw)
    count = _trajectories(y0)
    axes = _args_axes(args_axes, args, count)
    keywords = dict(
        solver=solver, rtol=rtol, atol=atol, dt0=dt0, controller=controller, saveat=saveat,
        max_steps=max_steps, event=event, mass_matrix=mass_matrix,
    )  # fmt: skip
    call = None
    if backend == "fused" or (backend == "auto" and jax.default_backend() == "gpu"):
        call = fused_call(
            f, y0, t_span, args, axes, keywords, throw=throw, backend=backend,
            lanes_per_block=lanes_per_block, platform=jax.default_backend(),
        )  # fmt: skip
    if call is None:
        return _raised(_vmapped(f, y0, t_span, args, axes, keywords), throw)
    try:
        return _raised(call(), throw)
    except Unsupported as error:
        raise ValueError(str(error)) from None


def fused_call(
    f, y0: Y, t_span, args: Args, axes, keywords: dict, *, throw: bool, backend: str,
    lanes_per_block: int | None, platform: str,
) -> Callable[[], Solution] | None:  # fmt: skip
    """The fused kernel's solve of the ensemble for `platform` ("gpu": Triton; else interpret
    mode), as a function of nothing; `None` (with `backend="auto"`) or a `ValueError` naming
    the reason (with `"fused"`) where the kernel cannot run it. The statuses are not checked
    (see `_raised`)."""
    lane_args, shared = _split(args, axes)
    combine = _Combine(jax.tree.structure(args))
    example = jax.tree.map(lambda x: jnp.zeros_like(x[0]), y0)
    example_args = combine(jax.tree.map(lambda x: x[0], lane_args), shared)
    problem, options, invalid = prepare(
        f, example, t_span, example_args, adjoint="recursive", throw=throw, progress=False,
        jump_ts=None, **keywords,
    )  # fmt: skip
    reason = unsupported(options, y0, platform)
    if reason is not None:
        if backend == "fused":
            raise ValueError(
                f"The fused ensemble kernel cannot run this problem: {reason}. Fix: pass "
                "`backend='vmap'` (or 'auto', which chooses it)."
            )
        return None
    validate.check_vector_field(f, problem.t0, example, example_args)
    settings = _settings(lanes_per_block, _trajectories(y0), platform)
    # Failures raise per trajectory (`_raised`): the compiled kernel is the same for `throw`.
    options = dataclasses.replace(options, throw=False)
    return lambda: _fused(problem, options, invalid, y0, lane_args, shared, combine, settings)


def unsupported(options: Options, y0: Y, platform: str) -> str | None:
    """Why the fused kernel cannot run a solve with these options and `y0` on `platform`, or
    `None`."""
    stepper = options.stepper
    if stepper.implicit or stepper.multistep:
        return (
            f"the {type(stepper).__name__} stepper solves its stages with Newton's method or "
            "keeps a history (explicit one-step steppers only: Tsit5, Dopri5, Dopri8, Bosh3, "
            "RK4, ...)"
        )
    if options.events is not None:
        return "events locate their crossings by a root finder, which the kernel does not run"
    if options.saveat.steps or options.saveat.dense:
        return "SaveAt(steps=True) and SaveAt(dense=True) keep max_steps rows per trajectory"
    for leaf in jax.tree.leaves(y0):
        if leaf.dtype not in (jnp.float32, jnp.float64):
            return f"the state has dtype {leaf.dtype} (float32 and float64 only)"
    if platform not in ("gpu", "cpu"):
        return f"the kernel is written for GPUs (Pallas' Triton backend), not {platform}"
    return None


def _trajectories(y0: Y) -> int:
    sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in jax.tree.leaves(y0)}
    if None in sizes or len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            "ensemble() takes y0 with a leading axis of trajectories on every leaf, of one "
            f"length (got leading sizes {sorted(str(s) for s in sizes)}). Fix: stack the "
            "initial states, e.g. `jnp.stack([y0_a, y0_b])` or `jnp.tile(y0, (n, 1))`."
        )
    (count,) = sizes
    assert count is not None  # refused above
    return count


def _args_axes(args_axes, args: Args, count: int):
    """`args_axes` broadcast to every leaf of `args` (0 or None each), checked."""
    try:
        axes = jax.tree.broadcast(args_axes, args, is_leaf=lambda x: x is None)
    except ValueError:
        raise ValueError(
            f"args_axes={args_axes!r} does not match the structure of args. Fix: pass 0 "
            "(every leaf per trajectory), None (all shared) or a pytree like args of 0 and None."
        ) from None
    for axis, leaf in _pairs(axes, args):
        if axis is None:
            continue
        if axis != 0:
            raise ValueError(
                f"args_axes holds {axis!r}; the ensemble takes 0 (a leaf with one row per "
                "trajectory) or None (shared). Fix: move that axis first (`jnp.moveaxis`)."
            )
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != count:
            raise ValueError(
                f"An args leaf of shape {jnp.shape(leaf)} is marked per trajectory (axis 0) but "
                f"there are {count} trajectories. Fix: give it a leading axis of {count}, or "
                "mark it shared with None in args_axes."
            )
    return axes


def _pairs(axes, args) -> list:
    leaves, tree = jax.tree.flatten(args)
    return list(zip(tree.flatten_up_to(axes), leaves, strict=True))


def _split(args: Args, axes) -> tuple[list, list]:
    """The leaves of `args` as two lists of one length: the per-trajectory ones (`None` where
    shared) and the shared ones (`None` where per trajectory)."""
    pairs = _pairs(axes, args)
    lane = [leaf if axis is not None else None for axis, leaf in pairs]
    shared = [leaf if axis is None else None for axis, leaf in pairs]
    return lane, shared


@dataclasses.dataclass(frozen=True)
class _Combine:
    """`combine(lane, shared)`: the `args` of one trajectory (of structure `tree`) from its own
    leaves and the shared ones, two lists like those of `_split` (`lane` may be `None`: the
    shared leaves only, `None` elsewhere). Hashable, so that the compiled ensemble is reused."""

    # jax binds `PyTreeDef` as a variable (from jaxlib), which pyright rejects as a type.
    tree: jax.tree_util.PyTreeDef  # pyright: ignore[reportInvalidTypeForm]

    def __call__(self, lane: list | None, shared: list) -> Args:
        if lane is None:
            lane = [None] * len(shared)
        merged = [s if own is None else own for own, s in zip(lane, shared, strict=True)]
        return jax.tree.unflatten(self.tree, merged)


def _vmapped(f, y0: Y, t_span, args: Args, axes, keywords: dict) -> Solution:
    one = lambda y, a: solve(f, y, t_span, a, throw=False, **keywords)
    return jax.vmap(one, in_axes=(0, axes))(y0, args)


def _settings(lanes_per_block: int | None, count: int, platform: str) -> KernelSettings:
    interpret = platform != "gpu"
    if lanes_per_block is None:
        lanes_per_block = min(128, 1 << max(count - 1, 0).bit_length()) if interpret else 128
    if lanes_per_block < 1 or lanes_per_block & (lanes_per_block - 1):
        raise ValueError(
            f"lanes_per_block={lanes_per_block} must be a power of two. Fix: pass e.g. 128."
        )
    return KernelSettings(lanes_per_block, interpret, max(1, min(8, lanes_per_block // 32)))


class _Uniform(eqx.Module):
    """The arrays every trajectory shares: the span, save times (as given, and distinct in
    internal time) and the options' arrays."""

    t0: jax.Array
    t1: jax.Array
    ts: jax.Array | None
    save_times: DistinctSaveTimes | None
    options: Options


@dataclasses.dataclass(frozen=True)
class _WithClosedOver:
    """`combine(lane, shared)` of the kernel: the user's `args` (by `combine`, from the first
    `count` leaves) and the values the vector field closes over (the shared leaves after
    them), as a pair."""

    combine: _Combine
    count: int

    def __call__(self, lane: list | None, shared: list) -> tuple[Args, list]:
        own = None if lane is None else lane[: self.count]
        return self.combine(own, shared[: self.count]), shared[self.count :]


@eqx.filter_jit
def _fused(
    problem: Problem, options: Options, invalid, y0: Y, lane_args: list, shared: list, combine,
    settings: KernelSettings,
) -> Solution:  # fmt: skip
    f = problem.f
    arrays, static = eqx.partition(options, eqx.is_array)
    ts = problem.ts
    direction = Setup.direction_of(problem, options)
    save_times = None if ts is None else DistinctSaveTimes.make(direction * ts)
    uniform = _Uniform(problem.t0, problem.t1, ts, save_times, arrays)
    # The values `f` closes over that may be traced (a parameter under `jit` or `grad`, the
    # arrays of an equinox module) become shared arguments of the kernel: its derivatives
    # reach them, and no tracer hides among the kernel's constants.
    one_y = jax.tree.map(lambda x: x[0], y0)
    one_args = combine(jax.tree.map(lambda x: x[0], lane_args), shared)
    # (Through a lambda: `closure_convert` hashes the function, and a module holding tracers
    # is unhashable.)
    field, hoisted = jax.closure_convert(lambda t, y, a: f(t, y, a), problem.t0, one_y, one_args)

    def kernel_field(t, y, args):
        own, closed_over = args
        return field(t, y, own, *closed_over)

    def start(args, shared_arrays) -> Start:
        assert isinstance(shared_arrays, _Uniform)  # as passed to `run_ensemble` below
        one = Problem(
            kernel_field, None, shared_arrays.t0, shared_arrays.t1, shared_arrays.ts, args, None
        )
        options_ = eqx.combine(shared_arrays.options, static)
        setup = Setup.make(one, options_, shared_arrays.save_times)
        return Start(setup.loop, setup.tau0, setup.dt)

    trajectory = Trajectory(start, _WithClosedOver(combine, len(shared)), settings)
    lanes = lane_args + [None] * len(hoisted)
    ran = run_ensemble(trajectory, y0, lanes, shared + list(hoisted), uniform)

    def finished(y0, lane_leaves, state, rows, times):
        t0, t1, ts = times
        one = Problem(f, y0, t0, t1, ts, combine(lane_leaves, shared), None)
        setup = Setup.make(one, options, save_times)
        _, init_evals = setup.loop.init_state(setup.tau0, y0, setup.dt)  # its count only
        zero = jnp.zeros((), jnp.int32)
        return finish(
            one, options, setup, state, Outputs(ts=rows), GradientStats(zero, zero), init_evals,
            invalid,
        )  # fmt: skip

    # The times enter once per trajectory, as in `jax.vmap(solve)`'s outputs: a saved time
    # shared by all would have per-trajectory derivatives (NaN where one failed).
    n = jax.tree.leaves(y0)[0].shape[0]
    times = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), (problem.t0, problem.t1, ts)
    )
    return jax.vmap(finished)(y0, lane_args, ran.state, ran.rows, times)


def _raised(sol: Solution, throw: bool) -> Solution:
    """`sol`, raising if `throw` and a trajectory failed: naming the trajectories when the
    statuses are known (outside `jit`), else as `vmap(solve)` does (the first failed
    trajectory and its message; under `EQX_ON_ERROR=nan` every trajectory's outputs are NaN
    instead, equinox's rule for a batch with a failed lane)."""
    if not throw:
        return sol
    status = sol.status
    if not status.is_traced() and os.environ.get("EQX_ON_ERROR", "raise") == "raise":
        failed = np.flatnonzero(np.asarray(status != Status.successful))
        if failed.size:
            shown = ", ".join(str(i) for i in failed[:10]) + (" ..." if failed.size > 10 else "")
            first = status[int(failed[0])]
            raise eqx.EquinoxRuntimeError(
                f"{failed.size} of {status.shape[0]} trajectories failed (trajectory {shown}). "
                f"Trajectory {failed[0]}: {first!r}. {first.message}"
            )
        return sol
    note = (
        " (In an ensemble the lane is the trajectory. For every failed one, pass "
        "`throw=False` and read `jnp.flatnonzero(sol.status != odeckpt.Status.successful)`.)"
    )
    notes = {name: note for name in Status.names() if name != "successful"}
    outputs = jax.vmap(lambda s, out: raise_if_failed(s, out, notes))(status, (sol.ts, sol.ys))
    return dataclasses.replace(sol, ts=outputs[0], ys=outputs[1])
