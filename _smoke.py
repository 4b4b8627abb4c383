import jax, jax.numpy as jnp, odeckpt, sys
jax.config.update("jax_enable_x64", True)
def lv(t, y, p):
    a,b,c,d = p
    return jnp.stack([a*y[0]-b*y[0]*y[1], d*y[0]*y[1]-c*y[1]])
y0 = jnp.array([10.0, 5.0]); p = jnp.array([1.1,0.4,0.4,0.1])
solver = sys.argv[1] if len(sys.argv)>1 else "tsit5"
def loss(p, y0, adjoint, rtol=1e-8):
    sol = odeckpt.solve(lv, y0, (0.0, 10.0), args=p, solver=solver, adjoint=adjoint, rtol=rtol, atol=1e-10, max_steps=20000)
    return jnp.sum(sol.ys[-1]**2)
fs = odeckpt.ForwardSensitivity()
print("val", loss(p, y0, fs))
t = jnp.array([1.0,0,0,0])
print("jvp", jax.jvp(lambda p: loss(p, y0, fs), (p,), (t,))[1])
eps=1e-6
print("fd ", (loss(p+eps*t, y0, "recursive", 1e-12)-loss(p-eps*t, y0, "recursive", 1e-12))/(2*eps))
print("grad", jax.grad(loss, argnums=(0,1))(p, y0, fs))
print("direct grad", jax.grad(loss, argnums=(0,1))(p, y0, "direct", 1e-12))
print("jacfwd", jax.jacfwd(loss)(p, y0, fs))
