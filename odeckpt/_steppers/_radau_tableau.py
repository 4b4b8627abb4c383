"""The validated, frozen coefficients of a three-stage collocation method solved in Hairer and
Wanner's transformed form (Radau IIA)."""

import dataclasses

import numpy as np
import numpy.typing as npt

from ._tableau import COEFFICIENT_TOLERANCE, frozen


@dataclasses.dataclass(frozen=True, eq=False)
class CollocationTableau:
    """The coefficients of a stiffly accurate three-stage collocation method whose stage matrix
    has one real eigenvalue and a complex pair (Radau IIA of order 5), checked once at
    construction.

    With `h = t1 - t0`, the stage increments `Z_i = Y_i - y0` solve
    `Z_i = h sum_j a_ij f(t0 + c_j h, y0 + Z_j)`, and `y1 = y0 + Z_3` (`c_3 = 1`). The error
    estimate is Hairer and Wanner's `(I - h gamma J)^{-1} (h gamma f(t0, y0) + gamma sum_i
    e_i Z_i)`, the difference from an embedded third-order solution that uses `f(t0, y0)`,
    filtered by `(I - h gamma J)^{-1}` so that it stays bounded on stiff components.

    **Arguments:**

    - `a`: `(3, 3)` stage matrix; `c`: `(3,)` nodes, `c_i = sum_j a_ij`, `c_3 = 1`.
    - `error`: `(3,)` the weights `e_i` of the error estimate, in units of `gamma`.

    Raises `ValueError`, naming the violated condition: the rows of `a` must not sum to `c`,
    the method must be a collocation method (stage order 3: `sum_j a_ij c_j^(q-1) = c_i^q / q`
    for `q = 1, 2, 3`), `a` must have one real eigenvalue and a complex pair, and the embedded
    solution must be of order 3.

    **Derived fields:** `gamma` (the real eigenvalue of `a`), `eigenvalue` (the complex one with
    positive imaginary part, `alpha + i beta`), `transform` `T` and `inverse` `T^{-1}` with
    `T^{-1} a T = [[gamma, 0, 0], [0, alpha, beta], [0, -beta, alpha]]` (the simplified Newton
    iteration then decouples into one real and one complex system), `dense`: the `(3, 3)`
    weights over the `Z_i` of the collocation polynomial's powers `theta^1..theta^3`, and
    `derivative`: the weights over the `Z_i` of `h f(t1, y1)` (the last row of `a^{-1}`).

    **References:** Hairer & Wanner, *Solving ODEs II*, Sec. IV.5 (Radau IIA) and IV.8
    (implementation: the transformed system, the error estimate (8.19)-(8.20)).
    """

    a: np.ndarray
    c: np.ndarray
    error: np.ndarray

    gamma: float = dataclasses.field(init=False)
    eigenvalue: complex = dataclasses.field(init=False)
    transform: np.ndarray = dataclasses.field(init=False)
    inverse: np.ndarray = dataclasses.field(init=False)
    dense: np.ndarray = dataclasses.field(init=False)
    derivative: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self):
        a, c, error = (
            frozen(self.a, "a", 2),
            frozen(self.c, "c", 1),
            frozen(self.error, "error", 1),
        )
        if a.shape != (3, 3) or c.shape != (3,) or error.shape != (3,):
            raise ValueError(f"Shapes must be a: (3, 3), c, error: (3,); got {a.shape}, {c.shape}.")
        if (
            np.any(np.abs(a.sum(axis=1) - c) > COEFFICIENT_TOLERANCE)
            or abs(c[-1] - 1) > COEFFICIENT_TOLERANCE
        ):
            raise ValueError("Each c_i must equal sum_j a_ij, and c_3 must be 1.")
        for q in (1, 2, 3):
            if np.any(np.abs(a @ c ** (q - 1) - c**q / q) > COEFFICIENT_TOLERANCE):
                raise ValueError(
                    f"Not a collocation method: sum_j a_ij c_j^{q - 1} != c_i^{q}/{q}."
                )
        # numpy's stubs give `.real` and `.imag` only to arrays of an inexact dtype.
        values: npt.NDArray[np.inexact]
        vectors: npt.NDArray[np.inexact]
        values, vectors = np.linalg.eig(a)
        real = np.flatnonzero(np.abs(values.imag) < COEFFICIENT_TOLERANCE)
        pair = np.flatnonzero(values.imag > COEFFICIENT_TOLERANCE)
        if real.size != 1 or pair.size != 1:
            raise ValueError(f"`a` must have one real eigenvalue and a complex pair; got {values}.")
        gamma = float(values[real[0]].real)
        u, v = vectors[:, real[0]].real, vectors[:, pair[0]]
        transform = np.stack([u, v.real, v.imag], axis=1)
        inverse = np.linalg.inv(transform)
        _check_embedded(a, c, error, gamma)
        vandermonde = c[:, None] ** np.arange(1, 4)[None, :]
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name, value in (
            ("a", a), ("c", c), ("error", error), ("transform", transform),
            ("inverse", inverse), ("dense", np.linalg.inv(vandermonde)),
            ("derivative", np.linalg.inv(a)[-1]),
        ):  # fmt: skip
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
            set_(name, value)
        set_("gamma", gamma)
        set_("eigenvalue", complex(values[pair[0]]))


def _check_embedded(a: np.ndarray, c: np.ndarray, error: np.ndarray, gamma: float) -> None:
    """The embedded solution `y0 + h (gamma f0 + sum_i bhat_i f(Y_i))`, `bhat = b + gamma a^T
    e`, must be of order 3: its weights at the nodes `(0, c)` integrate `1, t, t^2` exactly."""
    weights = np.concatenate([[gamma], a[-1] + gamma * a.T @ error])
    nodes = np.concatenate([[0.0], c])
    for q in (1, 2, 3):
        if abs(weights @ nodes ** (q - 1) - 1 / q) > COEFFICIENT_TOLERANCE:
            raise ValueError(f"The embedded solution is not of order 3 (condition q = {q}).")


_S6 = np.sqrt(6.0)
RADAU_IIA_5 = CollocationTableau(
    a=np.array(
        [
            [(88 - 7 * _S6) / 360, (296 - 169 * _S6) / 1800, (-2 + 3 * _S6) / 225],
            [(296 + 169 * _S6) / 1800, (88 + 7 * _S6) / 360, (-2 - 3 * _S6) / 225],
            [(16 - _S6) / 36, (16 + _S6) / 36, 1 / 9],
        ]
    ),
    c=np.array([(4 - _S6) / 10, (4 + _S6) / 10, 1.0]),
    error=np.array([-(13 + 7 * _S6) / 3, (-13 + 7 * _S6) / 3, -1 / 3]),
)
"""Radau IIA of order 5 (Hairer & Wanner, *Solving ODEs II*, Table IV.5.6), with the error
estimate of their RADAU5 code."""
