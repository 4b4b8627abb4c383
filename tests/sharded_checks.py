"""Sharded solves on several CPU devices, against the same solves on one; run by
`test_sharding.py` as a script in a fresh process (the device count must be set before JAX
starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/sharded_checks.py \
        ensemble grid --solvers rk4 tsit5
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/sharded_checks.py \
        worker --process-id 0 --num-processes 2 --port 12345  # and process 1, at once

It prints one JSON object, `{check: figures}`, of the figures `test_sharding.py` asserts on:

- `ensemble`: 8 Lotka-Volterra lanes (per-lane y0 and parameters) sharded over a 1-D mesh
    `('lanes',)`, `jit(vmap(solve))` and `jit(vmap(grad))`: the largest relative differences
    from the unsharded run, whether step counts agree, whether outputs are sharded like the
    inputs, and the collectives in the compiled programs.
- `grid`: one 64x64 reaction-diffusion state sharded `P('x', None)` over 4 devices, solved with
    RK4 (constant steps) and Tsit5 (adaptive), and differentiated with
    `RecursiveCheckpointAdjoint(checkpoints=8)`: the same figures, plus the per-device shape of
    the snapshot buffer found in the compiled gradient.
- `grid_explicit`: the grid under `jax.set_mesh` over an `Explicit` axis `('x',)` (shardings in
    the types), with a field whose differences run along the unsharded axis only (`jnp.roll`
    along a sharded axis is not implemented for `Explicit` axes in JAX itself): solve and
    gradient with `checkpoints=8` and with the default adjoint, against one device, the specs
    in the types, and the collectives beside those of the same programs on an `Auto` axis.
- `grid_explicit_implicit`: a 16x16 grid of that field over the `Explicit` axis, with the
    implicit steppers (Radau5, Kvaerno5, BDF, Rodas5; their dense LU algebra replicated):
    solve and gradient (default adjoint) against one device, and the specs in the types.
- `worker`: one of several processes joined by `jax.distributed` (2 CPU devices each, gloo
    collectives): the ensemble on a global mesh, each process checking its own lanes against
    an unsharded solve of them, and the error of a failing lane (every process raises).
"""

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from problems import lotka_volterra

import odeckpt

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
LANES = 8
GRID = 64
CHECKPOINTS = 8


def collectives(compiled_text: str) -> dict[str, int]:
    """How many of each collective op the compiled (partitioned) program holds."""
    return {name: len(re.findall(rf" {name}(?:-start)?\(", compiled_text)) for name in COLLECTIVES}


def relative_difference(a, b) -> float:
    """`max |a - b| / max |b|` over all leaves."""
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b)])
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def sharded_as(x: jax.Array, mesh: Mesh, *spec) -> bool:
    """Whether `x` is laid out as `NamedSharding(mesh, PartitionSpec(*spec))`."""
    return x.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*spec)), x.ndim)


# ----------------------------------------------------------------------------- ensemble


def ensemble_inputs(lanes: int = LANES) -> tuple[np.ndarray, np.ndarray]:
    """Per-lane `y0` `[lanes, 2]` and parameters `[lanes, 4]`."""
    rng = np.random.default_rng(0)
    y0 = rng.uniform(1.0, 10.0, (lanes, 2))
    params = np.array([1.1, 0.4, 0.4, 0.1]) * rng.uniform(0.5, 2.0, (lanes, 4))
    return y0, params


def ensemble_solve(y0, params):
    ts = jnp.linspace(0.0, 10.0, 11)
    return odeckpt.solve(lotka_volterra, y0, (0.0, 10.0), params, saveat=ts, max_steps=1024)


def ensemble_loss(y0, params):
    return jnp.sum(ensemble_solve(y0, params).ys ** 2)


