"""Stopping a study (qkvflow.bench.comparison.pool): every running run gets the signal once, nothing queued starts,
and the study names the runs it stopped. The runs are tiny Python processes that record each signal."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from qkvflow.bench.comparison import run_processes
from qkvflow.bench.comparison.pool import Pool, Stopped, current_pool, stop_report
from tests.bench import test_compare
from tests.bench.test_compare import _main
from tests.timescale import limit

study = test_compare.study  # the fixture: a two-model study of 12 trainings

# argv: VERB MARKER. Writes MARKER.ready (with its process group), then records each SIGINT/SIGTERM in
# MARKER; after the first it lingers half a second (to see a duplicate) and exits 128 + the signal.
CHILD = """
import os, signal, sys, time
marker = sys.argv[2]
got = []
def record(signum, frame):
    got.append(signum)
    with open(marker, "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, record)
with open(marker + ".ready", "w") as f:
    f.write(str(os.getpgrp()))
end = time.monotonic() + 300
while not got and time.monotonic() < end:
    time.sleep(0.01)
time.sleep(0.5)
sys.exit(128 + got[0] if got else 1)
"""


def _child(marker: Path, verb: str = "train") -> list[str]:
    return [sys.executable, "-c", CHILD, verb, str(marker)]


def _wait_for(condition, what: str) -> None:
    end = time.monotonic() + limit(60)
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def _ready(folder: Path) -> list[str]:
    return sorted(p.name[: -len(".ready")] for p in folder.glob("*.ready"))


@pytest.fixture
def pools():
    """Pools a test makes; any process still running at its end is killed (a failing test leaves none)."""
    made: list[Pool] = []
    yield lambda jobs: made.append(Pool(jobs)) or made[-1]
    for pool in made:
        pool.stop(signal.SIGKILL)
        pool.shutdown()


def test_a_stop_signals_each_running_process_once_and_starts_nothing_queued(tmp_path, pools):
    """Two slots, four runs: a stop reaches the two running ones once each, in process groups of their own
    (a terminal's Ctrl-C reaches the study alone); from the stop on no process starts, so the two queued
    never do, though the stopped runs free their slots."""
    pool = pools(2)
    futures = [
        pool.submit(1, lambda i=i: current_pool().run(f"train r{i}", _child(tmp_path / f"r{i}"), limit(600)))
        for i in range(4)
    ]
    _wait_for(lambda: len(_ready(tmp_path)) == 2, "two runs to start")
    assert pool.waiting() == 2
    assert sorted(pool.stop(signal.SIGINT)) == ["train r0", "train r1"]
    with pytest.raises(Stopped):  # a task that took a slot before the stop starts no process after it
        pool.run("train late", [sys.executable, "-c", "pass"])
    assert [f.result(limit(60)) for f in futures[:2]] == [130, 130]
    pool.shutdown()
    assert _ready(tmp_path) == ["r0", "r1"] and all(f.cancelled() for f in futures[2:])
    for i in (0, 1):
        assert (tmp_path / f"r{i}").read_text() == "SIGINT\n"  # once
        assert int((tmp_path / f"r{i}.ready").read_text()) != os.getpgrp()  # its own process group


def test_a_task_interrupted_by_ctrl_c_closes_the_pool_before_its_slot_is_free(tmp_path, pools):
    """A KeyboardInterrupt in a task (how a stop reaches the main thread through `.result()`) closes the
    pool before the task's slot is freed: the queued task never gets it."""
    pool = pools(1)

    def interrupted():
        raise KeyboardInterrupt

    first = pool.submit(1, interrupted)
    second = pool.submit(1, lambda: current_pool().run("train b", [sys.executable, "-c", "pass"], limit(600)))
    pool._threads[0].join()  # the first task is over and its slot free
    with pytest.raises(Stopped):
        pool.run("train c", [sys.executable, "-c", "pass"])
    pool.shutdown()
    assert isinstance(first.exception(), KeyboardInterrupt) and second.cancelled()


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stopping_a_study_names_the_runs_it_stopped_and_how_to_resume(study, monkeypatch, capsys, sig, status):
    """`bench compare --jobs 2` stopped by Ctrl-C (or SIGTERM) while two trainings run: each gets the signal
    once (SIGTERM passed on as SIGTERM), no other run starts, and one line names the stopped runs and says
    how to resume; the exit status is 128 + the signal."""
    real = run_processes._subprocess
    markers = study / "markers"
    markers.mkdir()

    def fake(cmd, log_file, timeout, attention):
        real(_child(markers / log_file.stem, cmd[3]), log_file, timeout, attention)

    def interrupt():
        _wait_for(lambda: len(_ready(markers)) == 2, "two trainings to start")
        os.kill(os.getpid(), sig)

    threading.Thread(target=interrupt, daemon=True).start()
    assert _main(study, monkeypatch, fake, "--jobs", "2") == status
    runs = ["gpt2-lr0.001-s0", "gpt2-lr0.001-s1"]
    assert _ready(markers) == runs
    for run in runs:
        assert (markers / run).read_text() == f"{sig.name}\n"
    line = stop_report(sig.name, [f"train {r}" for r in runs], 10)
    assert capsys.readouterr().err.splitlines() == [line]
    assert "stopped 2 runs in progress (train gpt2-lr0.001-s0, train gpt2-lr0.001-s1); 10 waiting" in line
    assert "Run the same command to resume" in line


def test_a_failed_run_is_named_by_its_run_and_how_it_ended(tmp_path):
    log = tmp_path / "ode-lr0.002-s1.out"
    code = "import os, signal; print('compiling', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    with pytest.raises(run_processes.UserError) as error:
        run_processes._subprocess([sys.executable, "-c", code, "train"], log, limit(300))
    assert (
        str(error.value)
        == f"bench compare: run ode-lr0.002-s1 (train) failed (killed by SIGKILL; log {log}): compiling"
    )
