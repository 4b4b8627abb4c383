"""Checks of `solve`'s inputs. Each raises at call (trace) time with the fix in the message;
checks that need values which are only known at run time go through `TracedChecks`."""

import warnings
from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from ._checks import known_values
from ._error_norm import per_leaf
from ._errors import error_if
from ._loop import Event
from ._types import Args, Scalar, VectorField, Y

T = TypeVar("T")


class TracedChecks:
    """The checks of traced inputs (known only at run time). With `throw`, each raises through
    the package's failure mechanism; without, they are gathered into one flag that the solve
    turns into `Status.invalid_inputs`, so that the program holds no host callback."""

    def __init__(self, throw: bool):
        self.throw = throw
        self._failed: list[jax.Array] = []

    def require(self, value, bad, message: str):
        """`value`, failing with `message` where `bad` holds (always rebind the result)."""
        if self.throw:
            return error_if(value, bad, message)
        self._failed.append(jnp.any(bad))
        return value

    def failed(self) -> jax.Array | None:
        """Whether any traced input is invalid (`None` if none was checked at run time)."""
        if not self._failed:
            return None
        return jnp.any(jnp.stack(self._failed))


def as_state(y0: Y) -> Y:
    """`y0` with every leaf an array of floating or complex dtype."""

    def convert(leaf):
        if isinstance(leaf, float | complex):
            return jnp.asarray(leaf)
        if not hasattr(leaf, "dtype"):
            raise TypeError(
                f"y0 must be a pytree of arrays, found a leaf of type {type(leaf).__name__}. "
                "Fix: convert it with `jnp.asarray(..., dtype=float)`."
            )
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(
                f"y0 has a leaf of dtype {leaf.dtype}; ODE states must be floating or complex. "
                "Fix: `y0 = jnp.asarray(y0, dtype=float)` (or float32 / complex64)."
            )
        if jnp.finfo(leaf.dtype).bits < 32:
            raise TypeError(
                f"y0 has a leaf of dtype {leaf.dtype}, too coarse (resolution "
                f"{jnp.finfo(leaf.dtype).eps}) for adaptive error control and for times along "
                "the span. Fix: solve in float32 (`y0.astype(jnp.float32)`, with `f` computing "
                "in float32) and cast the result back."
            )
        return jnp.asarray(leaf)

    leaves = jax.tree.leaves(y0)
    if not leaves:
        raise ValueError("y0 has no arrays. Fix: pass the initial state as an array or pytree.")
    return jax.tree.map(convert, y0)


def time_dtype(y0: Y) -> jnp.dtype:
    """The widest real floating dtype among the leaves of `y0`."""
    return jnp.result_type(*[jnp.finfo(leaf.dtype).dtype for leaf in jax.tree.leaves(y0)])


def time_span(t_span, dtype, checks: TracedChecks) -> tuple[Scalar, Scalar]:
    try:
        t0, t1 = t_span
    except (TypeError, ValueError):
        raise ValueError(
            f"t_span must be a pair (t0, t1), got {t_span!r}. Fix: pass e.g. `(0.0, 10.0)`."
        ) from None
    t0, t1 = (_real_number(name, t, dtype) for name, t in (("t0", t0), ("t1", t1)))
    if t0.shape != () or t1.shape != ():
        raise ValueError(
            f"t0 and t1 must be scalars, got shapes {t0.shape} and {t1.shape}. Fix: to solve "
            "over many spans, `jax.vmap` over `solve`."
        )
    return _finite("t0", t0, checks), _finite("t1", t1, checks)


def _real_number(name: str, value, dtype, example: str = "1.0") -> jax.Array:
    """`value` as an array of `dtype`, raising (naming the fix) unless it holds real numbers."""
    _check_real(name, value, example)
    return jnp.asarray(value, dtype)


