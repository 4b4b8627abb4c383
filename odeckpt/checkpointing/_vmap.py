"""Batch-aware helpers that keep loop control unbatched under `vmap`."""

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap


@custom_vmap
def any_lane(pred: jax.Array) -> jax.Array:
    """`pred` unchanged; under `vmap`, whether any lane's `pred` holds (an unbatched bool).

    A loop whose predicate goes through `any_lane` runs in lockstep while any lane runs: the
    step counter and the schedule stay unbatched, so `lax.cond`s keyed on them stay conds
    instead of becoming selects that evaluate both branches. Nested `vmap`s reduce level by
    level.

    **Arguments:**

    - `pred`: a boolean scalar, such as a while loop's predicate.

    **Returns:**

    `pred` itself outside `vmap`. Under `vmap` with `pred` batched, `jnp.any` of `pred` over
    the mapped axis, unbatched (it broadcasts back to the lanes where combined with batched
    values); with `pred` unbatched, `pred`.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp
    >>> from odeckpt.checkpointing import any_lane
    >>> jax.vmap(lambda p: any_lane(p) & jnp.ones((), bool))(jnp.array([True, False])).shape
    (2,)

    ```
    """
    return pred


@any_lane.def_vmap
def _any_lane_vmap(axis_size, in_batched, pred):
    del axis_size
    (batched,) = in_batched
    if batched:
        pred = any_lane(jnp.any(pred, axis=0))
    return pred, False


@custom_vmap
def lane_running(pred: jax.Array) -> jax.Array:
    """Whether a step taken inside a loop that runs while `any_lane(pred)` is a real step for
    this lane: `True` (a constant XLA folds away) outside `vmap`, where the loop only steps
    while `pred` holds; under `vmap`, `pred` itself, for the lanes that finished and step in
    lockstep with the others. The engine replays only steps that ran forward, so the same
    holds for its recomputations."""
    return jnp.ones_like(pred)


@lane_running.def_vmap
def _lane_running_vmap(axis_size, in_batched, pred):
    del axis_size
    (batched,) = in_batched
    if batched:
        return pred, True
    # Called again, so that an enclosing `vmap` that batches `pred` gets it back.
    return lane_running(pred), False
