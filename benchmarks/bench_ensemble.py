"""Ensembles under `vmap`, odeckpt vs diffrax: steps per lane, run time and compile time.

    python benchmarks/bench_ensemble.py                 # 1024 lanes, ~2 minutes on 2 CPU cores
    python benchmarks/bench_ensemble.py --quick         # smoke run, short timings
    python benchmarks/bench_ensemble.py --lanes 256

The problem (issue 8): 1024 Lotka-Volterra solves, `dy/dt = (a x - b x y, d x y - c y)`, one
parameter vector per lane, each entry drawn uniformly within +-20% of (1.1, 0.4, 0.4, 0.1)
(NumPy seed 0); the same y0 = (10, 5) for every lane; t in [0, 50]; Tsit5 with a PID controller
at rtol = 1e-6, atol = 1e-8; float64; `max_steps` = 4096; only y(t1) saved (odeckpt's default
`saveat`, diffrax's `SaveAt(t1=True)`); `throw` on. Both libraries otherwise use their defaults
(odeckpt `RecursiveCheckpointAdjoint` and `PIDController()`, diffrax
`RecursiveCheckpointAdjoint` and `PIDController(rtol, atol)`).

Two rows, each timed as `jax.jit` of the batched function in one process:

- `solve`: `jax.vmap(solve)(params) -> y(t1)` for all lanes.
- `gradient`: `jax.grad` of `sum over lanes of sum(y(t1)**2)` with respect to the `[lanes, 4]`
  parameters (each library's default adjoint).

Steps per lane: the accepted + rejected steps each lane reports under `vmap` (mean and max over
lanes; a lockstep batch runs as many loop iterations as its slowest lane), and the same lane
solved alone (unbatched), with the number of lanes whose batched count equals the unbatched one.
The two can differ by XLA's floating-point contraction (FMA), which rounds the batched and the
unbatched programs differently; see docs/scaling.md.

Results go to `benchmarks/results/ensemble.{json,md}` (`ensemble-quick.*` with `--quick`).
"""

import argparse
import dataclasses
import sys
from collections.abc import Callable

import jax

jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import (  # noqa: E402
    TIMING_COLUMNS,
    Column,
    Timing,
    compare,
    environment,
    markdown_table,
    write_results,
)

import odeckpt  # noqa: E402

BASE_PARAMS = np.array([1.1, 0.4, 0.4, 0.1])
Y0 = np.array([10.0, 5.0])
T_SPAN = (0.0, 50.0)
RTOL, ATOL = 1e-6, 1e-8
MAX_STEPS = 4096


def lotka_volterra(t, y, params):
    a, b, c, d = params[0], params[1], params[2], params[3]
    prey, predator = y[0], y[1]
    return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])


def lane_params(lanes: int, seed: int = 0) -> jax.Array:
    """`[lanes, 4]` parameters, each entry uniform within +-20% of `BASE_PARAMS`."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(BASE_PARAMS * rng.uniform(0.8, 1.2, (lanes, 4)))


def odeckpt_solve(params: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One lane: `(y(t1), steps)` with odeckpt's defaults."""
    sol = odeckpt.solve(
        lotka_volterra, jnp.asarray(Y0), T_SPAN, params, solver=odeckpt.Tsit5(), rtol=RTOL,
        atol=ATOL, max_steps=MAX_STEPS, throw=True,
    )  # fmt: skip
    return sol.ys[-1], sol.stats.num_steps


def diffrax_solve(params: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One lane: `(y(t1), steps)` with diffrax's defaults and the same settings."""
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lotka_volterra), diffrax.Tsit5(), T_SPAN[0], T_SPAN[1], None,
        jnp.asarray(Y0), params, saveat=diffrax.SaveAt(t1=True),
        stepsize_controller=diffrax.PIDController(rtol=RTOL, atol=ATOL), max_steps=MAX_STEPS,
        throw=True,
    )  # fmt: skip
    return sol.ys[-1], sol.stats["num_steps"]


def batched_final(solve: Callable) -> Callable:
    return lambda params: jax.vmap(solve)(params)[0]


def batched_gradient(solve: Callable) -> Callable:
    return jax.grad(lambda params: jnp.sum(batched_final(solve)(params) ** 2))


def steps(solve: Callable, params: jax.Array) -> dict[str, float]:
    """Steps per lane under `vmap` and solved alone, one lane at a time."""
    batched = np.asarray(jax.jit(jax.vmap(solve))(params)[1])
    alone = jax.jit(solve)
    unbatched = np.array([int(alone(p)[1]) for p in params])
    return {
        "steps_mean": float(batched.mean()),
        "steps_max": int(batched.max()),
        "unbatched_steps_mean": float(unbatched.mean()),
        "unbatched_steps_max": int(unbatched.max()),
        "lanes_equal_unbatched": int(np.sum(batched == unbatched)),
        "max_abs_steps_diff": int(np.max(np.abs(batched - unbatched))),
    }


