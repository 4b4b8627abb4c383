"""The integration loop: one step is an attempt by the stepper, its error judged by the
step-size controller, accepted or rejected, events located on it, and saves written. The
adjoints run this loop (`IntegrationLoop.cond`, `IntegrationLoop.step`) with the runner of
their kind of derivative."""

from ._controllers import (
    DEFAULT_ATOL as DEFAULT_ATOL,
    DEFAULT_RTOL as DEFAULT_RTOL,
    AbstractAdaptiveController as AbstractAdaptiveController,
    AbstractController as AbstractController,
    ConstantStep as ConstantStep,
    PIDController as PIDController,
    all_positive_finite as all_positive_finite,
)
from ._decision import Decision as Decision
from ._dense import DenseOutput as DenseOutput, piecewise as piecewise
from ._events import Event as Event, EventSet as EventSet, EventState as EventState
from ._integrate import (
    IntegrationLoop as IntegrationLoop,
    vector_field_in_internal_time as vector_field_in_internal_time,
)
from ._landing import (
    after as after,
    before as before,
    constant_step_count as constant_step_count,
    saves_per_step as saves_per_step,
)
from ._outputs import (
    DistinctSaveTimes as DistinctSaveTimes,
    Outputs as Outputs,
    Rows as Rows,
    Writes as Writes,
    index_unless_dropped as index_unless_dropped,
    written_groups as written_groups,
)
from ._progress import ProgressBar as ProgressBar, ProgressMeter as ProgressMeter
from ._state import LoopState as LoopState, StepRecord as StepRecord
