"""Forward solve, odeckpt vs diffrax: run time and compile time on the problems of issue 2.

    python benchmarks/bench_forward.py                      # all problems, ~2 minutes
    python benchmarks/bench_forward.py --problems linear    # one problem
    python benchmarks/bench_forward.py --quick              # smoke run, short timings

Both libraries solve the same problem in the same process: Tsit5, the same rtol/atol, the same
dtype, the same max_steps, `throw` on, the final state saved only (odeckpt's default `saveat`,
diffrax's `SaveAt(t1=True)`), each inside `jax.jit` of a function of `(y0, args)` returning the
final state. diffrax runs with its defaults otherwise (`PIDController`,
`RecursiveCheckpointAdjoint`). The two controllers differ in details (diffrax never shrinks the
step after an accepted step and caps the factor at `safety` after a rejection; odeckpt clips to
[factormin, factormax] and caps at 1), so the step counts can differ slightly: both are reported,
with a per-step run-time ratio.

Results go to `benchmarks/results/forward.{json,md}` (`forward-quick.*` with `--quick`).
"""

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import Column, Timing, compare, environment, write_results  # noqa: E402

import odeckpt  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Problem:
    """An initial value problem `dy/dt = f(t, y, args)` with its solver settings."""

    name: str
    description: str
    f: Callable
    y0: jax.Array
    args: Any
    t_span: tuple[float, float]
    rtol: float
    atol: float
    max_steps: int = 16_384

    @property
    def dtype(self) -> str:
        return str(self.y0.dtype)


def lotka_volterra() -> Problem:
    def f(t, y, params):
        a, b, c, d = params
        prey, predator = y
        return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])

    return Problem(
        name="lotka_volterra",
        description="Lotka-Volterra, y0=(10, 5), params (1.1, 0.4, 0.4, 0.1), t in [0, 100]",
        f=f,
        y0=jnp.array([10.0, 5.0]),
        args=jnp.array([1.1, 0.4, 0.4, 0.1]),
        t_span=(0.0, 100.0),
        rtol=1e-8,
        atol=1e-8,
    )


NEURAL_ODE_WEIGHT_SCALE = 4.0
"""Weights are equinox's default initialisation times this, so that the solve over [0, 1]
takes tens of steps (at scale 1 it takes 3)."""


def neural_ode() -> Problem:
    key_mlp, key_y0 = jax.random.split(jax.random.key(0))
    mlp = eqx.nn.MLP(
        32, 32, 128, 2, activation=jax.nn.softplus, key=key_mlp, dtype=jnp.float32
    )  # 32-128-128-32
    mlp = eqx.tree_at(
        lambda m: [layer.weight for layer in m.layers],
        mlp,
        [NEURAL_ODE_WEIGHT_SCALE * layer.weight for layer in mlp.layers],
    )
    params, static = eqx.partition(mlp, eqx.is_array)

    def f(t, y, params):
        return jax.vmap(eqx.combine(params, static))(y)

    return Problem(
        name="neural_ode",
        description="MLP 32-128-128-32, softplus, batch 256 (vmap), weights x"
        f"{NEURAL_ODE_WEIGHT_SCALE:g}, t in [0, 1]",
        f=f,
        y0=jax.random.normal(key_y0, (256, 32), jnp.float32),
        args=params,
        t_span=(0.0, 1.0),
        rtol=1e-4,
        atol=1e-6,
    )


def linear(n: int = 1000) -> Problem:
    key_a, key_y0 = jax.random.split(jax.random.key(0))
    # Circular law: the eigenvalues of R / sqrt(n) fill the unit disc, so those of A lie in the
    # disc of radius 0.5 around -1.
    a = -jnp.eye(n) + 0.5 * jax.random.normal(key_a, (n, n)) / np.sqrt(n)

    def f(t, y, a):
        return a @ y

    return Problem(
        name="linear",
        description=f"dy/dt = A y, n={n}, A = -I + 0.5 R / sqrt(n), R standard normal, "
        "t in [0, 10]",
        f=f,
        y0=jax.random.normal(key_y0, (n,)),
        args=a,
        t_span=(0.0, 10.0),
        rtol=1e-6,
        atol=1e-8,
    )


PROBLEMS = {"lotka_volterra": lotka_volterra, "neural_ode": neural_ode, "linear": linear}


