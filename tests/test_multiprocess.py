"""Two `qkvflow train` processes on this machine, joined by jax.distributed (loopback coordinator,
gloo collectives on CPU, 2 simulated devices each), started by launch/local_multi_gpu.sh: the code
path of a multi-host run. Stopped by a SIGTERM to one of them and resumed, they must reproduce the
one-device run step for step, and only process 0 may write metrics and checkpoint metadata.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkvflow.runs.tracking import metrics_file, read_metrics
from tests.timescale import limit
from tests.train_utils import TINY, reference_run

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "local_multi_gpu.sh"
FAST = [
    "--loss_curve",
    "null",
    "--trainer.max_eval_batches",
    "0",
    "--trainer.checkpointer.keep",
    "[{every: 2}]",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir: Path, corpus_root: Path, run_id: str, *, processes: int, devices: int, extra=()):
    env = dict(os.environ, PYTHON=sys.executable, EQX_ON_ERROR="nan", PYTHONUNBUFFERED="1")
    args = [
        "bash",
        str(LAUNCHER),
        "--run-id",
        run_id,
        "--processes",
        str(processes),
        "--cpu-devices",
        str(devices),
        "--log-dir",
        str(workdir / "logs"),
    ]
    if processes > 1:
        args += ["--port", str(_free_port())]
    args += [
        TINY,
        "--corpus.root",
        str(corpus_root),
        "--trainer.checkpointer.base_path",
        str(workdir / "checkpoints"),
        "--trainer.tracker",
        f"{{type: jsonl, path: {workdir / 'runs'}}}",
        "--trainer.log_dir",
        str(workdir / "levanter_logs"),
        *FAST,
        *extra,
    ]
    return subprocess.Popen(args, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _logs(workdir: Path, run_id: str, processes: int) -> list[str]:
    return [(workdir / "logs" / run_id / f"host-{i}.log").read_text() for i in range(processes)]


FINISH_LIMIT = limit(900)
"""Seconds a multi-process run may take (tests/timescale.py)."""


def _finish(proc, workdir, run_id, processes, timeout=FINISH_LIMIT):
    out, _ = proc.communicate(timeout=timeout)
    logs = _logs(workdir, run_id, processes)
    assert proc.returncode == 0, out + "\n".join(log[-3000:] for log in logs)
    return logs


def _losses(workdir: Path, run_id: str) -> list[float]:
    steps = read_metrics(metrics_file(str(workdir / "runs"), run_id))
    return [steps[s]["train/loss"] for s in sorted(steps) if "train/loss" in steps[s]]


def _records(workdir: Path, run_id: str) -> list[tuple]:
    """(event, step, metric names) of each metrics record."""
    lines = (workdir / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [
        (r["event"], -1 if r.get("step") is None else r["step"], tuple(sorted(r.get("metrics") or {}))) for r in records
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of the session's uninterrupted 8-step run on one device (tests/train_utils.reference_run,
    shared with test_train and test_faults). It evaluates and these runs do not; evaluation does not
    change a training step's arithmetic."""
    _, workdir, proc = reference_run(tmp_path_factory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = _losses(workdir, "tiny")
    assert len(curve) == 8
    return curve


def test_two_processes_stop_together_resume_and_match_one_device(tmp_path, tmp_path_factory, reference):
    """Two processes with 2 devices each, on a corpus without a training token cache yet, so that they build it
    together (Levanter's leader builds, the other waits on its broadcasts). SIGTERM reaches only process
    1: both stop after the same step, save and exit 0; a second launch resumes both from that checkpoint
    and finishes. The losses are the one-device run's (4 shards against 1 change only the order of f32
    reductions, so the tolerance of test_train's test_four_devices_match_one); process 0 alone writes the
    metrics (no record twice) and the checkpoint metadata (each written once, after both processes' shards)."""
    # The reference run's corpus, tokenizer and validation cache, without the training split's token cache:
    # that build goes through Levanter's leader/broadcast path like any other (a second one would add ~10 s
    # of its status polling and test nothing more).
    fresh = tmp_path / "corpora"
    shutil.copytree(reference_run(tmp_path_factory)[0], fresh)
    train_cache = fresh / "pydoc" / "levanter_cache" / "pydoc" / "train"
    assert train_cache.is_dir()
    shutil.rmtree(train_cache)
    proc = _launch(tmp_path, fresh, "multi", processes=2, devices=2)
    host1 = tmp_path / "logs" / "multi" / "host-1.log"
    deadline = time.monotonic() + limit(900)
    while "step 2/8" not in (host1.read_text() if host1.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    os.kill(_trainer_pid(proc.pid, process_id=1), signal.SIGTERM)
    logs = _finish(proc, tmp_path, "multi", 2)
    for log in logs:
        assert "of 2: 2 local devices, 4 in all" in log
    stopped = [[line for line in log.splitlines() if "qkvflow train: stopped by SIGTERM" in line] for log in logs]
    assert all(len(lines) == 1 for lines in stopped), logs
    steps = [lines[0].split("after step ")[1].split("/")[0] for lines in stopped]
    assert steps[0] == steps[1] and int(steps[0]) < 8, steps

    logs = _finish(_launch(tmp_path, fresh, "multi", processes=2, devices=2), tmp_path, "multi", 2)
    assert all("resuming run multi after step" in log and "step 8/8" in log for log in logs), logs
    assert _losses(tmp_path, "multi") == pytest.approx(reference, rel=2e-5, abs=2e-5)

    records = [r for r in _records(tmp_path, "multi") if r[1] >= 0]  # those of a step (hparams come per launch)
    assert len(records) == len(set(records)), records  # a second writer would repeat them
    assert sorted(step for event, step, names in records if "train/loss" in names) == list(range(8))
    run = tmp_path / "checkpoints" / "multi"
    assert "step-8" in {p.name for p in run.iterdir()}  # the final save, after step 8
    for step in run.glob("step-*"):
        assert json.loads((step / "metadata.json").read_text())["step"] == int(step.name.split("-")[1])


def _trainer_pid(launcher_pid: int, process_id: int) -> int:
    """The pid of the launcher's child that runs `--trainer.distributed.process_id process_id`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher_pid and b"--trainer.distributed.process_id" in cmdline:
            if cmdline[cmdline.index(b"--trainer.distributed.process_id") + 1] == str(process_id).encode():
                return int(entry.name)
    raise AssertionError(f"no child of {launcher_pid} runs process {process_id}")
