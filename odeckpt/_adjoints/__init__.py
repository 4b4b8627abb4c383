"""Adjoints: how the integration loop is run, and so how a solve is differentiated. One
contract (`AbstractAdjoint.run(loop, state, outputs) -> RunResult`), one module per adjoint."""

from ._backsolve import (
    BacksolveAdjoint as BacksolveAdjoint,
    InterpolatingAdjoint as InterpolatingAdjoint,
)
from ._base import (
    AbstractAdjoint as AbstractAdjoint,
    GradientStats as GradientStats,
    RunResult as RunResult,
)
from ._checkpointed import (
    DirectAdjoint as DirectAdjoint,
    RecursiveCheckpointAdjoint as RecursiveCheckpointAdjoint,
)
from ._forward import ForwardMode as ForwardMode
from ._reversible import ReversibleAdjoint as ReversibleAdjoint
from ._sensitivity import ForwardSensitivity as ForwardSensitivity

ADJOINTS: dict[str, type[AbstractAdjoint]] = {
    "recursive": RecursiveCheckpointAdjoint,
    "backsolve": BacksolveAdjoint,
    "interpolating": InterpolatingAdjoint,
    "direct": DirectAdjoint,
    "forward": ForwardMode,
    "forward_sensitivity": ForwardSensitivity,
    "reversible": ReversibleAdjoint,
}
"""Every built-in adjoint, by the name `solve(adjoint=...)` accepts."""
