"""Ensembles on a GPU: `odeckpt.ensemble`'s fused kernel vs `jax.vmap` of odeckpt and diffrax.

    python benchmarks/bench_ensemble_gpu.py                      # GPU: 2**3 .. 2**23, both dtypes
    python benchmarks/bench_ensemble_gpu.py --sizes 10 20 --dtypes float32
    python benchmarks/bench_ensemble_gpu.py --quick              # CPU smoke run, about a minute

The problem: Lorenz, `dy/dt = (sigma (y1 - y0), y0 (rho - y2) - y1, y0 y1 - beta y2)`, with
one `(sigma, rho, beta)` per trajectory, each entry drawn independently and uniformly within
+-10% of (10, 28, 8/3) (`numpy.random.default_rng(0).uniform(0.9, 1.1, (n, 3))` times them,
drawn in float64, then cast); the same y0 = (1, 0, 0) for every trajectory; t in [0, 1]; Tsit5
with a PID controller at rtol = atol = 1e-8; `max_steps` = 4096; `throw` on; only y(t1) saved;
float32 and float64; 2**3, 2**10, 2**17, 2**20 and 2**23 trajectories (`--sizes` takes the
exponents). In float32 odeckpt holds rtol to float32's resolution (1.2e-7, with a warning);
diffrax takes 1e-8 as given.

Candidates, each a function of `(y0, params)` under `jax.jit`:

- `fused`: `odeckpt.ensemble(..., backend="fused")`, one Pallas kernel with one trajectory per
  lane (Triton on a GPU; off a GPU Pallas' interpret mode, which is slow: keep CPU runs tiny).
- `vmap`: `odeckpt.ensemble(..., backend="vmap")`, that is `jax.vmap(odeckpt.solve)`, with
  odeckpt's default adjoint.
- `diffrax`: `jax.vmap(diffrax.diffeqsolve)` with `Tsit5()`, `PIDController(rtol, atol)`,
  `SaveAt(t1=True)`, `RecursiveCheckpointAdjoint()` (its default) and `max_steps` = 4096.

Both odeckpt candidates keep the default `saveat` (t1 only) and `lanes_per_block`.

Two tasks: `forward` returns y(t1), `[n, 3]`; `gradient` is `jax.grad` of `sum over trajectories
of sum(y(t1)**2)` with respect to the `[n, 3]` parameters.

Timing: each configuration (task, dtype, size, candidate) is compiled once (`jax.jit(fn).lower(
*args).compile()` after `jax.clear_caches()`, as `_harness.time_compile`; the compile time is
that one compile, not a median), called once (a warm-up whose output is the accuracy check),
then called repeatedly, each call ended by `jax.block_until_ready`, until `--target-seconds` of
calls (at least 3), 50 calls, or the configuration's `--max-seconds` (compile included) is
spent; the run time is the median. A warm-up call that takes over half the budget is the only
sample. Skipped, each with its reason in the results: a call predicted (by a line `a + b n`
through the two previous sizes) to take longer than `--max-seconds`; a program whose compiled
memory exceeds the device's; a candidate at larger sizes once it ran out of memory or failed;
anything not started within `--total-seconds` (for the GPU suite's time limit). It runs one
dtype at a time, the sizes in the order given, and rewrites the results after each
configuration, so a run cut short keeps what it measured.

Results go to `benchmarks/results/ensemble-gpu.{json,md}` (`ensemble-gpu-quick.*` with
`--quick`; `--name` sets the stem). It exits non-zero if a candidate failed (other than running
out of memory) or the fused results differ from the vmap ones by more than 1000 x max(rtol, eps).
"""

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable

import jax

jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import Column, environment, markdown_table, write_results  # noqa: E402

import odeckpt  # noqa: E402

BASE_PARAMS = np.array([10.0, 28.0, 8.0 / 3.0])
SPREAD = 0.1
Y0 = np.array([1.0, 0.0, 0.0])
T_SPAN = (0.0, 1.0)
RTOL = ATOL = 1e-8
MAX_STEPS = 4096
SIZES, QUICK_SIZES = [3, 10, 17, 20, 23], [3, 5]
DTYPES = ["float32", "float64"]
CANDIDATES = ("fused", "vmap", "diffrax")
TASKS = ("forward", "gradient")
VALUES_MOVED = 9
"""Values read and written per trajectory at the least: y0 and the parameters in (3 + 3),
y(t1) or the gradient out (3)."""


