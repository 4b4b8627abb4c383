"""Plots of solutions, step sizes, checkpoint schedules and compiled memory.

matplotlib is an optional dependency (`pip install "odeckpt[plot]"`), imported on the first
call of a function here, never by `import odeckpt`. Every function draws on `ax` (a new figure
when `None`) and returns the matplotlib `Axes`; `ax.figure.savefig(path)` writes it. Without a
display (and without `MPLBACKEND` set) the Agg backend is used.
"""

import os
import sys
from collections.abc import Mapping, Sequence

import equinox as eqx
import jax
import numpy as np

from ._memory import CompiledMemory, MemoryReport
from ._solution import Solution
from .checkpointing.schedules import offline_schedule, online_schedule, optimal_cost, simulate

__all__ = ["memory", "schedule", "solution", "step_sizes"]

_MAX_COMPONENTS = 8


def _axes(ax):
    """`ax`, or the axes of a new figure (importing matplotlib on first use)."""
    if ax is not None:
        return ax
    import matplotlib

    headless = sys.platform.startswith("linux") and not os.environ.get("DISPLAY")
    if headless and "MPLBACKEND" not in os.environ:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.figure(figsize=(7, 4), layout="constrained").add_subplot()


def _columns(ys) -> np.ndarray:
    """A pytree of `[T, ...]` arrays as one `[T, components]` array."""
    leaves = [np.asarray(leaf).reshape(len(leaf), -1) for leaf in jax.tree.leaves(ys)]
    return np.concatenate(leaves, axis=1)


def _evaluate(sol: Solution, ts: np.ndarray) -> np.ndarray:
    """`sol.evaluate(ts)` as `[len(ts), components]`, compiled (eagerly it runs op by op)."""
    return _columns(eqx.filter_jit(Solution.evaluate)(sol, ts))


