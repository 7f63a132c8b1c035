"""benchmarks/gc_time.py: the collector's time and counts of a program run with `-m`, at the thresholds
asked for, qkvflow's own setting included."""

import gc
import subprocess
import sys
from pathlib import Path

from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[2]

# A program that makes 30,000 two-object cycles (only the collector frees them) and prints the thresholds
# it ran at after qkvflow.cli.collect_less, as a `qkvflow` verb's start calls it.
CYCLES = """
import gc
from qkvflow.cli import collect_less
collect_less()
for _ in range(30_000):
    a, b = [], []
    a.append(b); b.append(a)
print(gc.get_threshold())
"""


# The same program without its cycles: what importing qkvflow.cli costs before collect_less raises the
# thresholds (the command line's early checks import PyYAML and light qkvflow modules at Python's defaults).
IMPORT_ONLY = CYCLES.split("for _ in")[0] + "print(gc.get_threshold())\n"


def _run(tmp_path, *args, program=CYCLES):
    (tmp_path / "cycles.py").write_text(program)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gc_time.py"), *args, "-m", "cycles"],
                          cwd=tmp_path, env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=limit(120))  # fmt: skip


def _counts(stderr: str) -> list[int]:
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("gc: ") and " s collecting" in line, stderr
    return [int(n) for n in line.split("[")[1].rstrip("]").split(",")]


def test_counts_the_collections_at_the_thresholds_asked_for(tmp_path):
    # 60,000 container allocations: one collection per ~700 at Python's thresholds (78 measured), 3 at
    # qkvflow's 20,000 (qkvflow.cli.GC_THRESHOLDS), each counted under the oldest generation it collected;
    # the bounds leave room for the interpreter's own allocations around the loop
    default = _run(tmp_path, "--thresholds", "700,10,10")
    assert default.returncode == 0, default.stderr
    assert default.stdout.strip() == "(700, 10, 10)"  # the program's own collect_less set these
    assert sum(_counts(default.stderr)) >= 60_000 // 1_000
    own = _run(tmp_path)
    assert own.returncode == 0, own.stderr
    assert own.stdout.strip() == str(gc.get_threshold())  # qkvflow's: the suite runs at them too
    imports = sum(_counts(_run(tmp_path, program=IMPORT_ONLY).stderr))
    assert 2 <= sum(_counts(own.stderr)) - imports <= 60_000 // 20_000 + 5


def test_bad_thresholds_are_refused(tmp_path):
    proc = _run(tmp_path, "--thresholds", "700,10")
    assert proc.returncode == 2 and "expected three positive integers" in proc.stderr, proc.stderr