def relative_difference(ours, peer) -> float:
    """`max |a - b| / max |b|`."""
    a, b = np.asarray(ours, np.float64), np.asarray(peer, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run_task(
    task: str, ours: Callable, peer: Callable, params: jax.Array, counts: dict, options: dict
) -> dict:
    print(f"\n== {task}")
    record = {"task": task, "lanes": int(params.shape[0]), **counts}
    record["rel_diff"] = relative_difference(jax.jit(ours)(params), jax.jit(peer)(params))
    timings: dict[str, Timing] = compare(
        {"odeckpt": (ours, (params,)), "diffrax": (peer, (params,))}, **options
    )
    for name, timing in timings.items():
        for field, value in dataclasses.asdict(timing).items():
            record[f"{name}_{field}"] = value
        record[f"{name}_run_ms"] = 1e3 * timing.run_s
    record["run_ratio"] = record["odeckpt_run_s"] / record["diffrax_run_s"]
    record["compile_ratio"] = record["odeckpt_compile_s"] / record["diffrax_compile_s"]
    record["compile_cpu_ratio"] = record["odeckpt_compile_cpu_s"] / record["diffrax_compile_cpu_s"]
    print(
        f"   run {record['odeckpt_run_ms']:.2f} vs {record['diffrax_run_ms']:.2f} ms "
        f"(ratio {record['run_ratio']:.2f}); compile {record['odeckpt_compile_s']:.2f} vs "
        f"{record['diffrax_compile_s']:.2f} s (ratio {record['compile_ratio']:.2f}); "
        f"rel. diff {record['rel_diff']:.1e}"
    )
    return record


COLUMNS = [
    Column("task", "task"),
    Column("lanes", "lanes"),
    Column("odeckpt_steps", "steps/lane odeckpt mean (max)"),
    Column("diffrax_steps", "steps/lane diffrax mean (max)"),
    *TIMING_COLUMNS,
    Column("rel_diff", "rel. diff", ".1e"),
]

STEP_COLUMNS = [
    Column("library", "library"),
    Column("steps_mean", "batched mean", ".1f"),
    Column("steps_max", "batched max"),
    Column("unbatched_steps_mean", "unbatched mean", ".1f"),
    Column("unbatched_steps_max", "unbatched max"),
    Column("lanes_equal_unbatched", "lanes equal to unbatched"),
    Column("max_abs_steps_diff", "max abs. difference"),
]

NOTES = """\
Ratios are odeckpt / diffrax (below 1: odeckpt faster). Run time: median of repeated calls of
the jitted batched function after warm-up. Compile time: `jax.jit(fn).lower(*args).compile()`
from cleared caches (trace + lower + XLA), median of repeats. Steps: accepted + rejected per
lane under `vmap`, mean (max) over lanes. "rel. diff" is max |odeckpt - diffrax| / max |diffrax|
over the batch (y(t1) for `solve`, the gradient for `gradient`); the two controllers differ in
details, so the libraries take slightly different steps. Target (issue 8): solve run ratio
<= 0.7."""


def step_notes(step_records: list[dict]) -> str:
    return (
        "Steps per lane, batched (`vmap`) vs each lane solved alone:\n\n"
        + markdown_table(step_records, STEP_COLUMNS)
        + "\n\nBatched and unbatched programs are compiled separately, and XLA:CPU contracts "
        "multiply-adds into FMAs differently in the two, so a lane's step sizes can differ in "
        "the last bit and, through the controller, its step count by a few steps. With FMA "
        "contraction unavailable (`XLA_FLAGS=--xla_cpu_max_isa=AVX`) the counts and states are "
        "identical (tests/test_batching.py)."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=1024, help="ensemble size (default 1024)")
    parser.add_argument("--quick", action="store_true", help="short timings, one compile each")
    parser.add_argument("--target-seconds", type=float, help="run-time budget per candidate")
    parser.add_argument("--compile-repeats", type=int, help="compiles timed per candidate")
    parser.add_argument("--name", help="results file stem (default ensemble / ensemble-quick)")
    options = parser.parse_args(argv)
    timing_options = {
        "target_s": options.target_seconds or (0.3 if options.quick else 2.0),
        "compile_repeats": options.compile_repeats or (1 if options.quick else 3),
        "rounds": 1 if options.quick else 3,
        "min_repeats": 2 if options.quick else 5,
    }
    name = options.name or ("ensemble-quick" if options.quick else "ensemble")
    env = environment()
    print(f"device: {env['device']}\nversions: {env['versions']}\ngit: {env['git']}")
    command = "python benchmarks/bench_ensemble.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )

    params = lane_params(options.lanes)
    counts = {"odeckpt": steps(odeckpt_solve, params), "diffrax": steps(diffrax_solve, params)}
    step_records = [{"library": lib, **c} for lib, c in counts.items()]
    for record in step_records:
        print(f"steps per lane: {record}")
    summary = {
        f"{lib}_steps": f"{c['steps_mean']:.1f} ({c['steps_max']})" for lib, c in counts.items()
    }
    records = [
        run_task(
            "solve", batched_final(odeckpt_solve), batched_final(diffrax_solve), params,
            summary, timing_options,
        ),
        run_task(
            "gradient", batched_gradient(odeckpt_solve), batched_gradient(diffrax_solve), params,
            summary, timing_options,
        ),
    ]  # fmt: skip
    for record in records:
        record["steps_per_lane"] = counts
    json_path, md_path = write_results(
        name,
        records,
        COLUMNS,
        title=f"Ensembles: {options.lanes} Lotka-Volterra solves under vmap, odeckpt vs diffrax",
        command=command.strip(),
        env=env,
        notes=NOTES + "\n\n" + step_notes(step_records),
    )
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
