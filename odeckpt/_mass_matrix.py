"""The public mass matrix of a differential-algebraic equation `M y' = f(t, y, args)`, and its
resolution into the flat real coordinates the steppers solve in."""

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from ._checks import tightest
from ._real_coordinates import RealCoordinates
from ._steppers import FlatMass
from ._types import Y

_INITIAL = ("solve", "check")


class MassMatrix(eqx.Module):
    """The constant mass matrix `M` of a differential-algebraic equation (DAE)
    `M y' = f(t, y, args)`, for `odeckpt.solve(..., mass_matrix=...)`. A singular `M` makes
    the rows of `f` that `M` leaves without derivatives algebraic equations, and the variables
    in its null space algebraic variables; the DAE must be of index 1 (the algebraic equations
    determine the algebraic variables: their Jacobian in them is invertible). A solve with an
    invertible `M` is an implicit ODE.

    **Arguments:**

    - `matrix`: `M` as an `(n, n)` NumPy-convertible array over the state raveled by
        `jax.flatten_util.ravel_pytree` (for a complex state, over its `n` complex components;
        or `(2n, 2n)` over its real coordinates, each real part followed by its imaginary
        part). It must be a constant known at call time, not a traced value: a parameter in
        `M` belongs in `f` (divide its row by it).
    - `diagonal`: instead of `matrix`, a diagonal `M` as a pytree shaped like the state whose
        leaves are numbers or arrays broadcastable to the state's leaves, e.g.
        `{"x": 1.0, "z": 0.0}` for a differential `x` and an algebraic `z`.
    - `initial`: `"solve"` (the default) finds the algebraic part of `y0` by Newton's method on
        the algebraic equations at `t0`, starting from the given values (and again after each
        event's `update` jump and at each time of `jump_ts`), leaving the differential part as
        given; `"check"` leaves `y0`
        as given and fails (`Status.inconsistent_initial_values`) where it violates the
        algebraic equations beyond the tolerances. Either way the derivatives of the solution
        in `y0` and the parameters are those of consistent initial values.

    **Example:** Robertson's chemical kinetics with its conservation law as the algebraic
    equation:

    ```python
    import jax.numpy as jnp
    import odeckpt

    def robertson(t, y, k):
        return jnp.stack([
            -k[0] * y[0] + k[2] * y[1] * y[2],
            k[0] * y[0] - k[1] * y[1] ** 2 - k[2] * y[1] * y[2],
            y[0] + y[1] + y[2] - 1.0,
        ])

    mass = odeckpt.MassMatrix(jnp.diag(jnp.array([1.0, 1.0, 0.0])))
    sol = odeckpt.solve(robertson, jnp.array([1.0, 0.0, 0.0]), (0.0, 1e5),
                        args=jnp.array([0.04, 3e7, 1e4]), solver=odeckpt.Radau5(),
                        mass_matrix=mass, rtol=1e-6, atol=1e-10)
    ```

    **References:** E. Hairer & G. Wanner, *Solving ODEs II*, 2nd ed. (1996), Sec. VI.1;
    P. N. Brown, A. C. Hindmarsh & L. R. Petzold, *SIAM J. Sci. Comput.* 19 (1998), 1495-1512
    (consistent initial values).
    """

    matrix: np.ndarray | None
    diagonal: Y
    initial: str = eqx.field(static=True)

    def __init__(self, matrix=None, *, diagonal=None, initial: str = "solve"):
        if (matrix is None) == (diagonal is None):
            raise ValueError(
                "MassMatrix needs exactly one of `matrix` and `diagonal`. Fix: "
                "`MassMatrix(M)` for an (n, n) matrix, or `MassMatrix(diagonal={...})` shaped "
                "like the state."
            )
        if initial not in _INITIAL:
            raise ValueError(f"MassMatrix(initial={initial!r}) must be one of {_INITIAL}.")
        self.matrix = None if matrix is None else _constant("matrix", matrix)
        if self.matrix is not None and (self.matrix.ndim != 2 or len(set(self.matrix.shape)) != 1):
            raise ValueError(
                f"MassMatrix(matrix) must be square, got shape {self.matrix.shape}. Fix: pass "
                "the (n, n) matrix over the raveled state."
            )
        self.diagonal = None if diagonal is None else jax.tree.map(_diagonal_leaf, diagonal)
        self.initial = initial

    def resolve(self, y0: Y, rtol, atol) -> FlatMass:
        """`M` over the real coordinates of states shaped like `y0`, with its algebraic
        structure, the constraints to be held to `rtol` and `atol` (the solve's)."""
        coordinates, flat = RealCoordinates.make(y0)
        m, n = flat.shape[0], coordinates.num_components
        if self.matrix is not None:
            matrix = self.matrix
            if matrix.shape == (n, n) and coordinates.has_complex:
                matrix = np.asarray(coordinates.real_matrix(jnp.asarray(matrix)))
            elif matrix.shape != (m, m):
                sizes = f"({n}, {n})" + ("" if m == n else f" or ({m}, {m})")
                raise ValueError(
                    f"mass_matrix has shape {matrix.shape} but the state has {n} components, "
                    f"so it must be {sizes} over the state raveled by "
                    "`jax.flatten_util.ravel_pytree`."
                )
            if np.iscomplexobj(matrix):
                raise ValueError(
                    "mass_matrix is complex for a real state. Fix: a real matrix (for a "
                    "complex state, give it over the complex components)."
                )
        else:
            matrix = np.diag(_flat_diagonal(self.diagonal, y0, coordinates))
        return _structure(np.asarray(matrix, np.float64), tightest(rtol), tightest(atol),
                          self.initial)  # fmt: skip


