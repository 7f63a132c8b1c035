"""The paths that README.md and docs/*.md name exist: every `--config_path FILE` of a command and every
file of the repository they point at (configs/, docs/, benchmarks/, launch/, qkvflow/, tests/), so a
renamed or removed file cannot leave a command in the docs that fails at its first argument. Files that
a command writes (runs/, checkpoints/, exports/, benchmarks/results/ made by a rerun) are not checked:
only paths under the repository's own folders, without placeholders (<run_id>, $VAR, {name}, *)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("configs", "docs", "benchmarks", "launch", "qkvflow", "tests")
PATH = re.compile(r"(?<![\w/.~-])((?:%s)/[\w./-]*\w)" % "|".join(FOLDERS))
CONFIG_PATH = re.compile(r"--config_path[= ]+([^\s`'\"),\]]+)")
PLACEHOLDER = re.compile(r"[<>${}*]|(^|/)[A-Z_]+(\.|/|$)")  # <run_id>, $VAR, {name}, *, VERB.py
TO_BE_WRITTEN = {"qkvflow/models/my_family.py"}  # docs/architecture.md: the file a new model family adds


def _named(text: str) -> set[str]:
    found = set(PATH.findall(text)) | set(CONFIG_PATH.findall(text))
    return {p.rstrip(".") for p in found if not PLACEHOLDER.search(p)}


def _exists(path: str, doc: Path) -> bool:
    """`path` relative to the repository or to the doc; `tests/train_utils.reference_run` names a
    function of tests/train_utils.py."""
    module = re.sub(r"\.\w+$", ".py", path)
    return any((base / p).exists() for base in (ROOT, doc.parent) for p in (path, module))


def test_the_parser_finds_paths_and_skips_placeholders():
    text = (
        "run `qkvflow train --config_path configs/quickstart.yaml` and see docs/own_text.md, "
        "tests/test_train.py::test_x, --config_path=my.yaml, configs/<name>.yaml, checkpoints/run/step-3, "
        "qkvflow/cli/VERB.py."
    )
    assert _named(text) == {"configs/quickstart.yaml", "docs/own_text.md", "tests/test_train.py", "my.yaml"}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_path_the_docs_name_exists(doc):
    written = {"benchmarks/results", "runs", "checkpoints", "exports", "sweeps", "tasks"}
    missing = []
    for path in sorted(_named(doc.read_text())):
        if path.split("/")[0] in written or path.startswith("benchmarks/results/"):
            continue
        if path.split("/")[0] not in FOLDERS:  # a --config_path of the user's own (my.yaml) or one a step wrote
            continue
        if path not in TO_BE_WRITTEN and not _exists(path, doc):
            missing.append(path)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"
