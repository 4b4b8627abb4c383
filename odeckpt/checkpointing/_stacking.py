"""Stacking layers of one structure: signatures, repeated runs, stacked parameters and states.

A stack of `k` layers (or of `k` repeats of a unit of layers) is one pytree whose array leaves
carry a leading axis of size `k` and whose static parts are those of the first repeat. The
`eqx.nn.State` entries of the repeats are stacked the same way, so that a scan can slice them
per step and write the updated values back.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu


class _Slot(eqx.Module):
    """A `StateIndex` without its marker: layers made separately have distinct markers."""

    init: Any


def _is_index(x) -> bool:
    return isinstance(x, eqx.nn.StateIndex)


def signature(tree) -> tuple:
    """Everything about `tree` but its array values: the pytree structure, the shapes and dtypes
    of the array leaves, and the other leaves themselves. Two trees with equal signatures can be
    stacked into one whose static parts serve both."""
    unmarked = jtu.tree_map(lambda x: _Slot(x.init) if _is_index(x) else x, tree, is_leaf=_is_index)
    leaves, treedef = jtu.tree_flatten(unmarked)
    described = tuple((x.shape, x.dtype) if eqx.is_array(x) else x for x in leaves)
    return treedef, described


def repeated_runs(signatures: Sequence) -> list[tuple[int, int, int]]:
    """Split a sequence into runs `(start, period, repeats)`, greedily from the front: at each
    position the unit of `period` consecutive items repeated most often back to back (the longest
    cover, then the shortest unit); items that start no repeat are runs of one.

    **Example:**

    ```python
    >>> repeated_runs(["in", "a", "b", "a", "b", "a", "b", "out"])
    [(0, 1, 1), (1, 2, 3), (7, 1, 1)]

    ```
    """
    runs, start, total = [], 0, len(signatures)
    while start < total:
        best_period, best_repeats = 1, 1
        for period in range(1, (total - start) // 2 + 1):
            unit = list(signatures[start : start + period])
            repeats = 1
            while start + (repeats + 1) * period <= total and unit == list(
                signatures[start + repeats * period : start + (repeats + 1) * period]
            ):
                repeats += 1
            if repeats >= 2 and repeats * period > best_period * best_repeats:
                best_period, best_repeats = period, repeats
        runs.append((start, best_period, best_repeats))
        start += best_period * best_repeats
    return runs


def stack(trees: Sequence):
    """One tree with the array leaves of `trees` stacked along a new leading axis and the static
    parts of `trees[0]`. The trees must share a `signature`."""
    params = [eqx.filter(t, eqx.is_array) for t in trees]
    columns = zip(*(jtu.tree_leaves(p) for p in params), strict=True)
    stacked = jtu.tree_unflatten(jtu.tree_structure(params[0]), [jnp.stack(c) for c in columns])
    return eqx.combine(stacked, eqx.filter(trees[0], eqx.is_array, inverse=True))


class StackedState(eqx.Module):
    """The `eqx.nn.State` entries of `k` stacked repeats: leaves with a leading axis `k`.

    `step` rebuilds one repeat's `State` (with the markers of the first repeat) from sliced
    leaves; `targets` are the structures the stacked results are written back to.
    """

    leaves: list
    # jax binds `PyTreeDef` as a variable (from jaxlib), which pyright rejects as a type.
    step: jtu.PyTreeDef = eqx.field(static=True)  # pyright: ignore[reportInvalidTypeForm]
    targets: tuple[jtu.PyTreeDef, ...] = eqx.field(static=True)  # pyright: ignore[reportInvalidTypeForm]
    stacked_targets: bool = eqx.field(static=True)

    def write_back(self, state: eqx.nn.State, leaves: list) -> eqx.nn.State:
        """`state` with the entries of the repeats replaced by the stacked `leaves`."""
        if self.stacked_targets:
            return state.update(jtu.tree_unflatten(self.targets[0], leaves))
        for r, target in enumerate(self.targets):
            state = state.update(jtu.tree_unflatten(target, [x[r] for x in leaves]))
        return state


def gather_state(state: eqx.nn.State, repeats: Sequence) -> StackedState:
    """The entries of `state` for each of `repeats` (separate layers or units), stacked."""
    subs = [state.substate(r) for r in repeats]
    columns = zip(*(jtu.tree_leaves(s) for s in subs), strict=True)
    defs = tuple(jtu.tree_structure(s) for s in subs)
    return StackedState([jnp.stack(c) for c in columns], defs[0], defs, False)


def stacked_state(state: eqx.nn.State, stacked_layers) -> StackedState:
    """The entries of `state` for layers already stacked (their leaves carry the leading axis)."""
    leaves, treedef = jtu.tree_flatten(state.substate(stacked_layers))
    return StackedState(leaves, treedef, (treedef,), True)
