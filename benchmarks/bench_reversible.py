"""Reversible gradients: `ReversibleAdjoint` against recursive checkpointing and diffrax.

    python benchmarks/bench_reversible.py            # default sizes, about 5 minutes on 2 CPU cores
    python benchmarks/bench_reversible.py --quick    # smoke run: tiny sizes, short timings
    python benchmarks/bench_reversible.py --lanes 4096 --memory-steps 80 320 1280  # larger

The timed function is `jax.grad(loss)` with respect to the parameters (`args`), `throw=True`,
float64. Candidates per problem, all in one process:

- `reversible`: `odeckpt.ReversibleAdjoint()` with `solver=odeckpt.Reversible(base, coupling=c)`.
- `recursive c=2`, `c=8`, `c=32`, `recursive default`: `odeckpt.RecursiveCheckpointAdjoint`
  with that many checkpoints (or none given) and the SAME reversible solver, so every
  gradient is of the same discrete solve.
- `recursive default, base`: the default recursive adjoint with the plain `base` stepper (what a
  user gets without `Reversible`).
- `diffrax recursive, base`: `diffrax.RecursiveCheckpointAdjoint()` with diffrax's `base`
  (diffrax has no reversible solver).

Figures per row: gradient run time (median after warm-up, candidates interleaved in rounds),
compile time (trace + lower + XLA compile from cleared caches, one compile per candidate: the
program compiled is the one timed), the compiled gradient's temporary memory
(`odeckpt.CompiledMemory.of(compiled).temp`, the figure `odeckpt.compiled_memory(jax.grad(loss),
params).temp` gives, read from the program that is run), steps (accepted+rejected) of the
forward solve, and the gradient's error, `max |g - g_ref| / max |g_ref|` over all leaves,
against two float64 references: "discrete", `DirectAdjoint` of the same reversible solve (the
exact derivative of the discrete solve; for the base-stepper rows, of the base solve) and
"continuous", the default recursive adjoint of a plain Tsit5 solve at rtol = atol = 1e-12
(1e-10 for Gray-Scott).

Problems (couplings chosen where the coupled scheme is stable AND its reconstruction stays
within `max_drift`; see docs/concepts.md, "Reversible steppers"):

1. `lotka_volterra`: y0 = (10, 5), params (1.1, 0.4, 0.4, 0.1), Tsit5 base, rtol = atol = 1e-8,
   loss sum(y(t1)**2). Span [0, 10] at c = 0.999 (the default coupling: 83 steps, c**-n = 1.09).
   Longer spans, reversible-adjoint rows only: [0, 20] at c = 0.99 (330 steps; 0.999 needs
   1226) and [0, 50] at c = 0.99 (1361 steps), whose reconstruction drifts: "refused: drift".
2. `neural_ode`: an MLP 2 -> 32 -> 2 with tanh, weights (W1, b1, W2, b2) as args (N(0, 1) x 2 /
   sqrt(fan-in)), a batch of 64 states, t in [0, 5], Tsit5 base, rtol = 1e-6, atol = 1e-8, loss
   sum(y(t1)**2), gradient with respect to all weights. c = 0.99: half the steps of 0.999
   (the parasitic mode needs h |lambda| < 1 - c) with c**-n about 4.
3. `gray_scott`: `du/dt = Du lap(u) - u v**2 + F (1 - u)`, `dv/dt = Dv lap(v) + u v**2 - (F + k)
   v`, F = 0.04, k = 0.06, Du = 2e-5, Dv = 1e-5, a periodic 128 x 256 grid of square cells of
   side 1/128 (2**15 points, [0, 1] x [0, 2]; 32 x 32 on [0, 1]**2 with `--quick`), a seeded
   square plus 1% noise, RK4 base with constant steps h = 0.025 over [0, 2] (80 steps), loss
   mean(v(t1)), gradient with respect to (F, k, Du, Dv). The fastest diffusion mode decays at
   lambda = 8 Du / dx**2 = 2.6: stability needs h lambda (0.066) < 1 - c, so c = 0.9, and the
   reconstruction, a backward integration, amplifies round-off by about exp(lambda T) (190)
   and by c**-n (0.9**-80 = 4.5e3). The row at [0, 4] (160 steps, 0.9**-160 = 2e7) is
   "refused: drift". Tried during development, not run here: c = 0.98 with h = 0.0075 (533
   steps, within the bound) undoes [0, 4] to 2e-12 of the discrete gradient; c = 0.999 at
   h = 0.025 (past the bound) undoes it too, but its forward solution departs from RK4's by
   9e-7 at t = 4 and 1e-4 at t = 6 (the parasitic mode), and drifts at t = 8.

Ratios (targets of the issue): reversible / recursive c=2 (target <= 0.2: at least 5x faster
at about equal memory), reversible / recursive default with the reversible solver and with the
base stepper (target <= 2); the compiled memory of `reversible`, `recursive default` and
`DirectAdjoint` of the Gray-Scott gradient at three spans (80, 160, 320 steps of h = 0.025;
compile only); and under `jax.vmap` over `--lanes` Lotka-Volterra lanes on [0, 10] (parameters
within +-10%, default 1000, 8 with `--quick`) the per-lane gradient time of reversible
(`max_steps` 4096 and 256) against recursive (target: no slower).

Results go to `benchmarks/results/reversible.{json,md}` (`reversible-quick.*` with `--quick`).
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, ClassVar

import jax

jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import RESULTS, Column, environment, markdown_table, write_results  # noqa: E402

import odeckpt  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Problems


@dataclasses.dataclass(frozen=True)
class Problem:
    """A gradient benchmark: `loss(args) = reduce(y(t1))` of `dy/dt = f(t, y, args)`."""

    name: str
    description: str
    f: Callable
    y0: Any
    args: Any
    t1: float
    base: tuple[odeckpt.AbstractStepper, diffrax.AbstractSolver]
    coupling: float
    why: str
    reduce: Callable
    rtol: float
    atol: float
    max_steps: int
    dt0: float | None = None
    """A constant step size (`ConstantStep`); `None`: adaptive."""
    candidates: tuple[str, ...] = ()
    """The candidates measured (names of `CANDIDATES`); empty: all of them."""
    reference_rtol: float = 1e-12


def lv_field(t, y, params):
    a, b, c, d = params
    prey, predator = y
    return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])


LV_Y0 = jnp.array([10.0, 5.0])
LV_PARAMS = jnp.array([1.1, 0.4, 0.4, 0.1])


def lotka_volterra(t1: float, coupling: float, why: str, candidates=(), suffix="") -> Problem:
    return Problem(
        name="lotka_volterra" + suffix,
        description=f"Lotka-Volterra, Tsit5, rtol=atol=1e-8, t in [0, {t1:g}]",
        f=lv_field,
        y0=LV_Y0,
        args=LV_PARAMS,
        t1=t1,
        base=(odeckpt.Tsit5(), diffrax.Tsit5()),
        coupling=coupling,
        why=why,
        reduce=lambda y: jnp.sum(y**2),
        rtol=1e-8,
        atol=1e-8,
        max_steps=4096,
        candidates=candidates,
    )


def mlp_field(t, y, w):
    return jnp.tanh(y @ w["W1"] + w["b1"]) @ w["W2"] + w["b2"]


def neural_ode(quick: bool) -> Problem:
    rng = np.random.default_rng(0)
    weights = {
        "W1": rng.normal(size=(2, 32)) * 2 / np.sqrt(2),
        "b1": rng.normal(size=32) * 0.1,
        "W2": rng.normal(size=(32, 2)) * 2 / np.sqrt(32),
        "b2": np.zeros(2),
    }
    t1 = 2.0 if quick else 5.0
    return Problem(
        name="neural_ode",
        description=f"MLP 2-32-2 tanh, batch 64, Tsit5, rtol=1e-6, atol=1e-8, t in [0, {t1:g}]",
        f=mlp_field,
        y0=jnp.asarray(rng.normal(size=(64, 2))),
        args={k: jnp.asarray(v) for k, v in weights.items()},
        t1=t1,
        base=(odeckpt.Tsit5(), diffrax.Tsit5()),
        coupling=0.99,
        why="0.99: half the steps of 0.999, c**-n about 4",
        reduce=lambda y: jnp.sum(y**2),
        rtol=1e-6,
        atol=1e-8,
        max_steps=4096,
    )


class DiffraxRK4(diffrax.AbstractERK):
    """The classical RK4 for diffrax (which has none), without an error estimate: for constant
    steps."""

    tableau: ClassVar[diffrax.ButcherTableau] = diffrax.ButcherTableau(
        c=np.array([0.5, 0.5, 1.0]),
        b_sol=np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6]),
        b_error=np.zeros(4),
        a_lower=(np.array([0.5]), np.array([0.0, 0.5]), np.array([0.0, 0.0, 1.0])),
    )
    interpolation_cls: ClassVar[Callable] = diffrax.ThirdOrderHermitePolynomialInterpolation.from_k

    def order(self, terms):
        del terms
        return 4


GS_PARAMS = jnp.array([0.04, 0.06, 2e-5, 1e-5])  # F, k, Du, Dv
GS_STEP = 0.025


def gray_scott_field(grid: tuple[int, int]) -> Callable:
    scale = grid[0] ** 2  # square cells of side 1 / grid[0]

    def laplacian(a):
        rolled = jnp.roll(a, 1, 0) + jnp.roll(a, -1, 0) + jnp.roll(a, 1, 1) + jnp.roll(a, -1, 1)
        return scale * (rolled - 4 * a)

    def f(t, y, params):
        feed, kill, du, dv = params[0], params[1], params[2], params[3]
        u, v = y[0], y[1]
        reaction = u * v**2
        return jnp.stack(
            [
                du * laplacian(u) - reaction + feed * (1 - u),
                dv * laplacian(v) + reaction - (feed + kill) * v,
            ]
        )

    return f


def gray_scott_y0(grid: tuple[int, int]) -> jax.Array:
    nx, ny = grid
    u, v = np.ones(grid), np.zeros(grid)
    seed = slice(nx // 2 - nx // 8, nx // 2 + nx // 8), slice(ny // 2 - ny // 8, ny // 2 + ny // 8)
    u[seed], v[seed] = 0.5, 0.25
    noise = 0.01 * np.random.default_rng(0).uniform(size=(2, *grid))
    return jnp.asarray(np.stack([u, v]) + noise)


def gray_scott(grid: tuple[int, int], steps: int, candidates=(), suffix="") -> Problem:
    lam = 8 * float(GS_PARAMS[2]) * grid[0] ** 2
    return Problem(
        name="gray_scott" + suffix,
        description=f"Gray-Scott {grid[0]}x{grid[1]} (2**{int(np.log2(np.prod(grid)))} points), "
        f"RK4, {steps} constant steps h={GS_STEP:g}, t in [0, {steps * GS_STEP:g}]",
        f=gray_scott_field(grid),
        y0=gray_scott_y0(grid),
        args=GS_PARAMS,
        t1=steps * GS_STEP,
        base=(odeckpt.RK4(), DiffraxRK4()),
        coupling=0.9,
        why=f"0.9: h lambda = {GS_STEP * lam:.2g} < 1 - c; 0.9**-{steps} = {0.9**-steps:.1g}",
        reduce=lambda y: jnp.mean(y[1]),
        rtol=1e-6,
        atol=1e-6,
        max_steps=steps + 1,  # one spare step, as bench_offload.py
        dt0=GS_STEP,
        candidates=candidates,
        reference_rtol=1e-10,
    )


T20_CANDIDATES = ("reversible", "recursive c=2", "recursive default", "recursive default, base")


def problems(options) -> list[Problem]:
    quick, grid = options.quick, tuple(options.grid)
    only_reversible = ("reversible",)
    lv_why = "0.999 (the default): stable; c**-n = 1.09 over the 83 steps of [0, 10]"
    every = [
        lotka_volterra(5.0 if quick else 10.0, 0.999, lv_why),
        lotka_volterra(20.0, 0.99, "0.99: 330 steps (0.999: 1226)", T20_CANDIDATES, "_t20"),
        lotka_volterra(
            50.0, 0.99, "0.99 (0.999: 11269 steps, drifts too)", only_reversible, "_t50"
        ),
        neural_ode(quick),
        gray_scott(grid, 40 if quick else 80),
        gray_scott(grid, 160, only_reversible, "_t4"),
    ]
    return [p for p in every if p.name.startswith(tuple(options.problems))]


# ---------------------------------------------------------------------------------------------
# Candidates


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A gradient to measure: the stepper (`"reversible"`, `"base"`) and the adjoint."""

    name: str
    solver: str
    adjoint: Any
    """An odeckpt adjoint, or `diffrax.RecursiveCheckpointAdjoint()` for the diffrax row."""
    max_steps: int | None = None
    """`None`: the problem's."""


