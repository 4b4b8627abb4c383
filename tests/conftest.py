import os
import pathlib

import jax
from hypothesis import settings

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

# The same examples on every run, so that CI is reproducible.
settings.register_profile("deterministic", derandomize=True)
settings.load_profile("deterministic")

# Scripts the tests run in subprocesses import the checkout under test, installed or not.
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
