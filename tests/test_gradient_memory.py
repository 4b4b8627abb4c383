"""Compiled memory of reverse-mode gradients: what each adjoint holds as the step count grows.

The figure is XLA's `memory_analysis().temp_size_in_bytes` of `jax.jit(jax.grad(loss))`: it is
deterministic and needs no run, only a compile. The problem is a 2**16-dimensional state (a
periodic reaction-diffusion equation) integrated with `n` constant steps of `DT = 2**-10`
over `[0, n * DT]`, n = 1000, 4000, 16000 (`max_steps = n`, so the bound is tight). The step is
a power of two so that the accumulated time is exact and the solve takes exactly `n` steps
(with `dt0 = 1 / n` rounding can leave a tiny extra step, see
`test_constant_steps_take_exactly_n_steps`). The claims (issue 4, DESIGN.md decision 1):

- `RecursiveCheckpointAdjoint(checkpoints=c)` holds `c` snapshots whatever `n`: flat in `n`,
  and one more state per extra checkpoint.
- `DirectAdjoint` stores the state before every step: affine in `n`, with a slope of at least
  one state per step.
- `BacksolveAdjoint` stores nothing per step: flat in `n`.
- At equal `checkpoints`, with Tsit5, odeckpt needs no more than `diffrax`'s
  `RecursiveCheckpointAdjoint`.

The default run checks `RecursiveCheckpointAdjoint` and `BacksolveAdjoint`; `-m slow` also
`InterpolatingAdjoint`, `DirectAdjoint`, the comparison with diffrax and that the solves take
exactly `n` steps. `BacksolveAdjoint` with checkpoints is
`test_memory_is_flat_in_the_number_of_steps` in `test_backsolve.py`.
"""

import functools

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odeckpt
from odeckpt import (
    BacksolveAdjoint,
    DirectAdjoint,
    InterpolatingAdjoint,
    RecursiveCheckpointAdjoint,
)

# One pytest-xdist worker runs the module: its tests share compiled measurements.
pytestmark = pytest.mark.xdist_group("test_gradient_memory")

SIZE = 2**16
STEPS = (1000, 4000, 16000)
CHECKPOINTS = 8
WINDOW = 16
STATE_BYTES = SIZE * 8  # float64
DT = 2.0**-10


def vector_field(t, y, params):
    diffusion, reaction = params
    return diffusion * (jnp.roll(y, 1) - 2 * y + jnp.roll(y, -1)) - reaction * jnp.tanh(y)


def _inputs(size=SIZE):
    y0 = jnp.asarray(np.sin(np.linspace(0.0, 2 * np.pi, size, endpoint=False)))
    return y0, jnp.array([1.0, 1.0])


def odeckpt_gradient(adjoint, n, solver):
    def loss(y0, params):
        sol = odeckpt.solve(
            vector_field,
            y0,
            (0.0, n * DT),
            params,
            solver=solver,
            adjoint=adjoint,
            controller=odeckpt.ConstantStep(),
            dt0=DT,
            max_steps=n,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    return jax.grad(loss, argnums=(0, 1))


def diffrax_gradient(adjoint, n):
    def loss(y0, params):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field),
            diffrax.Tsit5(),
            0.0,
            n * DT,
            DT,
            y0,
            params,
            stepsize_controller=diffrax.ConstantStepSize(),
            adjoint=adjoint,
            max_steps=n,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    return jax.grad(loss, argnums=(0, 1))


def temp_bytes(gradient) -> int:
    return odeckpt.compiled_memory(gradient, *_inputs()).temp


@functools.cache
def odeckpt_temp(kind: str, n: int, solver: str = "rk4", checkpoints: int = CHECKPOINTS) -> int:
    adjoints = {
        "recursive": RecursiveCheckpointAdjoint(checkpoints=checkpoints),
        "direct": DirectAdjoint(),
        "backsolve": BacksolveAdjoint(),
        "interpolating": InterpolatingAdjoint(checkpoints=checkpoints, window=WINDOW),
    }
    stepper = {"rk4": odeckpt.RK4(), "tsit5": odeckpt.Tsit5()}[solver]
    return temp_bytes(odeckpt_gradient(adjoints[kind], n, stepper))