def check_ensemble() -> dict:
    mesh = Mesh(np.array(jax.devices()), ("lanes",))
    lanes = NamedSharding(mesh, PartitionSpec("lanes"))
    y0, params = (jnp.asarray(x) for x in ensemble_inputs())
    y0_s, params_s = jax.device_put(y0, lanes), jax.device_put(params, lanes)
    solve = jax.jit(jax.vmap(ensemble_solve))
    grad = jax.jit(jax.vmap(jax.grad(ensemble_loss, argnums=(0, 1))))
    sharded, plain = solve(y0_s, params_s), solve(y0, params)
    g_sharded, g_plain = grad(y0_s, params_s), grad(y0, params)
    return {
        "devices": jax.device_count(),
        "input_sharded": sharded_as(params_s, mesh, "lanes", None),
        "ys_rel_diff": relative_difference(sharded.ys, plain.ys),
        "steps_equal": bool(np.all(np.asarray(sharded.stats.num_steps == plain.stats.num_steps))),
        "steps": np.asarray(sharded.stats.num_steps).tolist(),
        "ys_sharded": sharded_as(sharded.ys, mesh, "lanes", None, None),
        "stats_sharded": sharded_as(sharded.stats.num_steps, mesh, "lanes"),
        "ys_spec": str(sharded.ys.sharding.spec),
        "grad_rel_diff": relative_difference(g_sharded, g_plain),
        "grad_sharded": [sharded_as(g, mesh, "lanes", None) for g in g_sharded],
        "grad_specs": [str(g.sharding.spec) for g in g_sharded],
        "solve_collectives": collectives(solve.lower(y0_s, params_s).compile().as_text()),
        "grad_collectives": collectives(grad.lower(y0_s, params_s).compile().as_text()),
    }


# ----------------------------------------------------------------------------- grid


def grid_initial_state(n: int = GRID) -> np.ndarray:
    x = np.linspace(0.0, 1.0, n, endpoint=False)
    bump = np.exp(-50 * ((x[:, None] - 0.5) ** 2 + (x[None, :] - 0.3) ** 2))
    return np.sin(2 * np.pi * x)[:, None] * np.cos(4 * np.pi * x)[None, :] + 0.5 * bump


def reaction_diffusion(t, u, args):
    """`du/dt = D * laplacian(u) - k * u**3` on a periodic grid (five-point `jnp.roll`
    Laplacian, spacing 1/n, D scaled by 1/100)."""
    diffusion, reaction = args
    n = u.shape[0]
    laplacian = (
        jnp.roll(u, 1, 0) + jnp.roll(u, -1, 0) + jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1) - 4 * u
    )
    return diffusion * (n * n / 100) * laplacian - reaction * u**3


GRID_SOLVERS = {
    "rk4": dict(solver="rk4", dt0=0.01),
    "tsit5": dict(solver="tsit5", rtol=1e-6, atol=1e-8),
}


def grid_solve(u0, args, solver: str):
    adjoint = odeckpt.RecursiveCheckpointAdjoint(checkpoints=CHECKPOINTS)
    kwargs = GRID_SOLVERS[solver]
    return odeckpt.solve(
        reaction_diffusion, u0, (0.0, 0.5), args, adjoint=adjoint, max_steps=256, **kwargs
    )


def snapshot_shapes(compiled_text: str, n: int) -> dict[str, bool]:
    """Whether the compiled gradient holds the `[checkpoints, rows, n]` snapshot buffer per
    device (`rows = n / devices`), and whether it holds any full `[checkpoints, n, n]` one."""
    rows = n // jax.device_count()
    return {
        "per_device_snapshots": f"f64[{CHECKPOINTS},{rows},{n}]" in compiled_text,
        "full_snapshots": f"f64[{CHECKPOINTS},{n},{n}]" in compiled_text,
    }


def check_grid(solvers: list[str]) -> dict:
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x", None))
    u0 = jnp.asarray(grid_initial_state())
    u0_s = jax.device_put(u0, rows)
    args = (jnp.asarray(0.1), jnp.asarray(1.0))
    results = {"devices": jax.device_count()}
    for name in solvers:
        solve = jax.jit(lambda u, a, name=name: grid_solve(u, a, name))
        loss = lambda u, a, name=name: jnp.sum(grid_solve(u, a, name).ys ** 2)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        sharded, plain = solve(u0_s, args), solve(u0, args)
        (g_u, g_args), g_plain = grad(u0_s, args), grad(u0, args)
        grad_text = grad.lower(u0_s, args).compile().as_text()
        results[name] = {
            "ys_rel_diff": relative_difference(sharded.ys, plain.ys),
            "steps": [int(sharded.stats.num_steps), int(plain.stats.num_steps)],
            "ys_sharded": sharded_as(sharded.ys, mesh, None, "x", None),
            "ys_spec": str(sharded.ys.sharding.spec),
            "grad_rel_diff": relative_difference((g_u, g_args), g_plain),
            "grad_sharded": sharded_as(g_u, mesh, "x", None),
            "grad_spec": str(g_u.sharding.spec),
            "solve_collectives": collectives(solve.lower(u0_s, args).compile().as_text()),
            "grad_collectives": collectives(grad_text),
            **snapshot_shapes(grad_text, GRID),
        }
    return results