def _times(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    # Times in the state's dtype: a float64 t0 would make diffrax promote a float32 state.
    return tuple(np.asarray(t, problem.y0.dtype) for t in problem.t_span)


def odeckpt_solve(problem: Problem) -> Callable:
    def solve(y0, args):
        return odeckpt.solve(
            problem.f,
            y0,
            _times(problem),
            args,
            solver=odeckpt.Tsit5(),
            rtol=problem.rtol,
            atol=problem.atol,
            max_steps=problem.max_steps,
            throw=True,
        )

    return solve


def diffrax_solve(problem: Problem) -> Callable:
    def solve(y0, args):
        t0, t1 = _times(problem)
        return diffrax.diffeqsolve(
            diffrax.ODETerm(problem.f),
            diffrax.Tsit5(),
            t0,
            t1,
            None,
            y0,
            args,
            saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.PIDController(rtol=problem.rtol, atol=problem.atol),
            max_steps=problem.max_steps,
            throw=True,
        )

    return solve


def final_state(solve: Callable) -> Callable:
    """The timed function: `(y0, args) -> y(t1)`."""
    return lambda y0, args: solve(y0, args).ys[-1]


def odeckpt_stats(problem: Problem) -> dict[str, Any]:
    sol = jax.jit(odeckpt_solve(problem))(problem.y0, problem.args)
    return {
        "y1": sol.ys[-1],
        "accepted": int(sol.stats.num_accepted_steps),
        "rejected": int(sol.stats.num_rejected_steps),
    }


def diffrax_stats(problem: Problem) -> dict[str, Any]:
    sol = jax.jit(diffrax_solve(problem))(problem.y0, problem.args)
    return {
        "y1": sol.ys[-1],
        "accepted": int(sol.stats["num_accepted_steps"]),
        "rejected": int(sol.stats["num_rejected_steps"]),
    }


def reference(problem: Problem) -> np.ndarray:
    """y(t1) from diffrax Dopri8 in float64 at rtol = atol = 1e-12."""
    to64 = lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(problem.f),
        diffrax.Dopri8(),
        *problem.t_span,
        None,
        to64(problem.y0),
        jax.tree.map(to64, problem.args),
        saveat=diffrax.SaveAt(t1=True),
        stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
        max_steps=1_000_000,
    )
    return np.asarray(sol.ys[-1])


def relative_error(y, y_ref) -> float:
    """`max |y - y_ref| / max |y_ref|`: a norm-wise relative error, not fooled by components
    that pass near zero."""
    y, y_ref = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    return float(np.max(np.abs(y - y_ref)) / np.max(np.abs(y_ref)))


def run_problem(problem: Problem, *, target_s: float, compile_repeats: int) -> dict[str, Any]:
    print(f"\n== {problem.name}: {problem.description}")
    print(f"   Tsit5, rtol={problem.rtol:g}, atol={problem.atol:g}, {problem.dtype}")
    ours, peer = odeckpt_stats(problem), diffrax_stats(problem)
    for name, stats in (("odeckpt", ours), ("diffrax", peer)):
        assert stats["y1"].dtype == problem.y0.dtype, (name, stats["y1"].dtype)
    y_ref = reference(problem)
    record: dict[str, Any] = {
        "problem": problem.name,
        "description": problem.description,
        "dtype": problem.dtype,
        "rtol": problem.rtol,
        "atol": problem.atol,
        "max_steps": problem.max_steps,
    }
    for prefix, stats in (("odeckpt", ours), ("diffrax", peer)):
        record[f"{prefix}_accepted"] = stats["accepted"]
        record[f"{prefix}_rejected"] = stats["rejected"]
        record[f"{prefix}_steps"] = f"{stats['accepted']}+{stats['rejected']}"
        record[f"{prefix}_error"] = relative_error(stats["y1"], y_ref)
    record["relative_difference"] = relative_error(ours["y1"], peer["y1"])
    # The libraries agree if odeckpt is about as accurate as diffrax against a tight reference.
    record["agree"] = record["odeckpt_error"] <= max(2 * record["diffrax_error"], problem.rtol)
    print(
        f"   steps (accepted+rejected): odeckpt {record['odeckpt_steps']}, diffrax "
        f"{record['diffrax_steps']}"
    )
    print(
        f"   max |y_odeckpt - y_diffrax| / max |y_diffrax| = {record['relative_difference']:.2e}"
        f"; error vs reference: odeckpt {record['odeckpt_error']:.2e}, diffrax "
        f"{record['diffrax_error']:.2e}" + ("" if record["agree"] else "  ** DISAGREE **")
    )
    args = (problem.y0, problem.args)
    timings: dict[str, Timing] = compare(
        {
            "odeckpt": (final_state(odeckpt_solve(problem)), args),
            "diffrax": (final_state(diffrax_solve(problem)), args),
        },
        target_s=target_s,
        compile_repeats=compile_repeats,
    )
    for name, timing in timings.items():
        for field, value in dataclasses.asdict(timing).items():
            record[f"{name}_{field}"] = value
    for name in timings:
        record[f"{name}_run_ms"] = 1e3 * record[f"{name}_run_s"]
    record["run_ratio"] = record["odeckpt_run_s"] / record["diffrax_run_s"]
    record["compile_ratio"] = record["odeckpt_compile_s"] / record["diffrax_compile_s"]
    record["compile_cpu_ratio"] = record["odeckpt_compile_cpu_s"] / record["diffrax_compile_cpu_s"]
    steps = {name: record[f"{name}_accepted"] + record[f"{name}_rejected"] for name in timings}
    record["per_step_ratio"] = (record["odeckpt_run_s"] / steps["odeckpt"]) / (
        record["diffrax_run_s"] / steps["diffrax"]
    )
    print(
        f"   run: odeckpt {record['odeckpt_run_s'] * 1e3:.3f} ms, diffrax "
        f"{record['diffrax_run_s'] * 1e3:.3f} ms, ratio {record['run_ratio']:.2f} "
        f"(per step: {record['per_step_ratio']:.2f})"
    )
    print(
        f"   compile: odeckpt {record['odeckpt_compile_s']:.2f} s, diffrax "
        f"{record['diffrax_compile_s']:.2f} s, ratio {record['compile_ratio']:.2f} (lower "
        f"{record['odeckpt_lower_s']:.2f} vs {record['diffrax_lower_s']:.2f} s, XLA "
        f"{record['odeckpt_xla_compile_s']:.2f} vs {record['diffrax_xla_compile_s']:.2f} s; "
        f"CPU-time ratio {record['compile_cpu_ratio']:.2f})"
    )
    return record


