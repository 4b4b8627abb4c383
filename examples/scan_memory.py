"""The classic report: "jax.grad of my lax.scan stores every (y + z): 557 MB for 5 steps".

Each step adds `x * (y + z)` to a 1000x1000 carry `y`; reverse mode through `lax.scan` keeps
one `(y + z)` per step, so memory grows linearly with the number of steps. `checkpointed_scan`
keeps `checkpoints` carries instead, whatever the number of steps.

    python examples/scan_memory.py

Prints the compiled temporary memory of the gradient (XLA's `memory_analysis()`, deterministic;
nothing is run).
"""

import jax
import jax.numpy as jnp

from odeckpt.checkpointing import checkpointed_scan, scan_plan


def make_loss(scan, **kwargs):
    z = jnp.ones((1000, 1000), jnp.float32)

    def step(y, x):
        return y + x * (y + z), None

    def loss(xs):
        y, _ = scan(step, jnp.zeros((1000, 1000), jnp.float32), xs, **kwargs)
        return y.sum()

    return loss, step


def temp_mib(loss, n: int) -> float:
    xs = jnp.ones(n, jnp.float32)
    compiled = jax.jit(jax.grad(loss)).lower(xs).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main():
    print(f"{'steps':>6} | {'lax.scan MiB':>12} | {'checkpointed c=2':>16} | {'default':>8} | plan")
    for n in (5, 10, 20, 40, 80):
        plain = temp_mib(make_loss(jax.lax.scan)[0], n)
        two = temp_mib(make_loss(checkpointed_scan, checkpoints=2)[0], n)
        default_loss, step = make_loss(checkpointed_scan)
        default = temp_mib(default_loss, n)
        plan = scan_plan(step, jnp.zeros((1000, 1000), jnp.float32), jnp.ones(n, jnp.float32))
        print(f"{n:>6} | {plain:>12.1f} | {two:>16.1f} | {default:>8.1f} | {plan}")


if __name__ == "__main__":
    main()
