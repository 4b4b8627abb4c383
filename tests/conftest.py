import gc
import os
import pathlib

import jax
import pytest
from hypothesis import settings

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

# The same examples on every run, so that CI is reproducible.
settings.register_profile("deterministic", derandomize=True)
settings.load_profile("deterministic")

# Scripts the tests run in subprocesses import the checkout under test, installed or not.
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Free each module's compiled programs when it ends.

    XLA's CPU backend maps every compiled program into memory; kept for the whole run, the
    suite's programs exceed the kernel's limit on memory maps (`vm.max_map_count`, 65530 by
    default) and the process segfaults inside the compiler.
    """
    yield
    jax.clear_caches()
    gc.collect()