COLUMNS = [
    Column("problem", "problem"),
    Column("dtype", "dtype"),
    Column("odeckpt_steps", "odeckpt steps (acc+rej)"),
    Column("diffrax_steps", "diffrax steps (acc+rej)"),
    Column("odeckpt_run_ms", "odeckpt run (ms)", ".3g"),
    Column("diffrax_run_ms", "diffrax run (ms)", ".3g"),
    Column("run_ratio", "run ratio", ".2f"),
    Column("per_step_ratio", "per-step ratio", ".2f"),
    Column("odeckpt_compile_s", "odeckpt compile (s)", ".2f"),
    Column("diffrax_compile_s", "diffrax compile (s)", ".2f"),
    Column("compile_ratio", "compile ratio", ".2f"),
    Column("odeckpt_lower_s", "odeckpt trace+lower (s)", ".2f"),
    Column("diffrax_lower_s", "diffrax trace+lower (s)", ".2f"),
    Column("relative_difference", "rel. diff", ".1e"),
    Column("odeckpt_error", "odeckpt err", ".1e"),
    Column("diffrax_error", "diffrax err", ".1e"),
]

NOTES = """\
Ratios are odeckpt / diffrax (below 1: odeckpt faster). Run time: median of repeated calls of
the jitted solve after warm-up. Compile time: `jax.jit(fn).lower(*args).compile()` from cleared
caches (trace + lower + XLA compile), median of repeats. "per-step ratio" divides each run time
by that library's steps (accepted + rejected). "trace+lower" is the Python-side part of the
compile time (the rest is XLA). "rel. diff" is
max |y_odeckpt - y_diffrax| / max |y_diffrax| at t1; "err" is the same against diffrax Dopri8 in
float64 at rtol = atol = 1e-12."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", choices=sorted(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--quick", action="store_true", help="short timings, one compile")
    parser.add_argument("--target-seconds", type=float, help="run-time budget per candidate")
    parser.add_argument("--compile-repeats", type=int, help="compiles timed per candidate")
    parser.add_argument("--name", help="results file stem (default forward / forward-quick)")
    options = parser.parse_args(argv)
    target_s = options.target_seconds or (0.3 if options.quick else 2.0)
    compile_repeats = options.compile_repeats or (1 if options.quick else 5)
    name = options.name or ("forward-quick" if options.quick else "forward")

    env = environment()
    print(f"device: {env['device']}\nversions: {env['versions']}\ngit: {env['git']}")
    records = [
        run_problem(PROBLEMS[p](), target_s=target_s, compile_repeats=compile_repeats)
        for p in options.problems
    ]
    command = "python benchmarks/bench_forward.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    json_path, md_path = write_results(
        name,
        records,
        COLUMNS,
        title="Forward solve: odeckpt vs diffrax (Tsit5)",
        command=command.strip(),
        env=env,
        notes=NOTES,
    )
    print(f"\nwrote {json_path} and {md_path}")
    if not all(record["agree"] for record in records):
        sys.exit("odeckpt and diffrax disagree on some problem (see above)")


if __name__ == "__main__":
    main()
