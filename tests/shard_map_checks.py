"""Solves, gradients and the checkpointing engine inside `jax.shard_map` (with JAX's default
type checks) and under `jax.jit` over a mesh with `Explicit` axes, against the same on one
device; run by `test_shard_map.py` as a script in a fresh process with 4 CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/shard_map_checks.py \
        adjoints engine explicit

It prints one JSON object, `{check: figures}`:

- `adjoints`: 8 Lotka-Volterra lanes split over 4 devices by `shard_map`, `vmap` of the gradient
    (or of `jacfwd` for `ForwardMode`) of each adjoint with one stepper each (explicit,
    implicit, reversible), a terminal event and a DAE: the largest relative difference from
    `vmap` on one device, per case; and (`<case>/psum`, reverse mode) the gradient of the loss
    summed over all lanes with `lax.psum`, as data-parallel training takes it.
- `engine`: `checkpointed_scan` and `bounded_while_loop` differentiated inside `shard_map`.
- `explicit`: the lanes sharded over a mesh whose axis is `Explicit` (`jax.jit` propagates the
    sharding through the types), solve and gradient, under `jax.set_mesh` and without it, and
    the checkpointing engine's gradients.
- `explicit_cases`: every case of `adjoints` over `Explicit` axes (`--cases` picks them).
- `explicit_programs`: `odeckpt.ensemble`, `odeckpt.jit` and a failing lane over `Explicit`
    axes.
- `throw`: a failing lane with `throw=True`, inside `shard_map` (solve and gradient) and in a
    batch sharded by `jax.jit`, under `jax.jit` and `odeckpt.jit`: the error and its message.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from problems import lotka_volterra

import odeckpt

LANES = 8


def relative_difference(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(
        float(
            np.max(np.abs(np.asarray(x) - np.asarray(y))) / (np.max(np.abs(np.asarray(y))) + 1e-300)
        )
        for x, y in pairs
    )


def inputs() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    y0 = rng.uniform(1.0, 10.0, (LANES, 2))
    params = np.array([1.1, 0.4, 0.4, 0.1]) * rng.uniform(0.5, 2.0, (LANES, 4))
    return jnp.asarray(y0), jnp.asarray(params)


def dae(t, y, k):
    return jnp.stack([-k[0] * y[0], y[1] - y[0] ** 2])


CASES = {
    "recursive-tsit5": dict(adjoint="recursive", solver="tsit5"),
    "direct-tsit5": dict(adjoint="direct", solver="tsit5"),
    "forward-tsit5": dict(adjoint="forward", solver="tsit5"),
    "backsolve-tsit5": dict(adjoint="backsolve", solver="tsit5"),
    "interpolating-dopri5": dict(adjoint="interpolating", solver="dopri5"),
    "forward_sensitivity-kvaerno5": dict(adjoint=odeckpt.ForwardSensitivity(), solver="kvaerno5"),
    "recursive-radau5": dict(adjoint="recursive", solver="radau"),
    "reversible": dict(adjoint="reversible", solver=odeckpt.Reversible(odeckpt.Tsit5())),
    "recursive-event": dict(
        adjoint="recursive", solver="tsit5", event=odeckpt.Event(lambda t, y, p: y[0] - 2.0)
    ),  # fmt: skip
    "recursive-dae": dict(adjoint="recursive", solver="rodas5", mass_matrix=np.diag([1.0, 0.0])),
}


def loss_of(case: dict):
    options = dict(case)
    f = dae if "mass_matrix" in options else lotka_volterra

    def loss(y0, params):
        sol = odeckpt.solve(f, y0, (0.0, 5.0), params, rtol=1e-8, atol=1e-8, max_steps=2048,
                            throw=False, **options)  # fmt: skip
        return jnp.sum(sol.ys[-1] ** 2) + jnp.sum(sol.ts)

    return loss


def check_adjoints(cases: list[str]) -> dict:
    mesh = jax.make_mesh((4,), ("lanes",))
    lanes = NamedSharding(mesh, P("lanes"))
    y0, params = inputs()
    y0_s, params_s = jax.device_put(y0, lanes), jax.device_put(params, lanes)
    result = {}
    for name in cases:
        case = CASES[name]
        derivative = jax.jacfwd if case["adjoint"] == "forward" else jax.grad
        lane = jax.vmap(derivative(loss_of(case), argnums=(0, 1)))
        inside = jax.jit(
            jax.shard_map(
                lane, mesh=mesh, in_specs=(P("lanes"), P("lanes")), out_specs=P("lanes")
            )  # fmt: skip
        )
        result[name] = relative_difference(inside(y0_s, params_s), jax.jit(lane)(y0, params))
        if derivative is jax.jacfwd:
            continue  # (forward mode inside `shard_map` perturbs every device's input at once)
        # Data-parallel: the gradient of the loss summed over every device's lanes.
        batch_loss = lambda y0, p, case=case: jnp.sum(jax.vmap(loss_of(case))(y0, p))
        summed = lambda y0, p, batch_loss=batch_loss: jax.lax.psum(batch_loss(y0, p), "lanes")
        specs = dict(in_specs=(P("lanes"), P("lanes")), out_specs=P("lanes"))
        inside = jax.jit(jax.shard_map(jax.grad(summed, argnums=(0, 1)), mesh=mesh, **specs))
        reference = jax.jit(jax.grad(batch_loss, argnums=(0, 1)))(y0, params)
        result[f"{name}/psum"] = relative_difference(inside(y0_s, params_s), reference)
    solve = lambda y0, p: odeckpt.solve(lotka_volterra, y0, (0.0, 5.0), p, throw=False).ys
    forward = jax.shard_map(jax.vmap(solve), mesh=mesh, in_specs=(P("lanes"), P("lanes")),
                            out_specs=P("lanes"))  # fmt: skip
    result["solve"] = relative_difference(jax.jit(forward)(y0_s, params_s),
                                          jax.vmap(solve)(y0, params))  # fmt: skip
    return result


def scan_loss(x):
    step = lambda c, _: (jnp.sin(c) * x + c, None)
    final, _ = odeckpt.checkpointing.checkpointed_scan(step, x, None, length=50, checkpoints=4)
    return final


def while_loss(x):
    body = lambda c: (c[0] + 1, c[1] * (1 + x) + 0.1)
    _, y = odeckpt.checkpointing.bounded_while_loop(
        lambda c: c[1] < 100.0, body, (jnp.zeros((), jnp.int32), x), max_steps=64,
        checkpoints=4,
    )  # fmt: skip
    return y


ENGINE = {"checkpointed_scan": scan_loss, "bounded_while_loop": while_loss}


def check_engine() -> dict:
    mesh = jax.make_mesh((4,), ("lanes",))
    plain = jnp.linspace(0.1, 0.8, LANES)
    xs = jax.device_put(plain, NamedSharding(mesh, P("lanes")))
    result = {}
    for name, loss in ENGINE.items():
        lane = jax.vmap(jax.grad(loss))
        inside = jax.jit(jax.shard_map(lane, mesh=mesh, in_specs=P("lanes"), out_specs=P("lanes")))
        result[name] = relative_difference(inside(xs), lane(plain))
    return result


def check_explicit() -> dict:
    mesh = jax.make_mesh((4,), ("lanes",), axis_types=(AxisType.Explicit,))
    y0, params = inputs()
    case = CASES["recursive-tsit5"]
    lane_grad = jax.vmap(jax.grad(loss_of(case), argnums=(0, 1)))
    solve = jax.vmap(lambda y0, p: odeckpt.solve(lotka_volterra, y0, (0.0, 5.0), p).ys)
    plain = (jax.jit(solve)(y0, params), jax.jit(lane_grad)(y0, params))
    with jax.set_mesh(mesh):
        y0_s = jax.device_put(y0, P("lanes"))
        params_s = jax.device_put(params, P("lanes"))
        ys = jax.jit(solve)(y0_s, params_s)
        grads = jax.jit(lane_grad)(y0_s, params_s)
    # The same arrays without `jax.set_mesh`: the mesh comes with their types alone.
    loose = (jax.jit(solve)(y0_s, params_s), jax.jit(lane_grad)(y0_s, params_s))
    xs = jnp.linspace(0.1, 0.8, LANES)
    engine = [jax.jit(jax.vmap(jax.grad(loss))) for loss in ENGINE.values()]
    xs_s = jax.device_put(xs, NamedSharding(mesh, P("lanes")))
    return {
        "solve": relative_difference(ys, plain[0]),
        "grad": relative_difference(grads, plain[1]),
        "ys_spec": str(jax.typeof(ys).sharding.spec),
        "without_set_mesh": relative_difference(loose, plain),
        "engine": relative_difference([g(xs_s) for g in engine], [g(xs) for g in engine]),
    }


def check_explicit_cases(cases: list[str]) -> dict:
    """Every case of `CASES` over a mesh whose axis is `Explicit`: the gradient (`jacfwd` for
    `ForwardMode`) of each lane, the largest relative difference from one device, and
    whether the gradient kept the lanes' sharding."""
    mesh = jax.make_mesh((4,), ("lanes",), axis_types=(AxisType.Explicit,))
    y0, params = inputs()
    result = {}
    for name in cases:
        case = CASES[name]
        derivative = jax.jacfwd if case["adjoint"] == "forward" else jax.grad
        lane = jax.jit(jax.vmap(derivative(loss_of(case), argnums=(0, 1))))
        plain = lane(y0, params)
        with jax.set_mesh(mesh):
            sharded = lane(jax.device_put(y0, P("lanes")), jax.device_put(params, P("lanes")))
        specs = {str(jax.typeof(g).sharding.spec[0]) for g in jax.tree.leaves(sharded)}
        result[name] = {"grad": relative_difference(sharded, plain), "lanes": specs == {"lanes"}}
    return result


def check_explicit_programs() -> dict:
    """`odeckpt.ensemble` and `odeckpt.jit` over a mesh whose axis is `Explicit`: the largest
    relative difference from one device and the result's sharding; and a failing lane (5 of
    8) with `throw=True` under `jax.jit` and `odeckpt.jit`: the kind of error and its
    message."""
    mesh = jax.make_mesh((4,), ("lanes",), axis_types=(AxisType.Explicit,))
    y0, params = inputs()
    solve = jax.vmap(lambda y0, p: odeckpt.solve(lotka_volterra, y0, (0.0, 5.0), p).ys)
    ensemble = lambda y0, p: odeckpt.ensemble(lotka_volterra, y0, (0.0, 5.0), p).ys
    programs = {"ensemble": jax.jit(ensemble), "odeckpt.jit": odeckpt.jit(solve)}
    plain = {name: program(y0, params) for name, program in programs.items()}
    result = {}
    with jax.set_mesh(mesh):
        lanes = lambda x: jax.device_put(x, P("lanes"))
        for name, program in programs.items():
            ys = program(lanes(y0), lanes(params))
            spec = str(jax.typeof(ys).sharding.spec)
            result[name] = {"difference": relative_difference(ys, plain[name]), "spec": spec}
        failing = lanes(params.at[5, 0].set(jnp.nan))
        for compile_ in (jax.jit, odeckpt.jit):
            try:
                jax.block_until_ready(compile_(solve)(lanes(y0), failing))
                raised = {"raised": None, "message": ""}
            except Exception as error:
                raised = {"raised": type(error).__name__, "message": str(error)}
            result[f"{compile_.__module__.split('.')[0]}.jit/throw"] = raised
    return result


