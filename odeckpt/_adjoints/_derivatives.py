"""The derivative arithmetic the adjoints with rules of their own share (`BacksolveAdjoint`,
`InterpolatingAdjoint`, `ForwardSensitivity`): the pairing of a cotangent with a tangent, how
the outputs move with the final time and the save times, and how a crossing time of an event
moves with the state and the parameters."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import leading_mask
from .._loop import IntegrationLoop, LoopState
from .._types import BoolScalar, Scalar, Y


def pair(ct: Y, v: Y) -> Scalar:
    """`<ct, v>`: the cotangent pairing (real part, as for JAX's complex cotangents)."""
    terms: list[Scalar] = jax.tree.leaves(
        jax.tree.map(lambda c, x: jnp.sum(jnp.real(c * x)), ct, v)
    )
    return sum(terms[1:], terms[0])


def terminated(loop: IntegrationLoop, final: LoopState) -> BoolScalar:
    """Whether a terminal event ended the solve (at its crossing, which the end of the span
    does not move)."""
    if loop.events is None:
        return jnp.zeros((), bool)
    assert final.events is not None  # carried wherever the loop has events
    return final.events.event >= 0


class OutputTimes(eqx.Module):
    """The times the outputs are taken at, and how the outputs move with them along
    `dy(t)/dt = f(t, y(t))`: the final time (`rate_end`, the vector field there; still where a
    terminal event ended the solve) and the save times `ts` (`None`: none) with the saved
    states `ys`, of which only the rows `keep` move."""

    rate_end: Y
    ended_by_event: BoolScalar
    field: Callable
    ts: jax.Array | None
    ys: Y | None
    keep: jax.Array | None

    def tangent(self, dt_end, dts):
        """The outputs' tangents `(end, rows)` (`rows`: `None` without save times) from
        moving the final time by `dt_end` and the save times by `dts`: `f(t, y(t)) dt`."""
        dt_end = jnp.where(self.ended_by_event, 0, dt_end)
        end = jax.tree.map(lambda f: f * dt_end.astype(f.dtype), self.rate_end)
        if self.ts is None:
            return end, None
        keep = self.keep
        assert keep is not None  # given with the save times

        def row(t, y, dt, keep):
            # Masked before and after the product: neither a non-finite rate nor a non-finite
            # cotangent at a row that does not move (an unreached save) reaches the transpose.
            moved = lambda r: jnp.where(keep, r, 0) * dt.astype(r.dtype)
            return jax.tree.map(lambda r: jnp.where(keep, moved(r), 0), self.field(t, y))

        # Unreached rows hold inf: `f` is evaluated at finite stand-ins there.
        ts = jnp.where(jnp.isfinite(self.ts), self.ts, 0)
        ys = jax.tree.map(lambda y: jnp.where(leading_mask(keep, y), y, 0), self.ys)
        return end, jax.vmap(row)(ts, ys, dts, keep)

    def cotangents(self, t_end, ct_end_t, ct_end_y, ct_rows):
        """The cotangents of the final time `t_end` and of the save times (`None` without
        them), from those of the final time and state and of the saved rows: the transpose of
        `tangent`, plus the final time's own cotangent (none where an event ended the solve)."""
        dts = None if self.ts is None else jnp.zeros_like(self.ts)
        _, vjp = jax.vjp(self.tangent, t_end, dts)
        ct_t_end, ct_ts = vjp((ct_end_y, None if self.ts is None else ct_rows))
        return ct_t_end + jnp.where(self.ended_by_event, 0, ct_end_t), ct_ts


def crossing_tangent(g: Callable, tau: Scalar, y: Y, p, rate: Y, dy: Y, dp) -> tuple:
    """The tangents at a crossing `g(tau*, y(tau*), p) = 0` of a solution of `y' = f` (`rate`
    the vector field there): moving the state at the fixed time `tau*` by `dy` and the
    parameters `p` by `dp` moves the crossing by `dtau = -(g_y dy + g_p dp) / (g_t + g_y f)`
    and the state there by `dy + f dtau` (the implicit function theorem). Returns
    `(dtau, dy + f dtau)`, linear in `(dy, dp)`.

    **References:** Rozenvasser, "General sensitivity equations of discontinuous systems",
    Automation and Remote Control 28 (1967); R. T. Q. Chen, B. Amos, M. Nickel, "Learning
    Neural Event Functions for Ordinary Differential Equations", ICLR 2021.
    """
    primals = (tau, y, p)
    zero_p = jax.tree.map(jnp.zeros_like, p)
    slope = jax.jvp(g, primals, (jnp.ones_like(tau), rate, zero_p))[1]
    moved = jax.jvp(g, primals, (jnp.zeros_like(tau), dy, dp))[1]
    dtau = (-moved / slope).astype(tau.dtype)
    return dtau, jax.tree.map(lambda d, r: d + r * dtau.astype(r.dtype), dy, rate)


def crossing_cotangents(g: Callable, tau: Scalar, y: Y, p, rate: Y, ct_tau, ct_y) -> tuple:
    """The transpose of `crossing_tangent`: the cotangents `(ct_dy, ct_dp)` of the state at
    the fixed time `tau*` and of the parameters, from those of the crossing time (`ct_tau`)
    and of the state there (`ct_y`)."""
    linear = lambda dy, dp: crossing_tangent(g, tau, y, p, rate, dy, dp)
    return jax.linear_transpose(linear, y, p)((ct_tau, ct_y))
