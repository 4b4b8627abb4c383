"""Batched Lotka-Volterra solves, lane by lane against the same lane solved alone.

Imported by `test_batching.py` for its lanes, and run by it as a script in a fresh process:

    XLA_FLAGS=--xla_cpu_max_isa=AVX python tests/batching_checks.py \
        --solve recursive direct forward --derivative recursive

which prints one JSON object: for each adjoint named, every lane's `(num_steps,
num_accepted_steps, num_rejected_steps)` under `vmap` and alone and the largest relative
difference of `ys` (`--solve`), and that of the derivatives (`--derivative`: `vmap(grad)`
against per-lane `grad`; `vmap(jacfwd)` for `ForwardMode`).

Why a separate process with that flag: XLA:CPU contracts `a * b + c` into fused multiply-adds
(FMA) wherever its fusions allow, and the batched and the unbatched programs fuse differently,
so the two round some operations differently (by one ulp). The step-size controller amplifies
such a difference: on a lane with many rejected steps the step count can change. With the ISA
capped at AVX (no FMA instructions) both programs round alike, and a lane under `vmap` must then
take exactly the steps it takes alone. The flag has to be set before JAX starts its backend.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from problems import lotka_volterra

import odeckpt

T_SPAN = (0.0, 20.0)
SAVE_TS = np.linspace(0.0, 20.0, 11)
MAX_STEPS = 1024
BASE_PARAMS = np.array([1.1, 0.4, 0.4, 0.1])
BASE_Y0 = np.array([10.0, 5.0])

LANE_PARAMS = np.array(
    [
        [1.1, 0.4, 0.4, 0.1],
        [1.5, 1.0, 3.0, 1.0],
        [0.5, 0.2, 0.3, 0.05],
        [8.8, 3.2, 3.2, 0.8],  # the first lane 8 times faster: about 8 times the steps
    ]
)
"""Per-lane parameters (for a `vmap` over `args`, with `BASE_Y0`)."""

LANE_Y0 = np.array([[10.0, 5.0], [1000.0, 0.001], [5.0, 2.0], [3.0, 0.1]])
"""Per-lane initial states (for a `vmap` over `y0`, with `BASE_PARAMS`); the second lane's orbit
has sharp spikes and takes about 2.5 times the steps of the first."""

ADJOINTS = ("recursive", "direct", "forward")


def solve(y0, params, adjoint: str, *, max_steps: int = MAX_STEPS, throw: bool = True):
    return odeckpt.solve(
        lotka_volterra, y0, T_SPAN, params, adjoint=adjoint, saveat=SAVE_TS,
        max_steps=max_steps, throw=throw,
    )  # fmt: skip


def derivative(adjoint: str):
    """`(y0, params) -> d/d(y0, params)` of the saved states: `grad` of the sum of their squares
    for reverse-mode adjoints, `jacfwd` of the final state for `ForwardMode`."""
    if adjoint == "forward":
        return jax.jacfwd(lambda y0, p: solve(y0, p, adjoint).ys[-1], argnums=(0, 1))
    return jax.grad(lambda y0, p: jnp.sum(solve(y0, p, adjoint).ys ** 2), argnums=(0, 1))


def step_counts(stats) -> list[list[int]]:
    """`[[num_steps, num_accepted_steps, num_rejected_steps], ...]`, one row per lane."""
    columns = (stats.num_steps, stats.num_accepted_steps, stats.num_rejected_steps)
    return np.stack([np.atleast_1d(np.asarray(c)) for c in columns], axis=1).tolist()


def relative_difference(a, b) -> float:
    """`max |a - b| / max |b|` over all leaves."""
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)])
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def compare_solves(adjoint: str) -> dict:
    """Every lane (per-lane `y0` and parameters) solved under `vmap` and alone."""
    y0, params = jnp.asarray(LANE_Y0), jnp.asarray(LANE_PARAMS)
    one = jax.jit(lambda y, p: solve(y, p, adjoint))
    batched = jax.jit(jax.vmap(lambda y, p: solve(y, p, adjoint)))(y0, params)
    alone = [one(y, p) for y, p in zip(y0, params, strict=True)]
    return {
        "batched_steps": step_counts(batched.stats),
        "alone_steps": [step_counts(s.stats)[0] for s in alone],
        "ys_rel_diff": relative_difference(batched.ys, _stack([s.ys for s in alone])),
    }


def compare_derivatives(adjoint: str) -> dict:
    """Every lane's derivative under `vmap` and alone."""
    y0, params = jnp.asarray(LANE_Y0), jnp.asarray(LANE_PARAMS)
    one = jax.jit(derivative(adjoint))
    batched = jax.jit(jax.vmap(derivative(adjoint)))(y0, params)
    alone = [one(y, p) for y, p in zip(y0, params, strict=True)]
    return {"derivative_rel_diff": relative_difference(batched, _stack(alone))}


def _stack(trees):
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solve", nargs="*", choices=ADJOINTS, default=[])
    parser.add_argument("--derivative", nargs="*", choices=ADJOINTS, default=[])
    options = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    results: dict[str, dict] = {}
    for adjoint in options.solve:
        results.setdefault(adjoint, {}).update(compare_solves(adjoint))
    for adjoint in options.derivative:
        results.setdefault(adjoint, {}).update(compare_derivatives(adjoint))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
