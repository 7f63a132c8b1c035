"""The configuration reference (qkvflow.cli.startup.reference), which the documentation site's configuration page
is generated from: every field with its type, its default and the docstring below it, nested qkvflow
dataclasses as dotted keys, and text that survives a markdown table."""

import dataclasses
import re
from pathlib import Path
from typing import Optional

import pytest

from qkvflow.cli.startup import reference

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = 0.5
    """How fast, in 1/s; `a | b` is code."""


@dataclasses.dataclass
class Outer:
    name: str = "toy"
    """Written to runs/<run_id>/; one of a | b."""
    inner: Optional[Inner] = None
    """The inner section."""
    sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    flag: bool = True  # beside the field
    needed: int = dataclasses.field(kw_only=True)  # type: ignore (a tool's comment, not a docstring)


@pytest.fixture(autouse=True)
def expand_this_module(monkeypatch):
    """The toy classes here are expanded as qkvflow's own are."""
    monkeypatch.setattr(reference, "EXPANDED", ("qkvflow.", __name__))


def test_rows_give_type_default_and_docstring_with_nested_keys():
    assert reference.rows(Outer, "top.") == [
        ("top.name", "str", "`toy`", "Written to runs/<run_id>/; one of a | b."),
        ("top.inner", "Inner | null", "`null`", "The inner section."),
        ("top.inner.rate", "float", "`0.5`", "How fast, in 1/s; `a | b` is code."),
        ("top.sizes", "list[int]", "`[1, 2]`", ""),
        ("top.flag", "bool", "`true`", "beside the field"),
        ("top.needed", "int", "(required)", ""),
    ]


def test_table_cells_escape_pipes_and_tags_outside_code():
    table = reference.table(Outer, only=["name", "inner"]).splitlines()
    assert table[2] == "| `name` | str | `toy` | Written to runs/&lt;run_id&gt;/; one of a \\| b. |"
    assert table[4] == "| `inner.rate` | float | `0.5` | How fast, in 1/s; `a \\| b` is code. |"
    assert len(table) == 5  # sizes, flag and needed left out


def _docstring_in_source(path: Path, field: str) -> str:
    """The triple-quoted string below `field: ...` in a source file, read as text (not via draccus)."""
    text = path.read_text()
    m = re.search(rf"^    {field}: [^\n]*\n    \"\"\"(.*?)\"\"\"", text, re.MULTILINE | re.DOTALL)
    return " ".join(m.group(1).split())


def test_the_generated_page_holds_every_ode_key_with_its_default_and_docstring():
    from qkvflow.integrate.config import OdeConfig

    page = reference.reference()
    solver_doc = _docstring_in_source(ROOT / "qkvflow/integrate/config.py", "solver")
    assert solver_doc and f"| `model.ode.solver` | str | `euler` | {solver_doc} |" in page
    assert "| `model.ode.num_steps` | int | `12` |" in page
    for f in dataclasses.fields(OdeConfig):
        assert f"| `model.ode.{f.name}` |" in page, f.name
    for family in ("diffeqformer_gpt2", "node_transformer", "transevolve_gpt2"):
        assert f"### `type: {family}`" in page
    assert "## `qkvflow eval`" in page and "| `steps` |" in page
