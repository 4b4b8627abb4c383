"""A diffrax neural ODE and its odeckpt port: the same loss and gradient.

Run: python examples/migration/from_diffrax.py
(under a minute on 2 CPU cores, most of it compiling; float64).
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp

import odeckpt

jax.config.update("jax_enable_x64", True)

mlp = eqx.nn.MLP(2, 2, width_size=16, depth=2, activation=jnp.tanh, key=jax.random.key(0))
y0 = jnp.array([2.0, 0.0])
ts = jnp.linspace(0.0, 2.0, 20)
target = jnp.stack([jnp.cos(ts), jnp.sin(ts)], axis=-1) * 2.0


# The diffrax original: Tsit5 at rtol 1e-6, atol 1e-8, saved at `ts`.
def field(t, y, mlp):
    return mlp(y)


@eqx.filter_jit
def diffrax_loss(mlp):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field), diffrax.Tsit5(), 0.0, 2.0, None, y0, args=mlp,
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-8),
        saveat=diffrax.SaveAt(ts=ts),
    )  # fmt: skip
    return jnp.mean((sol.ys - target) ** 2), sol.stats["num_steps"]


# The port: the same vector field; the span, args, stepper and tolerances as keywords of `solve`.
@eqx.filter_jit
def odeckpt_loss(mlp):
    sol = odeckpt.solve(field, y0, (0.0, 2.0), mlp, solver="tsit5", rtol=1e-6, atol=1e-8, saveat=ts)
    return jnp.mean((sol.ys - target) ** 2), sol.stats["num_steps"]


# Both differentiate the discrete solve with recursive checkpointing: the same gradient.
(loss_d, steps_d), grad_d = eqx.filter_value_and_grad(diffrax_loss, has_aux=True)(mlp)
(loss_o, steps_o), grad_o = eqx.filter_value_and_grad(odeckpt_loss, has_aux=True)(mlp)
leaves_d, leaves_o = jax.tree.leaves(grad_d), jax.tree.leaves(grad_o)
scale = max(float(jnp.max(jnp.abs(g))) for g in leaves_d)
gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves_d, leaves_o, strict=True))
print(f"loss: diffrax {float(loss_d):.10f}, odeckpt {float(loss_o):.10f}")
print(f"steps: diffrax {int(steps_d)}, odeckpt {int(steps_o)}")
print(f"largest gradient difference relative to the largest entry: {gap / scale:.1e}")
assert abs(float(loss_d) - float(loss_o)) <= 1e-6 * abs(float(loss_d))
assert gap <= 1e-5 * scale
