"""An ensemble of solves in one kernel, and its derivatives by forward sensitivities in the same
kernel.

Each trajectory runs the `IntegrationLoop` that `solve` runs, step for step (the kernel
evaluates that loop's own step, see `_lanes`), so a lane takes the steps `solve` takes. The
derivatives are those of the discrete solve, as `DirectAdjoint` and `ForwardMode` give them:
the tangents of the state and of the stepper state (`f` at the step's end, the next step's first
stage) along `p` directions are carried beside each lane and stepped by the step's own
Jacobian-vector products; step sizes are not differentiated. A `jax.jvp`, `jax.grad` or
`jax.jacrev` of the ensemble runs the kernel once with one direction per differentiated input
component (of `y0`, of the per-trajectory `args` and of the shared ones) and contracts the
Jacobians it returns with the tangents, a linear map that reverse mode transposes.
"""

import dataclasses
import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .._loop import IntegrationLoop, LoopState, Rows
from .._types import Args, Scalar, Y
from ._kernel import KernelSettings, LaneLoop, run_lanes


class Start(eqx.Module):
    """Where one trajectory's solve starts: its `loop`, start time `tau0` and first step size
    `dt` (`None`: chosen by the controller)."""

    loop: IntegrationLoop
    tau0: Scalar
    dt: Scalar | None


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
    """One trajectory's solve as a function of its inputs: `start(args, uniform)` builds it for
    the trajectory's `args`, which `combine(lane_args, shared_args)` assembles from its own and
    the shared ones, and the arrays `uniform` that every trajectory shares (times, tolerances)."""

    start: Callable[[Args, object], Start]
    combine: Callable[[Args, Args], Args]
    settings: KernelSettings


class Ran(eqx.Module):
    """Every trajectory's final loop `state` and saved rows (`rows`: like `y0`, each leaf
    `(n, save times, ...)`), with a leading axis of trajectories."""

    state: LoopState
    rows: Y


def run_ensemble(trajectory: Trajectory, y0: Y, lane_args: Args, shared: Args, uniform) -> Ran:
    """Solve every trajectory (`y0`, `lane_args`: leading axis of trajectories; `shared` and
    `uniform`, the arrays the problem closes over, the same for all) in one kernel."""
    state, rows = _run(trajectory, y0, lane_args, shared, uniform)
    return Ran(state, rows)


def _plain_loop(trajectory: Trajectory, shared: Args) -> LaneLoop:
    def init(lane, uniform):
        y0, lane_args = lane
        start = trajectory.start(trajectory.combine(lane_args, shared), uniform)
        state, _ = start.loop.init_state(start.tau0, y0, start.dt)
        return state, jax.tree.leaves(start.loop.init_outputs(state).ts)

    def step(state, lane, uniform):
        _, lane_args = lane
        loop = trajectory.start(trajectory.combine(lane_args, shared), uniform).loop
        new, writes, _ = loop.step(state)
        return new, _rows(writes.ts)

    return LaneLoop(init, _cond(trajectory, shared), step)


def _cond(trajectory: Trajectory, shared: Args) -> Callable:
    def cond(state, uniform):
        # `cond` reads no `args`: the shared ones will do.
        loop = trajectory.start(trajectory.combine(None, shared), uniform).loop
        return loop.cond(state) & (state.num_steps < loop.max_steps)

    return cond


def _rows(rows: Rows | None) -> list:
    """A step's rows at the save times as the kernel writes them: `[index, values]` per leaf
    (none without save times)."""
    if rows is None:
        return []
    return [x for leaf in jax.tree.leaves(rows.values) for x in (rows.index, leaf)]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _run(trajectory: Trajectory, y0, lane_args, shared, uniform):
    state, buffers = run_lanes(
        _plain_loop(trajectory, shared), (y0, lane_args), uniform, trajectory.settings
    )
    return state, _as_rows(y0, buffers)


def _as_rows(y0: Y, leaves: list) -> Y | None:
    """The saved rows as a pytree like `y0` (`None` without save times)."""
    if not leaves:
        return None
    return jax.tree.unflatten(jax.tree.structure(y0), leaves)


class _Directions(eqx.Module):
    """The differentiated input components, one direction each: which leaves of `(y0,
    lane_args, shared)` are differentiated (`chosen`, by flat position) and their sizes."""

    chosen: tuple[int, ...] = eqx.field(static=True)
    sizes: tuple[int, ...] = eqx.field(static=True)

    @property
    def count(self) -> int:
        return sum(self.sizes)

    def basis(self, shapes: list) -> list[np.ndarray]:
        """For each chosen leaf, its tangent along every direction: `(count, *shape)`, one-hot."""
        out, start = [], 0
        for shape, size in zip(shapes, self.sizes, strict=True):
            block = np.zeros((self.count, size))
            block[start : start + size] = np.eye(size)
            out.append(block.reshape((self.count, *shape)))
            start += size
        return out


