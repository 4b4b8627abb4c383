"""Scaling over devices: a sharded ensemble, a sharded state and two processes, odeckpt vs diffrax.

    python benchmarks/bench_scaling.py            # 1024 lanes, 256x256 grid
    python benchmarks/bench_scaling.py --quick    # 256 lanes, 128x128 grid, short timings

Each device count runs in its own subprocess: on CPU with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (set before JAX starts), on a GPU host
over the first N real GPUs (a probe subprocess reads `jax.default_backend()`). This process
never starts a JAX backend itself. Three parts (docs/scaling.md):

1. `ensemble`: L Lotka-Volterra lanes (bench_ensemble.py's problem: per-lane parameters
   uniform within +-20%, Tsit5, rtol 1e-6, atol 1e-8, t in [0, 50], float64, y(t1) only),
   parameters sharded `P('lanes')` over 1, 2 and 4 devices, `jax.jit(jax.vmap(solve))`; the
   gradient is `jax.grad` of `sum y(t1)**2` with respect to the `[L, 4]` parameters. Diffrax
   beside: `jax.jit(jax.vmap(diffeqsolve))` on the same sharded inputs.
2. `grid`: one n x n reaction-diffusion state (tests/sharded_checks.py's `reaction_diffusion`
   and `grid_initial_state`), rows sharded `P('x', None)` over 1, 2 and 4 devices, Tsit5 over
   the fixed span [0, 0.5] (rtol 1e-6, atol 1e-8); the gradient of `sum y(t1)**2` with respect
   to u0 through `RecursiveCheckpointAdjoint(checkpoints=8)` (diffrax: its adjoint of the same
   name with `checkpoints=8`).
3. `2 processes`: the ensemble over 2 processes x 2 devices joined by `jax.distributed` on
   localhost (gloo collectives on CPU), each process supplying its half of the lanes.

Solves run with `throw=False`: under `jax.jit` over sharded inputs a failing lane would abort
the process (docs/scaling.md, Limits); failed lanes are counted instead. Times follow
`_harness.py` (compile from cleared caches; run time the median of calls after warm-up). The
two-process run cannot let each process choose its own number of calls (their collectives must
meet), so it makes a fixed number of calls. Parallel efficiency is `t1 / (N tN)` against the
one-device run of the same library and task.

Results go to `benchmarks/results/scaling.{json,md}` (`--name` to change).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import Column, compare, environment, time_compile, write_results  # noqa: E402

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent / "tests"))
from bench_ensemble import ATOL, MAX_STEPS, RTOL, T_SPAN, Y0, lane_params, lotka_volterra  # noqa: E402
from sharded_checks import grid_initial_state, reaction_diffusion  # noqa: E402

import odeckpt  # noqa: E402

DEVICE_COUNTS = (1, 2, 4)
GRID_SPAN = (0.0, 0.5)
GRID_ARGS = (0.1, 1.0)
CHECKPOINTS = 8
MARK = "SCALING-RESULT "
# Fixed numbers of timed calls in the two-process run (solve, gradient).
PROCESS_CALLS = {"solve": 20, "gradient": 5}


# ----------------------------------------------------------------------------- problems


def ensemble_lane(library: str):
    """One lane's `params -> (y(t1), steps, ok)` with `library`."""
    if library == "odeckpt":

        def lane(params):
            sol = odeckpt.solve(
                lotka_volterra, jnp.asarray(Y0), T_SPAN, params, solver=odeckpt.Tsit5(),
                rtol=RTOL, atol=ATOL, max_steps=MAX_STEPS, throw=False,
            )  # fmt: skip
            return sol.ys[-1], sol.stats.num_steps, sol.status == odeckpt.Status.successful

        return lane
    import diffrax

    def lane(params):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lotka_volterra), diffrax.Tsit5(), T_SPAN[0], T_SPAN[1], None,
            jnp.asarray(Y0), params, saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.PIDController(rtol=RTOL, atol=ATOL),
            max_steps=MAX_STEPS, throw=False,
        )  # fmt: skip
        return sol.ys[-1], sol.stats["num_steps"], sol.result == diffrax.RESULTS.successful

    return lane


def grid_solve(library: str):
    """`u0 -> (y(t1), steps, ok)` of the reaction-diffusion grid with `library`."""
    if library == "odeckpt":
        adjoint = odeckpt.RecursiveCheckpointAdjoint(checkpoints=CHECKPOINTS)

        def solve(u0):
            sol = odeckpt.solve(
                reaction_diffusion, u0, GRID_SPAN, GRID_ARGS, solver="tsit5", adjoint=adjoint,
                rtol=RTOL, atol=ATOL, max_steps=MAX_STEPS, throw=False,
            )  # fmt: skip
            return sol.ys[-1], sol.stats.num_steps, sol.status == odeckpt.Status.successful

        return solve
    import diffrax

    def solve(u0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(reaction_diffusion), diffrax.Tsit5(), GRID_SPAN[0], GRID_SPAN[1],
            None, u0, GRID_ARGS, saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.PIDController(rtol=RTOL, atol=ATOL),
            adjoint=diffrax.RecursiveCheckpointAdjoint(checkpoints=CHECKPOINTS),
            max_steps=MAX_STEPS, throw=False,
        )  # fmt: skip
        return sol.ys[-1], sol.stats["num_steps"], sol.result == diffrax.RESULTS.successful

    return solve


