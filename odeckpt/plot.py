"""Plots of solutions, step sizes, checkpoint schedules and compiled memory.

matplotlib is an optional dependency (`pip install "odeckpt[plot]"`), imported on the first
call of a function here, never by `import odeckpt`. Every function draws on `ax` (a new figure
when `None`) and returns the matplotlib `Axes`; `ax.figure.savefig(path)` writes it. Without a
display (and without `MPLBACKEND` set) the Agg backend is used.
"""

import os
import sys
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from ._memory import CompiledMemory, MemoryReport
from ._plot_data import XSCALES, YSCALES, Trajectories, choose_xscale, step_ends, trajectories
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


def solution(
    sol: Solution,
    *,
    labels: Sequence[str] | None = None,
    components: Sequence[int] | None = None,
    xscale: str = "auto",
    yscale: str = "linear",
    band: tuple[float, float] = (0.0, 1.0),
    samples: int = 1000,
    steps: bool = True,
    ax=None,
):
    """Plot each component of the state against time: one solution, or an ensemble as a band.

    Each artist drawn says what it is by its `gid`:

    - `"curve"`: with dense output, the stepper's continuous extension, evaluated at `samples`
        times spread over the time axis (evenly; on a log axis geometrically, the same number
        in every decade) and, for a single solve, at every step end; only where the solve went
        (it is never extrapolated). Without dense output, the saved points joined by straight
        lines.
    - `"saved"`: the saved points (`sol.ts`, `sol.ys`), as open circles.
    - `"steps"`: the end of every accepted step, as a tick on the time axis (known from dense
        output or `SaveAt(steps=True)`; `steps=False` leaves them out).
    - `"band"`: for an ensemble (a `Solution` batched by `jax.vmap` or from `odeckpt.ensemble`),
        the band between the `band` quantiles of the members at each time, and their median as
        the curve. A member counts where its solution is known (up to where it stopped if it
        failed). Without dense output the members must share their save times.

    `xscale="auto"` draws a log time axis when no time is negative and half of the times the
    solution knows (its step ends with dense output, else its saved times) lie in the first
    hundredth of the span, as for a stiff problem over many decades; a linear one otherwise.
    A log time axis starts at the first positive time the solution knows (the first step end
    when `t0 = 0`) and leaves out the points at `t <= 0`; a log value axis
    (`yscale="log"`) leaves out values `<= 0` (a gap in the curve, never a line to the edge).

    **Arguments:**

    - `sol`: a `Solution` with saved points (`SaveAt(ts=...)`, `steps=True`, ...) or dense
        output (`SaveAt(dense=True)`), or both; batched for an ensemble.
    - `labels`: a name for each component drawn (default: `y` followed by the path of the leaf
        and the index in it, as `y[0]` or `y['position'][1]`).
    - `components`: which components of the flattened state to draw (default: all, or the first
        8 of a larger state; the title says how many of how many are drawn).
    - `xscale`: `"auto"`, `"linear"` or `"log"` time axis.
    - `yscale`: `"linear"` or `"log"` value axis.
    - `band`: for an ensemble, the lower and upper quantiles that bound the band (default
        `(0.0, 1.0)`: minimum to maximum).
    - `samples`: how many times the dense output is evaluated at, besides the step ends.
    - `steps`: mark the step ends on the time axis.
    - `ax`: matplotlib axes to draw on (default: a new figure).

    **Returns:**

    The matplotlib `Axes`.

    **Example:**

    ```python
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> f = lambda t, y, args: jnp.stack([y[1], -y[0]])
    >>> saveat = odeckpt.SaveAt(ts=jnp.linspace(0.0, 6.0, 7), dense=True)
    >>> sol = odeckpt.solve(f, jnp.array([1.0, 0.0]), (0.0, 6.0), saveat=saveat)
    >>> ax = odeckpt.plot.solution(sol, labels=["position", "velocity"])
    >>> [line.get_gid() for line in ax.lines]
    ['curve', 'saved', 'curve', 'saved', 'steps']
    >>> [text.get_text() for text in ax.get_legend().get_texts()][:3]
    ['position', 'velocity', 'saved points']

    ```
    """
    _check_choice("xscale", xscale, XSCALES)
    _check_choice("yscale", yscale, YSCALES)
    if not 0.0 <= band[0] < band[1] <= 1.0:
        raise ValueError(f"`band` must be two quantiles 0 <= low < high <= 1, got {band}.")
    if samples < 2:
        raise ValueError(f"`samples` must be at least 2, got {samples}.")
    data = trajectories(sol, xscale, samples)
    drawn = _drawn_components(data.labels, components, labels)
    ax = _axes(ax)
    handles = []
    for colour, (index, label) in enumerate(drawn):
        handles.append(_draw_component(ax, data, index, label, f"C{colour}", band, yscale))
    handles += _draw_marks(ax, data, steps, band)
    ax.set(xscale=data.xscale, yscale=yscale, xlabel="t", ylabel="y")
    ax.set_title(_title(data, len(drawn), band))
    ax.legend(handles=handles, loc="best", fontsize="small")
    return ax


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