def lorenz(t, y, params):
    sigma, rho, beta = params[0], params[1], params[2]
    return jnp.stack([sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]])


def trajectory_params(n: int, dtype: str) -> np.ndarray:
    """`[n, 3]` parameters, each entry uniform within +-10% of `BASE_PARAMS` (seed 0)."""
    rng = np.random.default_rng(0)
    return (BASE_PARAMS * rng.uniform(1 - SPREAD, 1 + SPREAD, (n, 3))).astype(dtype)


def _times(dtype) -> tuple[np.ndarray, np.ndarray]:
    # Times in the state's dtype: a float64 t0 would make diffrax promote a float32 state.
    return tuple(np.asarray(t, dtype) for t in T_SPAN)


def odeckpt_final(backend: str) -> Callable:
    """`(y0, params) -> y(t1)` of every trajectory by `odeckpt.ensemble(backend=backend)`."""

    def final(y0, params):
        sol = odeckpt.ensemble(
            lorenz, y0, _times(y0.dtype), params, solver=odeckpt.Tsit5(), rtol=RTOL, atol=ATOL,
            max_steps=MAX_STEPS, throw=True, backend=backend,
        )  # fmt: skip
        return sol.ys[:, -1]

    return final


def diffrax_final(y0, params):
    """`(y0, params) -> y(t1)` of every trajectory by `jax.vmap(diffrax.diffeqsolve)`."""

    def one(y0, params):
        t0, t1 = _times(y0.dtype)
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lorenz), diffrax.Tsit5(), t0, t1, None, y0, params,
            saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.PIDController(rtol=RTOL, atol=ATOL),
            adjoint=diffrax.RecursiveCheckpointAdjoint(), max_steps=MAX_STEPS, throw=True,
        )  # fmt: skip
        return sol.ys[-1]

    return jax.vmap(one)(y0, params)


FINALS = {"fused": odeckpt_final("fused"), "vmap": odeckpt_final("vmap"), "diffrax": diffrax_final}


def timed_function(task: str, candidate: str) -> Callable:
    final = FINALS[candidate]
    if task == "forward":
        return final
    return jax.grad(lambda y0, params: jnp.sum(final(y0, params) ** 2), argnums=1)


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long each configuration may take and how many calls it times."""

    max_s: float
    target_s: float
    max_repeats: int
    min_repeats: int


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One candidate's compile and run times (seconds), its compiled memory per trajectory
    (arguments, outputs and temporaries; `None` where XLA does not say) and its first output."""

    lower_s: float
    xla_compile_s: float
    compile_cpu_s: float
    first_call_s: float
    run_s: float
    run_min_s: float
    repeats: int
    memory_bytes: int | None
    output: np.ndarray

    def figures(self, n: int) -> dict:
        return {
            "compile_s": self.lower_s + self.xla_compile_s,
            "lower_s": self.lower_s,
            "xla_compile_s": self.xla_compile_s,
            "compile_cpu_s": self.compile_cpu_s,
            "first_call_ms": 1e3 * self.first_call_s,
            "run_ms": 1e3 * self.run_s,
            "run_min_ms": 1e3 * self.run_min_s,
            "repeats": self.repeats,
            "traj_per_s": n / self.run_s,
            "memory_per_traj": None if self.memory_bytes is None else self.memory_bytes / n,
        }


@dataclasses.dataclass(frozen=True)
class Skip:
    """A configuration not measured: `kind` is `memory`, `time` or `failed`, `reason` says why."""

    kind: str
    reason: str


def _memory_bytes(compiled) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def _device_bytes() -> int | None:
    """The memory JAX may allocate on the default device (`None` where it does not say)."""
    stats = jax.devices()[0].memory_stats()
    return None if stats is None else stats.get("bytes_limit")


