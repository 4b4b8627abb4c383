"""What `odeckpt.plot` draws of a solution, as NumPy arrays: the time axis and its grid, the
curves (dense output where it is known), the saved points, the step ends and the labels of the
state's components. Nothing here imports matplotlib.
"""

import dataclasses
import math

import equinox as eqx
import jax
import numpy as np

from ._solution import Solution

XSCALES = ("auto", "linear", "log")
YSCALES = ("linear", "log")
CROWDED = 1e-2
"""`xscale="auto"` draws a log time axis when half of the solution's times lie in this fraction
of the span nearest its lower end (on a linear axis they would share its first few pixels)."""


@dataclasses.dataclass(frozen=True)
class Series:
    """Values at times: `t` is `[N]` (times shared by the members) or `[members, N]` (each
    member's own), `y` is `[members, N, components]` (NaN where a member has no value)."""

    t: np.ndarray
    y: np.ndarray


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """A solution (or an ensemble of `members` solutions) ready to draw.

    - `xscale`: `"linear"` or `"log"` (what `"auto"` chose).
    - `labels`: a name for each component of the flattened state.
    - `curve`: the dense output on the grid of `_time_grid` (and at the step ends of a single
        solve), or the saved points in time order without dense output.
    - `saved`: the saved points of a single solve (`None` for an ensemble or if none).
    - `step_ends`: the end of every accepted step of a single solve, where known.
    - `failures`: the name of each member's status that is not `successful` (a failed solve
        is drawn up to where it stopped).
    """

    xscale: str
    labels: tuple[str, ...]
    members: int
    curve: Series
    saved: Series | None
    step_ends: np.ndarray | None
    failures: tuple[str, ...]


def trajectories(sol: Solution, xscale: str, samples: int) -> Trajectories:
    """Gather what `plot.solution` draws of `sol` (batched under `vmap` or not), on a time axis
    of scale `xscale` with the dense output evaluated at about `samples` times."""
    batch = np.shape(sol.t0)
    members = _as_members(sol, batch)
    saved = _saved(members)
    ends = step_ends(sol) if batch == () else None
    if members.dense is not None:
        by_member = _step_ends_by_member(members)
        span = _dense_spans(members, by_member)
        known = by_member[np.isfinite(by_member)]
        xscale = choose_xscale(known, span) if xscale == "auto" else xscale
        grid = _time_grid(span, known, xscale, samples)
        if ends is not None:
            grid = np.union1d(grid, ends[(ends >= grid[0]) & (ends <= grid[-1])])
        values = _evaluate(members, grid)
        curve, labels = Series(grid, _columns(values, lead=2)), _component_labels(values, lead=2)
    else:
        assert saved is not None, "a solve saves points, dense output or both"
        known = saved.t[np.isfinite(saved.t)]
        span = np.stack([np.nanmin(saved.t, axis=1), np.nanmax(saved.t, axis=1)], axis=1)
        xscale = choose_xscale(known, span) if xscale == "auto" else xscale
        if xscale == "log":
            _lowest_positive(span, known)  # raises if there is none
        curve, labels = _common_saved_times(saved, xscale), _component_labels(members.ys, lead=2)
    if batch != () or saved is None:
        saved = None
    else:
        saved = _visible(Series(saved.t[0], saved.y), xscale)
    if ends is not None:
        ends = ends[1:][ends[1:] > 0] if xscale == "log" else ends[1:]
    statuses = [members.status[i] for i in range(len(span))]
    failures = tuple(s.name for s in statuses if s.name != "successful")
    return Trajectories(xscale, labels, len(span), curve, saved, ends, failures)


def choose_xscale(times: np.ndarray, span: np.ndarray) -> str:
    """`"log"` when no time is negative and half of `times` lie in the `CROWDED` fraction of
    the span nearest its lower end; `"linear"` otherwise."""
    lo, hi = float(np.min(span)), float(np.max(span))
    if lo < 0 or hi <= lo or times.size == 0:
        return "linear"
    return "log" if float(np.median(times)) - lo < CROWDED * (hi - lo) else "linear"


def _time_grid(span: np.ndarray, known: np.ndarray, xscale: str, samples: int) -> np.ndarray:
    """`samples` times from the lowest to the highest time of `span` (`[members, 2]`): evenly
    spaced, or geometrically spaced from the lowest positive time of `span` and `known` on a
    log axis (so that every decade gets its share)."""
    if xscale == "linear":
        return np.linspace(np.min(span), np.max(span), samples)
    return np.geomspace(_lowest_positive(span, known), np.max(span), samples)


def _lowest_positive(span: np.ndarray, known: np.ndarray) -> float:
    """The lowest positive time of `span` and `known`, where a log time axis starts."""
    times = np.concatenate([span.ravel(), known])
    if not np.any(times > 0):
        raise ValueError(
            f"a log time axis needs positive times, but the solution spans "
            f'[{np.min(span)}, {np.max(span)}]. Fix: pass `xscale="linear"`.'
        )
    return float(np.min(times[times > 0]))


