"""docs/migration.md shows each ported script of examples/migration/ whole, exactly as it is (so
the page and the scripts cannot drift apart), and the scripts run: each asserts that its port
gives the original library's answer. The migration and adjoint pages name only steppers,
adjoints and classes that odeckpt has, and the adjoint page's first table covers every adjoint
in at most six rows."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import odeckpt
from odeckpt._adjoints import ADJOINTS
from odeckpt._steppers import STEPPERS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCRIPTS = sorted((ROOT / "examples" / "migration").glob("*.py"))
PAGES = ["migration.md", "which-adjoint.md", "adjoint-history.md"]


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page, flags=re.S | re.M)


def table_rows(page: str, heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first table after the line `heading`."""
    after = f"\n{page}".split(f"\n{heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("|"))
    end = next((i for i in range(start, len(after)) if not after[i].startswith("|")), len(after))
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in after[start:end]]
    return rows[2:]  # past the header and the rule


def named_in(cell: str) -> tuple[set[str], set[str]]:
    """What a table cell names in its code spans: stepper and adjoint names (a span that is a
    quoted name, or `solver="radau"`), and classes (`Radau5`, `odeckpt.Heun()`; not
    `diffrax.Kvaerno5`)."""
    spans = re.findall(r"`([^`]+)`", cell)
    quoted = {name for span in spans for name in re.findall(r'(?:^|=)"(\w+)"', span)}
    classes = {name for span in spans for name in re.findall(r"(?<![\w.])([A-Z]\w*)", span)}
    classes |= {name for span in spans for name in re.findall(r"odeckpt\.([A-Z]\w*)", span)}
    return quoted, classes - {"True", "False", "None"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_page_shows_each_script_exactly(script):
    assert script.read_text() in python_blocks((DOCS / "migration.md").read_text())


def test_page_shows_nothing_but_the_scripts():
    scripts = {script.read_text() for script in SCRIPTS}
    stale = [block[:80] for block in python_blocks((DOCS / "migration.md").read_text())
             if block not in scripts]  # fmt: skip
    assert not stale, f"code on docs/migration.md that is in no script: {stale}"


@pytest.mark.parametrize("page", PAGES)
def test_every_odeckpt_name_exists(page):
    text = (DOCS / page).read_text()
    missing = sorted({name for name in re.findall(r"odeckpt\.(\w+)", text)
                      if not hasattr(odeckpt, name)})  # fmt: skip
    assert not missing, f"docs/{page} names odeckpt.{missing}, which odeckpt does not have"


@pytest.mark.parametrize(
    "heading, columns",
    [("## Which odeckpt stepper for each diffrax stepper", (1, 2)), ("## Names", (4,))],
)
def test_migration_tables_name_real_steppers_and_adjoints(heading, columns):
    page = (DOCS / "migration.md").read_text()
    for row in table_rows(page, heading):
        for column in columns:
            quoted, classes = named_in(row[column])
            unknown = quoted - set(STEPPERS) - set(ADJOINTS)
            unknown |= {name for name in classes if not hasattr(odeckpt, name)}
            assert not unknown, f"{row[0]}: {sorted(unknown)} are not odeckpt names"


def test_adjoint_decision_table_covers_every_adjoint_in_six_rows():
    rows = table_rows((DOCS / "which-adjoint.md").read_text(), "# Which adjoint should I use?")
    assert len(rows) <= 6
    named = set()
    for row in rows:
        quoted, classes = named_in(row[1])
        unknown = quoted - set(ADJOINTS) - set(STEPPERS)
        unknown |= {name for name in classes if not hasattr(odeckpt, name)}
        assert not unknown, f"{row[0]}: {sorted(unknown)} are not odeckpt names"
        named |= quoted | classes
    missing = [name for name, cls in ADJOINTS.items() if not {name, cls.__name__} & named]
    assert not missing, f"no row of the table names {missing}"


def test_adjoint_page_defines_digits_first_and_keeps_history_out():
    page = (DOCS / "which-adjoint.md").read_text()
    assert page.lower().index("digits") == page.index("**Correct digits**") + len("**Correct ")
    assert not re.search(r"\bcommit [0-9a-f]{7}|\bissues? \d+", page, flags=re.I)


# With -m slow: the four scripts take about two minutes on 2 CPU cores, most of it compiling
# (diffrax's and odeckpt's gradients, each in a fresh process).
@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_ported_script_runs_and_agrees(script):
    completed = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr
