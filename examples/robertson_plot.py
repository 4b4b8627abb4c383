# %% [markdown]
# # Plotting a stiff problem: Robertson's kinetics over sixteen decades
#
# Robertson's chemical kinetics (Robertson 1966; problem ROBER of Hairer & Wanner's test set),
# `y1' = -k1 y1 + k3 y2 y3`, `y2' = k1 y1 - k2 y2^2 - k3 y2 y3`, `y3' = k2 y2^2` with
# `k = (0.04, 3e7, 1e4)`, is solved by `Radau5` from `t = 0` to `1e11` and drawn with
# `odeckpt.plot`: a log time axis (chosen by `xscale="auto"`: half of the steps end before
# `t = 1e5`), the dense output evaluated on a geometric grid between the step ends, the 17
# saved points as circles, and a log value axis on which `y2` (at most `4e-5`) shows beside
# `y1` and `y3`. Then an ensemble of solves with uncertain rate constants, batched by
# `jax.vmap`, is drawn as a band (5% to 95% quantiles) around its median.
#
# Run as a script or open as a notebook (jupytext percent format). Sizes:
# `ODECKPT_EXAMPLE_SIZE=tiny|full` (default `full`); plots go to `ODECKPT_EXAMPLE_OUTPUT`
# (default `example-output`).

# %%
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import odeckpt
import odeckpt.plot

jax.config.update("jax_enable_x64", True)

SIZE = os.environ.get("ODECKPT_EXAMPLE_SIZE", "full")
OUTPUT = Path(os.environ.get("ODECKPT_EXAMPLE_OUTPUT", "example-output")) / "robertson_plot"
OUTPUT.mkdir(parents=True, exist_ok=True)
SETTINGS = {
    "full": dict(t1=1e11, members=64),
    "tiny": dict(t1=1e5, members=4),
}[SIZE]
DECADES = int(np.log10(SETTINGS["t1"])) + 5  # the saved times run from 1e-5 to t1
# y(1e11) of problem ROBER in the IVP test set (Mazzia and Magherini).
REFERENCE = np.array([0.2083340149701255e-07, 0.8333360770334713e-13, 0.9999999791665050])

# %% [markdown]
# ## One solve, with saved points and dense output

# %%
RATES = jnp.array([0.04, 3e7, 1e4])
y0 = jnp.array([1.0, 0.0, 0.0])
ts = jnp.logspace(-5, np.log10(SETTINGS["t1"]), DECADES + 1)


def robertson(t, y, rates):
    k1, k2, k3 = rates[0], rates[1], rates[2]
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


def solve(rates):
    return odeckpt.solve(
        robertson,
        y0,
        (0.0, SETTINGS["t1"]),
        rates,
        solver=odeckpt.Radau5(),
        rtol=1e-6,
        atol=1e-10,
        saveat=odeckpt.SaveAt(ts=ts, dense=True),
        max_steps=2048,
    )


sol = solve(RATES)
figure, (species, steps) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
odeckpt.plot.solution(sol, labels=["y1", "y2", "y3"], yscale="log", ax=species)
odeckpt.plot.step_sizes(sol, ax=steps)
figure.savefig(OUTPUT / "robertson.png", dpi=120)

# %% [markdown]
# ## An ensemble under `jax.vmap`: the rate constants known to within a factor of about 1.3

# %%
spread = jnp.exp(0.25 * jax.random.normal(jax.random.key(0), (SETTINGS["members"], 3)))
ensemble = jax.vmap(solve)(RATES * spread)
band_figure, band_axes = plt.subplots(figsize=(6, 4.2), layout="constrained")
odeckpt.plot.solution(
    ensemble, labels=["y1", "y2", "y3"], yscale="log", band=(0.05, 0.95), ax=band_axes
)
band_figure.savefig(OUTPUT / "ensemble.png", dpi=120)

# %% [markdown]
# The claims, checked on what was drawn: a log time axis, chosen automatically; every saved
# point drawn; the curve evaluated at 50 or more times in every decade of the span; one band
# per species for the ensemble. At full size, the end point agrees with the test set's
# reference to 1e-5 relative error.

# %%
curve_t = next(line for line in species.lines if line.get_gid() == "curve").get_xdata()
per_decade = np.histogram(np.log10(curve_t), bins=DECADES, range=(-5, DECADES - 5))[0]
saved = [len(line.get_xdata()) for line in species.lines if line.get_gid() == "saved"]
bands = [artist for artist in band_axes.collections if artist.get_gid() == "band"]
result = {
    "size": SIZE,
    "accepted_steps": int(sol.stats.num_accepted_steps),
    "xscale": species.get_xscale(),
    "saved_points_drawn": saved,
    "fewest_curve_points_in_a_decade": int(per_decade.min()),
    "bands": len(bands),
    "members": SETTINGS["members"],
    "relative_error_at_1e11": (
        np.abs(np.asarray(sol.ys[-1]) / REFERENCE - 1).tolist() if SIZE == "full" else None
    ),
}
(OUTPUT / "result.json").write_text(json.dumps(result, indent=2))
assert result["xscale"] == "log", result
assert saved == [len(ts)] * 3, result
assert result["fewest_curve_points_in_a_decade"] >= 50, result
assert result["bands"] == 3, result
assert SIZE != "full" or max(result["relative_error_at_1e11"]) < 1e-5, result