def _call_time(compiled, args: tuple) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def measure(fn: Callable, args: tuple, settings: Settings) -> Measurement | Skip:
    """Compile `jax.jit(fn)` once from cleared caches, call it once, then time repeated calls
    within `settings` (see the module docstring); a `Skip` if the compiled program needs more
    memory than the device has."""
    start = time.perf_counter()
    jax.clear_caches()
    cpu_start, lower_start = time.process_time(), time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at, compile_cpu = time.perf_counter(), time.process_time() - cpu_start
    memory, limit = _memory_bytes(compiled), _device_bytes()
    if memory is not None and limit is not None and memory > limit:
        return Skip("memory", f"needs {memory / 2**30:.1f} GiB, the device has {limit / 2**30:.1f}")
    called_at = time.perf_counter()
    output = jax.block_until_ready(compiled(*args))
    first = time.perf_counter() - called_at
    output = np.asarray(output)
    # At least one call after the warm-up (which pays one-time costs), unless it was slow.
    samples: list[float] = [] if first > settings.max_s / 2 else [_call_time(compiled, args)]
    while samples and len(samples) < settings.max_repeats:
        if time.perf_counter() - start + statistics.median(samples) > settings.max_s:
            break
        if len(samples) >= settings.min_repeats and sum(samples) >= settings.target_s:
            break
        samples.append(_call_time(compiled, args))
    return Measurement(
        lower_s=lowered_at - lower_start,
        xla_compile_s=compiled_at - lowered_at,
        compile_cpu_s=compile_cpu,
        first_call_s=first,
        run_s=statistics.median(samples or [first]),
        run_min_s=min(samples or [first]),
        repeats=len(samples),
        memory_bytes=memory,
        output=output,
    )


def attempt(fn: Callable, args: tuple, settings: Settings) -> Measurement | Skip:
    """`measure`, or why it could not (out of memory, or a failure)."""
    try:
        return measure(fn, args, settings)
    except Exception as error:  # recorded; the benchmark goes on
        text = str(error).strip()
        message = (text.splitlines() or [""])[0][:300]
        # XLA reports an allocation failure as a runtime error with this status in its text.
        if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
            return Skip("memory", f"out of memory ({message})")
        return Skip("failed", f"failed: {type(error).__name__}: {message}")


def planned_skip(past: list | Skip, n: int, settings: Settings, deadline: float) -> Skip | None:
    """Why not to measure a candidate at `n` trajectories, given its `past`: the `(n, run_s)`
    of its smaller sizes, or the `Skip` of one; `None` if nothing speaks against it.

    A call's time is predicted as `a + b n` through the last two sizes measured: small sizes
    are all overhead on a GPU, so a line through the origin would overestimate by far."""
    if time.monotonic() > deadline:
        return Skip("time", "not started: --total-seconds spent")
    if isinstance(past, Skip):
        return Skip(past.kind, f"skipped after a smaller size: {past.reason}")
    if len(past) < 2:
        return None
    (n1, t1), (n2, t2) = past[-2:]
    predicted = t2 + max(0.0, (t2 - t1) / (n2 - n1)) * (n - n2)
    if predicted <= settings.max_s:
        return None
    return Skip(
        "time", f"one call predicted to take {predicted:.0f} s (from {t1:.3g} s at {n1} and "
        f"{t2:.3g} s at {n2} trajectories), over --max-seconds {settings.max_s:g}",
    )  # fmt: skip


def relative_difference(ours: np.ndarray, peer: np.ndarray) -> float:
    """Max over trajectories of `max |ours - peer| / max |peer|` (NaN where either is)."""
    ours, peer = np.asarray(ours, np.float64), np.asarray(peer, np.float64)
    scale = np.max(np.abs(peer), axis=1)
    return float(np.max(np.max(np.abs(ours - peer), axis=1) / scale))


def agreement_bound(dtype: str) -> float:
    """Largest fused-vs-vmap difference accepted: the two take the same steps, so they differ
    by rounding, or, where rounding flips a step decision, by about the tolerance."""
    return 1e3 * max(RTOL, float(np.finfo(dtype).eps))