RECURSIVE = odeckpt.RecursiveCheckpointAdjoint
CANDIDATES = [
    Candidate("reversible", "reversible", odeckpt.ReversibleAdjoint()),
    Candidate("recursive c=2", "reversible", RECURSIVE(checkpoints=2)),
    Candidate("recursive c=8", "reversible", RECURSIVE(checkpoints=8)),
    Candidate("recursive c=32", "reversible", RECURSIVE(checkpoints=32)),
    Candidate("recursive default", "reversible", RECURSIVE()),
    Candidate("recursive default, base", "base", RECURSIVE()),
    Candidate("diffrax recursive, base", "base", diffrax.RecursiveCheckpointAdjoint()),
]


def stepper(problem: Problem, solver: str) -> odeckpt.AbstractStepper:
    base = problem.base[0]
    return base if solver == "base" else odeckpt.Reversible(base, coupling=problem.coupling)


def odeckpt_solve(problem: Problem, solver, adjoint, **overrides) -> Callable:
    """`args -> Solution` of the problem with odeckpt."""
    settings = dict(rtol=problem.rtol, atol=problem.atol, max_steps=problem.max_steps)
    settings |= dict(dt0=problem.dt0, throw=True)
    if problem.dt0 is not None:
        settings["controller"] = odeckpt.ConstantStep()
    settings |= overrides

    def solve(args):
        return odeckpt.solve(
            problem.f, problem.y0, (0.0, problem.t1), args, solver=solver, adjoint=adjoint,
            **settings,
        )  # fmt: skip

    return solve


