"""Ensembles of small systems as one Pallas kernel, one trajectory per lane."""

from ._kernel import KernelSettings as KernelSettings
from ._lanes import Unsupported as Unsupported
from ._solve import Start as Start, Trajectory as Trajectory, run_ensemble as run_ensemble
