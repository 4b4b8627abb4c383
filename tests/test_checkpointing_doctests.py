"""The docstring examples of `odeckpt.checkpointing` run and print what they claim."""

import doctest
import importlib

import pytest

MODULES = [
    "odeckpt.checkpointing._checkpoint_layers",
    "odeckpt._autodiff._custom",
    "odeckpt.checkpointing._layers",
    "odeckpt._autodiff._linear",
    "odeckpt.checkpointing._recomputation",
    "odeckpt.checkpointing._scan",
    "odeckpt.checkpointing._stacking",
    "odeckpt.checkpointing._vmap",
    "odeckpt.checkpointing._while_loop",
    "odeckpt.checkpointing.schedules._binomial",
    "odeckpt.checkpointing.schedules._multistage",
    "odeckpt.checkpointing.schedules._offline",
    "odeckpt.checkpointing.schedules._online",
    "odeckpt.checkpointing.schedules._ops",
    "odeckpt.checkpointing.schedules._planner",
    "odeckpt.checkpointing.schedules._schedule",
    "odeckpt.checkpointing.schedules._simulate",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), raise_on_error=False, verbose=False)
    assert result.failed == 0 and result.attempted > 0, result
