"""`checkpoint_layers`: rematerialise the layers of an existing model without editing its code."""

from collections.abc import Callable

import equinox as eqx
import jax.random as jr
import jax.tree_util as jtu

from .._autodiff import _tree
from . import _stacking
from ._indexed import indexed_scan
from ._layers import apply_unit, keeps_carry, unit_step


def _stateful(layer) -> bool:
    return isinstance(layer, eqx.nn.StatefulLayer) and layer.is_stateful()


# pyright reads equinox's `StatefulLayer.__call__: AbstractClassVar[...]` as a field (pyright#4965),
# a missing argument of every construction of the two layers below: those lines ignore it.
class Checkpointed(eqx.nn.StatefulLayer):
    """`layer`, recomputed in the backward pass (`jax.checkpoint` with `policy`).

    Saves memory where the compiler keeps the recomputation in place (GPU/TPU); XLA:CPU may
    schedule it early and keep the plain chain's memory.
    """

    layer: Callable
    policy: Callable | None = eqx.field(static=True)

    def is_stateful(self) -> bool:
        return _stateful(self.layer)

    def __call__(self, *args, **kwargs):
        return eqx.filter_checkpoint(self.layer, policy=self.policy)(*args, **kwargs)


class CheckpointedSequential(eqx.nn.StatefulLayer):
    """An `eqx.nn.Sequential` whose layers are rematerialised in the backward pass.

    Called exactly as `eqx.nn.Sequential` (same keys per layer, same state updates). Runs of a
    repeated unit of layers (one layer, or a few such as `Linear, Lambda(relu)`) are applied by
    a scan over the repeats whose step `i` takes repeat `i`'s parameters by index (no stacked
    copy of the parameters, nor of their gradients): the reverse pass stores each unit's input
    and recomputes one unit at a time, in a loop, a saving that is structural, on every
    backend. Other layers are checkpointed one by one (`Checkpointed`).
    """

    layers: tuple
    policy: Callable | None = eqx.field(static=True)

    def is_stateful(self) -> bool:
        return any(_stateful(layer) for layer in self.layers)

    def __call__(self, x, state: eqx.nn.State | None = None, *, key=None):
        n = len(self.layers)
        keys = [None] * n if key is None else jr.split(key, n)
        signatures = [_stacking.signature(layer) for layer in self.layers]
        for start, period, repeats in _stacking.repeated_runs(signatures):
            end = start + period * repeats
            x, state = self._run(self.layers[start:end], period, x, keys[start:end], state)
        return x if state is None else (x, state)

    def _run(self, layers, period, x, keys, state):
        units = [layers[i : i + period] for i in range(0, len(layers), period)]
        if len(units) > 1:
            out = _scan_units(units, x, keys, state, self.policy)
            if out is not None:
                return out
        remat = [Checkpointed(layer, self.policy) for layer in layers]  # pyright: ignore[reportCallIssue]
        return apply_unit(remat, x, keys, state, _stateful)

    def __getitem__(self, i: int) -> Callable:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)


def _scan_units(units: list, x, keys, state, policy):
    """`units` (repeats of one unit of layers) applied by `indexed_scan`; returns `(x, state)`,
    or `None` if the unit changes the structure, shape or dtype of `x`."""
    key_rows = None if keys[0] is None else keys.reshape(len(units), len(units[0]))
    gathered = None if state is None else _stacking.gather_state(state, units)
    # Flat leaves: the repeats' trees differ in their state markers, not in their arrays.
    params, static = eqx.partition(units[0], eqx.is_array)
    treedef = jtu.tree_structure(params)
    params = tuple(jtu.tree_leaves(eqx.filter(unit, eqx.is_array)) for unit in units)
    unit = unit_step(static, gathered, _stateful)
    step = lambda leaves, x, inputs: unit(jtu.tree_unflatten(treedef, leaves), x, inputs)
    xs = (key_rows, None if gathered is None else gathered.leaves)
    if not keeps_carry(step, params[0], x, _tree.index(xs, 0)):
        return None
    x, leaves = indexed_scan(step, params, x, xs, policy)
    if state is None:
        return x, None
    assert gathered is not None  # gathered from `state`
    return x, gathered.write_back(state, leaves)


def _is_sequence(node) -> bool:
    """An `eqx.nn.Sequential`, or a non-empty list or tuple of callable modules."""
    if isinstance(node, eqx.nn.Sequential):
        return True
    blocks = isinstance(node, list | tuple) and len(node) > 0
    return blocks and all(isinstance(x, eqx.Module) and callable(x) for x in node)


