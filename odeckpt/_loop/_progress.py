"""A tqdm progress bar driven from inside the compiled loop."""

import equinox as eqx
import jax
import numpy as np
import tqdm.auto

from .._types import Scalar, Y


class ProgressBar:
    """Host-side bar; opens on the first update of a solve and closes at 100%. All instances
    compare equal so that a new bar does not force `jit` to recompile."""

    def __init__(self):
        self._bar = None

    def __eq__(self, other) -> bool:
        return isinstance(other, ProgressBar)

    def __hash__(self) -> int:
        return hash(ProgressBar)

    def __call__(self, percent: np.ndarray) -> None:
        # Under `vmap` every lane reports: show the slowest one.
        value = int(np.min(percent))
        if self._bar is None:
            self._bar = tqdm.auto.tqdm(total=100, unit="%", desc="odeckpt.solve")
        self._bar.update(max(value - self._bar.n, 0))
        if value >= 100:
            self._bar.close()
            self._bar = None


class ProgressMeter(eqx.Module):
    """Reports `(t - t_start) / (t_end - t_start)` as a percentage after every step."""

    t_start: Scalar
    t_end: Scalar
    bar: ProgressBar = eqx.field(static=True)

    def update(self, token: Y, t: Scalar) -> Y:
        percent = (100 * (t - self.t_start) / (self.t_end - self.t_start)).astype(int)
        jax.debug.callback(self.bar, percent)
        return token
