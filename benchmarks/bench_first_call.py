"""Time to the first gradient in a new process, with and without JAX's persistent compilation
cache, odeckpt beside diffrax; and the cost of a repeated plain call of a compiled solve.

    python benchmarks/bench_first_call.py                 # both problems, about 4 minutes
    python benchmarks/bench_first_call.py --repeats 3     # median of 3 fresh processes each

Each figure comes from a fresh Python process (the worker mode of this script), which imports
JAX and the library, builds the problem and times the first call of the compiled gradient of
`loss = sum(sol.ys)` (trace + compile or cache load + run, ended by `block_until_ready`):

- `odeckpt, jax.jit`: `jax.jit(jax.grad(loss))`, whose failure checks are host callbacks;
- `odeckpt, odeckpt.jit`: `odeckpt.jit(jax.grad(loss))`, which holds none;
- `diffrax, jax.jit`: the same gradient with diffrax's `diffeqsolve` (its defaults otherwise).

"cold" is the first process with an empty cache directory, "warm" a second process with the
same directory (`jax_compilation_cache_dir`, every program stored regardless of its compile
time). A program with a host callback is never stored, so its warm figure is a second cold one.

The worker also reports the run time of a plain call (outside `jit`) of the already compiled
forward solve, with new values of the Python-float parameters on each call, and diffrax's.

Problems: (a) Lotka-Volterra as in the README (y0 = (10, 5), args = (1.1, 0.4, 0.4, 0.1) as
Python floats, t in [0, 20], 101 save times, Tsit5 at the default tolerances 1e-6 / 1e-8); (b)
the neural ODE of `bench_forward.py` (MLP 32-128-128-32, batch 256, float32, rtol 1e-4).
Results go to `benchmarks/results/first-call.{json,md}`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_START = time.perf_counter()
CANDIDATES = ("odeckpt, jax.jit", "odeckpt, odeckpt.jit", "diffrax, jax.jit")
PROBLEMS = ("lotka_volterra", "neural_ode")


def _worker(problem: str, candidate: str, cache: str) -> dict:
    """Time the first gradient call in this fresh process (see the module docstring)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import diffrax
    import jax.numpy as jnp
    import numpy as np

    import odeckpt

    imported = time.perf_counter()
    f, y0, t1, args, saveat, tolerances = _problem(problem)
    library = candidate.split(",")[0]

    def solve(args, **values):
        if library == "odeckpt":
            return odeckpt.solve(f, y0, (0.0, t1), args, saveat=saveat, **tolerances, **values)
        ts = None if saveat is None else np.asarray(saveat)
        return diffrax.diffeqsolve(
            diffrax.ODETerm(f), diffrax.Tsit5(), jnp.asarray(0.0, y0.dtype),
            jnp.asarray(t1, y0.dtype), None, y0, args,
            saveat=diffrax.SaveAt(ts=ts) if ts is not None else diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.PIDController(**tolerances), max_steps=4096,
        )  # fmt: skip

    loss = lambda args: jnp.sum(solve(args).ys)
    jit = odeckpt.jit if candidate.endswith("odeckpt.jit") else jax.jit
    start = time.perf_counter()
    jax.block_until_ready(jit(jax.grad(loss))(args))
    first = time.perf_counter() - start
    record = {"import_s": imported - _START, "first_call_s": first}
    if problem == "lotka_volterra" and not candidate.endswith("odeckpt.jit"):
        record["plain_call_ms"] = _plain_call_ms(solve, vary=False)
        if library == "odeckpt":  # diffrax compiles again for each new Python float
            record["new_values_call_ms"] = _plain_call_ms(solve, vary=True)
    return record


def _plain_call_ms(solve, vary: bool) -> float:
    """Median run time of a plain call of the compiled solve (with a new value of a Python-float
    rate constant in each call if `vary`)."""
    import jax

    jax.block_until_ready(solve((1.1, 0.4, 0.4, 0.1)).ys)
    times = []
    for i in range(60):
        start = time.perf_counter()
        jax.block_until_ready(solve((1.1 + 1e-3 * i * vary, 0.4, 0.4, 0.1)).ys)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _problem(name: str):
    """`(f, y0, t1, args, saveat, tolerances)` of a problem."""
    import jax.numpy as jnp

    if name == "lotka_volterra":

        def f(t, y, args):
            a, b, c, d = args
            prey, predator = y
            return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])

        ts = jnp.linspace(0.0, 20.0, 101)
        tolerances = {"rtol": 1e-6, "atol": 1e-8}  # odeckpt's defaults, given to diffrax too
        return f, jnp.array([10.0, 5.0]), 20.0, (1.1, 0.4, 0.4, 0.1), ts, tolerances
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_forward import neural_ode

    p = neural_ode()
    tolerances = {"rtol": p.rtol, "atol": p.atol}
    return p.f, p.y0, p.t_span[1], p.args, None, tolerances


def _measure(problem: str, candidate: str, repeats: int) -> dict:
    """Cold and warm figures of one candidate, each the median over `repeats` cache dirs."""
    runs = {"cold": [], "warm": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            for state in ("cold", "warm"):
                command = [sys.executable, __file__, "--worker", problem, candidate, cache]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                runs[state].append(json.loads(out.stdout.strip().splitlines()[-1]))
    record = {"problem": problem, "candidate": candidate}
    for state, results in runs.items():
        for key in results[0]:
            record[f"{state}_{key}"] = statistics.median(r[key] for r in results)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS)
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--name", default="first-call")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        print(json.dumps(_worker(*options.worker)))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from _harness import Column, environment, write_results

    candidates = [c for c in CANDIDATES if c in options.candidates]
    records = [_measure(p, c, options.repeats) for p in options.problems for c in candidates]
    for record in records:
        peers = [r for r in records if r["problem"] == record["problem"]]
        diffrax = next((r for r in peers if r["candidate"] == CANDIDATES[2]), None)
        if diffrax is None:
            continue
        record["warm_vs_diffrax"] = record["warm_first_call_s"] / diffrax["warm_first_call_s"]
        if "warm_plain_call_ms" in record:
            record["plain_call_vs_diffrax"] = (
                record["warm_plain_call_ms"] / diffrax["warm_plain_call_ms"]
            )
        print(record, flush=True)
    columns = [
        Column("problem", "problem"),
        Column("candidate", "candidate"),
        Column("cold_first_call_s", "first call, cold (s)", ".2f"),
        Column("warm_first_call_s", "first call, warm cache (s)", ".2f"),
        Column("warm_vs_diffrax", "warm / diffrax", ".2f"),
        Column("warm_import_s", "import (s)", ".2f"),
        Column("warm_plain_call_ms", "plain call (ms)", ".2f"),
        Column("plain_call_vs_diffrax", "plain call / diffrax", ".1f"),
        Column("warm_new_values_call_ms", "plain call, new args (ms)", ".2f"),
    ]
    write_results(
        options.name,
        records,
        columns,
        title="First gradient in a new process, and a repeated plain call",
        command="python benchmarks/bench_first_call.py" + "".join(f" {a}" for a in argv or []),
        env=environment(),
        notes=(
            "First call: trace + compile (or load from the persistent cache) + run of the "
            "compiled gradient, in a fresh process; median of `--repeats` processes. Plain "
            "call: a call of the already compiled forward solve outside `jit`, with the same "
            "arguments, and (odeckpt) with a new value of a Python-float rate constant each "
            "call; diffrax compiles again for each new Python float (Lotka-Volterra only)."
        ),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
