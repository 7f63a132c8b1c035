"""`qkvflow bench quality`: validation loss at a fixed training budget on Tiny Shakespeare.

Each model trains in its own `qkvflow train` subprocess from benchmarks/configs/quality_<name>.yaml
(nanoGPT's CPU "baby GPT" budget: 4 layers/steps, 4 heads, width 128, context 64, batch 12, 2000
iterations, lr 1e-3 cosine to 1e-4, beta2 0.99, dropout 0; nanoGPT reports val loss 1.88 for its GPT).
The runs write into a fresh work folder (so nothing resumes), and the final `eval/loss` over the
validation split (the last 10% of the text) is collected into JSON and a markdown table. With
`--learning_rates A,B,...` every model trains at each peak learning rate (same schedule shape) and is
reported at its best, so that no model is compared at a learning rate tuned for another.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from qkvflow import outputs
from qkvflow.bench import OUT_DIR
from qkvflow.errors import UserError
from qkvflow.outputs import check_writable
from qkvflow.runs.tracking import metrics_file, read_metrics

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("ode", "gpt2", "shared")
EXTRA_MODELS = ("ode_tuned", "parallel")  # run on request: --models ode_tuned,parallel
LABELS = {
    "ode": "DiffEqFormer (diffeqformer_gpt2, N=4 Euler steps, d_emb=64)",
    "gpt2": "GPT-2 baseline (Levanter gpt2, 4 layers)",
    "shared": "weight-shared ODE (shared_ode_gpt2, N=4)",
    "ode_tuned": "DiffEqFormer, time_embed_norm + matrix_init fan_in",
    "parallel": "parallel-block GPT-2 (parallel_gpt2, 4 layers; the ODE's discrete twin)",
}
NANOGPT_VAL_LOSS = 1.88


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvflow bench quality", description=__doc__)
    p.add_argument("--iters", type=int, default=2000, help="training steps per model (schedule spans them)")
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS + EXTRA_MODELS)}"
    )
    p.add_argument("--configs_dir", default=str(ROOT / "benchmarks" / "configs"))
    p.add_argument("--corpus_root", default=str(ROOT / "cache" / "corpora"))
    p.add_argument("--max_eval_batches", type=int, default=None, help="evaluate on a slice (default: all)")
    p.add_argument("--out_dir", default=OUT_DIR, help=f"folder of the output files (default {OUT_DIR})")
    p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    p.add_argument("--name", default="quality", help="output files OUT_DIR/NAME.json and NAME.md")
    p.add_argument("--workdir", default=None, help="where runs write (default: a fresh temporary folder)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per model")
    p.add_argument(
        "--learning_rates",
        default=None,
        help="comma-separated peak learning rates: train every model at each and report each "
        "model's best validation loss (default: the configs' 1e-3 only)",
    )
    return p


def _run_id(name: str, learning_rate: Optional[float]) -> str:
    return f"quality_{name}" if learning_rate is None else f"quality_{name}_lr{learning_rate:g}"


def check_fresh(workdir: Path, run_id: str) -> None:
    """The run's checkpoint folder must not exist yet: the benchmark removes it after the run, which is
    safe only for a folder this run created (an existing one would also be resumed, not trained afresh)."""
    checkpoints = Path(workdir) / "checkpoints" / run_id
    if os.path.lexists(checkpoints):
        raise UserError(
            f"bench quality: --workdir {workdir} already holds {checkpoints}: the benchmark trains afresh and "
            "removes its checkpoints afterwards; choose a new --workdir (or none, for a fresh temporary folder)"
        )


def train_one(name: str, args, workdir: Path, learning_rate: Optional[float] = None) -> dict:
    config = Path(args.configs_dir) / f"quality_{name}.yaml"
    if not config.is_file():
        raise UserError(f"bench quality: config {config} not found")
    run_id = _run_id(name, learning_rate)
    check_fresh(workdir, run_id)
    cmd = [
        sys.executable,
        "-m",
        "qkvflow",
        "train",
        "--config_path",
        str(config),
        "--corpus.root",
        args.corpus_root,
        "--trainer.id",
        run_id,
        "--trainer.num_train_steps",
        str(args.iters),
        "--trainer.steps_per_eval",
        str(args.iters),
        "--trainer.checkpointer.base_path",
        str(workdir / "checkpoints"),
        "--trainer.tracker",
        f"{{type: jsonl, path: {workdir / 'runs'}}}",
        "--trainer.log_dir",
        str(workdir / "logs"),
        "--log_every",
        str(max(1, min(100, args.iters // 10))),
    ]
    if args.max_eval_batches is not None:
        cmd += ["--trainer.max_eval_batches", str(args.max_eval_batches)]
    if learning_rate is not None:
        cmd += ["--optimizer.learning_rate", str(learning_rate)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    log_file = workdir / f"{run_id.removeprefix('quality_')}.log"
    with open(log_file, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log_file.read_text().strip().splitlines()[-1:]
        raise UserError(f"bench quality: training {name} failed (exit {proc.returncode}): {' '.join(tail)}")
    steps = read_metrics(metrics_file(str(workdir / "runs"), run_id))
    evals = [s for s in sorted(steps) if "eval/loss" in steps[s]]
    trains = [s for s in sorted(steps) if "train/loss" in steps[s]]
    params = None
    with open(metrics_file(str(workdir / "runs"), run_id)) as f:
        for line in f:
            record = json.loads(line)
            if record.get("event") == "summary" and "parameter_count" in record.get("metrics", {}):
                params = int(record["metrics"]["parameter_count"])
    shutil.rmtree(workdir / "checkpoints" / run_id, ignore_errors=True)  # written by this run alone (check_fresh)
    return {
        "label": LABELS[name],
        "config": os.path.relpath(config, ROOT),
        "val_loss": steps[evals[-1]]["eval/loss"] if evals else None,
        "train_loss": steps[trains[-1]]["train/loss"] if trains else None,
        "steps": (trains[-1] + 1) if trains else 0,
        "parameter_count": params,
        "wall_s": round(wall, 1),
        "learning_rate": learning_rate,
    }


def train_grid(name: str, args, workdir: Path, learning_rates: list[float]) -> dict:
    """Train `name` at each learning rate; the entry is the best run by validation loss, with all runs."""
    runs = [train_one(name, args, workdir, lr) for lr in learning_rates]
    scored = [r for r in runs if r["val_loss"] is not None]
    best = dict(min(scored, key=lambda r: r["val_loss"]) if scored else runs[0])
    best["grid"] = [{k: r[k] for k in ("learning_rate", "val_loss", "train_loss", "wall_s")} for r in runs]
    return best


def markdown(result: dict) -> str:
    lines = [
        f"Tiny Shakespeare (char level), {result['iters']} iterations x batch 12 x context 64"
        + (
            f", eval on {result['max_eval_batches']} batches"
            if result["max_eval_batches"]
            else ", full validation split"
        ),
        "",
        "| model | params | peak lr | val loss | train loss | wall (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["models"].values():
        lr = f"{r['learning_rate']:g}" if r.get("learning_rate") is not None else "config"
        lines.append(
            f"| {r['label']} | {r['parameter_count'] or '-'} | {lr} | {_loss(r['val_loss'])} | "
            f"{_loss(r['train_loss'])} | {r['wall_s']} |"
        )
    lines.append(f"| nanoGPT baby GPT (reference, 2000 iters) | 0.80M | 1e-3 | {NANOGPT_VAL_LOSS} | - | - |")
    grids = {name: r["grid"] for name, r in result["models"].items() if r.get("grid")}
    if grids:
        lrs = sorted({g["learning_rate"] for grid in grids.values() for g in grid})
        lines += [
            "",
            "Validation loss by peak learning rate (the best per model is reported above):",
            "",
            "| model | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
            "|---|" + "---:|" * len(lrs),
        ]
        for name, grid in grids.items():
            by_lr = {g["learning_rate"]: g["val_loss"] for g in grid}
            lines.append(f"| {name} | " + " | ".join(_loss(by_lr.get(lr)) for lr in lrs) + " |")
    return "\n".join(lines) + "\n"


def _loss(value) -> str:
    return f"{value:.4f}" if value is not None else "-"


def _learning_rates(text: Optional[str]) -> Optional[list[float]]:
    if text is None:
        return None
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (0 < r < 1) for r in rates):
        raise UserError(
            f"--learning_rates={text!r} is invalid: expected comma-separated numbers in (0, 1), e.g. 1e-3,2e-3"
        )
    return rates


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.iters < 1:
        raise UserError(f"--iters={args.iters} is invalid: expected an integer >= 1")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    bad = [n for n in names if n not in MODELS + EXTRA_MODELS]
    if bad or not names:
        raise UserError(
            f"--models={args.models!r} is invalid: expected a comma-separated subset of {','.join(MODELS + EXTRA_MODELS)}"
        )
    learning_rates = _learning_rates(args.learning_rates)
    files = {ext: Path(args.out_dir) / f"{args.name}.{ext}" for ext in ("json", "md")}
    for path in files.values():  # before any work
        outputs.check_file(path, "--out_dir", overwrite=args.overwrite)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="qkvflow-quality-"))
    for name in names:  # before any training: no run may find (and later remove) an existing checkpoint
        for lr in learning_rates or [None]:
            check_fresh(workdir, _run_id(name, lr))
    outputs.check_outside_repository(workdir, "--workdir")
    check_writable(str(workdir), "--workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    result = {
        "iters": args.iters,
        "max_eval_batches": args.max_eval_batches,
        "workdir": str(workdir),
        "learning_rates": learning_rates,
        "reference_nanogpt_val_loss": NANOGPT_VAL_LOSS,
        "models": {},
    }
    for name in names:
        print(f"bench quality: training {name} for {args.iters} steps (logs in {workdir})", flush=True)
        if learning_rates is None:
            result["models"][name] = train_one(name, args, workdir)
        else:
            result["models"][name] = train_grid(name, args, workdir, learning_rates)
    table = markdown(result)
    outputs.write_file(files["json"], "--out_dir", json.dumps(result, indent=2) + "\n", overwrite=args.overwrite)
    outputs.write_file(files["md"], "--out_dir", table, overwrite=args.overwrite)
    print(json.dumps(result))
    print(table)
    return 0