def _checkpointed(node, policy):
    if isinstance(node, eqx.nn.Sequential):
        return CheckpointedSequential(node.layers, policy)  # pyright: ignore[reportCallIssue]
    if isinstance(node, list | tuple) and _is_sequence(node):
        return type(node)(Checkpointed(layer, policy) for layer in node)  # pyright: ignore[reportCallIssue]
    if isinstance(node, eqx.Module) and callable(node):
        return Checkpointed(node, policy)  # pyright: ignore[reportCallIssue]
    raise TypeError(
        f"checkpoint_layers: `where` selected a {type(node).__name__}, which is not a layer; "
        "select callable modules (blocks, eqx.nn.Sequential) or lists of them, e.g. "
        "where=lambda m: m.blocks"
    )


def checkpoint_layers(model, where: Callable | None = None, policy: Callable | None = None):
    """The model with its layers rematerialised in the backward pass, its code untouched.

    Memory of the gradient falls from every layer's activations to the layers' inputs plus one
    layer's activations, for one more forward evaluation of each layer.

    **Arguments:**

    - `model`: any pytree of `eqx.Module`s.
    - `where`: which submodules to checkpoint, as in `eqx.tree_at` (a function from `model`
        to a node or a tuple of nodes). Default: every outermost `eqx.nn.Sequential` and every
        list or tuple of callable modules (such as a list of transformer blocks).
    - `policy`: a `jax.checkpoint` policy (e.g.
        `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`), saying which intermediate
        values to store instead of recomputing.

    **Returns:** a model of the same structure with the same arrays (its leaves are those of
    `model`, so gradients and optimiser states line up), whose selected nodes are replaced:

    - an `eqx.nn.Sequential` by a `CheckpointedSequential`: runs of layers of one structure
        (same pytree structure, array shapes and dtypes, equal static parts) are applied by a
        scan over the layers that takes layer `i`'s parameters by index (they are not stacked:
        no copy of the parameters or of their gradients), storing each layer's input and
        recomputing one layer at a time, which saves memory on every backend, XLA:CPU
        included; the other layers are checkpointed one by one;
    - a list or tuple of blocks, or a selected module, by `Checkpointed` layers (per-layer
        `jax.checkpoint`): the model's own code iterates over them, so they cannot be stacked.
        This saves memory on GPU/TPU; XLA:CPU reorders the recomputation of a straight chain
        of checkpointed layers and reports the plain chain's memory (wrap such blocks in an
        `eqx.nn.Sequential`, or use `checkpointed_layers`, for the structural saving).

    Dropout and other randomness must come from explicit keys (as in equinox); the recomputed
    layers receive the same keys, so the gradient equals the one without checkpointing, and
    `eqx.nn.State` updates (batch norm) are the same as well.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, equinox as eqx
    >>> from odeckpt.checkpointing import checkpoint_layers
    >>> keys = jax.random.split(jax.random.key(0), 4)
    >>> model = eqx.nn.Sequential([eqx.nn.Linear(8, 8, key=k) for k in keys])
    >>> loss = lambda m, x: jnp.sum(checkpoint_layers(m)(x) ** 2)
    >>> grads = eqx.filter_grad(loss)(model, jnp.ones(8))  # the structure of `model`
    >>> ref = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))(model, jnp.ones(8))
    >>> all(jax.tree.leaves(jax.tree.map(jnp.allclose, grads, ref)))
    True

    ```
    """
    if where is not None:
        selected = where(model)
        if isinstance(selected, tuple) and len(selected) == 0:
            raise ValueError(
                "checkpoint_layers: `where` selected nothing; return the submodules to "
                "checkpoint, e.g. where=lambda m: (m.encoder, m.decoder)"
            )
        return eqx.tree_at(where, model, replace_fn=lambda node: _checkpointed(node, policy))
    leaves = jtu.tree_leaves(model, is_leaf=_is_sequence)
    if not any(_is_sequence(leaf) for leaf in leaves):
        raise ValueError(
            "checkpoint_layers found no eqx.nn.Sequential and no list or tuple of modules in "
            f"{type(model).__name__}; pass where=... to pick the submodules to checkpoint, e.g. "
            "where=lambda m: (m.block1, m.block2)"
        )
    replace = lambda node: _checkpointed(node, policy) if _is_sequence(node) else node
    return jtu.tree_map(replace, model, is_leaf=_is_sequence)
