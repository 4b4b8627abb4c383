"""Where steps end: at `t + dt`, or exactly on the next stop (a save time or the end of the span)
when they would reach it within rounding.

Written once against an array namespace `xp`: `jax.numpy` in the integration loop, NumPy when a
constant-step solve's number of steps is predicted before it runs (`constant_step_count`), so
that the prediction replays the loop's arithmetic exactly. Times are internal times
`tau = direction * t`: they increase.
"""

from types import ModuleType
from typing import Any

import numpy as np

from .._steppers import AbstractStepper

MAX_SAVES_PER_STEP = 16
"""Distinct save times interpolated per step at most; a step is shortened to hit the last of
them."""


def saves_per_step(stepper: AbstractStepper) -> int:
    """How many save times one step may interpolate. A stepper whose continuous extension is
    less accurate than its steps (e.g. Dopri8 with a cubic Hermite) lands on every save time."""
    return MAX_SAVES_PER_STEP if stepper.dense_degree >= stepper.order - 1 else 1


def distinct_save_times(xp: ModuleType, ts):
    """Sorted save times `ts` with each value once, and where each time's value is.

    **Returns:** `(distinct, rows)`: `distinct` has the length of `ts`, its values each once
    and in order, then `inf` (never reached); `rows[i]` is the row of `distinct` that holds
    `ts[i]`.
    """
    n = ts.shape[0]
    positions = xp.arange(n)
    first = xp.searchsorted(ts, ts, side="left") == positions
    rows = (xp.cumsum(first) - 1).astype(np.int32)
    # The first occurrence of the value of row j: the first position whose row reaches j.
    source = xp.minimum(xp.searchsorted(rows, positions, side="left"), n - 1)
    distinct = xp.where(positions <= rows[-1], ts[source], xp.inf)
    return distinct, rows


def next_stop(xp: ModuleType, ts, t_end, save_index, per_step: int):
    """The next time a step must land on: the end of the span, or the last of the next
    `per_step` save times (`ts`: distinct save times, or `None`). A save time equal to the end
    is the end: the final state depends on `t_end` (the save row takes its own time's
    derivative in `IntegrationLoop._save_rows`)."""
    if ts is None or ts.shape[0] <= per_step:
        return t_end
    last = save_index + per_step - 1
    save_stop = ts[xp.minimum(last, ts.shape[0] - 1)]
    return xp.where((last < ts.shape[0]) & (save_stop < t_end), save_stop, t_end)


def next_jump(xp: ModuleType, jump_ts, t, t_end):
    """The first known discontinuity (sorted `jump_ts`) after `t` and before `t_end`, or
    `inf`. A step lands on the last time before it (so that no stage of the step sees the
    far side), and the next starts at the first time after it, with the stepper and the
    controller restarted (as diffrax does)."""
    index = xp.searchsorted(jump_ts, t, side="right")
    jump = jump_ts[xp.minimum(index, jump_ts.shape[0] - 1)]
    return xp.where((index < jump_ts.shape[0]) & (jump < t_end), jump, xp.inf)


def before(xp: ModuleType, t):
    """The largest floating-point number below `t` (with the derivative of `t` in JAX)."""
    return _moved(xp, t, -xp.inf)


def after(xp: ModuleType, t):
    """The smallest floating-point number above `t` (with the derivative of `t` in JAX)."""
    return _moved(xp, t, xp.inf)


def _moved(xp: ModuleType, t, towards) -> Any:  # an array of `xp`
    if xp is np:
        return np.nextafter(t, np.asarray(towards, t.dtype))
    import jax  # the NumPy replay imports no JAX

    fixed = jax.lax.stop_gradient(t)
    moved = t + (xp.nextafter(fixed, xp.asarray(towards, t.dtype)) - fixed)
    return xp.where(xp.isfinite(fixed), moved, t)  # no jump left: `inf` stays `inf`


STEP_ROUNDING = 0.01
"""How far, relative to its size, a step may end from `t + dt`: by the rounding of `t + dt`
(`resolves`), or lengthened to land on a stop (`lands`). Beyond it the steps would silently be
others than those asked for."""


