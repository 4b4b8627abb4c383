"""The real coordinates in which the implicit steppers solve: the state raveled into one real
vector, each complex number as its (real, imaginary) pair.

Newton's method, its Jacobian and the implicit function theorem need a linear map that is exact
for every vector field, and a complex-linear one is exact only for holomorphic fields (`-1j * y`
is, `1j * abs(y) ** 2 * y` is not). As real-linear maps on real coordinates they are exact for
both, so `jax.jacfwd`, LU factorisations, GMRES and the derivatives of the stages stay real and
need no complex conventions of their own; JAX carries complex cotangents through the split and
the merge. A real state's coordinates are its `jax.flatten_util.ravel_pytree` vector, with no
extra operation.
"""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array

from ._types import Y


class RealCoordinates(eqx.Module):
    """How a state pytree maps to its real coordinates and back.

    A complex leaf of shape `s` occupies `2 * prod(s)` coordinates, each element's real part
    followed by its imaginary part; a real leaf occupies `prod(s)`. The state's components (a
    complex number counts as one) are numbered as `ravel_pytree` numbers them.

    **Example:**

    ```python
    import jax.numpy as jnp
    from odeckpt._real_coordinates import RealCoordinates

    coordinates, z = RealCoordinates.make({"x": jnp.ones(2), "c": jnp.array([1 + 2j])})
    assert z.shape == (4,) and coordinates.num_components == 3
    y = coordinates.unravel(z)  # {"c": [1 + 2j], "x": [1.0, 1.0]}
    ```
    """

    unravel_parts: Callable = eqx.field(static=True)
    # jax binds `PyTreeDef` as a variable (from jaxlib), which pyright rejects as a type.
    treedef: jax.tree_util.PyTreeDef = eqx.field(static=True)  # pyright: ignore[reportInvalidTypeForm]
    is_complex: tuple[bool, ...] = eqx.field(static=True)
    sizes: tuple[int, ...] = eqx.field(static=True)

    @classmethod
    def make(cls, y: Y) -> tuple["RealCoordinates", Array]:
        """The coordinates of states shaped like `y`, and `y` in them."""
        leaves, treedef = jax.tree.flatten(y)
        is_complex = tuple(bool(jnp.iscomplexobj(leaf)) for leaf in leaves)
        parts = jax.tree.map(lambda x: _pairs(x) if jnp.iscomplexobj(x) else x, y)
        z, unravel_parts = ravel_pytree(parts)
        sizes = tuple(int(np.size(leaf)) for leaf in leaves)
        return cls(unravel_parts, treedef, is_complex, sizes), z

    @property
    def has_complex(self) -> bool:
        return any(self.is_complex)

    @property
    def num_components(self) -> int:
        """Components of the state, a complex number counted once."""
        return sum(self.sizes)

    def ravel(self, tree: Y) -> Array:
        """`tree` (structured like the state) as one real vector."""
        if not self.has_complex:
            return ravel_pytree(tree)[0]
        flags = jax.tree.unflatten(self.treedef, self.is_complex)
        return ravel_pytree(jax.tree.map(lambda x, c: _pairs(x) if c else x, tree, flags))[0]

    def unravel(self, z: Array) -> Y:
        """The state whose coordinates are `z`."""
        parts = self.unravel_parts(z)
        if not self.has_complex:
            return parts
        flags = jax.tree.unflatten(self.treedef, self.is_complex)
        return jax.tree.map(lambda p, c: _merge(p) if c else p, parts, flags)

    def modulus(self, z: Array) -> Array:
        """For each coordinate, the absolute value of the component it belongs to (both parts
        of a complex number get its modulus), so that norms weigh a complex number as one."""
        if not self.has_complex:
            return jnp.abs(z)
        flags = jax.tree.unflatten(self.treedef, self.is_complex)
        moduli = jax.tree.map(
            lambda p, c: jnp.repeat(jnp.abs(_merge(p))[..., None], 2, -1) if c else jnp.abs(p),
            self.unravel_parts(z),
            flags,
        )
        return ravel_pytree(moduli)[0]

    def real_matrix(self, matrix: Array) -> Array:
        """The real-coordinate matrix of the complex-linear map `matrix` (`(n, n)` over the
        components): entry `(i, j)` is the part of coordinate `i` in `matrix @ e_j`, with `e_j`
        the unit real or imaginary perturbation of coordinate `j`'s component."""
        component, imaginary = _layout(self.is_complex, self.sizes)
        unit = np.where(imaginary, 1j, 1.0)
        entries = matrix[np.ix_(component, component)] * unit[None, :]
        return jnp.where(imaginary[:, None], jnp.imag(entries), jnp.real(entries))


def _pairs(x: Array) -> Array:
    """`x` as (real, imaginary) pairs on a new last axis."""
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


def _merge(parts: Array) -> Array:
    return jax.lax.complex(parts[..., 0], parts[..., 1])


@functools.cache
def _layout(is_complex: tuple[bool, ...], sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """For each real coordinate: its component and whether it is an imaginary part."""
    component, imaginary, start = [], [], 0
    for flag, size in zip(is_complex, sizes, strict=True):
        ids = np.arange(start, start + size)
        start += size
        component.append(np.repeat(ids, 2) if flag else ids)
        imaginary.append(np.tile([False, True], size) if flag else np.zeros(size, bool))
    return np.concatenate(component), np.concatenate(imaginary)