def _check_real(name: str, value, example: str) -> None:
    """Raise (naming the fix) unless `value` holds real numbers."""
    fix = f"Fix: pass e.g. {name}={example}."
    if isinstance(value, bool | str):
        raise TypeError(f"{name}={value!r} must be a real number. {fix}")
    try:
        kind = jnp.result_type(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be a real number. {fix}") from None
    if not (jnp.issubdtype(kind, jnp.integer) or jnp.issubdtype(kind, jnp.floating)):
        raise TypeError(f"{name} has dtype {kind}; it must be a real number. {fix}")


def as_array(value, dtype):
    """`value` as an array of `dtype`: a NumPy array if it is known on the host (a Python
    number, a list or a NumPy array: converting it costs no device operation), else a JAX
    array."""
    if isinstance(value, int | float | complex | list | tuple | np.ndarray | np.generic):
        return np.asarray(value, dtype)
    return jnp.asarray(value, dtype)


def _finite(name: str, value: jax.Array, checks: TracedChecks) -> jax.Array:
    """`value`, raising unless it is finite: now if it is known, at run time if traced."""
    message = f"{name} is NaN or inf. Fix: check how {name} is computed."
    known = concrete(value)
    if known is None:
        return checks.require(value, ~jnp.all(jnp.isfinite(value)), message)
    if not np.all(np.isfinite(known)):
        raise ValueError(f"{message} Got {name}={known}.")
    return value


def flag(name: str, value) -> bool:
    """`value` as a Python bool: `True` or `False` (or a NumPy bool), else a `TypeError` naming
    the fix (a truthy `throw=None` or `progress="no"` would silently mean the opposite)."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    raise TypeError(
        f"solve({name}={value!r}) must be True or False. Fix: pass {name}=True or {name}=False."
    )


def check_finite(y0: Y) -> None:
    """Raise if `y0` is known at trace time and holds NaN or inf. (A traced `y0` is checked in
    the loop's initial status instead, which costs no extra run-time check.)"""
    for leaf in jax.tree.leaves(y0):
        if not isinstance(leaf, jax.core.Tracer) and not np.all(np.isfinite(leaf)):
            raise ValueError(
                "y0 contains NaN or inf. Fix: check how the initial condition is computed."
            )


def with_traced_numbers(args: Args, call: Callable[[Args], T]) -> T:
    """`call(args)`, with the Python `float` and `complex` leaves of `args` as arrays, so that a
    new value is a new input of the compiled solve instead of a new program; with `args`
    unchanged if `call` finds that a user's function needs one of them as a Python number (in
    an `if`, or as a shape)."""
    numbers = lambda leaf: isinstance(leaf, float | complex)
    if not any(numbers(leaf) for leaf in jax.tree.leaves(args)):
        return call(args)
    try:
        return call(jax.tree.map(lambda leaf: jnp.asarray(leaf) if numbers(leaf) else leaf, args))
    except jax.errors.ConcretizationTypeError:
        return call(args)


def check_vector_field(f: VectorField, t0: Scalar, y0: Y, args: Args) -> None:
    """Raise unless `f(t, y, args)` returns the structure, shapes and dtypes of `y0`."""
    out = eqx.filter_eval_shape(f, t0, y0, args)  # args may hold functions (an MLP activation)
    expected = jax.eval_shape(lambda: y0)
    if jax.tree.structure(out) != jax.tree.structure(expected):
        raise ValueError(
            "The vector field returned a different pytree structure than y0: "
            f"got {jax.tree.structure(out)}, expected {jax.tree.structure(expected)}. "
            "Fix: make `f(t, y, args)` return dy/dt with exactly the structure of y."
        )
    leaves = zip(jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(expected), strict=True)
    for (path, o), e in leaves:
        where = jax.tree_util.keystr(path) or "the state"
        if o.shape != e.shape:
            raise ValueError(
                f"The vector field returned shape {o.shape} for {where}, but y0 has shape "
                f"{e.shape}. Fix: return dy/dt with the same shape as y (check broadcasting)."
            )
        if o.dtype != e.dtype:
            raise ValueError(
                f"The vector field returned dtype {o.dtype} for {where}, but y0 has dtype "
                f"{e.dtype}. Fix: make f return the state's dtype, e.g. `dy.astype(y.dtype)`, or "
                "create y0 with the dtype f computes in."
            )


def tolerance(name: str, value, y0: Y):
    """`rtol` or `atol`, raising (naming the fix) unless it is one positive, finite real number,
    or a pytree like `y0` whose leaves are such numbers or arrays of their leaf's shape (a
    tolerance per component), returned as arrays of the state's real dtype (so that a new value
    is a new input of the compiled solve, never a new program). Traced values are checked at run
    time (see `PIDController.valid`).
    """
    known_values(name, value)  # rejects strings and bools
    if jax.tree.structure(value) == jax.tree.structure(y0):
        paths = jax.tree_util.tree_leaves_with_path(value)
        leaves = [
            _tolerance_leaf(name + jax.tree_util.keystr(path), leaf, y)
            for (path, leaf), y in zip(paths, jax.tree.leaves(y0), strict=True)
        ]
        value = jax.tree.unflatten(jax.tree.structure(y0), leaves)
    elif len(jax.tree.leaves(value)) == 1 and jax.tree.leaves(value)[0] is value:
        value = _tolerance_leaf(name, value, None, time_dtype(y0))
    else:
        raise ValueError(
            f"{name} has the pytree structure {jax.tree.structure(value)}, but y0 has "
            f"{jax.tree.structure(y0)}. Fix: pass one number for every component (e.g. "
            f"{name}=1e-6), or a pytree like y0 whose leaves are numbers or arrays of the leaf's "
            "shape (e.g. `jnp.array([...])` for an array state, not a list)."
        )
    return value


def _tolerance_leaf(name: str, value, y: jax.Array | None, dtype=None):
    """One leaf of a tolerance, checked: a scalar (or an array of `y`'s shape), positive and
    finite if known."""
    fix = f"Fix: pass a positive number, e.g. {name}=1e-6."
    _check_real(name, value, "1e-6")
    shape = jnp.shape(value)
    allowed = "()" if y is None else f"() or {y.shape}"
    if shape != () and (y is None or shape != y.shape):
        raise ValueError(
            f"{name} has shape {shape}; it must have shape {allowed}. Fix: one number, or an "
            "array of the state's shape (a tolerance per component)."
        )
    known = known_values(name, value)
    if known is not None and not (np.all(known > 0) and np.all(np.isfinite(known))):
        raise ValueError(f"{name}={value} must be positive and finite. {fix}")
    dtype = np.dtype(dtype if y is None else jnp.finfo(y.dtype).dtype)
    converted = as_array(value, dtype)
    if known is not None and not np.all(np.asarray(converted) > 0):
        raise ValueError(
            f"{name}={value} underflows to 0 in {dtype.name}, the precision of the state. Fix: "
            f"pass a tolerance above {np.finfo(dtype).tiny:.1e}, or solve in float64."
        )
    return converted


def warn_below_resolution(name: str, rtol, y0: Y) -> None:
    """Warn if a known `rtol` (called `name`) is below the resolution of the dtype of a leaf it
    applies to, where the solve raises it to that resolution (`resolvable_rtol`)."""
    for r, y in zip(jax.tree.leaves(per_leaf(rtol, y0)), jax.tree.leaves(y0), strict=True):
        known = known_values(name, r)
        eps = jnp.finfo(y.dtype).eps
        if known is not None and known.size and np.min(known) < eps:
            warnings.warn(
                f"{name} = {np.min(known):g} is below the resolution of {y.dtype} (eps = "
                f"{eps:.1e}): rounding errors in y alone exceed it, so the steps are held to "
                f"rtol = {eps:.1e} instead (`sol.stats.rtol_clamped` is True), and the result "
                f"is no more accurate than {y.dtype} allows. Fix: use rtol >= {10 * eps:.0e}, "
                'or solve in float64: `jax.config.update("jax_enable_x64", True)` at the start '
                "of the program, and a float64 y0.",
                stacklevel=3,
            )
            return


def concrete(x) -> np.ndarray | None:
    """The value of `x` if it is known at trace time, else `None`."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def step_size(dt0, t0: Scalar, t1: Scalar, checks: TracedChecks) -> Scalar | None:
    """`dt0` (`None`, or a scalar of `t0`'s dtype), raising unless it is finite, non-zero and
    points from `t0` to `t1` (any finite value when `t0 == t1`): now if the values are known,
    at run time if traced."""
    if dt0 is None:
        return None
    dt0 = _real_number("dt0", dt0, t0.dtype, "0.01")
    if dt0.shape != ():
        raise ValueError(f"dt0 must be a scalar, got shape {dt0.shape}. Fix: pass e.g. dt0=0.01.")
    message = (
        "dt0 must be finite, non-zero and have the sign of t1 - t0. Fix: pass e.g. "
        "dt0=(t1 - t0) / 100, or dt0=None to choose it automatically."
    )
    dt, t0_value, t1_value = concrete(dt0), concrete(t0), concrete(t1)
    if dt is None or t0_value is None or t1_value is None:
        span = t1 - t0
        wrong_way = (span != 0) & (jnp.sign(dt0) != jnp.sign(span))
        return checks.require(dt0, ~jnp.isfinite(dt0) | wrong_way, message)
    if t0_value == t1_value:
        return dt0
    if dt == 0:
        raise ValueError("dt0=0 would never advance. Fix: pass a non-zero dt0 or dt0=None.")
    if not np.isfinite(dt):
        raise ValueError(f"dt0={dt} is not finite. Fix: pass a finite dt0, or dt0=None.")
    if np.sign(dt) != np.sign(t1_value - t0_value):
        raise ValueError(
            f"dt0={float(dt)} points away from t1 (t0={float(t0_value)}, t1={float(t1_value)}). "
            "Fix: give dt0 the sign of t1 - t0."
        )
    return dt0


def check_save_times(ts, t0: Scalar, t1: Scalar, checks: TracedChecks):
    """`ts`, raising (at run time if traced) unless sorted along the direction of integration and
    inside the span."""
    message = (
        "SaveAt(ts=...) must be finite, sorted in the direction of integration and lie within "
        "[t0, t1]. Fix: e.g. `ts = jnp.linspace(t0, t1, n)`."
    )
    values, t0_value, t1_value = concrete(ts), concrete(t0), concrete(t1)
    if values is not None and t0_value is not None and t1_value is not None:
        lo, hi = min(t0_value, t1_value), max(t0_value, t1_value)
        order = np.diff(values) * (1 if t1_value >= t0_value else -1)
        inside = (values >= lo) & (values <= hi)  # False for NaN
        if np.any(order < 0) or not np.all(inside):
            raise ValueError(message + f" Got ts={values} for t_span=({t0_value}, {t1_value}).")
        return ts
    direction = jnp.where(t1 >= t0, 1, -1)
    inside = (ts >= jnp.minimum(t0, t1)) & (ts <= jnp.maximum(t0, t1))
    bad = jnp.any(jnp.diff(ts) * direction < 0) | ~jnp.all(inside)
    return checks.require(ts, bad, message)


def events(event) -> tuple | None:
    """`event` (an `Event`, a sequence of them, or `None`) as a tuple of `Event`s, or `None`."""
    if event is None:
        return None
    items = tuple(event) if isinstance(event, list | tuple) else (event,)
    for item in items:
        if not isinstance(item, Event):
            raise TypeError(
                f"event={item!r} is not an event. Fix: pass `odeckpt.Event(fn)` or a tuple of "
                "them, e.g. `event=odeckpt.Event(lambda t, y, args: y[0])`."
            )
    if not items:
        return None
    return items


def check_events(events: tuple, t0: Scalar, y0: Y, args: Args) -> None:
    """Raise unless every event's `fn(t, y, args)` returns a real floating scalar and its
    `update(t, y, args)` the structure, shapes and dtypes of `y0`."""
    for i, event in enumerate(events):
        name = "event" if len(events) == 1 else f"event[{i}]"
        out = eqx.filter_eval_shape(event.fn, t0, y0, args)
        fix = (
            "Fix: return a real number whose sign changes at the event, e.g. "
            "`y[0] - threshold` (not `y[0] > threshold`)"
        )
        if not isinstance(out, jax.ShapeDtypeStruct):
            raise TypeError(
                f"{name}.fn(t, y, args) returned {type(out).__name__}, not one scalar. {fix}."
            )
        if out.shape != ():
            raise ValueError(
                f"{name}.fn(t, y, args) returned shape {out.shape}; it must be a scalar. {fix}; "
                "for several conditions pass several events, `event=(Event(f1), Event(f2))`."
            )
        if not jnp.issubdtype(out.dtype, jnp.floating):
            raise TypeError(
                f"{name}.fn(t, y, args) returned dtype {out.dtype}; it must be a real floating "
                f"scalar. {fix}, as a float (`jnp.real(z)` of a complex value)."
            )
        if event.update is not None:
            _check_update(name, event.update, t0, y0, args)


def _check_update(name: str, update, t0: Scalar, y0: Y, args: Args) -> None:
    out = eqx.filter_eval_shape(update, t0, y0, args)
    expected = jax.eval_shape(lambda: y0)
    fix = (
        "Fix: return the new state with exactly the structure, shapes and dtypes of y, e.g. "
        "`y.at[1].set(-e * y[1])`."
    )
    if jax.tree.structure(out) != jax.tree.structure(expected):
        raise ValueError(
            f"{name}.update(t, y, args) returned the structure {jax.tree.structure(out)}, but "
            f"the state has {jax.tree.structure(expected)}. {fix}"
        )
    for o, e in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        if o.shape != e.shape or o.dtype != e.dtype:
            raise ValueError(
                f"{name}.update(t, y, args) returned {o.dtype}{list(o.shape)} for a state leaf "
                f"of {e.dtype}{list(e.shape)}. {fix}"
            )


def jump_times(jump_ts, dtype, checks: TracedChecks):
    """`jump_ts` (known discontinuities) as a 1-D array of `dtype`, or `None`."""
    if jump_ts is None:
        return None
    values = _real_number("jump_ts", jump_ts, dtype, "jnp.array([1.0, 2.0])")
    if values.ndim != 1 or values.shape[0] == 0:
        raise ValueError(
            f"jump_ts must be a non-empty 1-D array of times, got shape {values.shape}. Fix: "
            "pass e.g. `jump_ts=jnp.array([1.0, 2.0])`."
        )
    return _finite("jump_ts", values, checks)
