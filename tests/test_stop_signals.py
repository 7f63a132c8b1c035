"""Ctrl-C and SIGTERM before a run's first step, and a second signal while the main thread is inside
native code (qkvflow.training.faults.Preemption).

A compile holds the main thread in XLA, where CPython runs no signal handler until it returns. These
tests hold it in a C call that never returns by itself (a second lock of a default pthread mutex, which
a signal does not interrupt), so only the watcher thread can act: without it each would wait out its
time limit. `time.sleep`, which a signal does interrupt, checks the main thread's own handler.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from tests import warm
from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[1]

NATIVE_BLOCK = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None)\n"
    "mutex = ctypes.create_string_buffer(64)\n"  # all zeros: glibc's PTHREAD_MUTEX_INITIALIZER
    "libc.pthread_mutex_lock(mutex)\n"
    "print('ready', flush=True)\n"
    "libc.pthread_mutex_lock(mutex)\n"  # never returns; ctypes has released the GIL
)
PYTHON_BLOCK = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"


def _start(tmp_path, code: str):
    """`python -c code`, forked from the tests' warm interpreter (tests/warm.py: faults imports JAX)."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    proc = warm.popen([code], dict(os.environ), ROOT, out, err, entry="tests.warm:exec_code")
    end = time.monotonic() + limit(300)
    while "ready" not in out.read_text():
        assert proc.poll() is None and time.monotonic() < end, (proc.poll(), out.read_text(), err.read_text())
        time.sleep(0.01)
    return proc, out, err


def _finish(proc) -> int:
    try:
        return proc.wait(limit(60))
    finally:
        if proc.poll() is None:
            proc.kill()


ARMED = (
    "from qkvflow.training.faults import Preemption\n"
    "p = Preemption(verb='qkvflow train').install()\n"
    "p.exit_at_once_until_first_step()\n"
)


@pytest.mark.parametrize("block", ["native", "python"])
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_a_signal_before_the_first_step_exits_at_once_with_one_line(tmp_path, block, sig, status):
    """Before the first step there is nothing to finish or save: the first signal ends the process with the
    status a stop after a step has (130 after Ctrl-C, 0 after SIGTERM) and one line, whether the main
    thread is in Python or held in native code (as in a compile)."""
    proc, out, err = _start(tmp_path, ARMED + (NATIVE_BLOCK if block == "native" else PYTHON_BLOCK))
    proc.send_signal(sig)
    assert _finish(proc) == status, err.read_text()
    assert err.read_text() == f"qkvflow train: stopped by {sig.name} before the first step; nothing to save\n"
    assert out.read_text() == "ready\n"


def test_a_signal_that_came_while_the_data_was_prepared_ends_the_run_when_loading_starts(tmp_path):
    """A stop requested before the run loop armed the exit (while caches were built) is not left waiting
    for the compile: arming ends the process."""
    code = (
        "import os, signal\n"
        "from qkvflow.training.faults import Preemption\n"
        "p = Preemption(verb='qkvflow finetune').install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('requested', p.requested, flush=True)\n"
        "p.exit_at_once_until_first_step()\n"
        "print('not reached', flush=True)\n"
    )
    proc = warm.run([code], dict(os.environ), ROOT, timeout=limit(300), entry="tests.warm:exec_code")
    assert proc.returncode == 130 and proc.stdout == "requested True\n", (proc.stdout, proc.stderr)
    assert proc.stderr.endswith("qkvflow finetune: stopped by SIGINT before the first step; nothing to save\n")


def test_after_the_first_step_a_signal_asks_for_a_stop_and_a_second_one_ends_native_code(tmp_path):
    """After `first_step_done` the first SIGINT only asks for a stop (the process goes on); a second one
    ends it even while the main thread is held in native code (a long step, a checkpoint wait)."""
    code = (
        ARMED + "p.first_step_done()\n"
        "import os, signal\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('first', p.requested, flush=True)\n" + NATIVE_BLOCK
    )
    proc, out, err = _start(tmp_path, code)
    proc.send_signal(signal.SIGINT)
    assert _finish(proc) in (130, -signal.SIGINT), err.read_text()  # the watcher's exit, or the signal's own
    assert out.read_text() == "first True\nready\n"
    assert "SIGINT received: finishing the current step" in err.read_text()
