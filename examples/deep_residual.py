# %% [markdown]
# # A 256-layer residual network is a discretised neural ODE
#
# A residual layer `x_{k+1} = x_k + h g_k(x_k)` is one explicit Euler step of the ODE
# `dx/dt = g(t, x)`, with its own parameters at every step; 256 of them with `h = 1/256`
# integrate it from `t = 0` to `t = 1`. Here `g_k(x) = W2 tanh(W1 x + b1) + b2` (width 16,
# hidden 32, float32), between a linear lift of the 2-D input to 16 dimensions (an "augmented"
# neural ODE) and a linear readout. The task: tell two interleaved spirals apart.
#
# Reverse mode through 256 layers stores every layer's activations: memory grows with depth.
# `checkpointed_layers` applies the stacked layers as the steps of `checkpointed_scan`: it stores
# `c` layer inputs, whatever the depth, and recomputes the minimal number of layers (Revolve).
# We train the network with optax's Adam through `checkpointed_layers` (c = 8), check its
# gradient against `lax.scan`'s, then compare the compiled memory of the gradient against depth
# for `lax.scan`, `lax.scan` over `jax.checkpoint`-ed layers, and `checkpointed_layers`.
#
# Run as a script or open as a notebook (jupytext percent format). Sizes:
# `ODECKPT_EXAMPLE_SIZE=tiny|full` (default `full`); plots go to `ODECKPT_EXAMPLE_OUTPUT`
# (default `example-output`).

# %%
import json
import os
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib.pyplot as plt
import numpy as np
import optax
from jax import lax

import odeckpt
from odeckpt.checkpointing import checkpointed_layers, schedules

SIZE = os.environ.get("ODECKPT_EXAMPLE_SIZE", "full")
OUTPUT = Path(os.environ.get("ODECKPT_EXAMPLE_OUTPUT", "example-output")) / "deep_residual"
OUTPUT.mkdir(parents=True, exist_ok=True)
# `depths`: the networks whose gradient memory is compiled (nothing is run for them).
SETTINGS = {
    "full": dict(
        depth=256, points=1024, iterations=300, checkpoints=8, depths=(32, 64, 128, 256, 512)
    ),
    "tiny": dict(depth=16, points=128, iterations=30, checkpoints=4, depths=(8, 16, 32)),
}[SIZE]
DEPTH, CHECKPOINTS = SETTINGS["depth"], SETTINGS["checkpoints"]
WIDTH, HIDDEN = 16, 32

# %% [markdown]
# ## The data: two interleaved spirals


# %%
def two_spirals(key, points):
    """`points` 2-D points on two interleaved spiral arms, with their arm (0 or 1)."""
    k1, k2 = jr.split(key)
    arm = jnp.arange(points) % 2
    radius = jr.uniform(k1, (points,), minval=0.1, maxval=1.0)
    angle = 3 * jnp.pi * radius + jnp.pi * arm
    spiral = radius[:, None] * jnp.stack([jnp.cos(angle), jnp.sin(angle)], axis=1)
    return spiral + 0.02 * jr.normal(k2, (points, 2)), arm.astype(jnp.float32)


inputs, labels = two_spirals(jr.key(0), SETTINGS["points"])

# %% [markdown]
# ## The model
#
# The layers are made stacked, `eqx.filter_vmap(Layer)(keys)`: one `Layer` whose arrays carry
# a leading axis of size `depth`, as `checkpointed_layers` (and `lax.scan`) take them.


