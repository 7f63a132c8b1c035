"""Two `qkvflow train` processes on this machine, joined by jax.distributed (loopback coordinator,
gloo collectives on CPU, 2 simulated devices each), started by launch/local_multi_gpu.sh: the code
path of a multi-host run. They must reproduce a single process with 4 devices step for step, and
only process 0 may write metrics and checkpoint metadata.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkvflow.training.tracking import metrics_file, read_metrics
from tests.train_utils import TINY

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "local_multi_gpu.sh"
FAST = [
    "--trainer.log_jaxprs",
    "false",
    "--trainer.log_xla_hlo",
    "false",
    "--trainer.watch.interval",
    "0",
    "--loss_curve",
    "null",
    "--trainer.max_eval_batches",
    "0",
    "--trainer.checkpointer.keep",
    "[{every: 2}]",
    "--trainer.num_train_steps",
    "6",
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


def _finish(proc, workdir, run_id, processes, timeout=900):
    out, _ = proc.communicate(timeout=timeout)
    logs = _logs(workdir, run_id, processes)
    assert proc.returncode == 0, out + "\n".join(log[-3000:] for log in logs)
    return logs


def _losses(workdir: Path, run_id: str) -> list[float]:
    steps = read_metrics(metrics_file(str(workdir / "runs"), run_id))
    return [steps[s]["train/loss"] for s in sorted(steps) if "train/loss" in steps[s]]


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory, corpus_root):
    """The reference: one process with 4 devices."""
    workdir = tmp_path_factory.mktemp("one_process")
    _finish(_launch(workdir, corpus_root, "single", processes=1, devices=4), workdir, "single", 1)
    curve = _losses(workdir, "single")
    assert len(curve) == 6
    return curve, _records(workdir, "single")


def _records(workdir: Path, run_id: str) -> list[tuple]:
    """(event, step, metric names) of each metrics record."""
    lines = (workdir / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return sorted(
        (r["event"], -1 if r.get("step") is None else r["step"], tuple(sorted(r.get("metrics") or {}))) for r in records
    )


def test_two_processes_match_one_process_with_four_devices(tmp_path, corpus_root, four_devices):
    logs = _finish(_launch(tmp_path, corpus_root, "multi", processes=2, devices=2), tmp_path, "multi", 2)
    for log in logs:
        assert "of 2: 2 local devices, 4 in all" in log
        assert "step 6/6" in log
    curve, records = four_devices
    assert _losses(tmp_path, "multi") == pytest.approx(curve, rel=2e-5, abs=2e-5)

    # process 0 alone writes the metrics: the same records as the one-process run, none twice
    assert _records(tmp_path, "multi") == records
    # complete checkpoints (metadata written once, by process 0, after both processes' shards)
    run = tmp_path / "checkpoints" / "multi"
    assert sorted(p.name for p in run.iterdir()) == ["step-2", "step-4", "step-5"]
    for step in run.iterdir():
        assert json.loads((step / "metadata.json").read_text())["step"] == int(step.name.split("-")[1])


def test_sigterm_to_one_process_stops_both_and_the_run_resumes(tmp_path, corpus_root, four_devices):
    """SIGTERM reaches only process 1: both processes stop after the same step, save, exit 0; a
    second launch resumes both from that checkpoint and ends with the reference's losses."""
    proc = _launch(tmp_path, corpus_root, "multi", processes=2, devices=2)
    host1 = tmp_path / "logs" / "multi" / "host-1.log"
    deadline = time.monotonic() + 900
    while "step 2/6" not in (host1.read_text() if host1.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    os.kill(_trainer_pid(proc.pid, process_id=1), signal.SIGTERM)
    logs = _finish(proc, tmp_path, "multi", 2)
    stopped = [[line for line in log.splitlines() if "qkvflow train: stopped by SIGTERM" in line] for log in logs]
    assert all(len(lines) == 1 for lines in stopped), logs
    steps = [lines[0].split("after step ")[1].split("/")[0] for lines in stopped]
    assert steps[0] == steps[1] and int(steps[0]) < 6, steps

    logs = _finish(_launch(tmp_path, corpus_root, "multi", processes=2, devices=2), tmp_path, "multi", 2)
    assert all("resuming run multi after step" in log for log in logs)
    assert _losses(tmp_path, "multi") == pytest.approx(four_devices[0], rel=2e-5, abs=2e-5)


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