def _accepted_steps(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
    """Times and states at `t0` and at the end of every accepted step."""
    if sol.dense is not None:
        direction = 1.0 if float(sol.t1) >= float(sol.t0) else -1.0
        ends = np.asarray(sol.dense.t_ends)[: int(sol.dense.num_accepted)] * direction
        ts = np.concatenate([[float(sol.t0)], ends])
        return ts, _evaluate(sol, ts)
    # The `inf` padding after the last step is what a `SaveAt(steps=True)` block leaves in the
    # solution (a solve that used all of `max_steps` has none: use dense output there).
    ts = np.asarray(sol.ts) if sol.ts is not None else np.zeros(0)
    if sol.ts is None or np.all(np.isfinite(ts)):
        raise ValueError(
            "plotting the accepted steps needs them in the solution. Fix: solve with "
            "`saveat=odeckpt.SaveAt(steps=True)` (add `t0=True` to include the start) or "
            "`saveat=odeckpt.SaveAt(dense=True)`."
        )
    finite = np.isfinite(ts)
    return ts[finite], _columns(sol.ys)[finite]


def solution(sol: Solution, *, labels: Sequence[str] | None = None, ax=None):
    """Plot the trajectory of each state component with the accepted steps marked.

    With dense output the curves are the stepper's continuous extension on a fine grid and the
    markers the step ends; with `SaveAt(steps=True)` the saved points are joined by straight
    lines. At most 8 components are drawn (the first ones of the flattened state).

    **Arguments:**

    - `sol`: a `Solution` from a solve with `saveat=SaveAt(dense=True)` or `SaveAt(steps=True)`.
    - `labels`: a name for each component drawn (default `y[0]`, `y[1]`, ...).
    - `ax`: matplotlib axes to draw on (default: a new figure).

    **Returns:**

    The matplotlib `Axes`.

    **Example:**

    ```python
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> f = lambda t, y, args: jnp.stack([y[1], -y[0]])
    >>> sol = odeckpt.solve(f, jnp.array([1.0, 0.0]), (0.0, 6.0),
    ...                     saveat=odeckpt.SaveAt(dense=True))
    >>> ax = odeckpt.plot.solution(sol)
    >>> len(ax.lines)  # a curve and the step markers for each component
    4

    ```
    """
    steps_t, steps_y = _accepted_steps(sol)
    ax = _axes(ax)
    if sol.dense is not None:
        curve_t = np.linspace(float(sol.t0), float(sol.t1), 400)
        curve_y = _evaluate(sol, curve_t)
    else:
        curve_t, curve_y = steps_t, steps_y
    count = min(curve_y.shape[1], _MAX_COMPONENTS)
    labels = [f"y[{i}]" for i in range(count)] if labels is None else labels
    for i, label in zip(range(count), labels, strict=True):
        (line,) = ax.plot(curve_t, curve_y[:, i], label=label)
        ax.plot(steps_t, steps_y[:, i], "o", markersize=3, color=line.get_color())
    ax.set(xlabel="t", ylabel="y", title=f"solution ({len(steps_t) - 1} accepted steps marked)")
    ax.legend(loc="best", fontsize="small")
    return ax


def step_sizes(sol: Solution, *, ax=None):
    """Plot the size of every accepted step against the time it ends at (log scale).

    **Arguments:**

    - `sol`: a `Solution` from a solve with `saveat=SaveAt(dense=True)` or `SaveAt(steps=True)`.
    - `ax`: matplotlib axes to draw on (default: a new figure).

    **Returns:**

    The matplotlib `Axes`.

    **Example:**

    ```python
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> f = lambda t, y, args: jnp.stack([y[1], -y[0]])
    >>> sol = odeckpt.solve(f, jnp.array([1.0, 0.0]), (0.0, 6.0),
    ...                     saveat=odeckpt.SaveAt(t0=True, steps=True))
    >>> ax = odeckpt.plot.step_sizes(sol)
    >>> ax.get_yscale()
    'log'

    ```
    """
    ts, _ = _accepted_steps(sol)
    ts = np.sort(ts) if ts[-1] >= ts[0] else np.sort(ts)[::-1]
    ax = _axes(ax)
    ax.plot(ts[1:], np.abs(np.diff(ts)), "o-", markersize=3)
    ax.set(xlabel="t (end of step)", ylabel="step size", yscale="log", title="accepted steps")
    return ax


def _schedule_actions(n: int, c: int, online: bool) -> tuple[list[tuple[str, int]], int]:
    """The whole run as `(action, position)` pairs: the forward sweep, then the reverse sweep
    of `simulate`; and the number of forward steps."""
    plan = online_schedule(n, c) if online else offline_schedule(n, c)
    forward: list[tuple[str, int]] = [("store", 0)]
    for i in range(1, n):
        forward.append(("advance", i - 1))
        if i < n - 1 and plan.store[i] >= 0:
            forward.append(("store", i))
    run = simulate(plan, n, record=True)
    return forward + list(run.actions), run.forward_steps


_STYLES = {
    "advance": dict(color="black", linewidth=1),
    "reverse": dict(color="tab:red", linewidth=2.5),
    "store": dict(color="tab:blue", marker="s", markersize=5, linestyle="none"),
    "restore": dict(color="tab:blue", marker="o", markersize=7, linestyle="none", fillstyle="none"),
}


def schedule(n: int, checkpoints: int, *, online: bool = False, ax=None):
    """Draw a checkpoint schedule as step index against action, as Griewank and Walther do.

    Time runs downwards. Black segments advance the state one step (the first sweep and every
    recomputation), red segments run a step's VJP (the reverse sweep), blue squares store a
    snapshot and open circles restore one. The title compares the forward steps with the
    optimum `t(n, c) = r*n - C(c+r, r-1)`.

    **Arguments:**

    - `n`: number of steps.
    - `checkpoints`: number of snapshot slots `c` (counting the one that holds the initial
        state).
    - `online`: draw the online schedule of a while loop that stops after `n` steps
        (`odeckpt.checkpointing.schedules.online_schedule`) instead of the offline one.
    - `ax`: matplotlib axes to draw on (default: a new figure).

    **Returns:**

    The matplotlib `Axes`.

    **Example:**

    ```python
    >>> import odeckpt
    >>> ax = odeckpt.plot.schedule(10, 3)
    >>> ax.get_title()
    'n = 10 steps, c = 3 snapshots: 15 forward steps (optimal t(n, c) = 15)'

    ```

    **References:**

    A. Griewank and A. Walther (2000), "Algorithm 799: Revolve", ACM TOMS 26(1), figures 2-3;
    A. Griewank and A. Walther (2008), "Evaluating Derivatives", 2nd ed., SIAM, chapter 12.
    """
    actions, forward_steps = _schedule_actions(n, checkpoints, online)
    # One polyline per kind of action, segments separated by NaN, so that drawing stays cheap.
    paths: dict[str, tuple[list[float], list[float]]] = {kind: ([], []) for kind in _STYLES}
    time = 0
    for action, pos in actions:
        xs, ys = paths[action]
        if action == "advance":
            xs += [pos, pos + 1, np.nan]
            ys += [time, time + 1, np.nan]
            time += 1
        elif action == "reverse":
            xs += [pos + 1, pos, np.nan]
            ys += [time, time + 1, np.nan]
            time += 1
        else:
            xs.append(pos)
            ys.append(time)
    ax = _axes(ax)
    for kind, (xs, ys) in paths.items():
        ax.plot(xs, ys, label=kind, **_STYLES[kind])
    ax.invert_yaxis()
    ax.locator_params(axis="x", integer=True)
    ax.legend(loc="upper right", fontsize="small")
    optimum = (
        f"{'offline optimum' if online else 'optimal'} t(n, c) = {optimal_cost(n, checkpoints)}"
    )
    ax.set(
        xlabel="step index",
        ylabel="action (steps evaluated)",
        title=f"{'online schedule, ' if online else ''}n = {n} steps, c = {checkpoints} snapshots: "
        f"{forward_steps} forward steps ({optimum})",
    )
    return ax


def _bytes(report: MemoryReport | CompiledMemory, which: str, field: str) -> int:
    memory = getattr(report, which) if isinstance(report, MemoryReport) else report
    return getattr(memory, field)


def memory(
    series: Mapping[str, Mapping[int, MemoryReport | CompiledMemory] | MemoryReport],
    *,
    xlabel: str = "checkpoints",
    which: str = "gradient",
    field: str = "temp",
    log: bool = False,
    ax=None,
):
    """Plot compiled memory (in MiB) against steps or checkpoints, one line per series.

    **Arguments:**

    - `series`: name -> `{x: report}` (a line; `x` is a step count or a number of
        checkpoints), or name -> one report (a horizontal dashed line, for an adjoint whose
        memory does not depend on `x`). Reports come from `odeckpt.memory_report` (or are
        `CompiledMemory`).
    - `xlabel`: what `x` counts.
    - `which`: `"gradient"` or `"function"`: which half of a `MemoryReport` to draw.
    - `field`: the `CompiledMemory` field to draw (`"temp"`, the one checkpointing controls,
        or `"total"`).
    - `log`: a logarithmic memory axis (for series of very different sizes).
    - `ax`: matplotlib axes to draw on (default: a new figure).

    **Returns:**

    The matplotlib `Axes`.

    **Example:**

    ```python
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> from odeckpt.checkpointing import checkpointed_scan
    >>> def loss(xs, c):
    ...     step = lambda y, x: (jnp.sin(y) * x, None)
    ...     return checkpointed_scan(step, jnp.ones(1000), xs, checkpoints=c)[0].sum()
    >>> grad = jax.grad(loss)
    >>> temps = {c: odeckpt.compiled_memory(grad, jnp.ones(200), c) for c in (2, 8)}
    >>> ax = odeckpt.plot.memory({"checkpointed_scan": temps})
    >>> ax.get_xlabel()
    'checkpoints'

    ```
    """
    ax = _axes(ax)
    for index, (name, reports) in enumerate(series.items()):
        color = f"C{index}"
        if isinstance(reports, Mapping):
            xs = sorted(reports)
            ys = [_bytes(reports[x], which, field) / 2**20 for x in xs]
            ax.plot(xs, ys, "o-", color=color, label=name)
        else:
            mib = _bytes(reports, which, field) / 2**20
            ax.axhline(mib, linestyle="--", color=color, label=name)
    ax.set(xlabel=xlabel, ylabel=f"{field} memory of the {which} (MiB)")
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")
    return ax