def _drawn_components(
    names: tuple[str, ...], components: Sequence[int] | None, labels: Sequence[str] | None
) -> list[tuple[int, str]]:
    """`(index, label)` of each component to draw."""
    if components is None:
        components = range(min(len(names), _MAX_COMPONENTS))
    for index in components:
        if not -len(names) <= index < len(names):
            raise ValueError(
                f"component {index} does not exist: the flattened state has {len(names)} "
                f"components, {names[0]} to {names[-1]}. Fix: pass indices from 0 to "
                f"{len(names) - 1} as `components=`."
            )
    if labels is None:
        labels = [names[index] for index in components]
    if len(labels) != len(components):
        raise ValueError(
            f"{len(labels)} labels for {len(components)} components drawn. Fix: pass one label "
            "per component (see `components=`)."
        )
    return list(zip(components, labels, strict=True))


def _shown(values: np.ndarray, yscale: str) -> np.ndarray:
    """`values`, with those a log axis cannot show (`<= 0`) left out as NaN."""
    return np.where(values > 0, values, np.nan) if yscale == "log" else values


def _draw_component(ax, data: Trajectories, index: int, label: str, colour, band, yscale):
    """Draw one component (its curve, saved points or band); **returns** its curve."""
    t, y = data.curve.t, data.curve.y[..., index]
    if data.members > 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # times no member has reached
            low, median, high = np.nanquantile(y, [band[0], 0.5, band[1]], axis=0)
        ax.fill_between(
            t, _shown(low, yscale), _shown(high, yscale), color=colour, alpha=0.25, lw=0, gid="band"
        )
        y = median[None]
    (line,) = ax.plot(t, _shown(y[0], yscale), color=colour, label=label, gid="curve")
    if data.saved is not None and data.saved.t.size > 0:
        saved = _shown(data.saved.y[0, :, index], yscale)
        ax.plot(data.saved.t, saved, "o", color=colour, fillstyle="none", ms=5, gid="saved")
    return line


def _draw_marks(ax, data: Trajectories, steps: bool, band) -> list:
    """Draw the step ends; **returns** the legend entries of the saved points, step ends and
    band."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = []
    if data.saved is not None and data.saved.t.size > 0:
        handles.append(
            Line2D(
                [], [], color="0.3", marker="o", fillstyle="none", ls="none", label="saved points"
            )
        )
    if steps and data.step_ends is not None and data.step_ends.size > 0:
        ends = data.step_ends
        # A tick at the foot of the axes for each step end: `x` in data, `y` in axes units.
        ax.plot(
            ends, np.zeros_like(ends), "|", color="0.4", ms=8, mew=0.6, gid="steps",
            transform=ax.get_xaxis_transform(), clip_on=False,
        )  # fmt: skip
        handles.append(Line2D([], [], color="0.4", marker="|", ls="none", label="step ends"))
    if data.members > 1:
        handles.append(Patch(color="0.3", alpha=0.25, label=_band_name(band)))
    return handles


def _band_name(band: tuple[float, float]) -> str:
    if band == (0.0, 1.0):
        return "min to max"
    return f"quantiles {band[0]:g} to {band[1]:g}"


def _title(data: Trajectories, drawn: int, band: tuple[float, float]) -> str:
    if data.members > 1:
        failed = f" ({len(data.failures)} failed)" if data.failures else ""
        what = f"{data.members} solutions{failed}: median, band {_band_name(band)}"
    else:
        failed = f"failed: {data.failures[0]}" if data.failures else ""
        steps = None if data.step_ends is None else f"{len(data.step_ends)} accepted steps"
        notes = ", ".join(note for note in (steps, failed) if note)
        what = f"solution ({notes})" if notes else "solution"
    total = len(data.labels)
    return what if drawn == total else f"{what}, {drawn} of {total} components"


def step_sizes(sol: Solution, *, xscale: str = "auto", ax=None):
    """Plot the size of every accepted step against the time it ends at (log scale).

    **Arguments:**

    - `sol`: a `Solution` from a solve with `saveat=SaveAt(dense=True)` or `SaveAt(steps=True)`.
    - `xscale`: `"auto"`, `"linear"` or `"log"` time axis, chosen by `"auto"` as for `solution`.
    - `ax`: matplotlib axes to draw on (default: a new figure).

    **Returns:**

    The matplotlib `Axes`.

    **Example:**

    ```python
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> f = lambda t, y, args: jnp.stack([y[1], -y[0]])
    >>> sol = odeckpt.solve(f, jnp.array([1.0, 0.0]), (0.0, 6.0),
    ...                     saveat=odeckpt.SaveAt(steps=True))
    >>> ax = odeckpt.plot.step_sizes(sol)
    >>> ax.get_yscale(), ax.get_xscale()
    ('log', 'linear')

    ```
    """
    _check_choice("xscale", xscale, XSCALES)
    if np.shape(sol.t0) != ():
        raise ValueError(
            "`step_sizes` draws the steps of one solve, and this solution is batched. Fix: pick "
            "one, e.g. `jax.tree.map(lambda x: x[0], sol)`."
        )
    ts = step_ends(sol)
    if ts is None:
        raise ValueError(
            "plotting the accepted steps needs them in the solution. Fix: solve with "
            "`saveat=odeckpt.SaveAt(steps=True)` or `saveat=odeckpt.SaveAt(dense=True)`."
        )
    ends, sizes = ts[1:], np.abs(np.diff(ts))
    if xscale == "auto":
        xscale = choose_xscale(ends, np.array([[ts.min(), ts.max()]]))
    ax = _axes(ax)
    ax.plot(ends, sizes, "o-", markersize=3)
    ax.set(xlabel="t (end of step)", ylabel="step size", xscale=xscale, yscale="log")
    ax.set_title(f"accepted steps ({len(ends)})")
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
