"""Which cases the default run keeps: a family of parametrized cases keeps a few
representatives there (each code path at least once), and `pytest -m slow` runs them all."""

import pytest


def slow_unless(params, fast):
    """`params` for `parametrize`, all but those in `fast` marked slow."""
    return [
        p
        if p in fast
        else pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.slow)
        for p in params
    ]
