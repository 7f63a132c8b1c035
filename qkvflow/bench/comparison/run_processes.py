"""Each run of a `qkvflow bench compare` study as a process of its own, and the results it leaves.

A training is `python -m qkvflow train` on the run's config, an evaluation on the test half is
`python -m qkvflow eval` on its checkpoint, each started from the repository's root with its output in
`logs/<run>.out` and, under `--jobs K`, as a task of the study's pool (qkvflow.bench.comparison.pool).
A finished run leaves `results/<run>.json` (its selection loss) and `results/<run>.test.json` (its test
loss, and its depth rows), read back instead of run again. `say` writes one line of progress whole, as
runs in flight at once share stdout.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from qkvflow.bench.comparison import depth_curves, run_configs
from qkvflow.bench.comparison.pool import current_pool
from qkvflow.bench.comparison.study import is_ode, run_config, run_id
from qkvflow.bench.comparison.study_folder import write_json as _write_json
from qkvflow.errors import UserError
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.configfile import parse
from qkvflow.runs.tracking import metrics_file, read_metrics

ROOT = Path(__file__).resolve().parents[3]


def _subprocess(cmd: list[str], log_file: Path, timeout: float, attention: str = "auto") -> None:
    """`cmd` with its output to `log_file` (`logs/<run>.out`), as a process of the calling task's pool (so
    that a stop reaches it once, qkvflow.bench.comparison.pool); every run's attention kernel is `attention`
    (qkvflow.nn.attention, for the configs that leave attn_backend unset: check_attention refuses any
    other). A failure names the run, what it ran and how it ended."""
    run, verb = log_file.stem, cmd[3]
    options = dict(cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1", QKVFLOW_ATTENTION=attention))
    with open(log_file, "a") as log:
        owner = current_pool()
        if owner is None:  # not a task of a pool: nothing can stop it but the terminal
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, **options).returncode
        else:
            code = owner.run(f"{verb} {run}", cmd, timeout, popen=subprocess.Popen, stdout=log,
                             stderr=subprocess.STDOUT, **options)  # fmt: skip
    if code != 0:
        tail = log_file.read_text().strip().splitlines()[-1:]
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        raise UserError(f"bench compare: run {run} ({verb}) failed ({how}; log {log_file}): {' '.join(tail)}")


def say(line: str) -> None:
    """One line of progress, written whole (runs in flight at once share stdout)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(study: dict, model: str, lr: float, seed: int, workdir: Path, args) -> dict:
    """Train one run (or resume it) and return its result; a finished run is read back, not retrained."""
    rid = run_id(model, lr, seed)
    done = workdir / "results" / f"{rid}.json"
    if done.is_file():
        return json.loads(done.read_text())
    config_path = workdir / "configs" / f"{rid}.yaml"
    config_path.write_text(
        yaml.safe_dump(run_config(study, model, lr, seed, workdir, args.corpus_root), sort_keys=False)
    )
    say(f"bench compare: training {rid} ({study['iters']} steps)")
    start = time.perf_counter()
    _subprocess(
        [sys.executable, "-m", "qkvflow", "train", "--config_path", str(config_path)],
        workdir / "logs" / f"{rid}.out",
        args.timeout,
        args.attention,
    )
    file = metrics_file(str(workdir / "runs"), rid)
    steps = read_metrics(file)
    evals = [s for s in sorted(steps) if "eval/loss" in steps[s]]
    if not evals or evals[-1] != study["iters"] - 1:
        raise UserError(f"bench compare: {rid} has no eval loss after its last step in {file}")
    summary = {}
    with open(file) as f:
        for line in f:
            record = json.loads(line)
            if record.get("event") == "summary":
                summary.update(record.get("metrics", {}))
    result = {
        "model": model, "learning_rate": lr, "seed": seed, "selection_loss": steps[evals[-1]]["eval/loss"],
        "train_loss": steps[evals[-1]].get("train/loss"), "parameter_count": summary.get("parameter_count"),
        "wall_s": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    _write_json(done, result)
    return result


def test_loss(study: dict, model: str, lr: float, seed: int, workdir: Path, args) -> float:
    """The run's final model on the test half (`qkvflow eval`); read back if already measured."""
    rid = run_id(model, lr, seed)
    done = workdir / "results" / f"{rid}.test.json"
    if done.is_file():
        return json.loads(done.read_text())["test_loss"]
    if not (workdir / "checkpoints" / rid).is_dir():
        raise UserError(
            f"bench compare: {rid} is now a chosen run but its checkpoint was removed after an earlier selection; "
            "use a new --workdir (and --keep_checkpoints when you plan to add seeds or learning rates)"
        )
    out = workdir / "test" / rid
    shutil.rmtree(out, ignore_errors=True)  # a partial output of this study's own earlier attempt
    config_path, split = workdir / "configs" / f"{rid}.yaml", ["--corpus.eval_split", "test"]
    if "corpus" not in study["base_config"]:  # own data: the run's config reading the test half instead
        config_path, split = workdir / "configs" / f"{rid}.test.yaml", []
        config = run_config(study, model, lr, seed, workdir, args.corpus_root, half="test")
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "qkvflow", "eval", "--config_path", str(config_path),
           "--checkpoint", str(workdir / "checkpoints" / rid), *split, "--output", str(out)]  # fmt: skip
    if is_ode(study, model):
        cmd += depth_curves.eval_args(study.get("depth"))
    say(f"bench compare: evaluating {rid} on the test split")
    _subprocess(cmd, workdir / "logs" / f"{rid}.out", args.timeout, args.attention)
    rows = json.loads((out / "depth.json").read_text())["rows"]
    row = depth_curves.trained_row(rows)
    _write_json(done, {"test_loss": row["loss"], "depth": rows})
    return row["loss"]


def depth_report(study: dict, tests: dict, workdir: Path) -> dict:
    """Per ODE model, its chosen runs' test rows at every grid summarised over seeds (`depth_curves`)."""
    models = {}
    for model, per_seed in tests.items():
        if is_ode(study, model):
            lr = per_seed["learning_rate"]
            rows = {s: json.loads((workdir / "results" / f"{run_id(model, lr, s)}.test.json").read_text())["depth"]
                    for s in study["seeds"]}  # fmt: skip
            models[model] = depth_curves.summarise(rows)
    return {"study": study["name"], "title": study.get("title") or study["name"], "iters": study["iters"],
            "seeds": study["seeds"], "grids": study["depth"], "models": models}  # fmt: skip


def training_flops(config_path: Path, iters: int) -> Optional[float]:
    """3 x forward FLOPs of the run whose config is `config_path` (read as `qkvflow train` reads it), for
    `iters` steps (`run_configs.training_flops`)."""
    return run_configs.training_flops(parse(TrainConfig, ["--config_path", str(config_path)], "train"), iters)
