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


# The layers of docs/architecture.md, bottom to top: a module imports its own layer's rooms and those below.
LAYERS = {
    "qkvflow": 0, "errors": 0, "outputs": 0, "_jax_compat": 0,
    "data": 1,
    "nn": 2, "integrate": 2, "models": 2,
    "runs": 3, "plotting": 3,
    "evaluation": 4, "inference": 4, "export": 4, "analysis": 4,
    "training": 5,
    "finetune": 6,
    "bench": 7, "plan": 7,
    "cli": 8, "__main__": 8,
}  # fmt: skip
TRAINING_DOOR = "qkvflow.training.step"  # bench and plan build the training step through it alone


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_offenders(g: dict[str, set[str]]) -> list[str]:
    """Every import that climbs a layer, and every import by bench or plan of training other than its door."""
    offenders = []
    for name, deps in sorted(g.items()):
        for dep in sorted(deps):
            climbs = LAYERS[room(dep)] > LAYERS[room(name)]
            side_door = (
                room(name) in ("bench", "plan")
                and room(dep) == "training"
                and dep not in (TRAINING_DOOR, "qkvflow.training")
            )
            if climbs or side_door:
                offenders.append(f"{name} imports {dep}")
    return offenders


def test_every_room_has_a_layer():
    """A new top-level module or package is placed in docs/architecture.md's table before it is used."""
    assert {room(name) for name in graph()} - set(LAYERS) == set()


def test_no_import_climbs_a_layer():
    """evaluation, inference, export and analysis never import training (or fine-tuning, above it); the
    model core imports no run; nothing but the command line imports the command line; bench and plan
    enter training only through `qkvflow.training.step`."""
    assert layer_offenders(graph(annotations=True)) == []


def test_the_layer_rule_sees_a_climb_and_a_side_door():
    """The control: an evaluation module importing the training loop, and plan importing it directly,
    are both named."""
    g = {
        "qkvflow.evaluation.evaluate": {"qkvflow.training.loop", "qkvflow.runs.model"},
        "qkvflow.plan.step": {"qkvflow.training.loop", TRAINING_DOOR},
        "qkvflow.runs.model": {"qkvflow.cli"},
    }
    assert layer_offenders(g) == [
        "qkvflow.evaluation.evaluate imports qkvflow.training.loop",
        "qkvflow.plan.step imports qkvflow.training.loop",
        "qkvflow.runs.model imports qkvflow.cli",
    ]


def test_the_architecture_page_states_the_same_layers():
    """docs/architecture.md's table of layers is the rule this file enforces, row for row."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d) [^|]*\| ([^|]+) \|", page, flags=re.M)
    stated = {name.strip("` "): int(layer) for layer, rooms in rows for name in rooms.split(",")}
    assert stated == {k: v for k, v in LAYERS.items() if k != "qkvflow"}


def test_no_package_level_holds_more_than_twelve_modules():
    """Folders show the architecture: a level with more modules is split into subpackages that say what
    they are."""
    crowded = {
        str(folder.relative_to(PACKAGE.parent)): n
        for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]
        if (n := len([m for m in folder.glob("*.py") if m.name not in ("__init__.py", "__main__.py")])) > 12
    }
    assert crowded == {}


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


def deferred_imports(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each import of a qkvflow module inside a function of `path`."""
    source = path.read_text()
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                names = (
                    [a.name for a in inner.names]
                    if isinstance(inner, ast.Import)
                    else [inner.module or "."]
                    if isinstance(inner, ast.ImportFrom)
                    else []
                )
                if any(n.startswith("qkvflow") or (isinstance(inner, ast.ImportFrom) and inner.level) for n in names):
                    found.append((inner.lineno, lines[inner.lineno - 1]))
    return sorted(set(found))


def test_imports_are_at_the_top_but_for_a_few_that_say_why():
    """Imports of qkvflow modules sit at the top of a module, as in diffrax, equinox and Levanter, so
    that the import graph is what this file checks. The few deferred ones (the command line's start-up
    seam, a light path that must not load JAX) carry a `# lazy: why` comment on their line or the line
    above."""
    deferred = {
        f"{path.relative_to(PACKAGE.parent)}:{line}": text
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in deferred_imports(path)
    }
    unexplained = []
    for where, text in deferred.items():
        file, line = where.rsplit(":", 1)
        above = (PACKAGE.parent / file).read_text().splitlines()[int(line) - 2]
        if "# lazy:" not in text and "# lazy:" not in above:
            unexplained.append(f"{where}: {text.strip()}")
    assert unexplained == []
    assert len(deferred) < 20, sorted(deferred)


def test_the_deferred_import_count_sees_every_form(tmp_path):
    """The control: absolute, relative and plain `import` forms inside functions (nested too) are found,
    and module-level ones are not."""
    module = tmp_path / "m.py"
    module.write_text(
        "from qkvflow import errors\n"
        "def f():\n    from qkvflow.runs import model\n    import qkvflow.data\n"
        "    def g():\n        from . import sibling\n    import json\n"
    )
    assert [line for line, _ in deferred_imports(module)] == [3, 4, 6]