def row_diffusion(t, u, args):
    """`du/dt = D * d2u/dx2 - k * u**3` along the rows of a periodic grid (differences along the
    second, unsharded axis only; spacing 1/n, D scaled by 1/100)."""
    diffusion, reaction = args
    n = u.shape[1]
    second = jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1) - 2 * u
    return diffusion * (n * n / 100) * second - reaction * u**3


def explicit_solve(u0, args, solver: str, adjoint: str):
    """The grid of `row_diffusion`, with `checkpoints=8` or the default adjoint."""
    chosen = dict(
        checkpoints=odeckpt.RecursiveCheckpointAdjoint(checkpoints=CHECKPOINTS),
        default=odeckpt.RecursiveCheckpointAdjoint(),
    )[adjoint]
    kwargs = GRID_SOLVERS[solver]
    return odeckpt.solve(
        row_diffusion, u0, (0.0, 0.5), args, adjoint=chosen, max_steps=256, **kwargs
    )


def state_stacks(compiled_text: str, n: int) -> dict[str, list[str]]:
    """The stacks of states (`[k, rows, n]`) in a compiled program: those a device holds a
    block of rows of (`rows = n / devices`), and whole ones (`rows = n`)."""
    rows = n // jax.device_count()
    found = lambda rows: sorted(set(re.findall(rf"f64\[\d+,{rows},{n}\]", compiled_text)))
    return {"per_device_stacks": found(rows), "full_stacks": found(n)}


def check_grid_explicit(solvers: list[str]) -> dict:
    devices = jax.device_count()
    explicit = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Explicit,))
    auto = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,))
    u0 = jnp.asarray(grid_initial_state())
    args = (jnp.asarray(0.1), jnp.asarray(1.0))
    results = {"devices": devices}
    for name in solvers:
        for adjoint in ("checkpoints", "default"):
            solve = jax.jit(lambda u, a, s=name, j=adjoint: explicit_solve(u, a, s, j))
            loss = lambda u, a, s=name, j=adjoint: jnp.sum(explicit_solve(u, a, s, j).ys ** 2)
            grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
            figures, grad_text = explicit_figures(solve, grad, u0, args, explicit)
            u0_auto = jax.device_put(u0, NamedSharding(auto, PartitionSpec("x", None)))
            auto_text = grad.lower(u0_auto, args).compile().as_text()
            results[f"{name}_{adjoint}"] = {
                **figures,
                "auto_grad_collectives": collectives(auto_text),
                **state_stacks(grad_text, GRID),
                **snapshot_shapes(grad_text, GRID),
            }
    return results


def explicit_figures(solve, grad, u0, args, mesh) -> tuple[dict, str]:
    """`solve` and `grad` of `u0` on one device and sharded `P('x', None)` over the `Explicit`
    `mesh`: their differences, steps, specs and collectives, and the compiled gradient."""
    plain, g_plain = solve(u0, args), grad(u0, args)
    with jax.set_mesh(mesh):
        u0_s = jax.device_put(u0, PartitionSpec("x", None))
        sharded, (g_u, g_args) = solve(u0_s, args), grad(u0_s, args)
        solve_text = solve.lower(u0_s, args).compile().as_text()
        grad_text = grad.lower(u0_s, args).compile().as_text()
    figures = {
        "ys_rel_diff": relative_difference(sharded.ys, plain.ys),
        "steps": [int(sharded.stats.num_steps), int(plain.stats.num_steps)],
        "ys_type_spec": str(jax.typeof(sharded.ys).sharding.spec),
        "ys_sharded": sharded_as(sharded.ys, mesh, None, "x", None),
        "grad_rel_diff": relative_difference((g_u, g_args), g_plain),
        "grad_type_spec": str(jax.typeof(g_u).sharding.spec),
        "grad_sharded": sharded_as(g_u, mesh, "x", None),
        "solve_collectives": collectives(solve_text),
        "grad_collectives": collectives(grad_text),
    }
    return figures, grad_text


IMPLICIT_GRID = 16
IMPLICIT_SOLVERS = ("radau", "kvaerno5", "bdf", "rodas5")


