"""Butcher tableaux: the validated, frozen coefficients of an explicit Runge-Kutta method."""

import dataclasses

import numpy as np
from numpy.typing import ArrayLike

COEFFICIENT_TOLERANCE = 1e-12


def frozen(x: ArrayLike, what: str, ndim: int) -> np.ndarray:
    array = np.array(x, dtype=np.float64)
    if array.ndim != ndim:
        raise ValueError(f"`{what}` must be a {ndim}-d array, got shape {array.shape}.")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"`{what}` must be finite.")
    array.flags.writeable = False
    return array


def hermite_weights(b: np.ndarray, i_f1: int) -> np.ndarray:
    """Weights of the cubic Hermite interpolant through `(y0, f0, y1, f1)`.

    With `y1 - y0 = h sum_i b_i k_i`, `f0 = k_1` and `f1` the stage at index `i_f1`,
    `y(theta) = y0 + theta h f0 + theta^2 (3 dy - 2 h f0 - h f1) + theta^3 (h f0 + h f1 - 2 dy)`.
    """
    f0 = np.zeros_like(b)
    f0[0] = 1.0
    f1 = np.zeros_like(b)
    f1[i_f1] = 1.0
    return np.stack([f0, 3 * b - 2 * f0 - f1, f0 + f1 - 2 * b])


@dataclasses.dataclass(frozen=True, eq=False)
class ButcherTableau:
    """The coefficients of an explicit Runge-Kutta method, checked once at construction.

    With `h = t1 - t0`, stages `k_i = f(t0 + c_i h, y0 + h sum_{j<i} a_ij k_j)` and
    `y1 = y0 + h sum_i b_i k_i`.

    **Arguments:**

    - `a`: `(s, s)` strictly lower-triangular stage matrix.
    - `b`: `(s,)` weights of the propagated solution; they sum to 1.
    - `c`: `(s,)` stage nodes; `c_i = sum_j a_ij` (so `c_1 = 0`).
    - `b_error`: `(s,)` weights of the embedded error estimate `y1 - y1_hat = h sum_i e_i k_i`,
        i.e. `b - b_hat`; they sum to 0. `None` for a method without an embedded pair.
    - `b_dense`: `(degree, s)` native continuous extension: `y(theta) = y0 + h sum_i b_i(theta)
        k_i` with `b_i(theta) = sum_{j=1}^{degree} b_dense[j - 1, i] theta^j`, so that summing
        over powers gives `b`. `None` selects the cubic Hermite interpolant through
        `(y0, f0, y1, f1)` (Hairer, Norsett & Wanner vol. I, Sec. II.6).

    Raises `ValueError`, naming the violated condition, on inconsistent data.

    **Derived fields:**

    - `num_stages`: `s`.
    - `fsal`: whether the last stage is `f(t1, y1)` ("first same as last": `c_s = 1`,
        `a_s = b`, `b_s = 0`), in which case it is free to hand on as the next step's `k_1`.
    - `fn_evals_per_step`: evaluations of `f` per step when `k_1` comes from the previous step
        and `f(t1, y1)` is always computed (the next `k_1`): `s - 1` if FSAL, else `s`.
    - `dense_weights`: `(degree, s + (not fsal))` weights over the stages, with `f(t1, y1)`
        appended when it is not already the last stage, of the powers `theta^1 ... theta^degree`.
    - `dense_degree`: degree of the continuous extension.
    """

    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    b_error: np.ndarray | None = None
    b_dense: np.ndarray | None = None

    num_stages: int = dataclasses.field(init=False)
    fsal: bool = dataclasses.field(init=False)
    fn_evals_per_step: int = dataclasses.field(init=False)
    dense_weights: np.ndarray = dataclasses.field(init=False)
    dense_degree: int = dataclasses.field(init=False)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        a, b, c = frozen(self.a, "a", 2), frozen(self.b, "b", 1), frozen(self.c, "c", 1)
        s = b.shape[0]
        if s == 0:
            raise ValueError("A tableau needs at least one stage: `b` is empty.")
        if a.shape != (s, s) or c.shape != (s,):
            raise ValueError(
                f"Shapes must be a: (s, s), b: (s,), c: (s,); got a: {a.shape}, b: {b.shape}, "
                f"c: {c.shape}."
            )
        if np.any(np.triu(a) != 0):
            raise ValueError("`a` must be strictly lower triangular (explicit method).")
        bad = np.flatnonzero(np.abs(a.sum(axis=1) - c) > COEFFICIENT_TOLERANCE)
        if bad.size:
            raise ValueError(f"Each c_i must equal sum_j a_ij; violated at rows {bad.tolist()}.")
        if abs(b.sum() - 1) > COEFFICIENT_TOLERANCE:
            raise ValueError(f"sum(b) must equal 1 (consistency), got {b.sum()!r}.")
        set_("a", a)
        set_("b", b)
        set_("c", c)

        if self.b_error is not None:
            b_error = frozen(self.b_error, "b_error", 1)
            if b_error.shape != (s,):
                raise ValueError(f"`b_error` must have shape ({s},), got {b_error.shape}.")
            if abs(b_error.sum()) > COEFFICIENT_TOLERANCE:
                raise ValueError(f"sum(b_error) must equal 0, got {b_error.sum()!r}.")
            set_("b_error", b_error)

        fsal = s > 1 and c[-1] == 1 and b[-1] == 0 and np.array_equal(a[-1, :-1], b[:-1])
        num_ext = s if fsal else s + 1
        if self.b_dense is None:
            weights = hermite_weights(np.pad(b, (0, num_ext - s)), num_ext - 1)
        else:
            b_dense = frozen(self.b_dense, "b_dense", 2)
            if b_dense.shape[0] < 1 or b_dense.shape[1] != s:
                raise ValueError(f"`b_dense` must have shape (degree, {s}), got {b_dense.shape}.")
            if np.any(np.abs(b_dense.sum(axis=0) - b) > COEFFICIENT_TOLERANCE):
                raise ValueError(
                    "`b_dense` summed over powers must equal `b` (dense output at theta=1 is y1)."
                )
            set_("b_dense", b_dense)
            weights = np.pad(b_dense, ((0, 0), (0, num_ext - s)))
        weights.flags.writeable = False

        set_("num_stages", s)
        set_("fsal", bool(fsal))
        set_("fn_evals_per_step", s - 1 if fsal else s)
        set_("dense_weights", weights)
        set_("dense_degree", weights.shape[0])