def diffrax_solve(problem: Problem, adjoint) -> Callable:
    constant = problem.dt0 is not None
    controller = (
        diffrax.ConstantStepSize()
        if constant
        else diffrax.PIDController(rtol=problem.rtol, atol=problem.atol)
    )

    def solve(args):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(problem.f), problem.base[1], 0.0, problem.t1, problem.dt0,
            problem.y0, args, saveat=diffrax.SaveAt(t1=True), stepsize_controller=controller,
            adjoint=adjoint, max_steps=problem.max_steps, throw=True,
        )  # fmt: skip

    return solve


def gradient(problem: Problem, candidate: Candidate) -> Callable:
    if candidate.name.startswith("diffrax"):
        solve = diffrax_solve(problem, candidate.adjoint)
    else:
        solver = stepper(problem, candidate.solver)
        overrides = {} if candidate.max_steps is None else {"max_steps": candidate.max_steps}
        solve = odeckpt_solve(problem, solver, candidate.adjoint, **overrides)
    return jax.grad(lambda args: problem.reduce(solve(args).ys[-1]))


def names(problem: Problem) -> list[str]:
    return list(problem.candidates) or [c.name for c in CANDIDATES]


# ---------------------------------------------------------------------------------------------
# Measuring


@dataclasses.dataclass
class Measured:
    """One candidate compiled once: its compile time, memory, gradient, and run times."""

    compile_s: float | None = None
    temp_bytes: int | None = None
    value: Any = None
    failed: str | None = None
    call: Callable | None = None
    samples: list[float] = dataclasses.field(default_factory=list)