def run_configuration(
    task: str, dtype: str, exponent: int, args: tuple, history: dict, settings: Settings,
    deadline: float,
) -> dict:  # fmt: skip
    """Measure every candidate on one task, dtype and size; `history` holds each candidate's
    past (see `planned_skip`) and is updated."""
    n = 2**exponent
    record = {
        "task": task, "dtype": dtype, "exponent": exponent, "size": f"2^{exponent}",
        "trajectories": n, "bytes_per_traj": VALUES_MOVED * np.dtype(dtype).itemsize,
        "skipped": {}, "failed": [],
    }  # fmt: skip
    outputs = {}
    for name in CANDIDATES:
        key = (task, dtype, name)
        past = history.setdefault(key, [])
        result = planned_skip(past, n, settings, deadline)
        if result is None:
            result = attempt(timed_function(task, name), args, settings)
        gc.collect()
        if isinstance(result, Skip):
            print(f"   {name}: {result.reason}", flush=True)
            record["skipped"][name] = result.reason
            if result.kind == "failed":
                record["failed"].append(name)
            if result.kind != "time":
                history[key] = result
            continue
        past.append((n, result.run_s))
        outputs[name] = result.output
        record.update({f"{name}_{k}": v for k, v in result.figures(n).items()})
        print(
            f"   {name}: {1e3 * result.run_s:.4g} ms ({result.repeats} calls), compile "
            f"{result.lower_s + result.xla_compile_s:.2f} s", flush=True,
        )  # fmt: skip
    for peer in ("vmap", "diffrax"):
        if "fused" in outputs and peer in outputs:
            record[f"{peer}_over_fused"] = record[f"{peer}_run_ms"] / record["fused_run_ms"]
            record[f"fused_vs_{peer}"] = relative_difference(outputs["fused"], outputs[peer])
    if "fused_vs_vmap" in record:
        record["agree"] = record["fused_vs_vmap"] <= agreement_bound(dtype)
    return record


COLUMNS = [
    Column("task", "task"),
    Column("dtype", "dtype"),
    Column("size", "trajectories"),
    *(Column(f"{name}_run_ms", f"{name} (ms)", ".4g") for name in CANDIDATES),
    Column("vmap_over_fused", "vmap / fused", ".2f"),
    Column("diffrax_over_fused", "diffrax / fused", ".2f"),
    *(Column(f"{name}_traj_per_s", f"{name} traj/s", ".3g") for name in CANDIDATES),
    Column("fused_vs_vmap", "fused vs vmap", ".1e"),
    Column("fused_vs_diffrax", "fused vs diffrax", ".1e"),
    Column("bytes_per_traj", "bytes/traj"),
]

DETAIL_COLUMNS = [
    Column("task", "task"),
    Column("dtype", "dtype"),
    Column("size", "trajectories"),
    *(Column(f"{name}_compile_s", f"compile {name} (s)", ".2f") for name in CANDIDATES),
    *(Column(f"{name}_memory_per_traj", f"memory/traj {name} (B)", ".0f") for name in CANDIDATES),
    *(Column(f"{name}_repeats", f"calls {name}") for name in CANDIDATES),
]

NOTES = """\
Times: median of repeated calls of the jitted function after one warm-up call ("-": not
measured, see the list below). Ratios are vmap / fused and diffrax / fused: above 1 means the
fused kernel is faster. traj/s: trajectories divided by the run time. "fused vs vmap" and
"fused vs diffrax": the accuracy check, max over trajectories of max |fused - peer| / max |peer|
on y(t1) (forward) or the gradient (gradient). The fused kernel takes vmap's steps, so the two
differ by rounding; diffrax's controller differs in details, so it takes slightly different
steps. bytes/traj: the least a solve reads and writes per trajectory, y0 and the parameters in
and y(t1) or the gradient out (9 values); bytes/traj x traj/s is the bandwidth that would take,
to hold against the device's memory bandwidth. The fused kernel also writes each trajectory's
final loop state, and the gradient kernel its 3 x 3 Jacobian; those are not counted. Targets
(issue 37, on one H100 or H200): diffrax / fused at least 20 for the forward solve and at least
10 for the gradient, from 2^17 trajectories up."""