# %%
class Layer(eqx.Module):
    """One Euler step `x + h (W2 tanh(W1 x + b1) + b2)` of a batch `x` (`[points, WIDTH]`)."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear
    h: float = eqx.field(static=True)

    def __init__(self, key, h):
        k1, k2 = jr.split(key)
        self.up = eqx.nn.Linear(WIDTH, HIDDEN, key=k1)
        self.down = eqx.nn.Linear(HIDDEN, WIDTH, key=k2)
        self.h = h

    def __call__(self, x, *, key=None):
        return x + self.h * jax.vmap(lambda v: self.down(jnp.tanh(self.up(v))))(x)


class ResNet(eqx.Module):
    lift: eqx.nn.Linear
    layers: Layer  # stacked: every array has a leading axis of size `depth`
    readout: eqx.nn.Linear

    def __init__(self, key, depth):
        k1, k2, k3 = jr.split(key, 3)
        self.lift = eqx.nn.Linear(2, WIDTH, key=k1)
        self.layers = eqx.filter_vmap(lambda k: Layer(k, 1 / depth))(jr.split(k2, depth))
        self.readout = eqx.nn.Linear(WIDTH, 1, key=k3)

    def __call__(self, x, how="checkpointed_layers"):
        """Logits for a batch `x` (`[points, 2]`); `how` applies the layers."""
        x = jax.vmap(self.lift)(x)
        x = LAYERS[how](self.layers, x)
        return jax.vmap(self.readout)(x)[:, 0]


def scan_layers(layers, x, remat=False):
    params, static = eqx.partition(layers, eqx.is_array)
    step = lambda x, p: (eqx.combine(p, static)(x), None)
    return lax.scan(jax.checkpoint(step) if remat else step, x, params)[0]


LAYERS = {
    "lax.scan": scan_layers,
    "lax.scan over jax.checkpoint": lambda layers, x: scan_layers(layers, x, remat=True),
    f"checkpointed_layers, c={CHECKPOINTS}": lambda layers, x: checkpointed_layers(
        layers, x, checkpoints=CHECKPOINTS
    ),
}
CHECKPOINTED = f"checkpointed_layers, c={CHECKPOINTS}"


def loss(model, x, y, how=CHECKPOINTED):
    return jnp.mean(optax.sigmoid_binary_cross_entropy(model(x, how), y))


def accuracy(model, x, y):
    return float(jnp.mean((model(x, "lax.scan") > 0) == (y > 0.5)))


model = ResNet(jr.key(1), DEPTH)

# %% [markdown]
# ## The same gradient as `lax.scan`, and its price
#
# The recomputed layers run the same operations on the same inputs, so the gradient through
# `checkpointed_layers` equals `lax.scan`'s (to float32 rounding). The price is recomputation:
# with `c` stored inputs Revolve runs `t(n, c)` extra layer evaluations for `n` layers, the
# fewest possible (`schedules.optimal_cost`). Both gradients are timed here (median of a few
# runs after a warm-up, same process).


# %%
def median_seconds(fn, repeats=5):
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


gradient = eqx.filter_jit(eqx.filter_grad(loss))
grads = {how: gradient(model, inputs, labels, how) for how in ("lax.scan", CHECKPOINTED)}
pairs = zip(*(jax.tree.leaves(g) for g in grads.values()), strict=True)
gradient_error = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a))) for a, b in pairs)
seconds = {
    how: median_seconds(lambda how=how: gradient(model, inputs, labels, how))
    for how in ("lax.scan", CHECKPOINTED)
}
recomputed = schedules.optimal_cost(DEPTH, CHECKPOINTS)
print(f"largest difference from lax.scan's gradient, relative to each leaf: {gradient_error:.1e}")
print(
    f"gradient time: lax.scan {seconds['lax.scan'] * 1e3:.1f} ms, {CHECKPOINTED} "
    f"{seconds[CHECKPOINTED] * 1e3:.1f} ms (x{seconds[CHECKPOINTED] / seconds['lax.scan']:.2f}); "
    f"{recomputed} layers recomputed for {DEPTH} ({recomputed / DEPTH:.2f} per layer)"
)

# %% [markdown]
# ## Training
#
# Adam on the whole data set, every gradient through `checkpointed_layers`.

# %%
optimiser = optax.adam(optax.cosine_decay_schedule(1e-2, SETTINGS["iterations"]))


@eqx.filter_jit
def train_step(model, state):
    value, grads = eqx.filter_value_and_grad(loss)(model, inputs, labels)
    updates, state = optimiser.update(grads, state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state, value


state = optimiser.init(eqx.filter(model, eqx.is_array))
initial_accuracy = accuracy(model, inputs, labels)
losses = []
start = time.perf_counter()
for _ in range(SETTINGS["iterations"]):
    model, state, value = train_step(model, state)
    losses.append(float(value))
train_seconds = time.perf_counter() - start
final_loss = float(loss(model, inputs, labels))
final_accuracy = accuracy(model, inputs, labels)
print(
    f"{DEPTH} layers, {SETTINGS['iterations']} Adam steps in {train_seconds:.1f} s: "
    f"loss {losses[0]:.3f} -> {final_loss:.2g}, "
    f"accuracy {initial_accuracy:.2f} -> {final_accuracy:.2f}"
)

# %%
figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
grid = jnp.linspace(-1.2, 1.2, 200)
plane = jnp.stack(jnp.meshgrid(grid, grid), axis=-1).reshape(-1, 2)
logits = eqx.filter_jit(lambda m, x: m(x, "lax.scan"))(model, plane).reshape(200, 200)
left.contourf(grid, grid, jax.nn.sigmoid(logits), levels=20, cmap="RdBu", alpha=0.6)
points = np.asarray(inputs)
left.scatter(*points.T, c=np.asarray(labels), cmap="RdBu", edgecolors="k", s=8)
left.set(title=f"{DEPTH} residual layers after training", xticks=[], yticks=[], aspect="equal")
right.plot(losses)
right.set(xlabel="Adam step", ylabel="cross-entropy", yscale="log", title="training loss")
figure.savefig(OUTPUT / "training.png", dpi=120)
plt.close(figure)

# %% [markdown]
# ## Gradient memory against depth
#
# The gradient of the loss with respect to every parameter, compiled for each depth (XLA's
# `memory_analysis()` of the compiled program; nothing is run). `lax.scan` stores each layer's
# activations; `lax.scan` over `jax.checkpoint`-ed layers stores each layer's input; both grow
# with depth. `checkpointed_layers` stores `c` layer inputs: flat.


# %%
def gradient_memory(depth, how):
    deep = ResNet(jr.key(1), depth)
    grad = eqx.filter_grad(lambda m: loss(m, inputs, labels, how))
    return odeckpt.compiled_memory(grad, deep)


by_depth = {how: {d: gradient_memory(d, how) for d in SETTINGS["depths"]} for how in LAYERS}
layer_input_mib = SETTINGS["points"] * WIDTH * 4 / 2**20
print(f"temp memory of the gradient (MiB); one layer input is {layer_input_mib:.3f} MiB:")
print(f"{'layers':>8}" + "".join(f"{how:>32}" for how in LAYERS))
for d in SETTINGS["depths"]:
    print(f"{d:>8}" + "".join(f"{by_depth[how][d].temp / 2**20:>32.2f}" for how in LAYERS))

figure, ax = plt.subplots(figsize=(6.5, 4.5), layout="constrained")
odeckpt.plot.memory(by_depth, xlabel="layers", log=True, ax=ax)
ax.set_xscale("log", base=2)
ax.set_title(f"gradient memory, batch of {SETTINGS['points']}, width {WIDTH}")
figure.savefig(OUTPUT / "memory_vs_depth.png", dpi=120)
plt.close(figure)

# %% [markdown]
# The claims, checked: the gradient equals `lax.scan`'s, training lowers the loss, and the
# memory of `checkpointed_layers` does not grow with depth while `lax.scan`'s does.

# %%
temp_mib = {how: {d: m.temp / 2**20 for d, m in series.items()} for how, series in by_depth.items()}
result = {
    "size": SIZE,
    "depth": DEPTH,
    "checkpoints": CHECKPOINTS,
    "gradient_relative_error": gradient_error,
    "initial_loss": losses[0],
    "final_loss": final_loss,
    "initial_accuracy": initial_accuracy,
    "final_accuracy": final_accuracy,
    "train_seconds": train_seconds,
    "gradient_seconds": seconds,
    "recomputed_layers": recomputed,
    "layer_input_mib": layer_input_mib,
    "temp_mib_by_depth": temp_mib,
}
(OUTPUT / "result.json").write_text(json.dumps(result, indent=2))
flat = list(temp_mib[CHECKPOINTED].values())
scan = temp_mib["lax.scan"]
assert gradient_error < 1e-4, result
assert final_loss < losses[0], result
assert max(flat) <= 1.1 * min(flat), result
assert scan[max(scan)] > 2 * scan[min(scan)] and scan[max(scan)] > 4 * max(flat), result
