"""The migration page's ported scripts run, and each asserts that its port gives the original
library's answer (diffrax and scipy run beside odeckpt; torchdiffeq's port is checked against
the exact solution)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["from_diffrax", "from_scipy", "from_torchdiffeq"]


# With -m slow (each script compiles its solves in a fresh process); the page's agreement with
# the scripts is checked by default.
@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_ported_script_runs_and_agrees(name):
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "migration" / f"{name}.py")],
        capture_output=True, text=True, cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_page_shows_both_sides_of_each_script(name):
    page = (ROOT / "docs" / "migration.md").read_text()
    script = (ROOT / "examples" / "migration" / f"{name}.py").read_text()
    sections = re.findall(r"# --8<-- \[start:(\w+)\]", script)
    assert len(sections) == 2 and "odeckpt" in sections
    for section in sections:
        assert f'--8<-- "examples/migration/{name}.py:{section}"' in page
