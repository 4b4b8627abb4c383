"""Gradient memory of a deep MLP: plain, per-layer `jax.checkpoint`, `checkpoint_layers`,
`checkpointed_layers`.

Residual blocks `x + W2 tanh(W1 x)` (width 256, hidden 1024, float32) applied to a batch of
1024; the loss is `sum(y**2)` and the gradient is taken with respect to the parameters.

    python examples/deep_layers.py

Prints the compiled temporary memory of the gradient (XLA's `memory_analysis()`, deterministic;
nothing is run) on the default backend.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

from odeckpt.checkpointing import checkpoint_layers, checkpointed_layers

WIDTH, HIDDEN, BATCH = 256, 1024, 1024


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(WIDTH, HIDDEN, key=k1)
        self.down = eqx.nn.Linear(HIDDEN, WIDTH, key=k2)

    def __call__(self, x, *, key=None):
        """`x`: a batch `[BATCH, WIDTH]`."""
        return x + jax.vmap(lambda v: self.down(jnp.tanh(self.up(v))))(x)


class BlockList(eqx.Module):
    """A model whose own code loops over a list of blocks."""

    blocks: list

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def temp_mib(loss, model) -> float:
    x = jnp.ones((BATCH, WIDTH), jnp.float32)
    is_array = lambda a: eqx.is_array(a) or isinstance(a, jax.ShapeDtypeStruct)
    params, static = eqx.partition(model, is_array)
    grad = jax.jit(jax.grad(lambda p, x: loss(eqx.combine(p, static), x)))
    compiled = grad.lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def model_loss(model, x):
    return jnp.sum(model(x) ** 2)


def main():
    keys = jax.random.split(jax.random.key(0), 12)
    blocks = [Block(k) for k in keys]
    print(f"12 blocks, batch {BATCH}, width {WIDTH}, hidden {HIDDEN}, float32, {jax.devices()[0]}")
    print("gradient temp MiB:")
    print(f"  plain                          {temp_mib(model_loss, BlockList(blocks)):7.1f}")
    per_layer = checkpoint_layers(BlockList(blocks))
    print(f"  per-layer jax.checkpoint       {temp_mib(model_loss, per_layer):7.1f}")
    stacked = checkpoint_layers(eqx.nn.Sequential(blocks))
    print(f"  checkpoint_layers(Sequential)  {temp_mib(model_loss, stacked):7.1f}")
    for depth, c in ((12, 12), (12, 4), (48, 4), (192, 4)):
        # Shapes suffice for the compiled memory: no parameters are drawn.
        make = eqx.filter_vmap(Block)
        layers = eqx.filter_eval_shape(make, jax.random.split(jax.random.key(0), depth))
        loss = lambda m, x, c=c: jnp.sum(checkpointed_layers(m, x, checkpoints=c) ** 2)
        print(f"  checkpointed_layers depth {depth:3d} c={c:<2d} {temp_mib(loss, layers):7.1f}")


if __name__ == "__main__":
    main()
