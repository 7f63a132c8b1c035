"""What tests/conftest.py sets up for every test and the processes tests start."""

import os

from tests.helpers import with_host_devices


def test_the_session_compiles_cheaply_and_subprocesses_keep_it():
    """LLVM at -O0 and, on jaxlib 0.10, the classic fusion emitters, unless the caller chose; and a
    subprocess given several host devices keeps the session's flags (the device count was once the
    whole of XLA_FLAGS, dropping them)."""
    from importlib.metadata import version

    flags = os.environ["XLA_FLAGS"].split()
    assert flags == os.environ["QKVFLOW_TESTS_XLA_FLAGS"].split()  # an xdist worker keeps the session's
    assert sum(f.startswith("--xla_backend_optimization_level=") for f in flags) == 1, flags
    if "QKVFLOW_TESTS_CALLER_XLA_FLAGS" not in os.environ:
        assert "--xla_backend_optimization_level=0" in flags
        assert ("--xla_cpu_use_fusion_emitters=false" in flags) == version("jaxlib").startswith("0.10.")
    assert with_host_devices(4).split() == [*flags, "--xla_force_host_platform_device_count=4"]
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] and os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"


SLOW_GARBAGE = """
import gc
import time
import weakref


class Node:
    pass


def _slow(ref):
    time.sleep(0.05)


KEEP = []


def test_leaves_garbage_that_takes_seconds_to_collect():
    gc.disable()  # as rare as a test process's collections: the garbage waits for the session's end
    for _ in range(140):  # 7 s of weakref callbacks: past execnet's 5 s, within xdist's 10 s
        a, b = Node(), Node()
        a.b, b.a = b, a
        KEEP.append(weakref.ref(a, _slow))
"""


def test_an_xdist_worker_ends_without_warnings_or_status_lines(tmp_path):
    """A worker whose garbage takes seconds to collect (as a suite worker's thousands of compiled programs
    did): tests/conftest.py collects it before the worker reports its end, so execnet's SIGINT to a
    worker still busy 5 s after shutdown (a KeyboardInterrupt in a weakref callback, reported as a
    PytestUnraisableExceptionWarning) does not come; and -q prints no "bringing up nodes..." lines."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "test_garbage.py").write_text(SLOW_GARBAGE)
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-n", "1",
         "--rootdir", str(tmp_path), str(tmp_path / "test_garbage.py")],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out
    assert "Unraisable" not in out and "KeyboardInterrupt" not in out, out
    assert "bringing up nodes" not in out, out
