"""diffrax's stiff_ode example (Robertson's chemistry, Kvaerno5) and its odeckpt port: the same
solution; the steps each takes, and the gradient of a fit with Kvaerno5 and with Radau5.

Run: python examples/migration/from_diffrax_stiff.py
(about a minute on 2 CPU cores, most of it compiling; float64).
"""

import diffrax
import jax
import jax.numpy as jnp

import odeckpt

jax.config.update("jax_enable_x64", True)

ts = jnp.array([0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1e0, 1e1, 1e2])
y0 = jnp.array([1.0, 0.0, 0.0])
rates = jnp.array([0.04, 3e7, 1e4])


def robertson(t, y, k):  # diffrax's example keeps k in an eqx.Module; here in args, to fit it
    k1, k2, k3 = k
    return jnp.stack([
        -k1 * y[0] + k3 * y[1] * y[2],
        k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
        k2 * y[1] ** 2,
    ])  # fmt: skip


# The diffrax original: Kvaerno5, rtol = atol = 1e-8, a first step of 2e-4.
def diffrax_solve(k):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(robertson), diffrax.Kvaerno5(), 0.0, 100.0, 0.0002, y0, args=k,
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
    )  # fmt: skip


# The port, with the stepper and `atol` as arguments: "kvaerno5" as in diffrax, or "radau".
def odeckpt_solve(k, solver, rtol=1e-8, atol=1e-8):
    return odeckpt.solve(robertson, y0, (0.0, 100.0), k, solver=solver, rtol=rtol, atol=atol,
                         dt0=0.0002, saveat=ts)  # fmt: skip


# A fit's loss at the example's rates: the misfit of each species relative to its largest value
# (y2 peaks at 3.6e-5), to data made with rates 10% higher.
data = odeckpt_solve(rates * jnp.exp(0.1), "radau", rtol=1e-12, atol=1e-14).ys
log_k = jnp.log(rates)


def loss(log_k, solve):
    sol = solve(jnp.exp(log_k))
    return jnp.sum(((sol.ys - data) / jnp.max(jnp.abs(data), axis=0)) ** 2), sol


def gradient(solve):
    """The loss's gradient at `log_k`, and the solve there."""
    return jax.jit(jax.grad(lambda log_k: loss(log_k, solve), has_aux=True))(log_k)


per_species_atol = jnp.array([1e-8, 1e-12, 1e-8])  # atol 1e-8 is 3e-4 of y2's peak
solves = {
    "diffrax Kvaerno5": diffrax_solve,
    "odeckpt Kvaerno5": lambda k: odeckpt_solve(k, "kvaerno5"),
    "odeckpt Radau5": lambda k: odeckpt_solve(k, "radau"),
    "odeckpt Radau5, atol per species": lambda k: odeckpt_solve(k, "radau", atol=per_species_atol),
}
# The reference: the same gradient and solution with Radau5 at rtol = 1e-12.
reference, exact = gradient(lambda k: odeckpt_solve(k, "radau", rtol=1e-12, atol=1e-14))
errors = {}
for name, solve in solves.items():
    grad, sol = gradient(solve)
    steps = f"{int(sol.stats['num_accepted_steps'])} accepted"
    steps += f" + {int(sol.stats['num_rejected_steps'])} rejected"
    misfit = float(jnp.max(jnp.abs(sol.ys - exact.ys) / (1e-8 + 1e-8 * jnp.abs(exact.ys))))
    gap = grad - reference
    errors[name] = float(jnp.max(jnp.abs(gap)) / jnp.max(jnp.abs(reference)))
    print(f"{name}: {int(sol.stats['num_steps'])} steps ({steps}); solution error "
          f"{misfit:.2f} tolerances; gradient relative error {errors[name]:.1e}")  # fmt: skip
    assert misfit < 1  # every solve is within the tolerances asked for
assert errors["odeckpt Radau5"] < errors["odeckpt Kvaerno5"]
assert errors["odeckpt Radau5, atol per species"] < errors["diffrax Kvaerno5"]
