"""ruff's lint rules and its formatter (pyproject.toml, [tool.ruff]) hold for the whole tree, so the
default test command is also the lint and format step of CI."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    assert ruff, "ruff is missing: install the test extra (pip install -e '.[test]')"
    return subprocess.run([ruff, *args, "qkvflow", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_passes():
    proc = _ruff("check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_tree_is_ruff_formatted():
    """`ruff format` would change nothing (run it before committing)."""
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
