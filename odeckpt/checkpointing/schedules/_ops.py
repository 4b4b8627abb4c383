"""The array namespace a schedule's arithmetic runs in: NumPy for planning, `jax.numpy` in the
JAX loops."""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np


def _python_cond(pred, true_fun: Callable, false_fun: Callable, operand):
    return true_fun(operand) if pred else false_fun(operand)


@dataclasses.dataclass(frozen=True)
class Ops:
    """What a schedule's arithmetic computes with: an array namespace `xp`, an integer `dtype`
    and a `cond` with the contract of `lax.cond`. NumPy and Python's `if` by default; the JAX
    loops pass `jax.numpy`, `int32` and `lax.cond`, and run the same code on traced values.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import Ops
    >>> Ops().int([4, 7])
    array([4, 7])

    ```
    """

    xp: Any = np
    dtype: Any = np.int64
    cond: Callable = _python_cond

    def int(self, x):
        """`x` as an integer array of `dtype`."""
        return self.xp.asarray(x, self.dtype)


NUMPY = Ops()
