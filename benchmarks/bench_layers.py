"""Per-layer checkpointing: the compiled memory and run time of the gradient of a deep residual
network, by depth, for `lax.scan`, `lax.scan` over `jax.checkpoint` and `checkpointed_layers`.

    python benchmarks/bench_layers.py                       # depths 32 .. 512, batch 1024
    python benchmarks/bench_layers.py --depths 8 16 --points 64 --quick   # a smoke run

Problem: `depth` residual layers `x + (1/depth) * (W2 tanh(W1 x + b1) + b2)` (width 16, hidden
32, float32) applied to a batch of `--points` inputs; the timed function is `jax.grad` of the
mean square of the output with respect to every layer's parameters. Candidates (the layers'
parameters stacked along a leading axis):

- `lax.scan`: stores every layer's activations.
- `lax.scan over jax.checkpoint`: stores every layer's input.
- `checkpointed_layers c=C`: `C` stored layer inputs (`--checkpoints`, default 8), Revolve's
  optimal recomputation.

Figures per row: XLA's compiled temporary memory of the gradient (`memory_analysis()`), its run
time (median after warm-up, `_harness.compare`, candidates interleaved) and its ratio to
`lax.scan`, and the largest difference of the gradient from `lax.scan`'s, relative to each leaf.
The memory of `checkpointed_layers` should stay flat in the depth; the others grow linearly.

Results go to `benchmarks/results/layers.{json,md}` (`--name` to change the stem); the device
name is in the stamp.
"""

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
from _harness import Column, compare, environment, write_results

import odeckpt
from odeckpt.checkpointing import checkpointed_layers

WIDTH, HIDDEN = 16, 32


class Layer(eqx.Module):
    """One residual layer on a batch `x` (`[points, WIDTH]`)."""

    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array
    h: jax.Array

    def __call__(self, x, *, key=None):
        return x + self.h * (jnp.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2)


def stacked_layers(depth: int, key) -> Layer:
    """`depth` layers, every array with a leading axis of size `depth`."""
    k1, k2 = jax.random.split(key)
    w1 = jax.random.normal(k1, (depth, WIDTH, HIDDEN)) / WIDTH**0.5
    w2 = jax.random.normal(k2, (depth, HIDDEN, WIDTH)) / HIDDEN**0.5
    h = jnp.full((depth,), 1.0 / depth)
    return Layer(w1, jnp.zeros((depth, HIDDEN)), w2, jnp.zeros((depth, WIDTH)), h)


def apply(how: str, checkpoints: int):
    """The layer stack applied one way: `(layers, x) -> output`."""
    step = lambda x, layer: (layer(x), None)
    if how == "lax.scan":
        return lambda layers, x: jax.lax.scan(step, x, layers)[0]
    if how == "lax.scan over jax.checkpoint":
        return lambda layers, x: jax.lax.scan(jax.checkpoint(step), x, layers)[0]
    return lambda layers, x: checkpointed_layers(layers, x, checkpoints=checkpoints)


def gradient(forward):
    """`jax.grad` of the mean square of the output, with respect to the layers."""
    return jax.grad(lambda layers, x: jnp.mean(forward(layers, x) ** 2))


def run_depth(depth: int, options, timing_options) -> list[dict]:
    params = stacked_layers(depth, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (options.points, WIDTH))
    names = [
        "lax.scan",
        "lax.scan over jax.checkpoint",
        f"checkpointed_layers c={options.checkpoints}",
    ]
    grads = {name: gradient(apply(name, options.checkpoints)) for name in names}
    timings = compare({name: (grads[name], (params, x)) for name in names}, **timing_options)
    reference = jax.jit(grads["lax.scan"])(params, x)
    records = []
    for name in names:
        memory = odeckpt.compiled_memory(grads[name], params, x)
        value = jax.jit(grads[name])(params, x)
        difference = max(
            float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
            for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(value), strict=True)
        )
        timing = timings[name]
        records.append({
            "depth": depth, "points": options.points, "method": name,
            "temp_mib": memory.temp / 2**20, "run_ms": timing.run_s * 1e3,
            "run_ratio": timing.run_s / timings["lax.scan"].run_s,
            "compile_s": timing.compile_s, "gradient_rel_diff": difference,
        })  # fmt: skip
        print(
            f"depth {depth:5d}  {name:34s} temp {memory.temp / 2**20:9.2f} MiB  "
            f"run {timing.run_s * 1e3:9.3f} ms  rel. diff {difference:.1e}",
            flush=True,
        )
    return records


COLUMNS = [
    Column("depth", "depth"),
    Column("method", "method"),
    Column("temp_mib", "temp (MiB)", ".2f"),
    Column("run_ms", "run (ms)", ".3f"),
    Column("run_ratio", "run / lax.scan", ".2f"),
    Column("compile_s", "compile (s)", ".2f"),
    Column("gradient_rel_diff", "gradient rel. diff", ".1e"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", nargs="+", type=int, default=[32, 64, 128, 256, 512])
    parser.add_argument("--points", type=int, default=1024, help="batch size")
    parser.add_argument("--checkpoints", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="short timings, one compile")
    parser.add_argument("--name", default="layers", help="results file stem")
    options = parser.parse_args(argv)
    timing_options = {
        "target_s": 0.3 if options.quick else 2.0,
        "compile_repeats": 1,
        "rounds": 1 if options.quick else 3,
        "warmup": 1,
        "min_repeats": 2 if options.quick else 5,
    }
    env = environment()
    print(f"device: {env['device']}\nversions: {env['versions']}\ngit: {env['git']}")
    command = "python benchmarks/bench_layers.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    records = []
    for depth in options.depths:
        records += run_depth(depth, options, timing_options)
        json_path, md_path = write_results(
            options.name, records, COLUMNS,
            title="Per-layer checkpointing: gradient memory and time by depth",
            command=command.strip(), env=env,
        )  # fmt: skip
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
