"""The result of a solve."""

import dataclasses
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import wadler_lindig as wl
from jaxtyping import Array, ArrayLike, Float

from ._checks import leading_mask
from ._loop import DenseOutput
from ._status import Status
from ._types import BoolScalar, IntScalar, Scalar, Y


class Stats(eqx.Module):
    """Counters of what a solve did, and whether its `rtol` was clamped (per batch element
    under `vmap`).

    **Fields:**

    - `num_steps`: attempted steps (accepted + rejected); bounded by `max_steps`.
    - `num_accepted_steps`, `num_rejected_steps`: as named.
    - `num_fn_evals`: evaluations of the vector field, including those for the initial step size
        (for implicit steppers: one per Newton iteration; Jacobian evaluations are counted
        apart) and, for a DAE, one per Newton iteration of its consistent initial values.
    - `num_jacobian_evals`: Jacobian evaluations (linearisations for `NewtonKrylov`) by implicit
        and Rosenbrock steppers, and those of a DAE's consistent initial values; 0 for explicit
        ones.
    - `num_lu_factorisations`: LU factorisations of `I - h gamma J` (`M - h gamma J` with a mass
        matrix); 0 for explicit steppers.
    - `num_checkpoints`: snapshot slots that reverse-mode differentiation of this solve keeps
        (`RecursiveCheckpointAdjoint`'s `c`, device and host slots together with `offload`;
        the forward checkpoints of `BacksolveAdjoint` and `InterpolatingAdjoint`; `max_steps`
        for `DirectAdjoint`, which keeps one slot of residuals per possible step; `0` for
        `ForwardMode`).
    - `num_recomputed_steps`: steps that reverse-mode differentiation recomputes:
        `RecursiveCheckpointAdjoint`'s from its snapshots, exactly as its schedule will; for
        a continuous adjoint that reads `y(t)` from forward re-solves (`InterpolatingAdjoint`,
        `BacksolveAdjoint(reconstruct="forward")`) the forward steps they re-solve, at least
        (once each, and once more for a re-solve from `t0` at tolerances of its own); `0` for
        the other adjoints. Reverse mode also runs one VJP per step; the backward solve of the
        continuous adjoints is adaptive and its step count is only known in the backward
        pass: their `on_backward=...` reports it.
    - `rtol_clamped`: whether an `rtol` that steps are held to (the solve's or the
        controller's, and an adjoint's own: `BacksolveAdjoint(rtol=...)`,
        `InterpolatingAdjoint(rtol=...)`, `ForwardSensitivity(rtol=...)`) was below the
        resolution of the state's dtype (its machine epsilon: 1.2e-7 in float32, 2.2e-16 in
        float64), so that the steps were held to that resolution instead. A known `rtol` below
        it also warns when `solve` is called; a traced one is reported only here.

    - `max_steps`: the `max_steps` the solve ran with (a Python int).

    `Stats` also reads as a mapping, as diffrax's `sol.stats` dict does: `sol.stats["num_steps"]`,
    `dict(sol.stats)`, `sol.stats.keys()`; the keys are the field names (`num_steps`,
    `num_accepted_steps`, `num_rejected_steps` and `max_steps` mean what they mean in diffrax),
    and scipy's `nfev`, `njev` and `nlu` are accepted as aliases. It prints its numbers:
    `Stats(num_steps=41, ...)`, arrays of them under `vmap`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0))
    print(sol.stats.num_steps, sol.stats.num_fn_evals, sol.stats.num_checkpoints)
    print(sol.stats["num_accepted_steps"], dict(sol.stats))
    ```
    """

    num_steps: IntScalar
    num_accepted_steps: IntScalar
    num_rejected_steps: IntScalar
    num_fn_evals: IntScalar
    num_jacobian_evals: IntScalar
    num_lu_factorisations: IntScalar
    num_checkpoints: IntScalar
    num_recomputed_steps: IntScalar
    rtol_clamped: BoolScalar
    max_steps: int = eqx.field(static=True)

    def keys(self) -> list[str]:
        """The names of the counters (and `max_steps`), as a dict's keys."""
        return [field.name for field in dataclasses.fields(self)]

    def __getitem__(self, key: str) -> IntScalar | int:
        name = _STATS_ALIASES.get(key, key)
        if name not in self.keys():
            raise KeyError(
                f"{key!r} is not a statistic of a solve; the keys are {self.keys()} (and scipy's "
                f"{sorted(_STATS_ALIASES)})."
            )
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.keys() or key in _STATS_ALIASES

    def items(self) -> list[tuple[str, IntScalar | int]]:
        """`(key, value)` pairs, as a dict's items."""
        return [(key, self[key]) for key in self.keys()]

    def values(self) -> list[IntScalar | int]:
        """The values, as a dict's values."""
        return [self[key] for key in self.keys()]

    def __repr__(self) -> str:
        shown = ", ".join(f"{key}={_value(value)}" for key, value in self.items())
        return f"Stats({shown})"

    def __pdoc__(self, **kwargs):
        del kwargs
        return wl.TextDoc(repr(self))