def implicit_solve(u0, args, solver: str):
    """The grid of `row_diffusion` (mildly stiff: `D n^2 / 100` with `D = 1`) with an implicit
    stepper and the default adjoint."""
    return odeckpt.solve(
        row_diffusion, u0, (0.0, 0.5), args, solver=solver, rtol=1e-8, atol=1e-8, max_steps=512
    )


def check_grid_explicit_implicit(solvers: list[str]) -> dict:
    """The implicit steppers on a 16x16 state sharded `P('x', None)` over an `Explicit` axis:
    solve and gradient (default adjoint) against one device, and the specs in the types."""
    devices = jax.device_count()
    explicit = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Explicit,))
    u0 = jnp.asarray(grid_initial_state(IMPLICIT_GRID))
    args = (jnp.asarray(1.0), jnp.asarray(1.0))
    results = {"devices": devices}
    for name in solvers:
        solve = jax.jit(lambda u, a, s=name: implicit_solve(u, a, s))
        loss = lambda u, a, s=name: jnp.sum(implicit_solve(u, a, s).ys ** 2)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        results[name] = explicit_figures(solve, grad, u0, args, explicit)[0]
    return results


# ----------------------------------------------------------------------------- processes


def check_worker(process_id: int, num_processes: int, port: int) -> dict:
    """One process of a `jax.distributed` job: the ensemble on the global mesh."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=num_processes,
        process_id=process_id,
    )
    # Auto axes (Mesh's default) let XLA propagate the lane sharding through the solve.
    mesh = Mesh(np.array(jax.devices()), ("lanes",))
    lanes = NamedSharding(mesh, PartitionSpec("lanes"))
    y0, params = ensemble_inputs()
    per_process = LANES // num_processes
    mine = slice(process_id * per_process, (process_id + 1) * per_process)
    global_array = lambda x: jax.make_array_from_process_local_data(lanes, x[mine], x.shape)
    y0_g, params_g = global_array(y0), global_array(params)
    solve = jax.jit(jax.vmap(lambda y, p: ensemble_solve(y, p).ys))
    grad = jax.jit(jax.vmap(jax.grad(ensemble_loss, argnums=(0, 1))))
    ys, (g_y0, g_params) = solve(y0_g, params_g), grad(y0_g, params_g)

    def local(x: jax.Array) -> np.ndarray:
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start)
        return np.concatenate([np.asarray(s.data) for s in shards])

    # The reference: this process's lanes solved on its first device alone.
    device = jax.local_devices()[0]
    y0_l, params_l = (jax.device_put(jnp.asarray(x[mine]), device) for x in (y0, params))
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "ys_sharded": sharded_as(ys, mesh, "lanes", None, None),
        "grad_sharded": [sharded_as(g, mesh, "lanes", None) for g in (g_y0, g_params)],
        "ys_rel_diff": relative_difference(local(ys), solve(y0_l, params_l)),
        "grad_rel_diff": relative_difference([local(g_y0), local(g_params)], grad(y0_l, params_l)),
        "failing_lane": failing_lane(solve, y0_g, global_array(params)),
    }
    jax.distributed.shutdown()
    return result


def failing_lane(solve, y0: jax.Array, params: jax.Array) -> str:
    """The error of `solve` (`throw=True`) with lane 5's parameters NaN: the line of it that
    names the lane, or `""` if it raised none."""
    try:
        jax.block_until_ready(solve(y0, params.at[5, 0].set(jnp.nan)))
    except Exception as error:
        return next((line for line in str(error).splitlines() if "Lane" in line), str(error))
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "checks",
        nargs="+",
        choices=["ensemble", "grid", "grid_explicit", "grid_explicit_implicit", "worker"],
    )
    parser.add_argument("--solvers", nargs="+", choices=list(GRID_SOLVERS), default=["rk4"])
    parser.add_argument(
        "--implicit", nargs="+", choices=IMPLICIT_SOLVERS, default=list(IMPLICIT_SOLVERS)
    )
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--port", type=int, default=0)
    options = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    checks = {
        "ensemble": check_ensemble,
        "grid": lambda: check_grid(options.solvers),
        "grid_explicit": lambda: check_grid_explicit(options.solvers),
        "grid_explicit_implicit": lambda: check_grid_explicit_implicit(options.implicit),
        "worker": lambda: check_worker(options.process_id, options.num_processes, options.port),
    }
    print(json.dumps({name: checks[name]() for name in options.checks}))


if __name__ == "__main__":
    main()
