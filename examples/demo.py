"""odeckpt demo: solve a few problems and report steps, accuracy, time and compiled memory.

Run with `python examples/demo.py` (add `--quick` for a smaller run).
"""

import argparse
import time

import jax
import jax.numpy as jnp

import odeckpt

jax.config.update("jax_enable_x64", True)


def lotka_volterra(t, y, args):
    a, b, c, d = args
    prey, predator = y[0], y[1]
    return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])


def timed(fn, *args) -> tuple[object, float, float, int]:
    """Result, compile seconds, run seconds (best of 5) and compiled temporary bytes."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    result = jax.block_until_ready(compiled(*args))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        runs.append(time.perf_counter() - start)
    memory = compiled.memory_analysis()
    return result, compile_s, min(runs), getattr(memory, "temp_size_in_bytes", -1)


def report(name: str, sol: odeckpt.Solution, compile_s: float, run_s: float, temp: int) -> None:
    stats = sol.stats
    print(
        f"{name:<38} steps {int(stats.num_accepted_steps):>5} accepted "
        f"{int(stats.num_rejected_steps):>4} rejected {int(stats.num_fn_evals):>6} f-evals | "
        f"compile {compile_s:6.2f} s  run {1e3 * run_s:8.3f} ms  temp {temp / 2**10:8.1f} KiB"
    )


def main(quick: bool) -> None:
    print(f"odeckpt {odeckpt.__version__} on {jax.devices()[0].device_kind}, jax {jax.__version__}")
    y0 = jnp.array([10.0, 5.0])
    args = jnp.array([1.1, 0.4, 0.4, 0.1])
    t1 = 20.0 if quick else 100.0
    for solver in ("tsit5", "dopri5", "dopri8"):
        solve = lambda y0, args, s=solver: odeckpt.solve(
            lotka_volterra, y0, (0.0, t1), tuple(args), solver=s, rtol=1e-8, atol=1e-8
        )
        report(f"Lotka-Volterra, {solver}, rtol=1e-8", *timed(solve, y0, args))

    backwards = lambda y: odeckpt.solve(
        lotka_volterra, y, (t1, 0.0), tuple(args), rtol=1e-10, atol=1e-10
    )
    forward = odeckpt.solve(lotka_volterra, y0, (0.0, t1), tuple(args), rtol=1e-10, atol=1e-10)
    sol, *timing = timed(backwards, forward.ys[-1])
    report("the same, backwards to t0", sol, *timing)
    print(f"{'':<38} recovered y0 = {sol.ys[-1]} (started from {y0})")

    rk4 = lambda y0: odeckpt.solve(
        lotka_volterra,
        y0,
        (0.0, t1),
        tuple(args),
        solver="rk4",
        controller=odeckpt.ConstantStep(),
        dt0=0.01,
        max_steps=int(t1 / 0.01) + 1,
    )
    report("RK4, constant dt0=0.01", *timed(rk4, y0))

    batch = 64 if quick else 1024
    keys = jax.random.split(jax.random.key(0), batch)
    batch_y0 = y0 * jax.vmap(lambda k: jax.random.uniform(k, (2,), minval=0.5, maxval=1.5))(keys)
    ensemble = jax.vmap(
        lambda y: odeckpt.solve(lotka_volterra, y, (0.0, t1), tuple(args), rtol=1e-6, atol=1e-8)
    )
    sols, compile_s, run_s, temp = timed(ensemble, batch_y0)
    print(
        f"{'ensemble of ' + str(batch) + ' (vmap), tsit5':<38} steps "
        f"{int(sols.stats.num_accepted_steps.max()):>5} max per lane | compile {compile_s:6.2f} s  "
        f"run {1e3 * run_s:8.3f} ms  temp {temp / 2**10:8.1f} KiB"
    )

    print("\ngradient of sum(y(ts)**2) w.r.t. the 4 parameters, tsit5, 200 save times:")
    ts = jnp.linspace(0.0, t1, 200)

    def loss(args, adjoint):
        sol = odeckpt.solve(
            lotka_volterra,
            y0,
            (0.0, t1),
            tuple(args),
            adjoint=adjoint,
            rtol=1e-8,
            atol=1e-8,
            saveat=ts,
        )
        return jnp.sum(sol.ys**2)

    reference = None
    for adjoint in (
        "direct",
        "recursive",
        odeckpt.RecursiveCheckpointAdjoint(checkpoints=8),
        "backsolve",
        "forward",
    ):
        name = adjoint if isinstance(adjoint, str) else "recursive, checkpoints=8"
        derivative = jax.jacfwd if adjoint == "forward" else jax.grad
        grad, compile_s, run_s, temp = timed(derivative(lambda a, adj=adjoint: loss(a, adj)), args)
        reference = grad if reference is None else reference
        error = float(jnp.max(jnp.abs(grad - reference) / jnp.abs(reference)))
        print(
            f"  {name:<30} {'(jacfwd)' if adjoint == 'forward' else '(grad)  '} "
            f"rel. diff to direct {error:8.1e} | compile {compile_s:6.2f} s  "
            f"run {1e3 * run_s:8.3f} ms  temp {temp / 2**10:8.1f} KiB"
        )

    dense = odeckpt.solve(
        lotka_volterra, y0, (0.0, t1), tuple(args), saveat=odeckpt.SaveAt(dense=True)
    )
    print(f"dense output: y({t1 / 3:.2f}) = {dense.evaluate(t1 / 3)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller problems")
    main(parser.parse_args().quick)