def lands(xp: ModuleType, t, step_end, stop):
    """Whether a step from `t` to `step_end` lands on `stop`: it reaches it, or stops within
    rounding of it (no sliver step is left): within `100 eps |t|`, and within `STEP_ROUNDING`
    of the step (at large |t|, `100 eps |t|` can exceed the step itself)."""
    rounding = 100 * xp.finfo(step_end.dtype).eps * xp.maximum(xp.abs(stop), xp.abs(t))
    slack = xp.minimum(rounding, STEP_ROUNDING * (step_end - t))
    return step_end >= stop - slack


def resolves(xp: ModuleType, t, step_end, dt):
    """Whether times near `t` resolve the step size `dt`: the step from `t`, which ends at
    `step_end` (`t + dt` rounded), has the size `dt` to within `STEP_ROUNDING` of it. At large
    |t| (`dt` a few ulps of `t`: 1e15 in float64 with `dt = 0.3`), steps of `dt` would be
    rounded to other sizes."""
    return xp.abs((step_end - t) - dt) <= STEP_ROUNDING * dt


def saves_in_step(xp: ModuleType, ts, save_index, t1, rows: int):
    """Which of the `rows` save times from `save_index` on a step ending at `t1` reaches:
    `(index, valid)`, the save times' indices and a mask."""
    index = save_index + xp.arange(rows)
    t_save = ts[xp.minimum(index, ts.shape[0] - 1)]
    return index, (index < ts.shape[0]) & (t_save <= t1)


def constant_step_count(
    t0: float | np.ndarray,
    t1: float | np.ndarray,
    dt0: float | np.ndarray,
    ts: np.ndarray | None,
    per_step: int,
    dtype,
    max_steps: int,
    jump_ts: np.ndarray | None = None,
) -> int | None:
    """The steps a constant-step solve from `t0` to `t1` takes (with save times `ts` and known
    discontinuities `jump_ts`), in `dtype`; `None` past `max_steps`. Raises a `ValueError`
    (naming the fix) where the times of the span do not resolve `dt0` (`resolves`), which the
    solve would end with `Status.dt_underflow`."""
    direction = 1 if t1 >= t0 else -1
    tau, end, dt = (np.asarray(x, dtype) for x in (direction * t0, direction * t1, abs(dt0)))
    saves = None
    if ts is not None:
        saves, _ = distinct_save_times(np, np.asarray(direction * np.asarray(ts), dtype))
    save_index = 0 if saves is None else int(np.sum(saves <= tau))
    jumps = None if jump_ts is None else np.sort(np.asarray(direction * jump_ts, dtype))
    for count in range(max_steps + 1):
        if not tau < end:
            return count
        stop = next_stop(np, saves, end, save_index, per_step)
        jump = None if jumps is None else np.asarray(next_jump(np, jumps, tau, end), dtype)
        if jump is not None:
            stop = np.minimum(stop, before(np, jump))
        step_end = tau + dt
        landed = lands(np, tau, step_end, stop)
        if not landed and not resolves(np, tau, step_end, dt):
            raise ValueError(_unresolved(direction * tau, step_end - tau, dt0))
        tau = stop if landed else step_end
        if jump is not None and tau == before(np, jump):
            tau = after(np, jump)
        if saves is not None:
            rows = min(saves.shape[0], per_step)
            save_index += int(np.sum(saves_in_step(np, saves, save_index, tau, rows)[1]))
    return None


def _unresolved(t, step, dt0) -> str:
    """The message of a constant step size `dt0` that the times near `t` do not resolve (the
    step from `t` is `step`)."""
    dtype = np.asarray(t).dtype
    shown = lambda x: str(np.asarray(x, dtype)[()])  # the shortest digits in `dtype`
    wider = (
        ""
        if dtype.itemsize >= 8
        else 'solve in float64 (`jax.config.update("jax_enable_x64", True)` and a float64 y0), '
    )
    return (
        f"dt0={shown(dt0)} is too small for times as large as t = {shown(t)}: in {dtype} the "
        f"times near it are {shown(np.spacing(abs(t)))} apart, so the step from there would be "
        f"{shown(step)}, not {shown(abs(dt0))}. Fix: shift time so that the span starts at 0 "
        f"(solve over (0, t1 - t0) with `f` reading `t + t0`), {wider}or use a larger dt0."
    )