def _sensitivity_loop(
    trajectory: Trajectory, leaves: list, tree, directions: _Directions, lane_count: int
) -> LaneLoop:
    """The loop carrying, beside each lane's state, the tangents of its `y` and stepper state
    along every direction; its buffers: the saved rows, then their tangents `(rows, p, ...)`."""
    chosen = directions.chosen
    shapes = [jnp.shape(leaves[i])[1:] if i < lane_count else jnp.shape(leaves[i]) for i in chosen]
    dtypes = [jnp.result_type(leaves[i]) for i in chosen]
    basis = [b.astype(d) for b, d in zip(directions.basis(shapes), dtypes, strict=True)]

    def rebuild(lane_leaves, chosen_values):
        full = list(lane_leaves) + list(leaves[lane_count:])
        for i, value in zip(chosen, chosen_values, strict=True):
            full[i] = value
        y0, lane_args, shared = jax.tree.unflatten(tree, full)
        return y0, trajectory.combine(lane_args, shared)

    def along(function, primals, tangents_of_state, count):
        """`function`'s values and its tangents along every direction."""

        def one(*tangents):
            return jax.jvp(function, primals, tangents)

        in_axes = (0,) * (count + len(basis))
        return jax.vmap(one, in_axes=in_axes, out_axes=(None, 0))(*tangents_of_state, *basis)

    def init(lane, uniform):
        lane_leaves = jax.tree.leaves(lane)

        def start(*chosen_values):
            y0, args = rebuild(lane_leaves, chosen_values)
            begin = trajectory.start(args, uniform)
            state, _ = begin.loop.init_state(begin.tau0, y0, begin.dt)
            return state, begin.loop.init_outputs(state).ts

        primals = tuple(lane_leaves[i] if i < lane_count else leaves[i] for i in chosen)
        (state, rows), (d_state, d_rows) = along(start, primals, (), 0)
        carry = (state, d_state.y, d_state.stepper_state)
        d_rows = jax.tree.map(_rows_first, d_rows)
        return carry, [*jax.tree.leaves(rows), *jax.tree.leaves(d_rows)]

    def step(carry, lane, uniform):
        state, d_y, d_stepper = carry
        lane_leaves = jax.tree.leaves(lane)

        def advance(y, stepper_state, *chosen_values):
            _, args = rebuild(lane_leaves, chosen_values)
            loop = trajectory.start(args, uniform).loop
            moved = dataclasses.replace(state, y=y, stepper_state=stepper_state)
            new, writes, _ = loop.step(moved)
            return new, writes.ts

        primals = (state.y, state.stepper_state) + tuple(
            lane_leaves[i] if i < lane_count else leaves[i] for i in chosen
        )
        (new, writes), (d_new, d_writes) = along(advance, primals, (d_y, d_stepper), 2)
        d_rows = None
        if writes is not None:
            d_rows = Rows(writes.index, jax.tree.map(_rows_first, d_writes.values))
        return (new, d_new.y, d_new.stepper_state), _rows(writes) + _rows(d_rows)

    cond = _cond(trajectory, jax.tree.unflatten(tree, leaves)[2])
    return LaneLoop(init, lambda carry, uniform: cond(carry[0], uniform), step)


def _rows_first(x):
    """A tangent `(p, rows, ...)` as `(rows, p, ...)`."""
    return jnp.swapaxes(x, 0, 1)


def _run_jvp(trajectory: Trajectory, primals, tangents):
    y0, lane_args, shared, uniform = primals
    d_y0, d_lane_args, d_shared, d_uniform = tangents
    if any(not _is_zero(t) for t in jax.tree.leaves(d_uniform, is_leaf=_is_zero)):
        raise ValueError(
            "The fused ensemble differentiates with respect to y0, args and the values the "
            "vector field closes over, not the times (t0, t1, save times) or the tolerances. "
            "Fix: pass `backend='vmap'` to `odeckpt.ensemble`, which differentiates them all."
        )
    leaves, tree = jax.tree.flatten((y0, lane_args, shared))
    d_leaves = jax.tree.leaves((d_y0, d_lane_args, d_shared), is_leaf=_is_zero)
    lane_count = len(jax.tree.leaves((y0, lane_args)))
    chosen = tuple(i for i, d in enumerate(d_leaves) if not isinstance(d, SymbolicZero))
    if not chosen:
        out = _run(trajectory, y0, lane_args, shared, uniform)
        return out, jax.tree.map(_zero_tangent, out)
    sizes = tuple(
        int(np.prod(jnp.shape(leaves[i])[1 if i < lane_count else 0 :], dtype=int)) for i in chosen
    )
    directions = _Directions(chosen, sizes)
    lane_loop = _sensitivity_loop(trajectory, leaves, tree, directions, lane_count)
    (state, d_y, _), buffers = run_lanes(lane_loop, (y0, lane_args), uniform, trajectory.settings)
    half = len(buffers) // 2
    rows = _as_rows(y0, buffers[:half])
    d_rows = _as_rows(y0, buffers[half:])
    out_rows = None
    n = jax.tree.leaves(y0)[0].shape[0]
    coefficients = jnp.concatenate(
        [
            jnp.reshape(d_leaves[i], (n, -1))
            if i < lane_count
            else jnp.broadcast_to(jnp.reshape(d_leaves[i], (1, -1)), (n, sizes[k]))
            for k, i in enumerate(chosen)
        ],
        axis=1,
    )
    contract = lambda jac: jnp.einsum("np...,np->n...", jac, coefficients.astype(jac.dtype))
    d_state = jax.tree.map(_zero_tangent, state)
    d_state = dataclasses.replace(d_state, y=jax.tree.map(contract, d_y))
    if d_rows is not None:
        contract_rows = lambda jac: jnp.einsum("nrp...,np->nr...", jac, coefficients)
        out_rows = jax.tree.map(contract_rows, d_rows)
    return (state, rows), (d_state, out_rows)


def _is_zero(x) -> bool:
    return isinstance(x, SymbolicZero)


def _zero_tangent(x):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(jnp.shape(x), dtype=jax.dtypes.float0)


_run.defjvp(_run_jvp, symbolic_zeros=True)