def tasks(part: str, library: str) -> dict:
    """`{"solve": fn, "gradient": fn, "info": fn}` of one part and library, each of one array."""
    if part == "ensemble":
        full = jax.vmap(ensemble_lane(library))
    else:
        full = grid_solve(library)
    final = lambda x: full(x)[0]
    return {
        "solve": final,
        "gradient": jax.grad(lambda x: jnp.sum(final(x) ** 2)),
        "info": full,
    }


def info(fn, x) -> dict:
    """Steps, failures and `sum y(t1)**2` of one solve (the last to compare across runs)."""
    y, steps, ok = jax.jit(fn)(x)
    steps, ok = np.asarray(steps), np.asarray(ok)
    return {
        "steps_mean": float(steps.mean()),
        "steps_max": int(steps.max()),
        "failed": int(ok.size - ok.sum()),
        "sum_y2": float(jnp.sum(y**2)),
    }


# ----------------------------------------------------------------------------- one process


def mesh_sharding(devices: int, axis: str, *spec):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:devices]), (axis,))
    return NamedSharding(mesh, PartitionSpec(*spec))


def part_inputs(part: str, devices: int, options) -> tuple[jax.Array, int, str]:
    """The sharded input, its size (lanes or grid points) and the size's label."""
    if part == "ensemble":
        sharding = mesh_sharding(devices, "lanes", "lanes")
        params = jax.device_put(lane_params(options.lanes), sharding)
        return params, options.lanes, f"{options.lanes} lanes"
    sharding = mesh_sharding(devices, "x", "x", None)
    u0 = jax.device_put(jnp.asarray(grid_initial_state(options.grid)), sharding)
    return u0, options.grid**2, f"{options.grid}x{options.grid}"


def measure_part(part: str, devices: int, options, timing: dict) -> list[dict]:
    """Solve and gradient rows of odeckpt and diffrax for one part on `devices` devices."""
    x, size, label = part_inputs(part, devices, options)
    candidates, records = {}, []
    for library in ("odeckpt", "diffrax"):
        base = {"part": part, "library": library, "devices": devices, "size": label}
        try:
            fns = tasks(part, library)
            details = info(fns["info"], x)
            jax.block_until_ready(jax.jit(fns["gradient"])(x))
        except Exception as error:  # a peer that does not run on sharded inputs: say why
            text = f"{type(error).__name__}: {error}"
            records += [base | {"task": t, "error": text[:2000]} for t in ("solve", "gradient")]
            print(f"   {part} {library}: FAILED {text[:300]}", file=sys.stderr)
            continue
        for task in ("solve", "gradient"):
            candidates[f"{library}/{task}"] = (fns[task], (x,))
            records.append(base | {"task": task, "size_count": size, **details})
    timings = compare(candidates, **timing)
    for record in records:
        timing_of = timings.get(f"{record['library']}/{record['task']}")
        if timing_of is not None:
            record |= {
                "run_s": timing_of.run_s,
                "run_min_s": timing_of.run_min_s,
                "repeats": timing_of.repeats,
                "compile_s": timing_of.compile_s,
                "compile_cpu_s": timing_of.compile_cpu_s,
            }
    return records


def single_worker(options) -> dict:
    devices = options.devices
    assert jax.device_count() >= devices, (jax.device_count(), devices)
    timing = {
        "target_s": 0.3 if options.quick else 2.0,
        "compile_repeats": 1 if options.quick else 3,
        "rounds": 1 if options.quick else 3,
        "min_repeats": 3 if options.quick else 5,
    }
    records = []
    for part in ("ensemble", "grid"):
        start = time.perf_counter()
        records += measure_part(part, devices, options, timing)
        print(
            f"   {part} on {devices} devices: {time.perf_counter() - start:.0f} s", file=sys.stderr
        )
    return {"records": records, "environment": environment()}


# ----------------------------------------------------------------------------- processes


def fixed_calls(fn, args: tuple, calls: int) -> dict:
    """Compile time, then the median of `calls` calls after two warm-up calls: the same number
    of calls in every process, so their collectives meet."""
    lower_s, xla_s, cpu_s = time_compile(fn, *args)
    jitted = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(jitted(*args))
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        samples.append(time.perf_counter() - start)
    return {
        "run_s": statistics.median(samples),
        "run_min_s": min(samples),
        "repeats": calls,
        "compile_s": lower_s + xla_s,
        "compile_cpu_s": cpu_s,
    }


