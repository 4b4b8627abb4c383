"""Batch-aware helpers that keep loop control unbatched under `vmap`."""

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from .._autodiff import manual_axes, on_mesh_of_inputs, varying, while_loop


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
    values); with `pred` unbatched, `pred`. Inside `jax.shard_map`, also reduced over the
    devices of the manual mesh axes (one all-reduce of a scalar): the loop runs in lockstep on
    every device, with the same number of iterations, so that collectives in its body (and
    in the transposes of its derivatives) meet on every device.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp
    >>> from odeckpt.checkpointing import any_lane
    >>> jax.vmap(lambda p: any_lane(p) & jnp.ones((), bool))(jnp.array([True, False])).shape
    (2,)

    ```
    """
    manual = manual_axes()
    if manual:
        return jax.lax.psum(varying(jnp.asarray(pred, jnp.int32)), manual) > 0
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
    while `pred` holds; under `vmap`, and inside `jax.shard_map` (whose devices step in
    lockstep: `any_lane`), `pred` itself, for the lanes that finished and step with the
    others. The engine replays only steps that ran forward, so the same holds for its
    recomputations."""
    return pred if manual_axes() else jnp.ones_like(pred)


@lane_running.def_vmap
def _lane_running_vmap(axis_size, in_batched, pred):
    del axis_size
    (batched,) = in_batched
    if batched:
        return pred, True
    # Called again, so that an enclosing `vmap` that batches `pred` gets it back.
    return lane_running(pred), False


@on_mesh_of_inputs
def lockstep_while_loop(cond_fun, body_fun, init_val, *, body_masks: bool = False):
    """`jax.lax.while_loop(cond_fun, body_fun, init_val)`, whose predicate stays unbatched under
    `vmap`: the loop runs while any lane's `cond_fun` holds, and a lane whose `cond_fun` no
    longer holds keeps its value (as JAX's own batching of a while loop does).

    Outside `vmap` it is the plain loop (the lane mask is a constant XLA folds away). Under
    `vmap` it computes what `jax.vmap` of `lax.while_loop` computes, but the batched loop it
    produces has an unbatched predicate, which `jax.experimental.checkify` (and so
    `odeckpt.jit`) supports where it refuses a batched one.

    A finished lane keeps its value by a select over the whole loop value at every step. For a
    value holding large buffers that each step writes a few rows of, that select costs a pass
    over the buffers per step; with `body_masks=True` the body keeps finished lanes unchanged
    itself (typically by writing their rows to an out-of-range index, dropped), at the cost of
    the rows alone.

    **Arguments:** as for `jax.lax.while_loop`, and

    - `body_masks`: if `True`, `body_fun` is called as `body_fun(val, running)`, where `running`
        is whether this lane's `cond_fun(val)` holds (the constant `True` outside `vmap`), and
        must return `val` unchanged where `running` is false.

    **Returns:**

    The final loop value.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp
    >>> from odeckpt.checkpointing import lockstep_while_loop
    >>> halve = lambda x: lockstep_while_loop(lambda x: x > 1, lambda x: x / 2, x)
    >>> jax.vmap(halve)(jnp.array([1.0, 4.0, 5.0])).tolist()
    [1.0, 1.0, 0.625]

    ```
    """

    if not isinstance(body_masks, bool):
        raise TypeError(
            f"lockstep_while_loop(body_masks={body_masks!r}) must be True or False. Fix: pass "
            "body_masks=True for a body_fun(val, running) that keeps finished lanes itself."
        )

    def body(val):
        running = lane_running(cond_fun(val))
        if body_masks:
            return body_fun(val, running)
        return jax.tree.map(lambda new, old: jnp.where(running, new, old), body_fun(val), val)

    return while_loop(lambda val: any_lane(cond_fun(val)), body, init_val)
