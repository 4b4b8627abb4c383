"""`checkpointed_layers`: a stack of same-shaped layers applied with `checkpointed_scan`."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu

from . import _stacking
from ._scan import checkpointed_scan


def apply_unit(unit, x, keys, state, stateful: Callable[[Any], bool]):
    """Apply the layers of `unit` in order as `eqx.nn.Sequential` does: `layer(x, key=k)`, or
    `layer(x, state=state, key=k)` returning `(x, state)` where `stateful(layer)`."""
    for layer, key in zip(unit, keys, strict=True):
        if stateful(layer):
            x, state = layer(x, state=state, key=key)
        else:
            x = layer(x, key=key)
    return x, state


def unit_step(static, state, stateful: Callable[[Any], bool]) -> Callable:
    """The step applying one repeat of a unit of `p` layers: `step(params, x, (keys, leaves))
    -> (x, leaves)`, the unit being `eqx.combine(params, static)`.

    `keys`: `[p]` keys or `None`; `state`: a `StackedState` (whose `step` rebuilds one repeat's
    state from its `leaves`) or `None`; the step returns the repeat's updated state leaves
    (`None` without state).
    """

    def step(params, x, inputs):
        keys, leaves = inputs
        unit = eqx.combine(params, static)
        one = None if state is None else jtu.tree_unflatten(state.step, leaves)
        x, one = apply_unit(unit, x, (None,) * len(unit) if keys is None else keys, one, stateful)
        return x, None if one is None else jtu.tree_leaves(one)

    return step


def keeps_carry(step: Callable, params, x, inputs) -> bool:
    """Whether `step(params, x, inputs)` returns an output of the structure, shapes and dtypes
    of `x`."""
    out = jax.eval_shape(step, params, x, inputs)[0]
    described = lambda t: [(jnp.shape(a), jnp.result_type(a)) for a in jtu.tree_leaves(t)]
    same_tree = jtu.tree_structure(out) == jtu.tree_structure(x)
    return same_tree and described(out) == described(x)


def _stacked_layers(layers) -> tuple[Any, int]:
    """`layers` as one stacked tree and its depth: a list or tuple of layers of one `signature`
    is stacked; any other tree must already be stacked (array leaves share a leading axis)."""
    if isinstance(layers, list | tuple):
        signatures = [_stacking.signature(layer) for layer in layers]
        for i, s in enumerate(signatures):
            if s != signatures[0]:
                raise ValueError(
                    f"checkpointed_layers cannot stack layer {i} with layer 0: their structure, "
                    "array shapes/dtypes or static parts differ. Pass layers of one structure "
                    "(e.g. eqx.filter_vmap(make_layer)(keys)), or use checkpoint_layers, which "
                    "checkpoints heterogeneous layers one by one"
                )
        return _stacking.stack(layers), len(layers)
    arrays = jtu.tree_leaves(eqx.filter(layers, eqx.is_array))
    depths = {int(x.shape[0]) if x.ndim else 0 for x in arrays}
    if len(depths) != 1 or 0 in depths:
        raise ValueError(
            "checkpointed_layers needs stacked layers: array leaves sharing a leading axis, as "
            "eqx.filter_vmap(make_layer)(jax.random.split(key, depth)) makes them, or a list of "
            f"layers of one structure; got leading sizes {sorted(depths)}"
        )
    return layers, depths.pop()


def checkpointed_layers(
    layers, x, *, key=None, state: eqx.nn.State | None = None,
    checkpoints: int | None = None, memory_budget: int | str | None = None,
):  # fmt: skip
    """Apply a deep stack of same-shaped layers in order, with binomial checkpointing.

    The layers run as the steps of `checkpointed_scan`: memory holds `checkpoints` layer inputs
    (plus one layer's activations while it is differentiated), whatever the depth, and the
    reverse pass recomputes the minimal number of layers (Revolve).

    **Arguments:**

    - `layers`: the stacked layers, as `eqx.filter_vmap(make_layer)(jax.random.split(key, n))`
        makes them (every array leaf has leading axis `n`), or a list of `n` layers of one
        structure (stacked here; parameters shared, not copied in the model).
    - `x`: the input of the first layer; every layer must return an output of the same
        structure, shapes and dtypes.
    - `key`: dropout and other randomness. Split as `eqx.nn.Sequential` does
        (`jax.random.split(key, n)`), subkey `i` passed to layer `i` as `key=`; the keys are
        scanned inputs, so the recomputation draws exactly the same masks. Without it each
        layer gets `key=None`.
    - `state`: an `eqx.nn.State` holding the entries of the layers (stacked when the layers
        are, as `eqx.filter_vmap(eqx.nn.make_with_state(make_layer))(keys)` makes them). Each
        layer is then called as `layer(x, state=state, key=k) -> (x, state)` with its own slice.
        Under `jax.vmap(..., axis_name=...)` collectives such as the `lax.pmean` of
        `eqx.nn.BatchNorm` work, in the reverse pass too.
    - `checkpoints`, `memory_budget`: as `checkpointed_scan` (`checkpoints=c`: `c` stored layer
        inputs; neither: the default 64 MiB budget).

    **Returns:** the output of the last layer, or `(output, state)` with `state` given.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, equinox as eqx
    >>> from odeckpt.checkpointing import checkpointed_layers
    >>> make = lambda k: eqx.nn.Linear(8, 8, key=k)
    >>> layers = eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), 100))
    >>> loss = lambda layers, x: jnp.sum(checkpointed_layers(layers, x, checkpoints=4) ** 2)
    >>> grads = eqx.filter_jit(eqx.filter_grad(loss))(layers, jnp.ones(8))
    >>> grads.weight.shape
    (100, 8, 8)

    ```

    **References:** Griewank & Walther (2000), "Algorithm 799: Revolve", ACM TOMS 26(1).
    """
    units, n = _stacked_layers(layers)
    if state is None:
        gathered = None
    elif isinstance(layers, list | tuple):
        gathered = _stacking.gather_state(state, [(layer,) for layer in layers])
    else:
        gathered = _stacking.stacked_state(state, layers)
    keys = None if key is None else jr.split(key, n)[:, None]
    params, static = eqx.partition((units,), eqx.is_array)
    step = unit_step(static, gathered, lambda layer: state is not None)
    body = lambda x, inputs: step(inputs[0], x, inputs[1])
    xs = (params, (keys, None if gathered is None else gathered.leaves))
    x, leaves = checkpointed_scan(body, x, xs, checkpoints=checkpoints, memory_budget=memory_budget)
    if state is None:
        return x
    assert gathered is not None  # gathered from `state`
    return x, gathered.write_back(state, leaves)