def process_worker(options) -> dict:
    """One process of the two-process ensemble run."""
    if options.backend == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{options.port}",
        num_processes=options.num_processes,
        process_id=options.process_id,
    )
    sharding = mesh_sharding(jax.device_count(), "lanes", "lanes")
    params = np.asarray(lane_params(options.lanes))
    share = options.lanes // options.num_processes
    mine = params[options.process_id * share : (options.process_id + 1) * share]
    x = jax.make_array_from_process_local_data(sharding, mine, params.shape)
    fns = tasks("ensemble", "odeckpt")
    y, steps, ok = jax.jit(fns["info"])(x)
    # Global reductions (replicated scalars) are readable in every process.
    summary = jax.jit(lambda y, s, ok: (jnp.sum(y**2), jnp.mean(s), jnp.max(s), jnp.sum(~ok)))
    sum_y2, steps_mean, steps_max, failed = (float(v) for v in summary(y, steps, ok))
    base = {
        "part": "2 processes", "library": "odeckpt", "devices": jax.device_count(),
        "processes": jax.process_count(), "size": f"{options.lanes} lanes",
        "size_count": options.lanes,
        "steps_mean": steps_mean, "steps_max": int(steps_max), "failed": int(failed),
        "sum_y2": sum_y2,
    }  # fmt: skip
    records = [
        base | {"task": task, **fixed_calls(fns[task], (x,), PROCESS_CALLS[task])}
        for task in ("solve", "gradient")
    ]
    result = {"records": records, "environment": environment()}
    jax.distributed.shutdown()
    return result


# ----------------------------------------------------------------------------- driver