def _reason(error: Exception) -> str:
    """A short reason for a failure: a drift refusal by name, else the first line of odeckpt's
    message (or of the exception)."""
    text = str(error)
    if "did not return to y0" in text:
        return "refused: drift"
    start = text.find("adjoint=")
    line = (text[start:] if start >= 0 else text).strip().splitlines()
    return f"{type(error).__name__}: {(line[0] if line else '')[:160]}"


def compile_and_check(fn: Callable, args) -> Measured:
    """Compile `jax.jit(fn)` once from cleared caches, read its memory, run it once."""
    measured = Measured()
    try:
        jax.clear_caches()
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(args).compile()
        measured.compile_s = time.perf_counter() - start
        measured.temp_bytes = odeckpt.CompiledMemory.of(compiled).temp
        measured.value = jax.block_until_ready(compiled(args))
    except Exception as error:  # a refusal, a crash: recorded, not fatal
        measured.failed = _reason(error)
        return measured
    if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(measured.value)):
        measured.failed = "non-finite gradient"
        return measured
    measured.call = compiled
    return measured


def time_runs(measured: dict[str, Measured], args, timing: dict) -> None:
    """Median run times of the compiled candidates, interleaved in `timing["rounds"]` rounds of
    about `target_s / rounds` seconds each (at least one call per round)."""
    ready = {name: m for name, m in measured.items() if m.call is not None}
    repeats = {}
    for name, m in ready.items():
        jax.block_until_ready(m.call(args))  # second warm-up call (the first gave the value)
        start = time.perf_counter()
        jax.block_until_ready(m.call(args))
        estimate = max(time.perf_counter() - start, 1e-7)
        repeats[name] = max(1, min(10_000, int(timing["target_s"] / timing["rounds"] / estimate)))
    for _ in range(timing["rounds"]):
        for name, m in ready.items():
            for _ in range(repeats[name]):
                start = time.perf_counter()
                jax.block_until_ready(m.call(args))
                m.samples.append(time.perf_counter() - start)


