"""A solve's results read and print as a new user expects: `Stats` as a mapping too (with
diffrax's keys), and `Status`, `Stats` and `Solution` printed with their values, batched or
traced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odeckpt


def decay(t, y, args):
    return -args * y


def solve(rate=1.0, **kwargs):
    return odeckpt.solve(decay, jnp.array([1.0, 2.0]), (0.0, 1.0), args=rate, **kwargs)


def test_stats_as_a_mapping():
    sol = solve()
    stats = sol.stats
    assert stats["num_steps"] is stats.num_steps
    assert list(stats.keys()) == [
        "num_steps", "num_accepted_steps", "num_rejected_steps", "num_fn_evals",
        "num_jacobian_evals", "num_lu_factorisations", "num_checkpoints",
        "num_recomputed_steps", "rtol_clamped", "max_steps",
    ]  # fmt: skip
    as_dict = dict(stats)
    assert set(as_dict) == set(stats.keys()) and len(stats) == len(as_dict)
    assert int(as_dict["num_accepted_steps"]) + int(as_dict["num_rejected_steps"]) == int(
        as_dict["num_steps"]
    )
    assert as_dict["max_steps"] == 4096
    assert dict(stats.items()) == as_dict and list(stats.values()) == list(as_dict.values())
    # scipy's names as aliases.
    assert stats["nfev"] is stats.num_fn_evals and "njev" in stats and "nlu" in stats
    with pytest.raises(KeyError, match="num_steps"):
        stats["steps"]


def test_stats_keys_match_diffrax():
    diffrax = pytest.importorskip("diffrax")
    term = diffrax.ODETerm(lambda t, y, args: -y)
    diffrax_sol = diffrax.diffeqsolve(
        term, diffrax.Tsit5(), 0.0, 1.0, 0.1, jnp.array([1.0]),
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-8),
    )  # fmt: skip
    shared = set(diffrax_sol.stats) & set(solve().stats.keys())
    assert shared == {"num_steps", "num_accepted_steps", "num_rejected_steps", "max_steps"}


def test_reprs_show_values():
    sol = solve()
    steps = int(sol.stats.num_steps)
    assert repr(sol.status) == str(sol.status) == "Status.successful"
    assert repr(odeckpt.Status.max_steps_reached) == "Status.max_steps_reached"
    assert repr(sol.stats).startswith(f"Stats(num_steps={steps}, num_accepted_steps=")
    assert "max_steps=4096)" in str(sol.stats)
    text = repr(sol)
    assert "status=Status.successful" in text and f"Stats(num_steps={steps}," in text
    assert "ys=f64[1,2]" in text
    assert "t0=0.0," in text and "t1=1.0," in text


def test_reprs_batched():
    sols = jax.vmap(lambda r: solve(r, max_steps=6, throw=False))(jnp.array([1.0, 50.0]))
    assert repr(sols.status) == "Status([successful, max_steps_reached])"
    assert "num_steps=[" in repr(sols.stats)
    assert "max_steps_reached" in repr(sols)
    assert sols.status.message.startswith("max_steps_reached: The maximum number of steps")


def test_reprs_under_tracing():
    printed = []

    @jax.jit
    def run(rate):
        sol = solve(rate)
        printed.append((repr(sol.status), repr(sol.stats), repr(sol)))
        return sol.ys

    run(1.0)
    status, stats, whole = printed[0]
    assert status == "Status(traced)"
    assert stats.startswith("Stats(num_steps=traced,") and "max_steps=4096" in stats
    assert "Status(traced)" in whole


def test_status_message_and_comparisons():
    sol = solve(max_steps=2, throw=False)
    assert sol.status == odeckpt.Status.max_steps_reached
    assert sol.status != odeckpt.Status.successful
    assert sol.status in (odeckpt.Status.dt_underflow, odeckpt.Status.max_steps_reached)
    assert "raise `max_steps=`" in sol.status.message
    assert odeckpt.Status.successful.message == ""
    with pytest.raises(ValueError, match="compared with a Status"):
        sol.status == 0  # noqa: B015
    # Under vmap a status compares lane by lane.
    statuses = jax.vmap(lambda r: solve(r, max_steps=6, throw=False).status)(jnp.array([1.0, 50]))
    ok = statuses == odeckpt.Status.successful
    assert np.asarray(ok).tolist() == [True, False]
