"""The validated, frozen coefficients of an ESDIRK method (explicit first stage, singly
diagonally implicit, stiffly accurate)."""

import dataclasses

import numpy as np

from ._tableau import COEFFICIENT_TOLERANCE, frozen, hermite_weights


@dataclasses.dataclass(frozen=True, eq=False)
class ESDIRKTableau:
    """The coefficients of an ESDIRK method, checked once at construction.

    With `h = t1 - t0`: `k_1 = f(t0, y0)`; for `i >= 2` the stage value `z_i` solves
    `z_i = y0 + h sum_{j<i} a_ij k_j + h gamma f(t0 + c_i h, z_i)` and `k_i = f(t0 + c_i h, z_i)`;
    `y1 = z_s` (stiffly accurate: the last row of `a` is `b`), so `k_s = f(t1, y1)` is the next
    step's `k_1` and the cubic Hermite interpolant through `(y0, k_1, y1, k_s)` is the dense
    output.

    **Arguments:**

    - `a`: `(s, s)` lower-triangular stage matrix with `a_11 = 0` and `a_ii = gamma` for `i >= 2`.
    - `c`: `(s,)` stage nodes, `c_i = sum_j a_ij` (so `c_1 = 0` and `c_s = 1`).
    - `b_error`: `(s,)` weights of the error estimate `y1 - y1_hat = h sum_i e_i k_i`; they sum
        to 0.
    - `predictor`: `(s, s)` strictly lower-triangular weights of the Newton starting guess
        `k_i ~ sum_{j<i} alpha_ij k_j` (rows `i >= 2` sum to 1), i.e. the stage derivative
        interpolated from earlier ones.

    Raises `ValueError`, naming the violated condition, on inconsistent data.

    **Derived fields:** `num_stages` (`s`), `gamma`, `b` (the last row of `a`), and
    `dense_weights`, the `(3, s)` weights over the stages of the powers `theta^1..theta^3`.
    """

    a: np.ndarray
    c: np.ndarray
    b_error: np.ndarray
    predictor: np.ndarray

    num_stages: int = dataclasses.field(init=False)
    gamma: float = dataclasses.field(init=False)
    b: np.ndarray = dataclasses.field(init=False)
    dense_weights: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        a, c = frozen(self.a, "a", 2), frozen(self.c, "c", 1)
        b_error, predictor = (
            frozen(self.b_error, "b_error", 1),
            frozen(self.predictor, "predictor", 2),
        )
        s = c.shape[0]
        if s < 2 or a.shape != (s, s) or b_error.shape != (s,) or predictor.shape != (s, s):
            raise ValueError(
                "Shapes must be a: (s, s), c: (s,), b_error: (s,), predictor: (s, s) with s >= 2; "
                f"got {a.shape}, {c.shape}, {b_error.shape}, {predictor.shape}."
            )
        if np.any(np.triu(a, 1) != 0) or np.any(np.triu(predictor) != 0):
            raise ValueError("`a` must be lower triangular and `predictor` strictly lower.")
        gamma = a[1, 1]
        if a[0, 0] != 0 or not gamma > 0 or np.any(np.diag(a)[1:] != gamma):
            raise ValueError("The diagonal of `a` must be (0, gamma, ..., gamma), gamma > 0.")
        bad = np.flatnonzero(np.abs(a.sum(axis=1) - c) > COEFFICIENT_TOLERANCE)
        if bad.size:
            raise ValueError(f"Each c_i must equal sum_j a_ij; violated at rows {bad.tolist()}.")
        if abs(c[-1] - 1) > COEFFICIENT_TOLERANCE or abs(a[-1].sum() - 1) > COEFFICIENT_TOLERANCE:
            raise ValueError("The last row of `a` (= b, stiffly accurate) must sum to 1.")
        if abs(b_error.sum()) > COEFFICIENT_TOLERANCE:
            raise ValueError(f"sum(b_error) must equal 0, got {b_error.sum()!r}.")
        if np.any(np.abs(predictor[1:].sum(axis=1) - 1) > COEFFICIENT_TOLERANCE):
            raise ValueError("Rows 2..s of `predictor` must sum to 1.")
        weights = hermite_weights(a[-1], s - 1)
        weights.flags.writeable = False
        for name, value in (("a", a), ("c", c), ("b_error", b_error), ("predictor", predictor)):
            set_(name, value)
        set_("num_stages", s)
        set_("gamma", float(gamma))
        set_("b", a[-1])
        set_("dense_weights", weights)
