"""The docs site builds with warnings as errors, and every public name is documented with a
runnable example and listed in the API reference."""

import ast
import builtins
import doctest
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import odeckpt
import odeckpt.checkpointing
import odeckpt.checkpointing.schedules
import odeckpt.plot

ROOT = Path(__file__).resolve().parent.parent
NAMESPACES = {
    "odeckpt": odeckpt,
    "odeckpt.checkpointing": odeckpt.checkpointing,
    "odeckpt.plot": odeckpt.plot,
}
PUBLIC = [
    f"{prefix}.{name}"
    for prefix, namespace in NAMESPACES.items()
    for name in namespace.__all__
    if not isinstance(getattr(namespace, name), types.ModuleType)
]
# Public names whose docstrings still lack an example; their modules' owners add them. Strict:
# a name that gains an example must leave this list.
MISSING_EXAMPLES: set[str] = set()


def resolve(qualified: str) -> object:
    prefix, name = qualified.rsplit(".", 1)
    return getattr(NAMESPACES[prefix], name)


@pytest.mark.parametrize(
    "qualified",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(strict=True, reason="no example yet")
            if name in MISSING_EXAMPLES
            else (),
        )
        for name in PUBLIC
    ],
)
def test_public_name_has_docstring_with_example(qualified):
    doc = resolve(qualified).__doc__ or ""
    assert "**Example" in doc and "```python" in doc, f"{qualified} needs an **Example:** block"


def example_sources(obj: object) -> list[str]:
    """The code of each ```python block of `obj`'s docstring (doctest blocks as plain code)."""
    blocks = re.findall(r"```python\n(.*?)```", inspect.cleandoc(obj.__doc__ or ""), re.S)
    parser = doctest.DocTestParser()
    return [
        "".join(example.source for example in parser.get_examples(block))
        if ">>>" in block
        else block
        for block in blocks
    ]


def undefined_names(source: str) -> set[str]:
    """Names `source` reads but neither imports, assigns, defines nor takes as an argument (nor
    finds among the builtins): what an example would take from its module's globals."""
    tree = ast.parse(source)
    defined, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, ast.alias):
            defined.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return read - defined


# The examples are run by tests/test_checkpointing_doctests.py (doctest blocks of
# odeckpt.checkpointing) and by hand; running all of them here would take minutes, so this test
# checks, statically, that each one stands alone: it imports and defines every name it uses.
SELF_CONTAINED = PUBLIC + [
    f"odeckpt.checkpointing.schedules.{name}"
    for name in odeckpt.checkpointing.schedules.__all__
    if not isinstance(getattr(odeckpt.checkpointing.schedules, name), (int, float, str))
]


@pytest.mark.parametrize("qualified", SELF_CONTAINED)
def test_public_examples_are_self_contained(qualified):
    prefix, name = qualified.rsplit(".", 1)
    obj = getattr(sys.modules[prefix], name)
    for source in example_sources(obj):
        missing = undefined_names(source)
        assert not missing, f"{qualified}'s example uses {sorted(missing)} without defining them"


def test_api_reference_lists_every_public_name():
    reference = "\n".join(path.read_text() for path in (ROOT / "docs" / "api").glob("*.md"))
    listed = set(re.findall(r"^::: ([\w.]+)", reference, flags=re.MULTILINE))
    plot_members = re.search(r"::: odeckpt\.plot\s+options:\s+members: \[([^\]]*)\]", reference)
    listed |= {f"odeckpt.plot.{name.strip()}" for name in plot_members.group(1).split(",")}
    missing = sorted(set(PUBLIC) - listed)
    assert not missing, f"add to docs/api/*.md: {missing}"


def test_docs_build_strict(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
    )
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "api" / "memory" / "index.html").exists()
