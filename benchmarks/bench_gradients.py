"""Gradients, odeckpt vs diffrax: run time, compile time and compiled memory, adjoint by adjoint.

    python benchmarks/bench_gradients.py                        # everything, ~10 minutes
    python benchmarks/bench_gradients.py --problems lotka_volterra --adjoints recursive
    python benchmarks/bench_gradients.py --quick                # smoke run, short timings

Each odeckpt adjoint is measured against its diffrax counterpart in the same process:
`RecursiveCheckpointAdjoint` vs `diffrax.RecursiveCheckpointAdjoint`, `DirectAdjoint` vs
`diffrax.DirectAdjoint`, `BacksolveAdjoint` vs `diffrax.BacksolveAdjoint`. Both sides run with
their default settings (the headline rows) and, for the recursive adjoint, also with the same
`checkpoints` (second row). The timed function is `jax.grad(loss)` with loss = sum of squares of
the final state (`throw` on, the same solver, tolerances, dtype and `max_steps` on both sides).

Figures per row: gradient run time (median after warm-up), compile time (trace + lower + XLA
compile from cleared caches) and the compiled program's temporary memory
(`jax.jit(grad).lower(...).compile().memory_analysis().temp_size_in_bytes`), each as odeckpt /
diffrax; the steps both forward solves take; and the norm-wise relative difference of the two
gradients (`max |g_odeckpt - g_diffrax| / max |g_diffrax|` over all gradient leaves).

Problems:

- (a) `lotka_volterra`: Dopri5, rtol = atol = 1e-8, t in [0, 100], float64; gradient with
  respect to y0 and the four parameters.
- (b) `neural_ode`: the MLP 32-128-128-32 of `bench_forward.py`, batch 256, Tsit5, rtol = 1e-4,
  atol = 1e-6, float32; gradient with respect to the MLP parameters.
- (c) `diffusion`: a 2**16-dimensional periodic reaction-diffusion equation
  `dy/dt = D (y[i-1] - 2 y[i] + y[i+1]) - k tanh(y)`, Tsit5 with 1000 constant steps over
  [0, 1], float32; gradient with respect to y0 and (D, k).

Results go to `benchmarks/results/gradients.{json,md}` (`gradients-quick.*` with `--quick`).
"""

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

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
    write_results,
)
from bench_forward import lotka_volterra, neural_ode  # noqa: E402

import odeckpt  # noqa: E402
from odeckpt import (  # noqa: E402
    BacksolveAdjoint,  # noqa: E402
    DirectAdjoint,
    RecursiveCheckpointAdjoint,
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A gradient benchmark: an initial value problem, its solvers on both sides, and the
    arguments the loss is differentiated with respect to."""

    name: str
    description: str
    f: Callable
    y0: Any
    args: Any
    t_span: tuple[float, float]
    solver: tuple[odeckpt.AbstractStepper, diffrax.AbstractSolver]
    rtol: float
    atol: float
    max_steps: int
    argnums: int | tuple[int, ...]
    checkpoints: int
    """The equal-`checkpoints` row of the recursive adjoint uses this many on both sides."""
    dt0: float | None = None
    """A constant step size (`ConstantStep` / `ConstantStepSize`); `None`: adaptive (PID)."""

    @property
    def dtype(self) -> str:
        return str(jnp.asarray(self.y0).dtype)

    def times(self) -> tuple[np.ndarray, np.ndarray]:
        # Times in the state's dtype: a float64 t0 would make diffrax promote a float32 state.
        return tuple(np.asarray(t, self.dtype) for t in self.t_span)


def problem_lotka_volterra(quick: bool) -> Problem:
    base = lotka_volterra()
    t1 = 20.0 if quick else base.t_span[1]
    return Problem(
        name="lotka_volterra",
        description=f"Lotka-Volterra, y0=(10, 5), params (1.1, 0.4, 0.4, 0.1), t in [0, {t1:g}]",
        f=base.f,
        y0=base.y0,
        args=base.args,
        t_span=(0.0, t1),
        solver=(odeckpt.Dopri5(), diffrax.Dopri5()),
        rtol=1e-8,
        atol=1e-8,
        max_steps=4096,
        argnums=(0, 1),
        checkpoints=16,
    )


def problem_neural_ode(quick: bool) -> Problem:
    del quick
    base = neural_ode()
    return Problem(
        name="neural_ode",
        description=base.description,
        f=base.f,
        y0=base.y0,
        args=base.args,
        t_span=base.t_span,
        solver=(odeckpt.Tsit5(), diffrax.Tsit5()),
        rtol=base.rtol,
        atol=base.atol,
        max_steps=4096,
        argnums=1,
        checkpoints=16,
    )


DIFFUSION_SIZE = 2**16


def problem_diffusion(quick: bool) -> Problem:
    steps = 200 if quick else 1000

    def f(t, y, params):
        diffusion, reaction = params
        laplacian = jnp.roll(y, 1) - 2 * y + jnp.roll(y, -1)
        return diffusion * laplacian - reaction * jnp.tanh(y)

    x = np.linspace(0.0, 2 * np.pi, DIFFUSION_SIZE, endpoint=False)
    y0 = jnp.asarray(np.sin(x) + 0.5 * np.sin(7 * x) + 0.1 * np.cos(300 * x), jnp.float32)
    return Problem(
        name="diffusion",
        description=f"periodic reaction-diffusion, {DIFFUSION_SIZE} points, D=1, k=1, "
        f"{steps} constant steps over [0, 1]",
        f=f,
        y0=y0,
        args=jnp.array([1.0, 1.0], jnp.float32),
        t_span=(0.0, 1.0),
        solver=(odeckpt.Tsit5(), diffrax.Tsit5()),
        rtol=1e-4,
        atol=1e-6,
        # One spare step: odeckpt's float32 constant-step backsolve needs it (see docs).
        max_steps=steps + 1,
        argnums=(0, 1),
        checkpoints=16,
        dt0=1.0 / steps,
    )


PROBLEMS = {
    "lotka_volterra": problem_lotka_volterra,
    "neural_ode": problem_neural_ode,
    "diffusion": problem_diffusion,
}


@dataclasses.dataclass(frozen=True)
class Pair:
    """An odeckpt adjoint and its diffrax counterpart."""

    adjoint: str
    setting: str
    ours: odeckpt.AbstractAdjoint
    peer: diffrax.AbstractAdjoint


def pairs(problem: Problem, adjoints: list[str]) -> list[Pair]:
    c = problem.checkpoints
    every = {
        "recursive": [
            Pair(
                "recursive",
                "default",
                RecursiveCheckpointAdjoint(),
                diffrax.RecursiveCheckpointAdjoint(),
            ),
            Pair(
                "recursive",
                f"checkpoints={c}",
                RecursiveCheckpointAdjoint(checkpoints=c),
                diffrax.RecursiveCheckpointAdjoint(checkpoints=c),
            ),
        ],
        "direct": [Pair("direct", "default", DirectAdjoint(), diffrax.DirectAdjoint())],
        "backsolve": [Pair("backsolve", "default", BacksolveAdjoint(), diffrax.BacksolveAdjoint())],
    }
    return [pair for name in adjoints for pair in every[name]]


def odeckpt_solve(problem: Problem, adjoint) -> Callable:
    constant = problem.dt0 is not None

    def solve(y0, args):
        return odeckpt.solve(
            problem.f,
            y0,
            problem.times(),
            args,
            solver=problem.solver[0],
            adjoint=adjoint,
            rtol=problem.rtol,
            atol=problem.atol,
            dt0=problem.dt0,
            controller=odeckpt.ConstantStep() if constant else None,
            max_steps=problem.max_steps,
            throw=True,
        )

    return solve


def diffrax_solve(problem: Problem, adjoint) -> Callable:
    constant = problem.dt0 is not None
    controller = (
        diffrax.ConstantStepSize()
        if constant
        else diffrax.PIDController(rtol=problem.rtol, atol=problem.atol)
    )

    def solve(y0, args):
        t0, t1 = problem.times()
        return diffrax.diffeqsolve(
            diffrax.ODETerm(problem.f),
            problem.solver[1],
            t0,
            t1,
            None if problem.dt0 is None else np.asarray(problem.dt0, problem.dtype),
            y0,
            args,
            saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=controller,
            adjoint=adjoint,
            max_steps=problem.max_steps,
            throw=True,
        )

    return solve


def gradient(problem: Problem, solve: Callable) -> Callable:
    """`(y0, args) -> grad` of the sum of squares of the final state."""

    def loss(y0, args):
        return jnp.sum(solve(y0, args).ys[-1] ** 2)

    return jax.grad(loss, argnums=problem.argnums)


def relative_difference(ours, peer) -> float:
    """`max |a - b| / max |b|` over all leaves: norm-wise, not fooled by tiny components."""
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(ours)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(peer)])
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def compiled_figures(fn: Callable, *args) -> tuple[int, int]:
    """`(temp_bytes, hlo_lines)`: the temporary bytes XLA reserves for `jax.jit(fn)` and the
    length of its optimized HLO in lines (both deterministic, needing no run)."""
    compiled = jax.jit(fn).lower(*args).compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    return temp, compiled.as_text().count("\n")


def steps(problem: Problem) -> dict[str, str]:
    """Steps (accepted+rejected) of both forward solves (the same for every adjoint)."""
    ours = jax.jit(odeckpt_solve(problem, "forward"))(problem.y0, problem.args).stats
    peer = jax.jit(diffrax_solve(problem, diffrax.RecursiveCheckpointAdjoint()))(
        problem.y0, problem.args
    ).stats
    return {
        "odeckpt_steps": f"{int(ours.num_accepted_steps)}+{int(ours.num_rejected_steps)}",
        "diffrax_steps": f"{int(peer['num_accepted_steps'])}+{int(peer['num_rejected_steps'])}",
    }


def forward_run_s(problem: Problem, timing_options: dict) -> float:
    """Median run time of odeckpt's jitted forward solve (the loss without its gradient)."""
    loss = lambda y0, args: jnp.sum(odeckpt_solve(problem, "recursive")(y0, args).ys[-1] ** 2)
    options = {**timing_options, "compile_repeats": 1}
    return compare({"forward": (loss, (problem.y0, problem.args))}, **options)["forward"].run_s


def _failure(error: Exception) -> str:
    """The first sentence of odeckpt's error message inside a `JaxRuntimeError`."""
    text = str(error)
    start = text.find("BacksolveAdjoint:")
    text = text[start:] if start >= 0 else text
    return text.split(". Fix:")[0].strip()


def run_pair(problem: Problem, pair: Pair, counts: dict, timing_options: dict) -> dict[str, Any]:
    label = f"{problem.name} / {pair.adjoint} ({pair.setting})"
    print(f"\n== {label}")
    args = (problem.y0, problem.args)
    ours = gradient(problem, odeckpt_solve(problem, pair.ours))
    peer = gradient(problem, diffrax_solve(problem, pair.peer))
    record: dict[str, Any] = {
        "problem": problem.name,
        "description": problem.description,
        "adjoint": pair.adjoint,
        "setting": pair.setting,
        "dtype": problem.dtype,
        "max_steps": problem.max_steps,
        **counts,
    }
    g_peer = jax.jit(peer)(*args)
    try:
        # Waited for here: on a GPU a refusal arrives with the result.
        g_ours = jax.block_until_ready(jax.jit(ours)(*args))
    except jax.errors.JaxRuntimeError as error:
        # odeckpt refuses a gradient it cannot vouch for (e.g. BacksolveAdjoint's drift
        # check); the row says so instead of timing it.
        record["odeckpt_failed"] = _failure(error)
        print(f"   odeckpt's gradient failed: {record['odeckpt_failed']}")
        return record
    record["grad_rel_diff"] = relative_difference(g_ours, g_peer)
    for name, fn in (("odeckpt", ours), ("diffrax", peer)):
        record[f"{name}_temp_bytes"], record[f"{name}_hlo_lines"] = compiled_figures(fn, *args)
    timings: dict[str, Timing] = compare(
        {"odeckpt": (ours, args), "diffrax": (peer, args)}, **timing_options
    )
    for name, timing in timings.items():
        for field, value in dataclasses.asdict(timing).items():
            record[f"{name}_{field}"] = value
        record[f"{name}_run_ms"] = 1e3 * timing.run_s
        record[f"{name}_temp_mib"] = record[f"{name}_temp_bytes"] / 2**20
    record["run_ratio"] = record["odeckpt_run_s"] / record["diffrax_run_s"]
    record["grad_per_forward"] = record["odeckpt_run_s"] / counts["odeckpt_forward_s"]
    record["compile_ratio"] = record["odeckpt_compile_s"] / record["diffrax_compile_s"]
    record["compile_cpu_ratio"] = record["odeckpt_compile_cpu_s"] / record["diffrax_compile_cpu_s"]
    record["memory_ratio"] = record["odeckpt_temp_bytes"] / max(record["diffrax_temp_bytes"], 1)
    print(
        f"   steps odeckpt {counts['odeckpt_steps']}, diffrax {counts['diffrax_steps']}; "
        f"gradient rel. diff {record['grad_rel_diff']:.2e}"
    )
    print(
        f"   run {record['odeckpt_run_ms']:.3f} vs {record['diffrax_run_ms']:.3f} ms "
        f"(ratio {record['run_ratio']:.2f}); compile {record['odeckpt_compile_s']:.2f} vs "
        f"{record['diffrax_compile_s']:.2f} s (ratio {record['compile_ratio']:.2f}, trace+lower "
        f"{record['odeckpt_lower_s']:.2f} vs {record['diffrax_lower_s']:.2f} s); temp "
        f"{record['odeckpt_temp_mib']:.2f} vs {record['diffrax_temp_mib']:.2f} MiB "
        f"(ratio {record['memory_ratio']:.2f})"
    )
    return record


COLUMNS = [
    Column("problem", "problem"),
    Column("adjoint", "adjoint"),
    Column("setting", "setting"),
    Column("odeckpt_steps", "steps odeckpt"),
    Column("diffrax_steps", "steps diffrax"),
    *TIMING_COLUMNS,
    Column("odeckpt_temp_mib", "temp odeckpt (MiB)", ".3g"),
    Column("diffrax_temp_mib", "temp diffrax (MiB)", ".3g"),
    Column("memory_ratio", "memory ratio", ".2f"),
    Column("grad_per_forward", "odeckpt grad / forward", ".1f"),
    Column("odeckpt_lower_s", "trace+lower odeckpt (s)", ".2f"),
    Column("diffrax_lower_s", "trace+lower diffrax (s)", ".2f"),
    Column("odeckpt_hlo_lines", "HLO lines odeckpt"),
    Column("diffrax_hlo_lines", "HLO lines diffrax"),
    Column("grad_rel_diff", "grad rel. diff", ".1e"),
    Column("odeckpt_failed", "odeckpt refused"),
]

NOTES = """\
Ratios are odeckpt / diffrax (below 1: odeckpt faster or smaller). Each row times `jax.grad` of
loss = sum(y(t1)**2) with the named adjoint on both sides. Run time: median of repeated calls
of the jitted gradient after warm-up. Compile time: `jax.jit(grad).lower(*args).compile()` from
cleared caches (trace + lower + XLA), median of repeats. Temp: XLA's
`memory_analysis().temp_size_in_bytes` of the compiled gradient; HLO lines: the length of its
optimized HLO text. Steps: accepted+rejected of
each library's forward solve. "odeckpt grad / forward": the gradient's run time over that of
odeckpt's forward solve of the same loss. "grad rel. diff" is max |g_odeckpt - g_diffrax| /
max |g_diffrax| over all gradient leaves. Targets (issue 36, default settings): run ratio
<= 0.3 (a, and odeckpt grad / forward <= 4), <= 0.6 (b), <= 0.6 (c); compile ratio <= 0.5;
memory ratio <= 1.0."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument(
        "--adjoints",
        nargs="+",
        choices=["recursive", "direct", "backsolve"],
        default=["recursive", "direct", "backsolve"],
    )
    parser.add_argument("--quick", action="store_true", help="short problems and timings")
    parser.add_argument("--target-seconds", type=float, help="run-time budget per candidate")
    parser.add_argument("--compile-repeats", type=int, help="compiles timed per candidate")
    parser.add_argument("--name", help="results file stem (default gradients / gradients-quick)")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=["neural_ode/direct"],
        help="problem/adjoint rows to leave out (default neural_ode/direct: both libraries "
        "store residuals for all max_steps = 4096 steps, about 6 GB each)",
    )
    options = parser.parse_args(argv)
    timing_options = {
        "target_s": options.target_seconds or (0.3 if options.quick else 2.0),
        "compile_repeats": options.compile_repeats or (1 if options.quick else 3),
        "rounds": 1 if options.quick else 3,
        "min_repeats": 2 if options.quick else 5,
    }
    name = options.name or ("gradients-quick" if options.quick else "gradients")

    env = environment()
    print(f"device: {env['device']}\nversions: {env['versions']}\ngit: {env['git']}")
    command = "python benchmarks/bench_gradients.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    records = []
    for problem_name in options.problems:
        problem = PROBLEMS[problem_name](options.quick)
        print(f"\n#### {problem.name}: {problem.description} ({problem.dtype})")
        counts = {**steps(problem), "odeckpt_forward_s": forward_run_s(problem, timing_options)}
        for pair in pairs(problem, options.adjoints):
            if f"{problem.name}/{pair.adjoint}" in options.skip:
                continue
            records.append(run_pair(problem, pair, counts, timing_options))
            # Written after every row, so a long run interrupted keeps what it measured.
            json_path, md_path = write_results(
                name,
                records,
                COLUMNS,
                title="Gradients: odeckpt vs diffrax, adjoint by adjoint",
                command=command.strip(),
                env=env,
                notes=NOTES,
            )
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
