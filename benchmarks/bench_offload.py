"""Host offload: device memory, host memory and run time of checkpointed gradients, with and
without `offload="host"`.

    python benchmarks/bench_offload.py                      # GPU: states 2**16 .. 2**22
    python benchmarks/bench_offload.py --sizes 16 17 18     # CPU: what is quick there
    python benchmarks/bench_offload.py --quick              # smoke run, short timings

Problem: a periodic reaction-diffusion equation `dy/dt = D (y[i-1] - 2 y[i] + y[i+1]) -
k tanh(y)` with `2**p` points, RK4 with `--steps` constant steps over [0, 1], float32 (or
`--dtype float64`); the timed function is `jax.grad` of the sum of squares of the final state
with respect to `y0` and `(D, k)`. Candidates at each size, all `RecursiveCheckpointAdjoint`:

- `device c=C`: `C` snapshots (`--checkpoints`, default 32) in device memory: the baseline.
- `device c=c`: `c` snapshots (`--device-checkpoints`, default 4): the device memory the
  offloading candidates use, without host memory.
- `host c+H`: `offload="host"` with `c` device slots and `H` host snapshots, for each `H` of
  `--host-checkpoints` (default 32 and 256).

Figures per row: the compiled program's device temporary memory and host temporary memory
(`memory_analysis().temp_size_in_bytes` and `.host_temp_size_in_bytes`; XLA:CPU has one memory
and reports everything as device memory, host figures 0), the gradient's run time (median after
warm-up, `_harness.compare`, candidates interleaved) and its ratio to the baseline, compile
time, the snapshots and recomputed steps the adjoint reports (`sol.stats`), the copies between
device and host its plan predicts, and the gradient's largest relative difference from the
baseline's (a check that offloading changes nothing but where snapshots live).

Results go to `benchmarks/results/offload.{json,md}` (`--name` to change the stem); the device
name is in the stamp.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _harness import Column, compare, environment, write_results

import odeckpt
from odeckpt.checkpointing.schedules import plan as plan_schedule


def vector_field(t, y, params):
    diffusion, reaction = params
    laplacian = jnp.roll(y, 1) - 2 * y + jnp.roll(y, -1)
    return diffusion * laplacian - reaction * jnp.tanh(y)


def initial_state(size: int, dtype) -> jax.Array:
    x = np.linspace(0.0, 2 * np.pi, size, endpoint=False)
    return jnp.asarray(np.sin(x) + 0.5 * np.sin(7 * x) + 0.1 * np.cos(300 * x), dtype)


def solve(adjoint: odeckpt.AbstractAdjoint, steps: int, y0, params) -> odeckpt.Solution:
    # `max_steps = steps + 1` (a spare step, as the adjoint plans for a constant-step count it
    # knows), so that the plan is the same whether or not the count is known at trace time.
    return odeckpt.solve(vector_field, y0, (0.0, 1.0), params, solver="rk4", dt0=1.0 / steps,
                         adjoint=adjoint, max_steps=steps + 1)  # fmt: skip


def gradient(adjoint: odeckpt.AbstractAdjoint, steps: int):
    def loss(y0, params):
        return jnp.sum(solve(adjoint, steps, y0, params).ys[-1] ** 2)

    return jax.grad(loss, argnums=(0, 1))


def stats(adjoint, steps, y0, params):
    sol = jax.jit(lambda y0, p: solve(adjoint, steps, y0, p))(y0, params)
    return int(sol.stats.num_checkpoints), int(sol.stats.num_recomputed_steps)


def candidates(options) -> dict[str, tuple[odeckpt.AbstractAdjoint, dict]]:
    c, big = options.device_checkpoints, options.checkpoints
    out = {
        f"device c={big}": (odeckpt.RecursiveCheckpointAdjoint(checkpoints=big), {}),
        f"device c={c}": (odeckpt.RecursiveCheckpointAdjoint(checkpoints=c), {}),
    }
    for h in options.host_checkpoints:
        split = {"device": c, "host": h}
        adjoint = odeckpt.RecursiveCheckpointAdjoint(checkpoints=split, offload="host")
        out[f"host {c}+{h}"] = (adjoint, split)
    return out


def memory(fn, *args) -> dict[str, int | None]:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return {
        "device_temp_bytes": analysis.temp_size_in_bytes,
        "host_temp_bytes": getattr(analysis, "host_temp_size_in_bytes", None),
    }


def relative_difference(got, ref) -> float:
    diffs = [
        float(jnp.max(jnp.abs(g - r))) / max(float(jnp.max(jnp.abs(r))), 1e-30)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
    ]
    return max(diffs)


def run_size(power: int, options, timing_options) -> list[dict]:
    size, steps = 2**power, options.steps
    y0 = initial_state(size, options.dtype)
    params = jnp.array([1.0, 1.0], options.dtype)
    state_bytes = size * jnp.dtype(options.dtype).itemsize
    print(f"\n#### 2**{power} = {size} points ({state_bytes / 2**20:.3g} MiB), {steps} steps")
    rows = candidates(options)
    fns = {name: gradient(adjoint, steps) for name, (adjoint, _) in rows.items()}
    timings = compare({name: (fn, (y0, params)) for name, fn in fns.items()}, **timing_options)
    baseline_name = next(iter(rows))
    baseline = jax.jit(fns[baseline_name])(y0, params)
    records = []
    for name, (adjoint, split) in rows.items():
        snapshots, recomputed = stats(adjoint, steps, y0, params)
        transfers = None
        if split:  # one copy each way per segment started
            p = plan_schedule(steps + 1, state_bytes, checkpoints=split, offload="host")
            transfers = 2 * -(-steps // p.segment)
        timing = timings[name]
        record = {
            "size": size,
            "power": power,
            "steps": steps,
            "dtype": options.dtype,
            "state_mib": state_bytes / 2**20,
            "method": name,
            "snapshots": snapshots,
            "recomputed_steps": recomputed,
            "transfers": transfers,
            **memory(fns[name], y0, params),
            "run_ms": 1e3 * timing.run_s,
            "compile_s": timing.compile_s,
            "run_ratio": timing.run_s / timings[baseline_name].run_s,
            "max_rel_diff": relative_difference(jax.jit(fns[name])(y0, params), baseline),
        }
        record["device_temp_mib"] = record["device_temp_bytes"] / 2**20
        host = record["host_temp_bytes"]
        record["host_temp_mib"] = None if host is None else host / 2**20
        print(
            f"{name:>16}: device {record['device_temp_mib']:.1f} MiB, host "
            f"{record['host_temp_mib']} MiB, run {record['run_ms']:.1f} ms "
            f"(x{record['run_ratio']:.2f}), recomputed {recomputed}, transfers {transfers}, "
            f"rel diff {record['max_rel_diff']:.1e}"
        )
        records.append(record)
    return records


COLUMNS = [
    Column("power", "log2 size"),
    Column("state_mib", "state (MiB)", ".3g"),
    Column("method", "method"),
    Column("snapshots", "snapshots"),
    Column("device_temp_mib", "device temp (MiB)", ".1f"),
    Column("host_temp_mib", "host temp (MiB)", ".1f"),
    Column("run_ms", "run (ms)", ".4g"),
    Column("run_ratio", "run / baseline", ".2f"),
    Column("compile_s", "compile (s)", ".2f"),
    Column("recomputed_steps", "recomputed steps"),
    Column("transfers", "transfers"),
    Column("max_rel_diff", "gradient rel. diff", ".1e"),
]

NOTES = """\
Baseline: the first row of each size (all snapshots in device memory). `device temp` and
`host temp` are XLA's compiled `memory_analysis()` figures (temporary buffers of the gradient);
XLA:CPU has a single memory, reports host figures as 0 and counts the host snapshots as device
temporaries, so on CPU the offloading rows show the two-level schedule's cost, not a memory
split. `transfers`: copies between device and host the plan predicts (one each way per
segment). `gradient rel. diff`: largest relative difference from the baseline's gradient."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_sizes = list(range(16, 23)) if jax.default_backend() == "gpu" else [16, 17, 18]
    parser.add_argument(
        "--sizes", nargs="+", type=int, default=default_sizes,
        help="log2 of the state sizes (default 16..22 on GPU, 16..18 else)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, help="RK4 steps (default 1000 on GPU, 200 else)")
    parser.add_argument("--checkpoints", type=int, default=32, help="baseline device snapshots")
    parser.add_argument("--device-checkpoints", type=int, default=4)
    parser.add_argument("--host-checkpoints", nargs="+", type=int, default=[32, 256])
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--quick", action="store_true", help="short timings, one compile")
    parser.add_argument("--name", default="offload", help="results file stem")
    options = parser.parse_args(argv)
    if options.steps is None:
        options.steps = 1000 if jax.default_backend() == "gpu" else 200
    if options.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    # On CPU one gradient of the larger sizes takes seconds: one call per candidate and
    # round, three rounds interleaved.
    cpu = jax.default_backend() == "cpu"
    timing_options = {
        "target_s": 0.3 if options.quick or cpu else 2.0,
        "compile_repeats": 1,
        "rounds": 1 if options.quick else 3,
        "warmup": 1,
        "min_repeats": 1 if cpu else (2 if options.quick else 5),
    }
    env = environment()
    print(f"device: {env['device']}\nversions: {env['versions']}\ngit: {env['git']}")
    command = "python benchmarks/bench_offload.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    records = []
    for power in options.sizes:
        records += run_size(power, options, timing_options)
        # Written after every size, so a long run interrupted keeps what it measured.
        json_path, md_path = write_results(
            options.name,
            records,
            COLUMNS,
            title="Host offload: device memory, host memory and run time",
            command=command.strip(),
            env=env,
            notes=NOTES,
        )
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