def check_throw() -> dict:
    """A failing lane (5 of 8) with `throw=True`, inside `shard_map` and in a batch sharded over
    the devices (`jit` propagating the sharding), under `jax.jit` and under `odeckpt.jit`: the
    kind of error and its message (both must come within seconds, with no process aborted by
    a rendezvous timeout)."""
    mesh = jax.make_mesh((4,), ("lanes",), axis_types=(AxisType.Auto,))
    y0, params = inputs()
    params = params.at[5, 0].set(jnp.nan)
    lanes = NamedSharding(mesh, P("lanes"))
    solve = lambda y0, p: odeckpt.solve(lotka_volterra, y0, (0.0, 5.0), p).ys
    gradient = jax.grad(lambda y0, p: jnp.sum(solve(y0, p) ** 2), argnums=1)
    specs = dict(mesh=mesh, in_specs=(P("lanes"), P("lanes")), out_specs=P("lanes"))
    programs = {
        "shard_map": jax.shard_map(jax.vmap(solve), **specs),
        "shard_map_gradient": jax.shard_map(jax.vmap(gradient), **specs),
        "sharded_jit": jax.vmap(solve),
    }
    result = {}
    for compile_ in (jax.jit, odeckpt.jit):
        for name, program in programs.items():
            try:
                jax.block_until_ready(
                    compile_(program)(jax.device_put(y0, lanes), jax.device_put(params, lanes))
                )
                raised = {"raised": None, "message": ""}
            except Exception as error:
                raised = {"raised": type(error).__name__, "message": str(error)}
            result[f"{compile_.__module__.split('.')[0]}.jit/{name}"] = raised
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = ["adjoints", "engine", "explicit", "explicit_cases", "explicit_programs", "throw"]
    parser.add_argument("checks", nargs="+", choices=names)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    options = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    checks = {
        "adjoints": lambda: check_adjoints(options.cases),
        "engine": check_engine,
        "explicit": check_explicit,
        "explicit_cases": lambda: check_explicit_cases(options.cases),
        "explicit_programs": check_explicit_programs,
        "throw": check_throw,
    }
    print(json.dumps({name: checks[name]() for name in options.checks}))


if __name__ == "__main__":
    main()
