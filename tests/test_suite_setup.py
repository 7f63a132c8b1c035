"""What tests/conftest.py sets up for every test and the processes tests start."""

import os

from tests.helpers import with_host_devices
from tests.timescale import limit


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
        cwd=root, env=env, capture_output=True, text=True, timeout=limit(300),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out
    assert "Unraisable" not in out and "KeyboardInterrupt" not in out, out
    assert "bringing up nodes" not in out, out


# --- time limits: one factor (tests/timescale.py) -------------------------------------------------------

LIMIT_CALLS = {"wait", "join", "result", "communicate", "exception"}
"""Methods whose first positional argument is a time limit in seconds."""


def _bare_limits(source: str) -> list[int]:
    """Lines of `source` with a time limit written as a bare number: a `timeout=` argument or parameter
    default, a limit passed to `.wait`/`.join`/`.result`/`.communicate`, or `time.monotonic() + N`."""
    import ast

    def bare(node) -> bool:
        return (
            isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
        )

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            lines += [k.value.lineno for k in node.keywords if k.arg == "timeout" and bare(k.value)]
            method = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if method in LIMIT_CALLS and node.args and bare(node.args[0]):
                lines.append(node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults
            defaults += node.args.kw_defaults
            lines += [d.lineno for a, d in zip(args, defaults) if a.arg == "timeout" and d is not None and bare(d)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            clock = isinstance(node.left, ast.Call) and ast.unparse(node.left.func) == "time.monotonic"
            if clock and bare(node.right):
                lines.append(node.lineno)
    return sorted(lines)


def test_every_time_limit_in_the_tests_scales_with_one_factor():
    """A limit that load can break is written `limit(seconds)` (tests/timescale.py), so that
    QKVFLOW_TEST_TIME_SCALE stretches all of them; the check itself finds each kind of bare limit."""
    from pathlib import Path

    probe = (
        "proc.wait(60)\nsubprocess.run(cmd, timeout=120)\nend = time.monotonic() + 900\n"
        "def f(timeout=600.0): pass\nthread.join(timeout=limit(30))\nproc.wait(timeout)\ntime.sleep(1.0)\n"
    )
    assert _bare_limits(probe) == [1, 2, 3, 4]
    root = Path(__file__).resolve().parent
    found = {
        str(path.relative_to(root.parent)): lines
        for path in sorted(root.rglob("*.py"))
        if path.name != "timescale.py" and (lines := _bare_limits(path.read_text()))
    }
    assert found == {}, f"bare time limits (write them as limit(seconds)): {found}"


def test_the_time_factor_is_read_from_one_variable_and_checked():
    import pytest

    from tests.timescale import ENV, factor

    assert ENV == "QKVFLOW_TEST_TIME_SCALE"
    assert factor({}) == 1.0 and factor({ENV: ""}) == 1.0 and factor({ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "fast", "inf", "nan"):
        with pytest.raises(ValueError, match=f"{ENV}={bad!r} is invalid: expected a positive number"):
            factor({ENV: bad})


def test_a_test_that_hangs_fails_at_the_scaled_per_test_limit(tmp_path, request):
    """pytest-timeout (the `test` extra) with conftest's limit: `timescale.PER_TEST` seconds times the factor on
    every test. With a factor that makes it 0.5 s, a test sleeping for a minute fails with a timeout, and one
    that finishes in time passes; here, this test carries the session's limit."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    from tests.timescale import PER_TEST, limit

    if not request.config.pluginmanager.hasplugin("timeout"):
        pytest.skip("pytest-timeout is not installed (the `test` extra pins it)")
    marker = request.node.get_closest_marker("timeout")
    if request.config.getoption("timeout") is None and not os.environ.get("PYTEST_TIMEOUT"):
        assert marker is not None and marker.args == (limit(PER_TEST),)
    (tmp_path / "test_hang.py").write_text(
        "import time\n\ndef test_hangs():\n    time.sleep(60)\n\ndef test_quick():\n    pass\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_TIMEOUT", "PYTEST_ADDOPTS")}
    env.update(QKVFLOW_TEST_TIME_SCALE=str(0.5 / PER_TEST), PYTHONPATH=str(root))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-c", os.devnull,
         "--rootdir", str(tmp_path), str(tmp_path / "test_hang.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=limit(300),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 failed, 1 passed" in proc.stdout and "Timeout" in proc.stdout, proc.stdout[-3000:]