def worker_environment(backend: str, devices: int, visible: str | None = None) -> dict:
    if backend == "cpu":
        flags = f"--xla_force_host_platform_device_count={devices}"
        return os.environ | {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return os.environ if visible is None else os.environ | {"CUDA_VISIBLE_DEVICES": visible}


def probe() -> tuple[str, int]:
    """The default backend and its device count, read in a subprocess."""
    code = "import jax; print(jax.default_backend(), jax.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    backend, count = out.stdout.split()[-2:]
    return backend, int(count)


def parse_result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    return json.loads(lines[-1][len(MARK) :])


def worker_arguments(options) -> list[str]:
    arguments = ["--lanes", str(options.lanes), "--grid", str(options.grid)]
    return arguments + (["--quick"] if options.quick else [])


def run_single(options, backend: str, devices: int) -> dict:
    command = [sys.executable, str(HERE), "--worker", "single", "--devices", str(devices)]
    print(f"== {devices} device(s)", flush=True)
    out = subprocess.run(
        command + worker_arguments(options), env=worker_environment(backend, devices),
        stdout=subprocess.PIPE, text=True, timeout=options.worker_timeout,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"the {devices}-device worker failed (exit {out.returncode})")
    return parse_result(out.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(options, backend: str, total_devices: int) -> dict | str:
    """The two-process run's result, or why it was not run."""
    if backend != "cpu" and total_devices < 4:
        return f"needs 4 GPUs ({total_devices} here)"
    print("== 2 processes x 2 devices", flush=True)
    port, workers, logs = free_port(), [], []
    for i in range(2):
        # Files, not pipes: a worker blocked on a full pipe would stall the other's collectives.
        logs.append(open(Path(options.log_dir) / f"scaling-process-{i}.out", "w+"))
        command = [sys.executable, str(HERE), "--worker", "process", "--process-id", str(i)]
        command += ["--num-processes", "2", "--port", str(port), "--backend", backend]
        visible = None if backend == "cpu" else f"{2 * i},{2 * i + 1}"
        workers.append(
            subprocess.Popen(
                command + worker_arguments(options), stdout=logs[i], text=True,
                env=worker_environment(backend, 2, visible),
            )
        )  # fmt: skip
    try:
        codes = [worker.wait(timeout=options.worker_timeout) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if codes != [0, 0]:
        return f"failed: exit codes {codes}"
    return parse_result(outputs[0])


def derive(records: list[dict]) -> None:
    """Add throughput, speed-up and efficiency against the one-device run of the same library
    and task, and the relative difference of `sum y(t1)**2` from it."""
    reference = {
        (r["part"], r["library"], r["task"]): r
        for r in records
        if r["devices"] == 1 and "run_s" in r and r["part"] != "2 processes"
    }
    for record in records:
        if "run_s" not in record:
            continue
        record["run_ms"] = 1e3 * record["run_s"]
        record["run_min_ms"] = 1e3 * record["run_min_s"]
        if record["part"] in ("ensemble", "2 processes"):
            record["lanes_per_s"] = record["size_count"] / record["run_s"]
        part = "ensemble" if record["part"] == "2 processes" else record["part"]
        one = reference.get((part, record["library"], record["task"]))
        if one is None:
            continue
        record["speedup"] = one["run_s"] / record["run_s"]
        record["efficiency"] = record["speedup"] / record["devices"]
        record["sum_y2_rel_diff"] = abs(record["sum_y2"] - one["sum_y2"]) / abs(one["sum_y2"])
        record["steps"] = f"{record['steps_mean']:.1f} ({record['steps_max']})"


COLUMNS = [
    Column("part", "part"),
    Column("library", "library"),
    Column("task", "task"),
    Column("devices", "devices"),
    Column("size", "size"),
    Column("steps", "steps mean (max)"),
    Column("failed", "failed"),
    Column("run_ms", "run (ms)", ".3g"),
    Column("run_min_ms", "run min (ms)", ".3g"),
    Column("lanes_per_s", "lanes/s", ".3g"),
    Column("speedup", "speed-up", ".2f"),
    Column("efficiency", "efficiency", ".2f"),
    Column("compile_s", "compile (s)", ".2f"),
    Column("sum_y2_rel_diff", "diff vs 1 device", ".1e"),
    Column("error", "error"),
]


def notes(backend: str, env: dict, processes) -> str:
    cores = env["device"]["cpu_count"]
    if backend == "cpu":
        machine = (
            f"Machine: {cores} CPU cores; the N devices are XLA host devices made with "
            "`--xla_force_host_platform_device_count=N`, which share those cores. With more "
            "devices than cores the devices take turns on the same cores, so the efficiency "
            "`t1 / (N tN)` cannot reach 1 here and the 4-device figures measure sharding overhead "
            "(partitioning, the per-step all-reduce, halo exchanges) more than parallel speed-up; "
            "a one-device run also uses XLA's intra-op threads on every core. These figures say "
            "that sharding works and what it costs, not how it scales on real devices."
        )
    else:
        machine = f"Machine: {env['device']['device_kind']} GPUs, one per device."
    skipped = "" if isinstance(processes, dict) else f"\n\nTwo-process run not run: {processes}."
    return (
        machine
        + "\n\nRun time: median of calls of the jitted function after warm-up (one process: "
        "`_harness.compare`, odeckpt and diffrax interleaved; two processes: a fixed "
        f"{PROCESS_CALLS['solve']} solve and {PROCESS_CALLS['gradient']} gradient calls). "
        "Compile: `jax.jit(fn).lower(x).compile()` from cleared caches. Speed-up and efficiency: "
        "against the one-device run of the same library and task (for two processes, the "
        "one-device ensemble); efficiency = t1 / (N tN). `diff vs 1 device`: relative "
        "difference of sum y(t1)**2 from the one-device solve (adaptive steps: the grid's error "
        "norm is summed shard by shard, so it agrees to rounding). Solves run with "
        "`throw=False`; `failed` counts lanes (or grids) that did not succeed." + skipped
    )


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, help="ensemble lanes (default 1024; --quick 256)")
    parser.add_argument("--grid", type=int, help="grid side (default 256; --quick 128)")
    parser.add_argument("--quick", action="store_true", help="small sizes, short timings")
    parser.add_argument("--name", default="scaling", help="results file stem")
    parser.add_argument("--worker-timeout", type=float, default=1200, help="seconds per worker")
    parser.add_argument("--log-dir", default="/tmp", help="two-process worker logs")
    # Internal: the subprocesses.
    parser.add_argument("--worker", choices=["single", "process"], help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="cpu", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.lanes = options.lanes or (256 if options.quick else 1024)
    options.grid = options.grid or (128 if options.quick else 256)
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse(argv)
    if options.worker is not None:
        worker = single_worker if options.worker == "single" else process_worker
        print(MARK + json.dumps(worker(options)), flush=True)
        return
    start = time.perf_counter()
    backend, count = probe()
    counts = [n for n in DEVICE_COUNTS if backend == "cpu" or n <= count]
    print(f"backend {backend} ({count} devices); device counts {counts}", flush=True)
    singles = {n: run_single(options, backend, n) for n in counts}
    processes = run_processes(options, backend, count)
    records = [r for n in counts for r in singles[n]["records"]]
    if isinstance(processes, dict):
        records += processes["records"]
    derive(records)
    env = singles[max(counts)]["environment"]
    command = "python benchmarks/bench_scaling.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    json_path, md_path = write_results(
        options.name, records, COLUMNS,
        title=f"Scaling over devices: {options.lanes}-lane ensemble, {options.grid}x"
        f"{options.grid} sharded grid, two processes",
        command=command.strip(), env=env, notes=notes(backend, env, processes),
    )  # fmt: skip
    print(f"wrote {json_path} and {md_path} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
