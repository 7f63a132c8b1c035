"""tests/warm.py: a command line forked from the warm server behaves as the same command line in a new
interpreter would, in everything the tests look at (pid, environment, folder, output files, exit
status, signals), and one whose environment the server cannot give it runs as a subprocess."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import warm
from tests.timescale import limit

ENTRY = "tests.test_warm:report"
NOT_A_LIMIT = 0.1
"""Seconds of a wait that is meant to time out (the child outlives it): not scaled."""


def report(argv: list[str]) -> int:
    """What a child sees, as JSON on stdout; then what argv asks: "exit N", "raise", "interrupt", "wait"."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    try:  # equinox's runtime check answers by EQX_ON_ERROR: "raise" raises, "nan" returns NaN
        checked = float(eqx.error_if(jnp.array(1.0), jnp.array(True), "checked"))
    except Exception:
        checked = "raised"
    hf_level = sys.modules["transformers"].logging.get_verbosity() if "transformers" in sys.modules else None
    seen = {"hf_level": hf_level, "pid": os.getpid(), "cwd": os.getcwd(), "devices": jax.device_count(), "checked": str(checked),
            "marker": os.environ.get("QKVFLOW_TEST_INJECT_NONFINITE"), "ppid": os.getppid()}  # fmt: skip
    print(json.dumps(seen), flush=True)
    print("to stderr", file=sys.stderr)
    action, *value = argv
    if action == "exit":
        return int(value[0])
    if action == "raise":
        raise ValueError("a bug")
    if action == "interrupt":
        raise KeyboardInterrupt
    time.sleep(limit(60))  # "wait": for a signal
    return 0


def _env(**extra) -> dict:
    """The session's environment, 3 CPU devices and a variable of qkvflow's (tests.helpers, which would
    give the devices, imports Levanter: this module stays light for the subprocess that imports it)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=3"
    return dict(os.environ, XLA_FLAGS=flags, QKVFLOW_TEST_INJECT_NONFINITE="1:loss", **extra)


def test_a_warm_child_is_its_own_process_with_its_environment_folder_and_outputs(tmp_path):
    proc = warm.run(["exit", "3"], _env(EQX_ON_ERROR="nan", TRANSFORMERS_VERBOSITY="error"), cwd=tmp_path,
                    timeout=limit(300), entry=ENTRY)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[0])
    assert seen["pid"] != os.getpid() and seen["cwd"] == str(tmp_path)
    assert seen["devices"] == 3 and seen["marker"] == "1:loss"  # XLA_FLAGS read at the child's backend start
    assert seen["checked"] == "nan"  # EQX_ON_ERROR applied although equinox was imported in the server
    assert seen["hf_level"] == 40  # TRANSFORMERS_VERBOSITY=error (logging.ERROR), the same
    assert seen["ppid"] != os.getpid()  # forked by the server, not started by this process
    assert proc.stderr == "to stderr\n"
    # neither set in the next child (pytest's own environment may hold them: an import in this process can
    # set TRANSFORMERS_VERBOSITY): the libraries' defaults, so nothing leaks from one child to another
    env = {k: v for k, v in _env().items() if k not in ("EQX_ON_ERROR", "TRANSFORMERS_VERBOSITY")}
    seen = json.loads(
        warm.run(["exit", "0"], env, cwd=tmp_path, timeout=limit(300), entry=ENTRY).stdout.splitlines()[0]
    )
    assert seen["checked"] == "raised" and seen["hf_level"] == 30  # transformers' default: logging.WARNING


def test_exit_statuses_are_the_interpreters(tmp_path):
    """An exception: its traceback on stderr and status 1; an uncaught Ctrl-C ends by SIGINT (-2), as
    CPython does; a signal's status is minus its number, as subprocess reports it."""
    proc = warm.run(["raise"], _env(), cwd=tmp_path, timeout=limit(300), entry=ENTRY)
    assert proc.returncode == 1 and "ValueError: a bug" in proc.stderr
    proc = warm.run(["interrupt"], _env(), cwd=tmp_path, timeout=limit(300), entry=ENTRY)
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr
    out, err = tmp_path / "out", tmp_path / "err"
    child = warm.popen(["wait"], _env(), tmp_path, out, err, entry=ENTRY)
    assert isinstance(child, warm.Process)
    deadline = time.monotonic() + limit(300)
    while not out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(NOT_A_LIMIT)  # the child waits for a signal: this wait must end first
    child.send_signal(signal.SIGTERM)
    assert child.wait(limit(60)) == -signal.SIGTERM and child.poll() == -signal.SIGTERM


def test_a_variable_read_at_import_time_gets_a_new_interpreter(tmp_path):
    """JAX reads JAX_* variables when it is imported: a child that sets one of its own is a subprocess."""
    proc = warm.run(["exit", "0"], _env(JAX_ENABLE_X64="1"), cwd=tmp_path, timeout=limit(300), entry=ENTRY)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0])["ppid"] == os.getpid()
    child = warm.popen(["exit", "0"], _env(JAX_ENABLE_X64="1"), tmp_path, tmp_path / "o", tmp_path / "e", entry=ENTRY)
    assert isinstance(child, subprocess.Popen) and child.wait(limit(300)) == 0
