"""`python -m odeckpt demo`: one problem, its gradient by every adjoint, time and memory.

The problem is an ensemble of predator-prey (Lotka-Volterra) populations, one ODE whose state
holds every member, so that the state is large enough for memory to be about the state rather
than about bookkeeping. The loss is the mean square of the populations at a few save times; its
gradient with respect to the four rate constants is taken with each adjoint and compared with
`DirectAdjoint` (the exact derivative of the discrete solve).
"""

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tqdm.auto

from ._adjoints import (
    AbstractAdjoint,
    BacksolveAdjoint,
    DirectAdjoint,
    ForwardMode,
    RecursiveCheckpointAdjoint,
)
from ._memory import CompiledMemory, compiled_memory
from ._saveat import SaveAt
from ._solution import Solution
from ._solve import solve

RATES = (1.1, 0.4, 0.4, 0.1)


@dataclasses.dataclass(frozen=True)
class DemoSize:
    """How big the demo is: ensemble members, end time, save times, step limit and the
    checkpoint counts of the memory sweep."""

    members: int
    t1: float
    saves: int
    max_steps: int
    checkpoints: tuple[int, ...]


SIZES = {
    "full": DemoSize(members=512, t1=30.0, saves=30, max_steps=1024, checkpoints=(2, 4, 8, 16, 32)),
    "tiny": DemoSize(members=8, t1=5.0, saves=5, max_steps=256, checkpoints=(2, 4)),
}


def lotka_volterra(t, y, rates):
    a, b, c, d = rates[0], rates[1], rates[2], rates[3]
    prey, predator = y[0], y[1]
    return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])


def initial_populations(members: int) -> jax.Array:
    """Prey and predators (`[2, members]`) spread around the (10, 5) of the textbook example."""
    scale = jax.random.uniform(jax.random.key(0), (2, members), minval=0.5, maxval=1.5)
    return jnp.array([[10.0], [5.0]]) * scale


def make_loss(size: DemoSize, adjoint: AbstractAdjoint) -> Callable[[jax.Array], jax.Array]:
    y0 = initial_populations(size.members)
    ts = jnp.linspace(size.t1 / size.saves, size.t1, size.saves)

    def loss(rates):
        sol = solve(
            lotka_volterra,
            y0,
            (0.0, size.t1),
            rates,
            adjoint=adjoint,
            rtol=1e-8,
            atol=1e-8,
            saveat=ts,
            max_steps=size.max_steps,
        )
        assert sol.ys is not None  # saved at `ts`
        return jnp.mean(sol.ys**2)

    return loss


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the demo's table."""

    name: str
    derivative: str
    gradient: np.ndarray
    memory: CompiledMemory
    compile_s: float
    run_s: float


def measure(name: str, derivative: str, fn: Callable, rates: jax.Array) -> Row:
    """Compile `fn` (timed), run it 5 times (median) and read its compiled memory."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(rates).compile()
    compile_s = time.perf_counter() - start
    gradient = np.asarray(compiled(rates))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(compiled(rates))
        runs.append(time.perf_counter() - start)
    return Row(
        name, derivative, gradient, CompiledMemory.of(compiled), compile_s, statistics.median(runs)
    )


def adjoints(size: DemoSize) -> dict[str, tuple[AbstractAdjoint, str]]:
    """Each adjoint of the table with the derivative it is used with."""
    c = size.checkpoints[len(size.checkpoints) // 2]
    return {
        "direct": (DirectAdjoint(), "grad"),
        "recursive (default)": (RecursiveCheckpointAdjoint(), "grad"),
        f"recursive, checkpoints={c}": (RecursiveCheckpointAdjoint(checkpoints=c), "grad"),
        "backsolve": (BacksolveAdjoint(), "grad"),
        "forward": (ForwardMode(), "jacfwd"),
    }


def gradient_table(size: DemoSize, rates: jax.Array) -> list[Row]:
    rows = []
    candidates = adjoints(size)
    for name, (adjoint, derivative) in tqdm.auto.tqdm(candidates.items(), desc="adjoints"):
        transform = jax.jacfwd if derivative == "jacfwd" else jax.grad
        rows.append(measure(name, derivative, transform(make_loss(size, adjoint)), rates))
    return rows


def format_table(rows: list[Row]) -> str:
    reference = rows[0].gradient
    lines = [
        f"{'adjoint':<28} {'via':<7} {'rel. error vs direct':>20} {'temp memory':>12} "
        f"{'compile':>8} {'run':>10}"
    ]
    for row in rows:
        error = np.max(np.abs(row.gradient - reference)) / np.max(np.abs(reference))
        lines.append(
            f"{row.name:<28} {row.derivative:<7} {error:>20.1e} "
            f"{row.memory.temp / 2**20:>8.2f} MiB {row.compile_s:>6.2f} s "
            f"{1e3 * row.run_s:>7.2f} ms"
        )
    return "\n".join(lines)


def memory_sweep(size: DemoSize, rows: list[Row], rates: jax.Array) -> dict:
    """Compiled temp memory of the gradient against checkpoints, with the adjoints of the table
    whose memory does not depend on checkpoints as flat lines."""
    measured = {row.name: row.memory for row in rows}
    recursive = {}
    for c in tqdm.auto.tqdm(size.checkpoints, desc="memory vs checkpoints"):
        if f"recursive, checkpoints={c}" in measured:
            recursive[c] = measured[f"recursive, checkpoints={c}"]
        else:
            loss = make_loss(size, RecursiveCheckpointAdjoint(checkpoints=c))
            recursive[c] = compiled_memory(jax.grad(loss), rates)
    flat = {name: measured[name] for name in ("direct", "backsolve")}
    return {"recursive": recursive, **flat}


def trajectory(size: DemoSize, rates: jax.Array) -> Solution:
    """The first ensemble member alone, with dense output for the plot."""
    y0 = initial_populations(size.members)[:, 0]
    return solve(
        lotka_volterra,
        y0,
        (0.0, size.t1),
        rates,
        rtol=1e-8,
        atol=1e-8,
        saveat=SaveAt(dense=True),
        max_steps=size.max_steps,
    )


def save_figure(sol: Solution, sweep: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    from . import plot

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    plot.solution(sol, labels=["prey", "predators"], ax=left)
    left.set_title("Lotka-Volterra, first ensemble member (accepted Tsit5 steps marked)")
    plot.memory(sweep, log=True, ax=right)
    right.set_title("compiled temp memory of the gradient against checkpoints")
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(size_name: str = "full", output: Path = Path("odeckpt-demo.png")) -> None:
    """Run the demo: print the table and write the PNG to `output`."""
    jax.config.update("jax_enable_x64", True)
    size = SIZES[size_name]
    rates = jnp.array(RATES)
    print(
        f"odeckpt demo on {jax.devices()[0].device_kind}, jax {jax.__version__}: "
        f"{size.members} Lotka-Volterra populations (state {2 * size.members} float64), "
        f"t in [0, {size.t1:g}], Tsit5 rtol=atol=1e-8; loss = mean square at {size.saves} "
        f"save times; gradient w.r.t. the 4 rate constants."
    )
    rows = gradient_table(size, rates)
    sweep = memory_sweep(size, rows, rates)
    try:
        save_figure(trajectory(size, rates), sweep, output)
        written = f"plot written to {output}"
    except ImportError:
        written = 'no plot: matplotlib is missing (pip install "odeckpt[plot]")'
    print(format_table(rows))
    print(written)