_STATS_ALIASES = {
    "nfev": "num_fn_evals",
    "njev": "num_jacobian_evals",
    "nlu": "num_lu_factorisations",
}
"""scipy's `OdeResult` names for the same counts."""


def _value(value) -> str:
    """A number, a list of numbers (batched), or `traced`."""
    if isinstance(value, jax.core.Tracer):
        return "traced"
    array = np.asarray(value)
    return str(array.item()) if array.ndim == 0 else np.array2string(array, separator=", ")


class _Shown:
    """Prints as the text it holds."""

    def __init__(self, text: str):
        self.text = text

    def __pdoc__(self, **kwargs) -> wl.AbstractDoc:
        del kwargs
        return wl.TextDoc(self.text)


class Solution(eqx.Module):
    """The output of `odeckpt.solve`.

    **Fields:**

    - `ts`, `ys`: the saved times and states (see `SaveAt` for the layout); `ys` is a pytree like
        `y0` whose leaves have a leading time axis.
    - `stats`: a `Stats` of counters.
    - `status`: a `Status`; `Status.successful` unless the solve stopped early (`throw=False`).
    - `t0`, `t1`: the time span.
    - `dense`: the continuous extension (`SaveAt(dense=True)`), read through `evaluate`.
    - `event`: with `solve(..., event=...)`, the index of the terminal event that ended the
        solve (into the tuple of events; `0` for a single one), or `-1` if none did; `None`
        without events.

    It prints its arrays' shapes, and its `stats`, `status`, `t0`, `t1` and `event` with their
    values. Names of diffrax's and scipy's solutions that odeckpt spells otherwise (`sol.result`,
    `sol.y`, `sol.t`, `sol.success`, `sol.message`, ...) raise an `AttributeError` naming the
    odeckpt spelling.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), saveat=odeckpt.SaveAt(ts=jnp.linspace(0.0, 1.0, 11)))
    sol.ts.shape  # (11,); each leaf of sol.ys has shape (11, *leaf_of_y0.shape)
    ```
    """

    ts: Float[Array, " n"] | None
    ys: Y | None
    stats: Stats
    status: Status
    t0: Scalar
    t1: Scalar
    dense: DenseOutput | None
    event: IntScalar | None = None

    def __pdoc__(self, **kwargs) -> wl.AbstractDoc:
        # Arrays print as shapes; the span and the event index, small numbers, as values.
        pairs = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("t0", "t1", "event") and value is not None:
                value = _Shown(_value(value))
            if not (field.name == "event" and value is None):
                pairs.append((field.name, value))
        docs = wl.named_objs(pairs, **kwargs)
        return wl.bracketed(wl.TextDoc("Solution("), docs, wl.comma, wl.TextDoc(")"), indent=2)

    def __repr__(self) -> str:
        return wl.pformat(self)

    def __getattr__(self, name: str):
        # Reached only for a name that is neither a field nor a method: name the odeckpt
        # spelling of another library's.
        hint = _FOREIGN_ATTRIBUTES.get(name)
        message = f"'Solution' object has no attribute {name!r}"
        if hint is not None:
            library, fix = hint
            message += f" ({library}'s name). Fix: {fix}."
        raise AttributeError(message, name=name, obj=self)

    def evaluate(self, t: Float[ArrayLike, "..."]) -> Y:
        """The continuous solution at time(s) `t` (needs `SaveAt(dense=True)`).

        **Arguments:**

        - `t`: a time or an array of times inside the solved span: `[t0, t1]`, or up to where
            the solve stopped if it failed (`throw=False`).

        **Returns:**

        A pytree like `y0`; with an array `t`, leaves get `t`'s shape as leading axes. A time
        outside the solved span raises a `ValueError` when `t` and the solution are known
        (outside `jax.jit`), and evaluates to NaN when they are traced: the solution is never
        extrapolated.

        **Example:**

        ```python
        sol = odeckpt.solve(f, y0, (0.0, 2.0), saveat=odeckpt.SaveAt(dense=True))
        sol.evaluate(jnp.linspace(0.0, 2.0, 50))  # leaves of shape (50, *leaf_of_y0.shape)
        ```
        """
        if self.dense is None:
            raise ValueError(
                "`Solution.evaluate` needs the dense output. Fix: pass "
                "`saveat=odeckpt.SaveAt(dense=True)` to `odeckpt.solve`."
            )
        t = jnp.asarray(t, dtype=self.t0.dtype)
        direction = jnp.where(self.t1 >= self.t0, 1, -1).astype(t.dtype)
        tau = direction * t
        inside = self.dense.covers(tau)
        _check_inside(inside, t, self.dense, direction)
        evaluate = self.dense.evaluate
        for _ in range(t.ndim):
            evaluate = jax.vmap(evaluate)
        values = evaluate(tau)
        return jax.tree.map(lambda y: jnp.where(leading_mask(inside, y), y, jnp.nan), values)