def step_ends(sol: Solution) -> np.ndarray | None:
    """`t0` and the end of every accepted step of a single solve, from the dense output or a
    `SaveAt(steps=True)` block (recognised by its `inf` padding); `None` if neither has them."""
    t0 = float(sol.t0)
    if sol.dense is not None:
        ends = _step_ends_by_member(_as_members(sol, ()))[0]
        return np.concatenate([[t0], ends[np.isfinite(ends)]])
    ts = np.asarray(sol.ts) if sol.ts is not None else np.zeros(0)
    padding = np.flatnonzero(np.isinf(ts))
    if padding.size == 0:
        return None
    # The layout of `SaveAt`: the steps block is `max_steps` long and ends with its padding.
    block = ts[padding[-1] + 1 - sol.stats.max_steps : padding[-1] + 1]
    return np.concatenate([[t0], block[np.isfinite(block)]])


def _component_labels(tree, lead: int) -> tuple[str, ...]:
    """`y`, then the path of each leaf (`y['a']`, `y.position`) and the index of each entry
    (`y[0]`, `y['a'][1, 2]`), for the leaves of `tree` after their first `lead` axes; a complex
    leaf's entries twice, as `Re ...` and `Im ...` (the order of `_columns`)."""
    labels = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "y" + jax.tree_util.keystr(path)
        shape = np.shape(leaf)[lead:]
        names = [f"{name}[{', '.join(map(str, i))}]" if i else name for i in np.ndindex(*shape)]
        if np.iscomplexobj(leaf):
            names = [f"Re {n}" for n in names] + [f"Im {n}" for n in names]
        labels += names
    return tuple(labels)


def _as_members(sol: Solution, batch: tuple[int, ...]) -> Solution:
    """`sol` with one leading axis of members (the batch axes of a `vmap`, flattened; one
    member for a single solve)."""
    count = math.prod(batch)
    return jax.tree.map(lambda x: np.asarray(x).reshape((count, *np.shape(x)[len(batch) :])), sol)


def _columns(tree, lead: int) -> np.ndarray:
    """The leaves of `tree` as one real array: `lead` axes, then every component (a complex
    leaf's real parts, then its imaginary parts)."""
    columns = []
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        flat = leaf.reshape(*leaf.shape[:lead], -1)
        columns += [np.real(flat), np.imag(flat)] if np.iscomplexobj(leaf) else [flat]
    return np.concatenate(columns, axis=-1)


@eqx.filter_jit
def _evaluate_members(members: Solution, ts):
    return jax.vmap(Solution.evaluate, in_axes=(0, None))(members, ts)


def _evaluate(members: Solution, ts: np.ndarray):
    """Each member's dense output at `ts` (compiled; NaN outside the span it solved)."""
    return jax.tree.map(np.asarray, _evaluate_members(members, ts))


def _dense_spans(members: Solution, ends: np.ndarray) -> np.ndarray:
    """`[members, 2]`: each member's `t0` and the end of its last accepted step (from `ends`,
    those of `_step_ends_by_member`)."""
    t0 = np.asarray(members.t0, dtype=float)
    taken = np.sum(np.isfinite(ends), axis=1)
    reached = np.take_along_axis(ends, np.maximum(taken - 1, 0)[:, None], axis=1)[:, 0]
    return np.stack([t0, np.where(taken > 0, reached, t0)], axis=1)


def _step_ends_by_member(members: Solution) -> np.ndarray:
    """`[members, max_steps]`: the ends of each member's accepted steps, NaN after its last."""
    assert members.dense is not None
    direction = np.where(np.asarray(members.t1) >= np.asarray(members.t0), 1.0, -1.0)
    ends = np.asarray(members.dense.t_ends, dtype=float) * direction[:, None]
    taken = np.arange(ends.shape[1]) < np.asarray(members.dense.num_accepted)[:, None]
    return np.where(taken, ends, np.nan)


def _saved(members: Solution) -> Series | None:
    """Each member's saved points (times `[members, S]`, NaN for unused `steps` slots), or
    `None` if nothing was saved."""
    if members.ts is None:
        return None
    ts = np.asarray(members.ts, dtype=float)
    return Series(np.where(np.isfinite(ts), ts, np.nan), _columns(members.ys, lead=2))


def _visible(series: Series, xscale: str) -> Series:
    """The points of `series` (times `[N]`) that a time axis of `xscale` can show."""
    keep = np.isfinite(series.t) & ((series.t > 0) if xscale == "log" else True)
    return Series(series.t[keep], series.y[:, keep])


def _common_saved_times(saved: Series, xscale: str) -> Series:
    """The saved points of every member (`saved.t` is `[members, S]`), in time order, at times
    shared by all members."""
    if not np.array_equal(saved.t, np.broadcast_to(saved.t[0], saved.t.shape), equal_nan=True):
        raise ValueError(
            "the members of this ensemble saved at different times (`SaveAt(steps=True)`), so "
            "no band joins them. Fix: solve with `saveat=odeckpt.SaveAt(dense=True)` or at "
            "common times `SaveAt(ts=...)`."
        )
    order = np.argsort(saved.t[0], kind="stable")
    return _visible(Series(saved.t[0][order], saved.y[:, order]), xscale)
