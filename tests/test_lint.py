"""ruff's lint rules (pyproject.toml, [tool.ruff]) hold for the whole tree, so the default test command
is also the lint step of CI."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    ruff = shutil.which("ruff", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    assert ruff, "ruff is missing: install the test extra (pip install -e '.[test]')"
    proc = subprocess.run([ruff, "check", "qkvflow", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