def relative_error(ours, reference) -> float:
    """`max |a - b| / max |b|` over all leaves."""
    a = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(ours)])
    b = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(reference)])
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def count(stats) -> str:
    """`accepted+rejected` of odeckpt's or diffrax's solve statistics."""
    get = stats.get if isinstance(stats, dict) else lambda key: getattr(stats, key)
    return f"{int(get('num_accepted_steps'))}+{int(get('num_rejected_steps'))}"


def references(problem: Problem, solvers: set[str], continuous: bool):
    """`(gradients, steps)`: for each of `solvers` (`"reversible"`, `"base"`) `DirectAdjoint`'s
    gradient of its solve (the discrete reference) and its steps; `"continuous"`: the default
    recursive adjoint of plain Tsit5 at `reference_rtol`; `"diffrax"`: diffrax's steps."""
    grads, steps = {}, {}
    for solver in ("reversible", "base"):
        if solver not in solvers:
            continue
        solve = odeckpt_solve(problem, stepper(problem, solver), odeckpt.DirectAdjoint())
        loss = lambda args, solve=solve: (lambda sol: (problem.reduce(sol.ys[-1]), sol.stats))(
            solve(args)
        )
        try:
            grads[solver], stats = jax.jit(jax.grad(loss, has_aux=True))(problem.args)
            steps[solver] = count(stats)
        except Exception as error:
            print(f"   discrete reference ({solver}) failed: {_reason(error)}")
    if "diffrax" in solvers:
        stats = jax.jit(diffrax_solve(problem, diffrax.RecursiveCheckpointAdjoint()))(problem.args)
        steps["diffrax"] = count(stats.stats)
    if continuous:
        tight = odeckpt_solve(
            problem, odeckpt.Tsit5(), RECURSIVE(), rtol=problem.reference_rtol,
            atol=problem.reference_rtol, controller=None, dt0=None, max_steps=100_000,
        )  # fmt: skip
        loss = lambda args: problem.reduce(tight(args).ys[-1])
        grads["continuous"] = jax.jit(jax.grad(loss))(problem.args)
    return grads, steps


# ---------------------------------------------------------------------------------------------
# One problem


