"""Transitional: the names `odeckpt/_adjoint.py` imports until it reads
`recomputed_steps(plan, n)` and `Plan.slots` (delete this module with that change)."""

import jax

from ._recomputation import _offload_recomputations, _schedule_recomputations
from .schedules import Schedule, offline_schedule


def recomputed_steps(schedule: Schedule, n) -> jax.Array:
    return _schedule_recomputations(schedule, n)


def offload_recomputed_steps(segment: int, checkpoints: int, n) -> jax.Array:
    return _offload_recomputations(offline_schedule(segment, checkpoints), segment, n)