DETAIL_NOTES = """\
Compile: one `jax.jit(fn).lower(*args).compile()` from cleared caches (trace, lower and XLA or
Triton compile). memory/traj: XLA's `memory_analysis()` of the compiled program (arguments,
outputs and temporaries) divided by the trajectories. calls: timed calls after the warm-up (0:
the warm-up call took over half of `--max-seconds` and is the time shown)."""


def notes(records: list[dict]) -> str:
    skipped = [
        f"- {r['task']} {r['dtype']} {r['size']} {name}: {reason}"
        for r in records
        for name, reason in r["skipped"].items()
    ]
    parts = [NOTES, markdown_table(records, DETAIL_COLUMNS), DETAIL_NOTES]
    parts.append("Skipped:\n\n" + "\n".join(skipped) if skipped else "Nothing skipped.")
    return "\n\n".join(parts)


def write(name: str, records: list[dict], command: str, env: dict):
    """`write_results` of the records so far, by task, dtype and size."""
    ordered = sorted(records, key=lambda r: (TASKS.index(r["task"]), r["dtype"], r["exponent"]))
    return write_results(
        name, ordered, COLUMNS, command=command, env=env, notes=notes(ordered),
        title="Ensembles: Lorenz with per-trajectory parameters, odeckpt's fused kernel vs "
        "vmap (odeckpt, diffrax)",
    )  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", nargs="+", type=int,
        help="log2 of the numbers of trajectories (default 3 10 17 20 23; --quick: 3 5)",
    )  # fmt: skip
    parser.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, help="default both; --quick: float64"
    )
    parser.add_argument(
        "--quick", action="store_true", help="CPU smoke run: 2**3 and 2**5, float64, one call"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=60.0,
        help="budget of one configuration (task, dtype, size, candidate), compile included",
    )  # fmt: skip
    parser.add_argument(
        "--total-seconds", type=float, help="start no configuration after this long"
    )
    parser.add_argument("--target-seconds", type=float, help="timed calls per candidate (s)")
    parser.add_argument("--name", help="results file stem (default ensemble-gpu[-quick])")
    options = parser.parse_args(argv)
    options.sizes = options.sizes or (QUICK_SIZES if options.quick else SIZES)
    options.dtypes = options.dtypes or (["float64"] if options.quick else DTYPES)
    options.name = options.name or ("ensemble-gpu-quick" if options.quick else "ensemble-gpu")
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse(argv)
    settings = Settings(
        max_s=options.max_seconds,
        target_s=options.target_seconds if options.target_seconds is not None else 2.0,
        max_repeats=1 if options.quick else 50,
        min_repeats=1 if options.quick else 3,
    )
    deadline = time.monotonic() + (options.total_seconds or float("inf"))
    env = environment()
    print(f"device: {env['device']}\nversions: {env['versions']}\ngit: {env['git']}")
    if jax.default_backend() != "gpu":
        print("no GPU: the fused kernel runs in Pallas' interpret mode (slow; keep sizes tiny)")
    command = "python benchmarks/bench_ensemble_gpu.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    records, history = [], {}
    # One dtype at a time, smallest size first: a run cut short has a whole scaling curve.
    for dtype in options.dtypes:
        for exponent in options.sizes:
            n = 2**exponent
            args = (
                jnp.asarray(np.tile(Y0.astype(dtype), (n, 1))),
                jnp.asarray(trajectory_params(n, dtype)),
            )
            for task in TASKS:
                print(f"\n== {task}, {dtype}, 2^{exponent} = {n} trajectories", flush=True)
                records.append(
                    run_configuration(task, dtype, exponent, args, history, settings, deadline)
                )
                paths = write(options.name, records, command.strip(), env)
            del args
            gc.collect()
    print(f"\nwrote {paths[0]} and {paths[1]}")
    failed = [r for r in records if r["failed"]]
    disagree = [r for r in records if r.get("agree") is False]
    if failed or disagree:
        sys.exit(
            f"{len(failed)} configurations failed and {len(disagree)} disagree (fused vs vmap "
            "beyond 1000 x max(rtol, eps)); see above"
        )


if __name__ == "__main__":
    main()