def run_problem(problem: Problem, timing: dict) -> list[dict[str, Any]]:
    print(f"\n#### {problem.name}: {problem.description}, coupling {problem.coupling}", flush=True)
    chosen = [c for c in CANDIDATES if c.name in names(problem)]
    measured = {}
    for candidate in chosen:
        measured[candidate.name] = m = compile_and_check(gradient(problem, candidate), problem.args)
        print(
            f"   {candidate.name}: compile {m.compile_s or 0:.2f} s, {m.failed or 'ok'}", flush=True
        )
    solvers = {"diffrax" if "diffrax" in c.name else c.solver for c in chosen}
    refs, counts = references(problem, solvers, any(m.call for m in measured.values()))
    time_runs(measured, problem.args, timing)
    records = []
    for candidate in chosen:
        m = measured[candidate.name]
        base = problem.base[0].name
        reversible = candidate.solver == "reversible"
        record = {
            "problem": problem.name,
            "description": problem.description,
            "candidate": candidate.name,
            "solver": f"Reversible({base}, c={problem.coupling:g})" if reversible else base,
            "coupling": problem.coupling if reversible else None,
            "coupling_why": problem.why,
            "steps": counts.get("diffrax" if "diffrax" in candidate.name else candidate.solver),
            "compile_s": m.compile_s,
            "temp_bytes": m.temp_bytes,
            "temp_mib": None if m.temp_bytes is None else m.temp_bytes / 2**20,
            "status": m.failed or "ok",
        }
        if m.samples:
            record["run_ms"] = 1e3 * statistics.median(m.samples)
            record["run_min_ms"] = 1e3 * min(m.samples)
            record["repeats"] = len(m.samples)
        if m.failed is None:
            discrete = refs.get(candidate.solver)
            if discrete is not None:
                record["err_discrete"] = relative_error(m.value, discrete)
            record["err_continuous"] = relative_error(m.value, refs["continuous"])
            if "diffrax" in candidate.name:
                record["err_discrete"] = None  # diffrax's discrete solve is not odeckpt's
        records.append(record)
    first = records[0].get("run_ms")
    for record in records:
        if first and record.get("run_ms"):
            record["vs_reversible"] = record["run_ms"] / first
        print("   " + ", ".join(f"{k}={v}" for k, v in record.items() if k not in DROP))
    return records


DROP = ("description", "coupling_why", "temp_bytes", "problem")


def summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per problem: the ratios the issue sets targets for, and whether each is met."""
    out = []
    for problem in dict.fromkeys(r["problem"] for r in records):
        rows = {r["candidate"]: r for r in records if r["problem"] == problem}
        rev = rows.get("reversible", {}).get("run_ms")
        entry: dict[str, Any] = {"problem": problem}
        for key, other, target in (
            ("vs_c2", "recursive c=2", 0.2),
            ("vs_default", "recursive default", 2.0),
            ("vs_default_base", "recursive default, base", 2.0),
        ):
            theirs = rows.get(other, {}).get("run_ms")
            if rev and theirs:
                entry[key] = rev / theirs
                entry[key + "_met"] = "met" if rev / theirs <= target else "missed"
        rev_mem = rows.get("reversible", {}).get("temp_bytes")
        c2_mem = rows.get("recursive c=2", {}).get("temp_bytes")
        if rev_mem and c2_mem:
            entry["memory_vs_c2"] = rev_mem / c2_mem
        if len(entry) > 1:
            out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------
# Memory against the number of steps, and ensembles under vmap


def memory_sweep(grid: tuple[int, int], step_counts: list[int]) -> list[dict[str, Any]]:
    """Compiled temporary memory of the Gray-Scott gradient at several spans (compile only)."""
    adjoints = {
        "reversible": odeckpt.ReversibleAdjoint(),
        "recursive default": RECURSIVE(),
        "direct": odeckpt.DirectAdjoint(),
    }
    records = []
    for steps in step_counts:
        problem = gray_scott(grid, steps)
        record: dict[str, Any] = {"steps": steps, "state_mib": problem.y0.nbytes / 2**20}
        for name, adjoint in adjoints.items():
            solve = odeckpt_solve(problem, stepper(problem, "reversible"), adjoint)
            loss = lambda args, solve=solve, p=problem: p.reduce(solve(args).ys[-1])
            try:
                temp = odeckpt.compiled_memory(jax.grad(loss), problem.args).temp
                record[name] = temp / 2**20
            except Exception as error:
                record[name] = None
                print(f"   memory of {name} at {steps} steps failed: {_reason(error)}")
        print(f"   memory sweep: {record}", flush=True)
        records.append(record)
    return records


def vmap_lanes(lanes: int, t1: float, timing: dict) -> list[dict[str, Any]]:
    """Per-lane gradient time of Lotka-Volterra under `jax.vmap`, parameters within +-10%."""
    rng = np.random.default_rng(1)
    params = LV_PARAMS * (1 + 0.1 * jnp.asarray(rng.uniform(-1, 1, (lanes, 4))))
    problem = lotka_volterra(t1, 0.999, "")
    chosen = [c for c in CANDIDATES if c.name in VMAP_CANDIDATES]
    chosen.insert(1, Candidate("reversible, max_steps=256", "reversible", chosen[0].adjoint, 256))
    measured = {}
    for candidate in chosen:
        grad = gradient(problem, candidate)
        measured[candidate.name] = compile_and_check(jax.vmap(grad), params)
        print(f"   vmap compiled {candidate.name}: {measured[candidate.name].failed or 'ok'}")
    time_runs(measured, params, timing)
    records = []
    for candidate in chosen:
        m = measured[candidate.name]
        record: dict[str, Any] = {
            "lanes": lanes,
            "t1": t1,
            "candidate": candidate.name,
            "compile_s": m.compile_s,
            "temp_mib": None if m.temp_bytes is None else m.temp_bytes / 2**20,
            "status": m.failed or "ok",
        }
        if m.samples:
            record["run_ms"] = 1e3 * statistics.median(m.samples)
            record["per_lane_us"] = 1e6 * statistics.median(m.samples) / lanes
        records.append(record)
    recursive = next(r for r in records if r["candidate"] == "recursive default")
    for record in records:
        if recursive.get("per_lane_us") and record.get("per_lane_us"):
            record["vs_recursive"] = record["per_lane_us"] / recursive["per_lane_us"]
        print(f"   vmap: {record}", flush=True)
    return records


VMAP_CANDIDATES = ("reversible", "recursive c=2", "recursive default", "recursive default, base")


# ---------------------------------------------------------------------------------------------
# Tables


COLUMNS = [
    Column("problem", "problem"),
    Column("candidate", "candidate"),
    Column("solver", "solver"),
    Column("steps", "steps"),
    Column("run_ms", "run (ms)", ".4g"),
    Column("vs_reversible", "run / reversible", ".2f"),
    Column("compile_s", "compile (s)", ".2f"),
    Column("temp_mib", "temp (MiB)", ".4g"),
    Column("err_discrete", "err vs discrete", ".1e"),
    Column("err_continuous", "err vs continuous", ".1e"),
    Column("status", "status"),
]
COUPLING_COLUMNS = [
    Column("problem", "problem"),
    Column("description", "problem setting"),
    Column("coupling", "coupling c"),
    Column("coupling_why", "why"),
]
SUMMARY_COLUMNS = [
    Column("problem", "problem"),
    Column("vs_c2", "reversible / recursive c=2 (target <= 0.2)", ".3f"),
    Column("vs_c2_met", "met?"),
    Column("memory_vs_c2", "memory reversible / c=2", ".2f"),
    Column("vs_default", "reversible / recursive default (target <= 2)", ".2f"),
    Column("vs_default_met", "met?"),
    Column("vs_default_base", "reversible / recursive default, base (target <= 2)", ".2f"),
    Column("vs_default_base_met", "met?"),
]
MEMORY_COLUMNS = [
    Column("steps", "steps"),
    Column("state_mib", "one state (MiB)", ".3g"),
    Column("reversible", "reversible (MiB)", ".4g"),
    Column("recursive default", "recursive default (MiB)", ".4g"),
    Column("direct", "direct (MiB)", ".4g"),
]
VMAP_COLUMNS = [
    Column("lanes", "lanes"),
    Column("candidate", "candidate"),
    Column("run_ms", "run (ms)", ".4g"),
    Column("per_lane_us", "per lane (us)", ".4g"),
    Column("vs_recursive", "per lane / recursive default's (target for reversible: <= 1)", ".2f"),
    Column("compile_s", "compile (s)", ".2f"),
    Column("temp_mib", "temp (MiB)", ".4g"),
    Column("status", "status"),
]

NOTES = """\
Gradient of the loss with respect to the parameters, float64, `throw=True`. run: median of the
jitted gradient's calls after warm-up, candidates interleaved in rounds; "run / reversible":
this row's run time over the `reversible` row's. compile: one `jax.jit(grad).lower().compile()`
from cleared caches (trace + lower + XLA). temp: XLA's temporary memory of that compiled
gradient (`odeckpt.CompiledMemory.of(compiled).temp`). steps: accepted+rejected of the forward
solve of the row's solver. err vs discrete: `max |g - g_ref| / max |g_ref|` against
`DirectAdjoint` of the same solve (the exact derivative of the discrete solve); err vs
continuous: against a plain Tsit5 solve at rtol = atol = 1e-12 (Gray-Scott: 1e-10). A row whose
status is "refused: drift" is `ReversibleAdjoint`'s drift check raising (with `throw=True`):
undoing the steps did not return to y0 within `max_drift`."""


def notes(records, summary_records, memory_records, vmap_records, lanes) -> str:
    parts = [NOTES]
    couplings = {r["problem"]: r for r in records if r["coupling"] is not None}
    parts += ["## Couplings", markdown_table(list(couplings.values()), COUPLING_COLUMNS)]
    if summary_records:
        parts += ["## Targets", markdown_table(summary_records, SUMMARY_COLUMNS)]
    if memory_records:
        parts += [
            "## Memory against the number of steps (Gray-Scott, reversible solver, compile only)",
            markdown_table(memory_records, MEMORY_COLUMNS),
        ]
    if vmap_records:
        parts += [
            f"## Under `jax.vmap`: {lanes} Lotka-Volterra lanes, parameters within +-10%, "
            f"t in [0, {vmap_records[0]['t1']:g}], Reversible(Tsit5, c=0.999)",
            markdown_table(vmap_records, VMAP_COLUMNS),
        ]
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = ["lotka_volterra", "neural_ode", "gray_scott"]
    parser.add_argument("--problems", nargs="+", choices=choices, default=choices)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, short timings")
    parser.add_argument("--grid", nargs=2, type=int, help="Gray-Scott grid (default 128 256)")
    parser.add_argument("--lanes", type=int, help="vmap lanes (default 1000, 8 with --quick)")
    parser.add_argument("--memory-steps", nargs="+", type=int, help="spans of the memory sweep")
    parser.add_argument("--target-seconds", type=float, help="timed run time per candidate")
    parser.add_argument("--no-vmap", action="store_true", help="leave out the vmap part")
    parser.add_argument("--no-memory", action="store_true", help="leave out the memory sweep")
    parser.add_argument("--name", help="results stem (default reversible / reversible-quick)")
    options = parser.parse_args(argv)
    quick = options.quick
    options.grid = options.grid or ([32, 32] if quick else [128, 256])
    lanes = options.lanes or (8 if quick else 1000)
    memory_steps = options.memory_steps or ([20, 40] if quick else [80, 160, 320])
    timing = {"target_s": options.target_seconds or (0.2 if quick else 0.6), "rounds": 3}
    name = options.name or ("reversible-quick" if quick else "reversible")
    command = "python benchmarks/bench_reversible.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    env = environment()
    print(f"device: {env['device']}\nversions: {env['versions']}\ngit: {env['git']}")
    start = time.perf_counter()
    records, memory_records, vmap_records = [], [], []

    def write():
        table = summary(records)
        write_results(
            name, records, COLUMNS, title="Reversible gradients: ReversibleAdjoint vs recursive "
            "checkpointing and diffrax", command=command.strip(), env=env,
            notes=notes(records, table, memory_records, vmap_records, lanes),
        )  # fmt: skip
        extra = {"summary": table, "memory_sweep": memory_records, "vmap": vmap_records}
        path = RESULTS / f"{name}.json"
        payload = json.loads(path.read_text()) | extra
        path.write_text(json.dumps(payload, indent=2) + "\n")

    for problem in problems(options):
        records += run_problem(problem, timing)
        write()  # after every problem, so an interrupted run keeps what it measured
    if not options.no_memory and "gray_scott" in options.problems:
        print("\n#### memory against steps (Gray-Scott)", flush=True)
        memory_records += memory_sweep(tuple(options.grid), memory_steps)
        write()
    if not options.no_vmap:
        print(f"\n#### vmap over {lanes} lanes (Lotka-Volterra)", flush=True)
        vmap_records += vmap_lanes(lanes, 5.0 if quick else 10.0, timing)
        write()
    print(f"\nwrote {RESULTS / name}.{{json,md}} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