_SUCCESS = "`sol.status == odeckpt.Status.successful`"
_FOREIGN_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "result": (
        "diffrax",
        f"use `sol.status`, an `odeckpt.Status` ({_SUCCESS}, `sol.status.message`)",
    ),
    "y": (
        "scipy",
        "use `sol.ys`, times first: scipy's `sol.y` has shape (n, len(t)), `sol.ys` of an "
        "array state has (len(ts), n), so scipy's layout is `sol.ys.T`",
    ),
    "t": ("scipy", "use `sol.ts`"),
    "success": ("scipy", f"use {_SUCCESS}"),
    "message": ("scipy", "use `sol.status.message` (`''` for success)"),
    "sol": ("scipy", "use `sol.evaluate(t)`, with `saveat=odeckpt.SaveAt(dense=True)`"),
    "nfev": ("scipy", "use `sol.stats['nfev']` (or `sol.stats.num_fn_evals`)"),
    "njev": ("scipy", "use `sol.stats['njev']` (or `sol.stats.num_jacobian_evals`)"),
    "nlu": ("scipy", "use `sol.stats['nlu']` (or `sol.stats.num_lu_factorisations`)"),
    "t_events": (
        "scipy",
        "use `sol.event` (the terminal event that ended the solve, or -1); with "
        "`SaveAt(t1=True)`, `sol.ts[-1]` and `sol.ys[-1]` are its time and state",
    ),
    "y_events": ("scipy", "use `sol.ys[-1]` with `SaveAt(t1=True)`, and `sol.event`"),
    "derivative": (
        "diffrax",
        "evaluate the vector field on the dense output, `f(t, sol.evaluate(t), args)`",
    ),
    **{
        name: ("diffrax", "none is returned: a solve always starts afresh")
        for name in ("solver_state", "controller_state", "made_jump")
    },
}
"""An attribute name of diffrax's `Solution` or scipy's `OdeResult` -> (the library, the fix)."""


def _check_inside(inside: Array, t: Array, dense: "DenseOutput", direction: Array) -> None:
    """Raise if the values are known and some `t` lies outside the solved span."""
    try:
        known = np.asarray(inside)
    except jax.errors.TracerArrayConversionError:
        return
    if not np.all(known):
        start, end = (float(direction * x) for x in (dense.t_start, dense.t_last))
        outside = np.asarray(t)[~known]
        raise ValueError(
            f"`Solution.evaluate` got time(s) {outside} outside the solved span from {start} to "
            f"{end}; the solution is not extrapolated. Fix: evaluate inside the span (or solve "
            "over a longer one)."
        )
