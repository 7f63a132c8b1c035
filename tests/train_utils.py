"""Run `qkvflow train` in a process of its own (a fresh JAX backend, so tests can simulate several devices;
forked from a warm interpreter, tests/warm.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from qkvflow.runs.tracking import metrics_file, read_metrics
from tests import warm
from tests.helpers import with_host_devices
from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "configs" / "tiny_train.yaml")


def train_args(workdir: Path, corpus_root: Path, *overrides: str, run_id: str = "tiny") -> list[str]:
    """The command line of `qkvflow train` on the tiny config, with every output inside `workdir`."""
    return [
        sys.executable,
        "-m",
        "qkvflow",
        "train",
        "--config_path",
        TINY,
        "--corpus.root",
        str(corpus_root),
        "--trainer.id",
        run_id,
        "--trainer.checkpointer.base_path",
        str(workdir / "checkpoints"),
        "--trainer.tracker",
        f"{{type: jsonl, path: {workdir / 'runs'}}}",
        "--trainer.log_dir",
        str(workdir / "logs"),
        *overrides,
    ]


def train_env(devices: int = 1, **extra: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    env["XLA_FLAGS"] = with_host_devices(devices)
    return env


TRAIN_LIMIT = limit(600)
"""Seconds a tiny training run may take (tests/timescale.py)."""


def train(
    workdir: Path, corpus_root: Path, *overrides: str, run_id: str = "tiny", devices: int = 1, timeout=TRAIN_LIMIT
):
    argv = train_args(workdir, corpus_root, *overrides, run_id=run_id)[3:]
    return warm.run(argv, train_env(devices), cwd=workdir, timeout=timeout)


def run_cases(argv: list[str]) -> int:
    """Runs each case of the JSON `argv[0]` through `qkvflow.cli.main` (what `python -m qkvflow` calls)
    and prints {case: [exit code, stdout, stderr]}: a process of its own per case costs each case
    seconds of start-up. stdout and stderr are real files (Levanter's logging set-up enables faulthandler
    on stderr)."""
    import contextlib
    import tempfile
    import traceback

    from qkvflow.cli import main

    results, files = {}, []
    for case, case_argv in json.loads(argv[0]).items():
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        files += [out, err]  # kept open: a handler set up in one case may still hold them
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(case_argv)
            except SystemExit as e:
                code = e.code
            except Exception:  # the case's test fails on it, the others still run
                code = None
                traceback.print_exc(file=err)
        out.seek(0)
        err.seek(0)
        results[case] = [code, out.read(), err.read()]
    sys.__stdout__.write(json.dumps(results) + "\n")
    sys.__stdout__.flush()
    return 0


def cli_in_one_process(cases: dict, env: dict, cwd, timeout: float = limit(900)) -> dict:
    """Run several `qkvflow` command lines (argv after `python -m qkvflow`) one after another in one new
    process (tests/warm.py) with `env`: {case: (exit code or None after an exception, stdout, stderr)}."""
    proc = warm.run([json.dumps(cases)], env, cwd=cwd, timeout=timeout, entry="tests.train_utils:run_cases")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {case: tuple(result) for case, result in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def losses(workdir: Path, run_id: str = "tiny") -> list[float]:
    steps = read_metrics(metrics_file(str(workdir / "runs"), run_id))
    return [steps[s]["train/loss"] for s in sorted(steps) if "train/loss" in steps[s]]


def reference_run(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The uninterrupted 8-step run of tiny_train.yaml on one device (evaluating every 4 steps), trained once
    per test session and shared by every test process: test_train compares its resumed and sharded runs
    with it, test_faults its killed and resumed ones, and the evaluation and fine-tuning tests use its
    checkpoint (tests/finetune_utils.shared_setup). It trains on a corpus folder of its own, whose
    Levanter token cache it builds under the lock, so that readers never build it concurrently.
    (corpus root, work folder, the finished process)."""
    from qkvflow.data.corpora import prepare_corpus
    from tests.helpers import shared_path

    root, lock = shared_path(tmp_path_factory, "reference_run")
    corpora, done = root / "corpora", root / "process.json"
    with lock:
        if not done.exists():
            root.mkdir(parents=True, exist_ok=True)
            prepare_corpus("pydoc", str(corpora))
            proc = train(root, corpora, "--trainer.steps_per_eval", "4")
            done.write_text(json.dumps([proc.returncode, proc.stdout, proc.stderr]))
    return corpora, root, subprocess.CompletedProcess(["qkvflow", "train"], *json.loads(done.read_text()))


def initialize_without_writes(config, before_writes=lambda: None) -> None:
    """A stand-in for `qkvflow.training.session._initialize` in in-process tests: the device checks and
    the verb's checks before the run's first write (`before_writes`), without JAX's distributed start-up,
    the run lock or Levanter's trackers."""
    from qkvflow.training import preflight

    preflight.check_devices(config.trainer)
    before_writes()