@pytest.mark.slow
def test_constant_steps_take_exactly_n_steps():
    # The memory claims below assume max_steps = n is enough: check it on a small state.
    for n in STEPS:
        y0, params = _inputs(4)
        sol = odeckpt.solve(
            vector_field,
            y0,
            (0.0, n * DT),
            params,
            solver=odeckpt.RK4(),
            controller=odeckpt.ConstantStep(),
            dt0=DT,
            max_steps=n,
        )
        assert int(sol.stats.num_steps) == n
        assert float(sol.ts[-1]) == n * DT


def test_recursive_checkpoint_memory_is_flat_in_steps():
    temps = [odeckpt_temp("recursive", n) for n in STEPS]
    assert max(temps) <= 1.1 * min(temps), temps
    # What grows is the snapshots: for a state this large a snapshot leaves out the stepper's
    # cached f(t, y) (recomputed on restore), so c more checkpoints cost c states.
    more = odeckpt_temp("recursive", STEPS[0], checkpoints=2 * CHECKPOINTS) - temps[0]
    assert more == pytest.approx(CHECKPOINTS * STATE_BYTES, rel=0.25), (temps, more)
    assert max(temps) < STEPS[0] * STATE_BYTES / 10, temps


@pytest.mark.slow
def test_direct_memory_grows_linearly_in_steps():
    temps = [odeckpt_temp("direct", n) for n in STEPS]
    (n0, n1, n2), (m0, m1, m2) = STEPS, temps
    slopes = [(m1 - m0) / (n1 - n0), (m2 - m1) / (n2 - n1)]
    # Affine in n: the same bytes per step between 1000 and 4000 as between 4000 and 16000 ...
    assert slopes[1] == pytest.approx(slopes[0], rel=0.1), (temps, slopes)
    # ... and at least one state per step.
    assert slopes[0] >= STATE_BYTES, (temps, slopes)
    assert temps[-1] >= 0.9 * (STEPS[-1] / STEPS[0]) * temps[0], temps


def test_backsolve_memory_is_flat_in_steps():
    temps = [odeckpt_temp("backsolve", n) for n in STEPS]
    assert max(temps) <= 1.1 * min(temps), temps
    assert max(temps) <= 64 * STATE_BYTES, temps


@pytest.mark.slow
def test_interpolating_memory_is_its_checkpoints_and_window():
    """Flat in the steps: `checkpoints` states and `window` steps of dense output (RK4's
    polynomials of degree 3: 4 states a step; the window held and the one a re-solve fills),
    whatever the number of steps."""
    temps = [odeckpt_temp("interpolating", n) for n in (STEPS[0], STEPS[-1])]
    assert max(temps) <= 1.1 * min(temps), temps
    window = WINDOW * (odeckpt.RK4.dense_degree + 1)
    assert max(temps) <= (CHECKPOINTS + 2 * window + 32) * STATE_BYTES, temps


def _compare_with_diffrax(n):
    ours = odeckpt_temp("recursive", n, "tsit5")
    peer = temp_bytes(diffrax_gradient(diffrax.RecursiveCheckpointAdjoint(CHECKPOINTS), n))
    assert ours <= peer, (n, ours / 2**20, peer / 2**20)


# Tsit5 (diffrax has no RK4) at equal checkpoints. For a state this large the snapshots leave out
# the cached f(t, y), recomputed on restore; the reverse sweep follows the forward run's recorded
# decisions, so that changes no gradient.
@pytest.mark.slow
def test_recursive_checkpoint_memory_at_most_diffrax():
    _compare_with_diffrax(STEPS[0])


@pytest.mark.slow
@pytest.mark.parametrize("n", STEPS[1:])
def test_recursive_checkpoint_memory_at_most_diffrax_long(n):
    _compare_with_diffrax(n)