def _constant(name: str, value) -> np.ndarray:
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"MassMatrix({name}) is a traced value; it must be a constant known at call time. "
            "Fix: pass a NumPy array (or a concrete jax array); a parameter in M belongs in "
            "`f` (divide its row of the equations by it)."
        )
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.number) or not np.all(np.isfinite(array)):
        raise ValueError(f"MassMatrix({name}) must hold finite numbers, got {value!r}.")
    return array


def _diagonal_leaf(leaf) -> np.ndarray:
    array = _constant("diagonal", leaf)
    if np.iscomplexobj(array):
        raise ValueError("MassMatrix(diagonal=...) must be real (1.0 differential, 0.0 algebraic).")
    return array.astype(np.float64)


def _flat_diagonal(diagonal: Y, y0: Y, coordinates: RealCoordinates) -> np.ndarray:
    """The diagonal over the real coordinates: each leaf broadcast to the state's leaf, a
    complex component's entry repeated for its real and imaginary parts."""
    try:
        entries = jax.tree.map(lambda d, y: np.broadcast_to(d, np.shape(y)), diagonal, y0)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "MassMatrix(diagonal=...) must be shaped like the state: a pytree of the same "
            "structure whose leaves broadcast to the state's leaves (e.g. "
            f"{{'x': 1.0, 'z': 0.0}}). ({error})"
        ) from None
    parts = [
        np.repeat(np.ravel(d), 2) if c else np.ravel(d)
        for d, c in zip(jax.tree.leaves(entries), coordinates.is_complex, strict=True)
    ]
    return np.concatenate(parts) if parts else np.zeros((0,))


def _structure(matrix: np.ndarray, rtol, atol, initial: str) -> FlatMass:
    """`matrix` with orthonormal bases of its null space and of that of its transpose (from the
    singular value decomposition, rank to the usual relative tolerance)."""
    u, singular, vt = np.linalg.svd(matrix)
    size = matrix.shape[0]
    largest = singular[0] if size else 0.0
    rank = int(np.sum(singular > size * np.finfo(np.float64).eps * largest))
    return FlatMass(
        matrix=matrix, algebraic=np.ascontiguousarray(vt[rank:].T),
        constraints=np.ascontiguousarray(u[:, rank:]), rtol=rtol, atol=atol, initial=initial,
    )  # fmt: skip
