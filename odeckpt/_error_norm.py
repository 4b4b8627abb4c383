"""The scaled error norm that judges a step: one definition for the step-size controllers and
for the steppers that propose their own step sizes (`Radau5`, `BDF`), so that both judge a
step alike."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ._types import BoolScalar, Scalar, Y


def rms(y: Y, scale: Y) -> Scalar:
    """The root mean square of `y / scale` over every component; NaN if any is NaN."""
    squares = jax.tree.leaves(jax.tree.map(lambda a, s: jnp.sum(jnp.abs(a / s) ** 2), y, scale))
    size = sum(leaf.size for leaf in jax.tree.leaves(y))
    mean = sum(squares) / max(size, 1)  # a state without components has no error
    # sqrt has an infinite derivative at 0 (a zero error, or a masked zero-length step under
    # vmap); keep it out of the gradient so that it cannot turn into NaN. A NaN mean stays NaN.
    positive = mean > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, mean, 1)), mean)


TOLERANCE_REFERENCE = 1e-3
"""The default `rtol` at which a stepper's steps are held to the solve's tolerances whatever its
`tolerance_exponent` (`AbstractStepper.tolerance_reference`)."""


def effective_tolerances(
    rtol, atol, exponent: float, dtype, reference: float = TOLERANCE_REFERENCE
) -> tuple:
    """The tolerances a stepper with `tolerance_exponent = exponent` and `tolerance_reference =
    reference` holds its steps to when the solve asks for `rtol` and `atol` on a state of
    `dtype`: `rtol' = r0 (rtol / r0) ** exponent` with `r0 = reference`, but not below
    `min(rtol, 1000 eps)` (the error estimates of steps held tighter would be rounding noise),
    and `atol' = atol rtol' / rtol` (the ratio `atol / rtol`, which says where a component
    counts as small, is kept). The identity for `exponent = 1`, except that an `rtol` below the
    resolution of `dtype` is first raised to it (`resolvable_rtol`).

    With error-per-step control, a method whose error estimate is of its own order (implicit
    Euler, BDF), or whose order drops on stiff components (ESDIRK and Rosenbrock methods),
    makes a global error `C tol ** s` with `s < 1`; `exponent = 1 / s` makes it proportional
    to `rtol`. A method whose estimate is of lower order than the method (Radau IIA: order 5,
    estimate of order 3) makes `s > 1`, and `exponent < 1` makes it proportional, as Hairer
    and Wanner's RADAU5 does with its own transformation.

    **Example:**

    ```python
    from odeckpt._error_norm import effective_tolerances

    rtol, atol = effective_tolerances(1e-8, 1e-10, 1.25, "float64")  # about 5.6e-10, 5.6e-12
    ```

    **References:** Hairer & Wanner, *Solving ODEs II*, Sec. IV.8 (RADAU5's tolerances);
    D. J. Higham, "Global error versus tolerance for explicit Runge-Kutta methods", *IMA J.
    Numer. Anal.* 11 (1991), 457-480.
    """
    rtol = resolvable_rtol(rtol, dtype)
    if exponent == 1:
        return rtol, atol
    floor = jnp.minimum(rtol, 1000 * float(np.finfo(np.dtype(dtype)).eps))
    effective = jnp.maximum(reference * (rtol / reference) ** exponent, floor)
    return effective, atol * effective / rtol


def resolvable_rtol(rtol, dtype):
    """`rtol`, raised to the resolution of `dtype` (its machine epsilon: 1.2e-7 in float32)
    where it is below: the rounding of the state alone exceeds a tighter tolerance, and steps
    held to it would be rejected until the solve ran out of steps. `atol` needs no such floor
    (small components resolve small errors). `Stats.rtol_clamped` reports a raised `rtol`."""
    eps = float(np.finfo(np.dtype(dtype)).eps)
    if isinstance(rtol, int | float):
        return max(float(rtol), eps)
    return jnp.maximum(rtol, eps)


def below_resolution(rtol, y: Y) -> BoolScalar:
    """Whether `rtol` (a number, or a pytree of them like `y`) is below the resolution of the
    dtype of a leaf of `y` it applies to somewhere: whether `resolvable_rtol` raises it."""
    pairs = zip(jax.tree.leaves(per_leaf(rtol, y)), jax.tree.leaves(y), strict=True)
    checks = [jnp.any(jnp.asarray(r) < np.finfo(leaf.dtype).eps) for r, leaf in pairs]
    return functools.reduce(jnp.logical_or, checks, jnp.array(False))


def real_dtype(y: Y):
    """The real dtype of the state `y`'s widest leaf (that of its precision)."""
    return jnp.finfo(jnp.result_type(*jax.tree.leaves(y))).dtype


def scaled_error(y_error: Y, y0: Y, y1: Y, rtol, atol) -> Scalar:
    """The root mean square over every component of `y_error / (atol + rtol max(|y0|, |y1|))`:
    a step whose error estimate is `y_error` is accepted when this is at most 1. `rtol` and
    `atol` are numbers (traced or not) or pytrees of them like `y0` (one per leaf).

    **Example:**

    ```python
    import jax.numpy as jnp
    from odeckpt._error_norm import scaled_error

    error = scaled_error(jnp.array([1e-7]), jnp.array([1.0]), jnp.array([0.9]), 1e-6, 1e-8)
    ```
    """
    scale = jax.tree.map(
        lambda a, b, at, rt: at + rt * jnp.maximum(jnp.abs(a), jnp.abs(b)),
        y0, y1, per_leaf(atol, y0), per_leaf(rtol, y0),
    )  # fmt: skip
    return rms(y_error, scale)


def scaled_distance(y: Y, other: Y, rtol, atol, *, symmetric: bool = True) -> Scalar:
    """How far the state `y` lies from `other`: the root mean square over every component of
    `(y - other) / (atol + rtol m)`, `m` the larger of `|y|` and `|other|` (`symmetric=False`:
    `|other|` alone, the distance from a reference state). `rtol` and `atol` as in
    `scaled_error`.

    **Example:**

    ```python
    import jax.numpy as jnp
    from odeckpt._error_norm import scaled_distance

    distance = scaled_distance(jnp.array([1.001]), jnp.array([1.0]), 1e-3, 1e-6)  # about 1
    ```
    """
    difference = jax.tree.map(jnp.subtract, y, other)
    return scaled_error(difference, y if symmetric else other, other, rtol, atol)


def per_leaf(tolerance, y: Y) -> Y:
    """A tolerance as a pytree like `y`: itself if it is one (a tolerance per leaf), else the one
    number repeated for every leaf."""
    if jax.tree.structure(tolerance) == jax.tree.structure(y):
        return tolerance
    return jax.tree.map(lambda _: tolerance, y)
