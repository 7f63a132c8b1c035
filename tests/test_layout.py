"""The package layout that docs/architecture.md describes: imports point one way and form no cycles.

Imports are read from the source (every `import` and `from ... import`, at module level or inside a
function, since a function-level import is still a dependency), so nothing is executed. Imports under
`if TYPE_CHECKING:` are left out: they serve annotations and never run.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qkvflow"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, annotations: bool = False) -> set[str]:
    """The qkvflow modules that `path` imports (a package import counts as its __init__); with
    `annotations`, also those imported under `if TYPE_CHECKING:`."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found, tree = set(), ast.parse(path.read_text())
    for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n == "qkvflow" or n.startswith("qkvflow."))
    return found


def _runtime_nodes(tree: ast.AST):
    """ast.walk without the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def graph(annotations: bool = False) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in imports(path, annotations) if m in modules and m != name} for name, path in modules.items()
    }


def test_the_layout_parser_sees_imports_of_every_kind(tmp_path):
    """The control: absolute, relative and function-level imports are all found."""
    g = graph()
    assert "qkvflow.models.generator" in g["qkvflow.models.fields.gpt2"]  # absolute, module level
    assert "qkvflow.models.discrete.model" in g["qkvflow.models.discrete"]  # relative (`from .model import`)
    assert "qkvflow.models.registry" in g["qkvflow.runs.configfile"]  # inside a function


def test_only_the_entry_point_imports_the_verbs():
    """Library code never imports a verb: `qkvflow.cli` sits on top of everything else."""
    offenders = sorted(
        f"{name} imports {m}"
        for name, deps in graph().items()
        if not (name == "qkvflow.__main__" or name.startswith("qkvflow.cli"))
        for m in deps
        if m == "qkvflow.cli" or m.startswith("qkvflow.cli.")
    )
    assert not offenders, offenders


def test_the_model_core_does_not_import_the_application_layer():
    """nn/, models/ and integrate/ (the model core) import nothing from training, export, analysis, bench or cli."""
    core = ("qkvflow.nn", "qkvflow.models", "qkvflow.integrate")
    upper = ("qkvflow.training", "qkvflow.export", "qkvflow.analysis", "qkvflow.bench", "qkvflow.cli")
    offenders = sorted(
        f"{name} imports {m}"
        for name, deps in graph().items()
        if name.startswith(core)
        for m in deps
        if m.startswith(upper)
    )
    assert not offenders, offenders


def test_there_are_no_import_cycles():
    """Not even through imports made for annotations only (`if TYPE_CHECKING:`)."""
    g = graph(annotations=True)
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(g[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_the_suites_longest_first_list_names_existing_files():
    """tests/conftest.py orders the long files first for pytest-xdist; a renamed file would silently
    drop out of that order."""
    from tests.conftest import LONGEST_FIRST

    root = Path(__file__).resolve().parents[1]
    assert [p for p in LONGEST_FIRST if not (root / p).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_gpu_marked_tests_live_in_the_files_the_accelerator_script_runs():
    """benchmarks/accelerator.sh runs `pytest -m gpu` on a fixed list of files (collecting the whole suite
    for a handful of tests cost seconds): a gpu-marked test in any other file would never run on an
    accelerator."""
    root = Path(__file__).resolve().parents[1]
    script = (root / "benchmarks" / "accelerator.sh").read_text()
    command = re.search(r'run tests "\$PYTHON" -m pytest -m gpu ((?:tests/\S+\.py )+)', script)
    assert command, "accelerator.sh no longer runs `pytest -m gpu` on its test files"
    run = set(command.group(1).split())
    marked = {
        str(p.relative_to(root))
        for p in sorted((root / "tests").rglob("*.py"))
        if p.name != "test_layout.py" and "mark.gpu" in p.read_text()
    }
    assert marked - run == set()
