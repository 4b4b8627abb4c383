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

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp
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
